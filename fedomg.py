"""FedOMG — Federated Domain Generalization with Data-free On-server Matching Gradient (Nguyen et
al., ICLR 2025; official code github.com/skydvn/FedOMG, its server solver from CAGrad). Clients
run plain local SGD; the server, without any data, searches the convex hull of their updates for
an invariant direction near the mean one (Algorithm 1; Γ = {γ_u} on the simplex, U clients):

    g_u   = θ_u − θ^(r-1)                                                        (Eq. 8)
    Γ*    = argmin_Γ  g_Γ · g_0 + κ ||g_0|| ||g_Γ||,   g_Γ = Σ_u γ_u g_u              (Eq. 15)
    θ^(r) = θ^(r-1) + η_g (g_0 + λ g_Γ*) / (1 + κ²),   λ = κ ||g_0|| / ||g_Γ*||  (Eq. 16–17)

in the official code's form (fed_merge.py), which made the paper's tables and every result here:
Eq. 15–16 on the scaled updates w_u g_u (w_u = p_u = N_u / Σ N, the DG code; w_u = 1 on mnist,
emnist, cifar10, cifar100, the FL code), g_0 their plain mean, inner products over s² (s: their
mean norm), every norm sqrt(||x||² + ε), ε = 1e-4, the step added (g_u points downhill). Γ* from
the U×U Gram matrix of the updates (float64) by Table 4's solver: Γ = softmax(v) from v = 0,
torch's SGD on v (lr 25, momentum 0.5), the best of 21 evaluations. κ = 0.5 (Table 4). η_g: 0.5 on
pacs, vlcs, officehome (the DG scripts' --global_model_lr; Table 4 prints 5e-2), 1 on the FL
datasets (the FL code's --omg_meta_lr), elsewhere `auto`: U (1 + κ²) each round, the g_0 term then
FedAvg's step (κ = 0: FedAvg to rounding). Clients keep their SGD (its momentum) across rounds and
divide their lr by 10 after 80% of the rounds, as the DG code (the FL code: no step, no momentum).
DG: pretrained ResNet-18 + linear head, SGD lr 1e-3, batch 16, momentum 0.9, weight decay 5e-4, 5
local epochs. Eq. 15–17 as printed (FedAvg bit for bit at κ = 0), the exact solver, a fresh client
optimiser, another lr step: benchmark/diagnostics/fedomg_readings.py. Paper against code, the
measurements, how to copy the server step: docs/fedomg.md.

    python fedomg.py --dataset pacs --data-root ./data
    python fedomg.py --dataset mnist --clients 100 --sample 20 --alpha 0.1 --rounds 800
"""
import importlib.util
if __name__ == "__main__" and importlib.util.find_spec("harness"):  # the harness first: a Ctrl-C
    import harness  # noqa: F401   while torch loads is one line, exit 130 (harness/__init__.py)
import torch

import common
import data

DG = dict(model="resnet18", head="linear", lr=1e-3, batch_size=16, momentum=0.9, weight_decay=5e-4,
          local_epochs=5, global_lr=0.5)                          # η_g: the DG scripts'
FL = dict(global_lr=1.0)                                          # η_g: the FL code's
DEFAULTS = {"*": dict(kappa=0.5, global_lr="auto"),               # κ: Table 4; η_g: AUTO
            **{name: DG for name in ("pacs", "vlcs", "officehome")},
            **{name: FL for name in data.FL}}
AUTO = {"global_lr": "U (1 + κ²), U the clients sampled in the round (eta_g)"}


# ---------------------------------------------------------------- the method as plain functions
# Functions of tensors and numbers alone (torch only), to copy into another training loop: the
# clients run plain local SGD and upload θ_u; FedOMG's own part is the server's step.

def server_update(theta, thetas, N, eta_g, kappa=0.5, weighted=True):
    """The server's round (Algorithm 1): θ^(r-1) (flat) and the U sampled clients' trained θ_u
    (flat, any iterable, read one at a time) with their training-set sizes N_u in, θ^(r) out.
    weighted: the DG code's w_u = p_u (False: the FL code's w_u = 1). η_g has no default: this
    step's κ = 0 form is Σ_u w_u g_u / U, so η_g = U (1 + κ²) makes the g_0 term FedAvg's step
    (weighted) and η_g = 1 moves 1/U of it; the DG scripts use 0.5. N: a list, one N_u per θ_u
    (else ValueError, from `updates`)."""
    G = updates(theta, thetas, len(N))                                       # Eq. 8
    p = torch.tensor([float(N_u) for N_u in N]) / sum(float(N_u) for N_u in N)   # p_u = N_u / Σ N
    w = p if weighted else torch.ones(len(N))
    return theta + eta_g * code_step(G, w, kappa)                            # Eq. 15–17


def updates(theta, thetas, U):
    """Eq. 8: the U × |θ| matrix G of the g_u = θ_u − θ^(r-1), the server's only large buffer.
    ValueError unless thetas holds U θ_u of θ's shape, and one at least."""
    G = torch.empty(U, theta.numel(), dtype=theta.dtype, device=theta.device)
    count = 0                                                    # the θ_u read so far
    for u, theta_u in enumerate(thetas):
        if u == U or theta_u.shape != theta.shape:
            raise ValueError(f"updates: update {u + 1} of shape {tuple(theta_u.shape)} for U = {U} "
                             f"and θ of shape {tuple(theta.shape)}")
        G[u] = theta_u - theta
        count = u + 1
    if not 0 < count == U:
        raise ValueError(f"updates: {count} update(s) θ_u for U = {U}")
    return G


def code_step(G, w, kappa, eps=1e-4):
    """Eq. 15–16 as the official code steps (fed_merge.py OMG, CAGrad) on the scaled updates
    ĝ_u = w_u g_u: g_0 = mean_u ĝ_u, Γ* by Eq. 15 over the ĝ_u, λ = κ ||g_0||_ε / (||ĝ_Γ*||_ε + ε),
    and (g_0 + λ ĝ_Γ*) / (1 + κ²) = Σ_u w_u (1/U + λ γ*_u) g_u / (1 + κ²), the code's last line.
    Every term is an inner product of updates: Γ* needs only the Gram matrix K of the ĝ_u,
    divided by s² = (mean_u ||ĝ_u||_ε)² as in the code (Table 4's lr 25 assumes that scale).
    ValueError unless G is U × |θ| for the U ≥ 1 weights w."""
    if not (G.dim() == 2 and w.dim() == 1 and len(G) == len(w) > 0):
        raise ValueError(f"code_step: G of shape {tuple(G.shape)} for w of shape "
                         f"{tuple(w.shape)} (G: U × |θ|, w: U, U ≥ 1)")
    U = len(w)
    w = w.double().cpu()
    K = w[:, None] * gram(G) * w[None, :]                        # the Gram matrix of the ĝ_u
    K = K / (K.diagonal() + eps).sqrt().mean() ** 2              # / s²
    a = torch.full((U,), 1.0 / U, dtype=torch.float64)           # g_0 = aᵀ ĝ
    Gamma = solve(K, a, kappa, eps) if kappa > 0 else a                          # Eq. 15
    norm_g0 = (a @ K @ a + eps).sqrt()
    lam = kappa * norm_g0 / ((Gamma @ K @ Gamma + eps).clamp(min=0).sqrt() + eps)     # Eq. 17
    coef = w * (a + lam * Gamma) / (1 + kappa ** 2)                              # Eq. 16
    return coef.to(G.dtype).to(G.device) @ G


def objective(Gamma, K, a, kappa, eps=1e-4):
    """Eq. 15 from the Gram matrix K alone, g_0 = aᵀ𝐠: g_Γ · g_0 + κ ||g_0||_ε ||g_Γ||_ε =
    Γᵀ K a + κ sqrt(aᵀ K a + ε) sqrt(Γᵀ K Γ + ε)."""
    norm_g0 = (a @ K @ a + eps).sqrt()
    norm_gGamma = (Gamma @ K @ Gamma + eps).clamp(min=0).sqrt()
    return Gamma @ K @ a + kappa * norm_g0 * norm_gGamma


def solve(K, a, kappa, eps=1e-4, evaluations=21, lr=25.0, momentum=0.5):
    """Γ* of Eq. 15 by Table 4's solver, as the code's (CAGrad's): Γ = softmax(v) from v = 0,
    torch's SGD with momentum on v by autograd, the best of `evaluations` objective values (with lr
    25 the iterates oscillate when K is near singular). K, a: float64 CPU tensors."""
    v = torch.zeros(len(a), dtype=K.dtype, requires_grad=True)
    opt = torch.optim.SGD([v], lr=lr, momentum=momentum)
    best, best_Gamma = float("inf"), None
    for i in range(evaluations):
        Gamma = torch.softmax(v, 0)
        f = objective(Gamma, K, a, kappa, eps)
        if f.item() < best:
            best, best_Gamma = f.item(), Gamma.detach()
        if i < evaluations - 1:
            opt.zero_grad()
            f.backward()
            opt.step()
    return best_Gamma


def gram(G, cols=1 << 16):
    """K = G Gᵀ in float64, on the host: G (U × |θ|) read `cols` columns at a time, each block
    converted to float64 alone (memory: one U × cols block, not a float64 copy of G). Its entries
    sum |θ| products: one float32 product was off by 8e-4 (relative) on ResNet-18-sized updates."""
    K = torch.zeros(len(G), len(G), dtype=torch.float64, device=G.device)
    for i in range(0, G.shape[1], cols):
        B = G[:, i:i + cols].double()
        K += B @ B.T
    return K.cpu()                                               # one host sync per round


# ------------------------------------------------------------------------------------ one round

@common.stackable                       # with --parallel-clients on, every sampled client at once
@common.replies(lambda site, sent: {"theta": sent["theta"], "loss": common.SCALAR})
def client_update(site, sent):
    """On client u: plain local SGD from θ^(r-1) at the round's lr, its momentum its own across
    rounds (the DG code; none at --momentum 0, the FL code); θ_u and its mean loss."""
    make_opt = lambda params: common.sgd(params, site.args, lr=sent["lr"])
    keep = site.args.momentum > 0
    theta_u, loss = common.local_train(site, sent["theta"], make_opt=make_opt, keep_momentum=keep)
    return {"theta": theta_u, "loss": loss}


def fedomg_round(t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                     # θ^(r-1)
    S = common.sample_clients(ctx, len(fed.clients), args.sample)
    sent = {"theta": theta, "lr": local_lr(t, args)}
    up = common.on_clients(client_update, S, sent, t, ctx)             # E epochs each, θ_u back
    N = [float(fed.clients[c].n) for c in S]
    weighted = args.dataset not in data.FL
    theta_r = server_update(theta, [r["theta"] for r in up], N, eta_g(args, len(S)), args.kappa,
                            weighted)                                  # Eq. 8, 15–17
    common.set_flat(model, theta_r)
    return {c: r["loss"] for c, r in zip(S, up)}


def local_lr(t, args):
    """The DG code's StepLR (trainval_func.py: step size int(0.8 E R) local epochs, γ = 0.1): the
    local lr of round t is divided by 10 from round 0.8 R + 1 on. The FL code has no step."""
    return args.lr * (0.1 if args.dataset not in data.FL and t > 0.8 * args.rounds else 1.0)


def eta_g(args, U):
    """η_g of a round of U sampled clients (Eq. 17): --global-lr, or where it is "auto" (the
    table's value but on the DG and FL datasets) U (1 + κ²): code_step's g_0 term is then FedAvg's
    step."""
    return U * (1 + args.kappa ** 2) if args.global_lr == "auto" else args.global_lr


def add_args(p):
    p.add_argument("--kappa", type=float, help="searching radius κ (Table 4)")


def check(args, given):
    if not args.kappa >= 0:
        raise common.UserError(f"--kappa must be >= 0, got {args.kappa}")


METHOD = common.Method("fedomg", __doc__, fedomg_round, clients=(client_update,), add_args=add_args,
                       defaults=DEFAULTS, auto=AUTO, check=check, parallel=True)


def main(argv=None):                  # the program: the command line, checkpoints, results
    if importlib.util.find_spec("harness") is None:   # copied without harness/: common.program
        return common.program(METHOD, argv)
    return importlib.import_module("harness").main(METHOD, argv)


if __name__ == "__main__":
    main()
