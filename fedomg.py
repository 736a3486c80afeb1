"""FedOMG — Federated Domain Generalization with Data-free On-server Matching Gradient
(Nguyen et al., ICLR 2025). Official code: github.com/skydvn/FedOMG (server solver from CAGrad,
Liu et al., NeurIPS 2021).

Clients run plain local SGD; the server treats their updates as gradients and, without any data,
searches the convex hull of the updates for an invariant gradient direction near the FedAvg one:

    g_u   = θ_u^{(r,E)} − θ^{(r-1)}                                   (Eq. 8)
    g_FL  = Σ_u N_u g_u / Σ_u N_u                                      (FedAvg's update)
    Γ*    = argmin_{Γ ∈ simplex}  Γg · g_FL + κ ||g_FL|| ||Γg||,   Γg = Σ_u γ_u g_u      (Eq. 15)
    g_IGD = g_FL + κ ||g_FL|| / ||Γ*g|| · Γ*g                          (Eq. 16)
    θ^(r) = θ^(r-1) + η_g g_IGD / (1 + κ²)                             (Eq. 17, see the sign note)

Algorithm 1 (one round r): send θ^(r-1) to the U clients; each trains E local epochs and returns θ_u;
the server forms the g_u, solves Eq. 15 and steps by Eq. 16–17. κ = 0 gives FedAvg (Corollary 1).

Every term of Eq. 15 is an inner product of updates, so Γ* needs only the U×U Gram matrix K = G Gᵀ
of the stacked updates G (U × |θ|): Γg·g_FL = Γᵀ K p, ||g_FL||² = pᵀ K p, ||Γg||² = Γᵀ K Γ with
p_u = N_u / Σ N. The server holds G (U × |θ| floats: 3 × 11.2M × 4 B = 134 MB for ResNet-18 DG) and
one more |θ| vector, nothing else.

Choices, and where they come from:
- Sign (Eq. 17). The paper writes θ − η_g g_IGD while Eq. 8 defines g_u = θ_u − θ, which already
  points downhill; the official code adds. This file adds: θ ← θ + η_g g_IGD.
- Rescaling. CAGrad's code (used by FedOMG's) divides the step by 1 + κ²; Eq. 16 omits it. Table 4's
  global lr was tuned with the code, so the default rescales; `--no-rescale` gives Eq. 16 as printed.
- The solver. `--solver sgd` (default, Table 4): Γ = softmax(w), w = 0 at first, SGD on w with lr 25
  and momentum 0.5, 21 evaluations of the objective keeping the best Γ; K is divided by the squared
  mean update norm first, as in the code (the argmin is unchanged, the lr 25 assumes that scale).
  `--solver exact`: scipy's SLSQP on the simplex (as CAGrad's repository offers); Eq. 15 is convex.
  Measured (tests, random Gram matrices): the 21 evaluations reach the exact objective within 1e-3
  (relative) for up to 10 clients, and for nearly parallel updates; about 4e-3 off at 20 clients
  (1e-3 needs ~200 evaluations, `--solver-evals`) and 3-15% off at 100; when the update norms span
  orders of magnitude the optimum is a vertex of the simplex that 20 softmax steps do not reach.
- Weights. g_FL uses the data sizes N_u (paper); the code weights the updates by data fraction too.
- Client optimiser. The official DG code keeps each client's SGD (its momentum) across rounds:
  the default here (`--fresh-opt` starts a new one every round). It also divides the local lr by 10
  after 80% of the rounds (the paper is silent): done here too (`--lr-step 1` never does).
- BatchNorm: the ResNets keep BN in eval mode (common.py), so buffers never change and only the
  trainable parameters form g_u; the official code does not aggregate BN statistics either.
- Combining with other clients (Table 2's FedIIR+OMG, γ = 1e-4): a method file does not import
  another, so the combination is not a flag. To build it, give `common.train_clients` FedIIR's penalised
  loss (loss_fn=fediir.iir_loss(...), with its global-gradient pass) in `fedomg_round` below; the
  server rule `omg_step` is unchanged.

Defaults. DG (pacs, vlcs, officehome; paper §D.6, Table 4): pretrained ResNet-18 with a linear head,
SGD lr 1e-3, batch 16, momentum 0.9, weight decay 5e-4, 5 local epochs, 100 rounds, one client per
source domain, κ = 0.5, η_g = 5e-2 (the official scripts use 0.5). FL (mnist, cifar10, cifar100,
emnist; Table 1): the small CNN, lr 0.005, batch 16, 5 local epochs, 100 clients, α = 0.1; the paper
gives no η_g there, and none for RotatedMNIST (not in the paper): η_g = 1 as FedAvg, so that the
comparison isolates the direction of the step; rmnist keeps FedIIR's Table 3 client settings.

    python fedomg.py --dataset pacs --data-root ./data
    python fedomg.py --dataset mnist --clients 100 --sample 20 --alpha 0.1
    python fedomg.py --solver exact --rounds 20 --test-domain 0
"""
import numpy as np
import torch

import common

DG = dict(model="resnet18", head="linear", lr=1e-3, batch_size=16, momentum=0.9, weight_decay=5e-4,
          local_epochs=5, global_lr=5e-2)
DEFAULTS = {"pacs": DG, "vlcs": DG, "officehome": DG}


# ----------------------------------------------------------------------- Eq. 15 on the Gram matrix

def objective(gamma, K, p, kappa):
    """Eq. 15 from K = G Gᵀ alone: Γᵀ K p + κ sqrt(pᵀ K p) sqrt(Γᵀ K Γ)."""
    return gamma @ K @ p + kappa * (p @ K @ p).sqrt() * (gamma @ K @ gamma).clamp(min=0).sqrt()


def solve_sgd(K, p, kappa, lr=25.0, momentum=0.5, evaluations=21):
    """Table 4's solver: Γ = softmax(w) from w = 0, SGD with momentum on w (PyTorch's rule: the
    first step uses the gradient, then buf = momentum·buf + grad), keeping the best of
    `evaluations` objective values. The gradient in closed form: ∂f/∂Γ = Kp + c KΓ / ||Γg||
    (c = κ ||g_FL||), through the softmax: ∂f/∂w = Γ ⊙ (∂f/∂Γ − Γ·∂f/∂Γ)."""
    K, p = K.numpy(), p.numpy()
    b, c = K @ p, kappa * np.sqrt(max(p @ K @ p, 0.0))
    w, buf = np.zeros(len(p)), None
    best, best_gamma = np.inf, None
    for i in range(evaluations):
        gamma = np.exp(w - w.max())
        gamma /= gamma.sum()
        Kg = K @ gamma
        norm = np.sqrt(max(gamma @ Kg, 1e-30))
        f = gamma @ b + c * norm
        if f < best:
            best, best_gamma = f, gamma
        if i < evaluations - 1:
            df = b + c * Kg / norm
            grad = gamma * (df - gamma @ df)
            buf = grad if buf is None else momentum * buf + grad
            w = w - lr * buf
    return torch.from_numpy(best_gamma)


def solve_exact(K, p, kappa):
    """Eq. 15 to convergence: SLSQP over Γ ∈ [0, 1]^U with Σ Γ = 1, started from the uniform Γ."""
    from scipy.optimize import minimize
    Kn, pn = K.numpy(), p.numpy()
    c = kappa * np.sqrt(max(pn @ Kn @ pn, 0.0))

    def f(x):
        n = np.sqrt(max(x @ Kn @ x, 1e-30))
        return x @ Kn @ pn + c * n, Kn @ pn + c * (Kn @ x) / n
    U = len(pn)
    res = minimize(f, np.full(U, 1 / U), jac=True, method="SLSQP", bounds=[(0, 1)] * U,
                   constraints={"type": "eq", "fun": lambda x: x.sum() - 1, "jac": lambda x: np.ones(U)},
                   options={"ftol": 1e-15, "maxiter": 1000})
    x = np.clip(res.x, 0, None)
    return torch.from_numpy(x / x.sum())


def omg_step(G, g_FL, p, kappa, solver="sgd", rescale=True, evaluations=21):
    """Eq. 15–17: the server's update direction from the stacked client updates G (U × |θ|), their
    data-weighted mean g_FL and weights p. Returns g_IGD (divided by 1 + κ² when rescaling)."""
    if kappa == 0:                                               # Corollary 1: FedAvg
        return g_FL
    K = (G @ G.T).double().cpu()                                 # U × U, one host sync per round
    p = p.double().cpu()
    K = K / K.diagonal().clamp(min=0).sqrt().mean().clamp(min=1e-30) ** 2   # scale of the code
    gamma = solve_sgd(K, p, kappa, evaluations=evaluations) if solver == "sgd" else solve_exact(K, p, kappa)  # Eq. 15
    norm_FL, norm_Gg = (p @ K @ p).sqrt(), (gamma @ K @ gamma).clamp(min=0).sqrt()
    Gg = gamma.to(G.dtype).to(G.device) @ G                      # Γ*g
    if norm_Gg > 0:
        g_IGD = g_FL + (kappa * norm_FL / norm_Gg).item() * Gg   # Eq. 16 (norms in K's scale: a ratio)
    else:
        g_IGD = g_FL
    return g_IGD / (1 + kappa ** 2) if rescale else g_IGD


# ------------------------------------------------------------------------------------ one round

def fedomg_round(t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                         # θ^(r-1)
    S = common.sample_clients(ctx, len(fed.clients), args.sample)
    G = torch.empty(len(S), theta.numel(), device=theta.device)            # the g_u, U × |θ|
    delta_sum, weight_sum, losses = torch.zeros_like(theta), 0.0, {}
    lr = args.lr * (0.1 if t > args.lr_step * args.rounds else 1.0)       # the code's StepLR
    keep = not args.fresh_opt and args.momentum > 0
    client_sgd = lambda params: torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    trained = common.train_clients(model, theta, [fed.clients[c] for c in S], args, ctx, client_sgd,
                                   momentum=state["momentum"] if keep else None)  # clients: plain local SGD
    for u, (c, (theta_u, loss)) in enumerate(zip(S, trained)):
        losses[c] = loss
        G[u] = theta_u - theta                                             # Eq. 8
        delta_sum += float(fed.clients[c].n) * G[u]
        weight_sum += float(fed.clients[c].n)
    g_FL = delta_sum / weight_sum                                          # FedAvg's update
    p = torch.tensor([float(fed.clients[c].n) for c in S]) / weight_sum
    g_IGD = omg_step(G, g_FL, p, args.kappa, args.solver, not args.no_rescale, args.solver_evals)  # Eq. 15–16
    common.set_flat(model, theta + args.global_lr * g_IGD)                 # Eq. 17 (+, see docstring)
    return losses


def init_state(model, fed, args, ctx):
    return {"momentum": {}}                                                # client id -> momentum


def add_args(p):
    p.add_argument("--kappa", type=float, default=0.5, help="searching radius κ (Table 4)")
    p.add_argument("--solver", default="sgd", choices=["sgd", "exact"],
                   help="Γ* by Table 4's softmax-SGD (lr 25, momentum 0.5, 21 evaluations) or by SLSQP")
    p.add_argument("--solver-evals", type=int, default=21, help="objective evaluations of the sgd solver (Table 4: 21)")
    p.add_argument("--no-rescale", action="store_true", help="Eq. 16 as printed, without the code's 1/(1+κ²)")
    p.add_argument("--fresh-opt", action="store_true", help="a new client optimiser every round (default: kept)")
    p.add_argument("--lr-step", type=float, default=0.8,
                   help="divide the local lr by 10 after this fraction of the rounds (the code's StepLR; 1 = never)")


def check(args):
    if not args.kappa >= 0:
        raise common.UserError(f"--kappa must be >= 0, got {args.kappa}")
    if args.solver_evals < 1:
        raise common.UserError(f"--solver-evals must be positive, got {args.solver_evals}")
    if not 0 < args.lr_step <= 1:
        raise common.UserError(f"--lr-step must be in (0, 1], got {args.lr_step}")


def main(argv=None):
    return common.main("fedomg", __doc__, fedomg_round, argv, add_args, DEFAULTS, init_state, check=check,
                       parallel_clients=True)


if __name__ == "__main__":
    main()
