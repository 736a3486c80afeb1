"""FedOMG — Federated Domain Generalization with Data-free On-server Matching Gradient
(Nguyen et al., ICLR 2025). Official code: github.com/skydvn/FedOMG (server solver from CAGrad,
Liu et al., NeurIPS 2021): FedOMG-DG/algorithms/FedOMG/ for the DG tables (server step in
utils/fed_merge.py, FedOMG and OMG), system/ for the FL table (flcore/servers/server_OMG.py).

Clients run plain local SGD; the server treats their updates as gradients and, without any data,
searches the convex hull of the updates for an invariant gradient direction near the FedAvg one.
The paper (Algorithm 1, Appendix B; Theorem 1's Eq. 13 states the same), with Γ = {γ_u} on the
simplex and 𝐠 = {g_u}:

    g_u   = θ_u^{(r,E)} − θ^{(r-1)}                                             (Eq. 8)
    g_FL  = Σ_u N_u g_u / Σ_u N_u                                    (FedAvg's update, below Eq. 11)
    Γ*    = argmin_Γ  g_Γ · g_FL + κ ||g_FL|| ||g_Γ||,   g_Γ = Γ𝐠 = Σ_u γ_u g_u              (Eq. 15)
    g_IGD = g_FL + κ ||g_FL|| / ||g_Γ*|| · g_Γ*                                         (Eq. 16)
    θ^(r) = θ^(r-1) − η_g g_IGD                                          (Eq. 17; the sign: below)

Algorithm 1 (one round r): send θ^(r-1) to the U clients; each trains E local epochs and returns θ_u;
the server forms the g_u, solves Eq. 15 and steps by Eq. 16–17. κ = 0 gives FedAvg (Corollary 1).
The server's part is `server_update` below, a plain function of tensors with η_g explicit (to copy
it with the functions it calls, into any training loop: docs/fedomg.md, "Copy it").

The official code steps differently, and its step is the default (`--server-rule code`). It scales
each update by a weight w_u, then runs CAGrad on the scaled updates ĝ_u = w_u g_u, which averages
them uniformly:

    ĝ_0   = (1/U) Σ_u ĝ_u                                              (the code's anchor for g_FL)
    Γ*    = argmin_Γ  ĝ_Γ · ĝ_0 + κ ||ĝ_0||_ε ||ĝ_Γ||_ε,   ĝ_Γ = Σ_u γ_u ĝ_u     (Eq. 15 on the ĝ_u)
    λ     = κ ||ĝ_0||_ε / (||ĝ_Γ*||_ε + ε)
    θ^(r) = θ^(r-1) + η_g (ĝ_0 + λ ĝ_Γ*) / (1 + κ²)                         (Eq. 16–17, the code's)

where ||x||_ε = sqrt(||x||² + ε), ε = 1e-4, every inner product divided by s² with
s = mean_u ||ĝ_u||_ε (the code's normalisation, before the ε's). w_u = p_u = N_u / Σ N (data
fraction) in the DG code; w_u = 1 in the FL code. So in the DG setting ĝ_0 = g_FL / U: at κ = 0 the
code's step is 1/U of FedAvg's (of Corollary 1's), and for κ > 0 Γ* differs too, because it is
searched over the p_u g_u (three PACS-sized clients, correlated random updates, κ = 0.5: Eq. 16's
step is 3.8× as long as the code's, ≈ U (1 + κ²), cosine 0.95). The paper's tables came from the
code, so the code's 1/U, 1/(1+κ²) and ε are the default (η_g below carries the U and the 1 + κ²
where no code gives it); `--server-rule paper` gives Eq. 15–17 as printed (Γ* over the g_u, no 1/U,
no 1/(1+κ²), no ε), and only that rule reproduces FedAvg bit for bit at κ = 0 (the usage line
below, tested). The weights w_u follow the code of the setting: the FL code's (w_u = 1, so
its κ = 0 step is the unweighted mean of the updates) for the FL datasets of Table 1 (mnist, emnist,
cifar10, cifar100), the DG code's (w_u = p_u) for all others.

Every term of Eq. 15 is an inner product of updates, so Γ* needs only the U×U Gram matrix K = G Gᵀ
of the stacked updates G (U × |θ|, the g_u as rows): g_Γ·g_FL = Γᵀ K p, ||g_FL||² = pᵀ K p,
||g_Γ||² = Γᵀ K Γ (for the code's rule, K of the ĝ_u: diag(w) K diag(w)). K is accumulated in
float64, G read in column blocks: its entries are sums of |θ| products (11.2M for ResNet-18), and one
float32 product over them was off by 8e-4 (relative, 3 random updates); Eq. 15 is ill-conditioned
when the updates are nearly parallel. The code uses float32. The cost, ResNet-18-sized updates on
one CPU thread: the whole server step 0.13 s / 1.8 s / 22 s for U = 3 / 20 / 100 (a float32 K alone:
0.08 s at U = 3, 6 s at U = 100). The server holds G (U × |θ| floats: 3 × 11.2M × 4 B = 134 MB for
ResNet-18 DG) and one more |θ| vector, nothing else.

Choices, and where they come from:
- Sign (Eq. 17). The paper writes θ − η_g g_IGD while Eq. 8 defines g_u = θ_u − θ, which already
  points downhill; the official code adds. Both rules here add: θ ← θ + η_g · step.
- The solver. `--solver sgd` (default, Table 4 and the DG code): Γ = softmax(v), v = 0 at first,
  SGD on v with lr 25 and momentum 0.5, 21 evaluations of the objective keeping the best Γ; K is
  divided by s² first, as in the code (the argmin is unchanged, the lr 25 assumes that scale).
  `--solver exact`: scipy's SLSQP on the simplex (as CAGrad's repository offers); Eq. 15 is convex.
  Measured against SLSQP (κ = 0.5, Gram matrices of U updates of 500 Gaussian entries, seeds 0–9;
  "correlated": one shared random direction plus 0.8× independent noise, as updates from one
  model; test_fedomg_solver_accuracy_as_stated re-measures it), the objective the 21 evaluations reach lies above the
  exact minimum by, relative: U = 10, ≤ 1.7e-3 (correlated ≤ 2.2e-3); U = 20, 2.5e-3–1.1e-2
  (3.4e-3–6.0e-3); U = 100, 26–38% (3.5–5.6%). With 201 evaluations (`--solver-evals 201`):
  ≤ 2.7e-4, ≤ 1.6e-3 and 9–13% (correlated ≤ 3.7e-3 at 100). Nearly parallel updates: within 1e-3.
  When the update norms span orders of magnitude the optimum is a vertex of the simplex that 20
  softmax steps do not reach. The best of the evaluations is kept, not the last: with lr 25 the
  iterates oscillate when the Gram matrix is near singular (more clients than update directions).
  The FL code's own solver defaults (26 evaluations, momentum 0.1, κ = 0.25) are not followed:
  Table 4's solver and κ are used in every setting.
- Weights. p_u uses the clients' training-set sizes N_u (paper); the DG code's fractions count each
  domain whole (its 'total' split), here 90% of it (the validation hold-out is not trained on): the
  same fractions up to rounding.
- Server step size η_g (Eq. 17). `--global-lr`, given by hand, is used as it is, every round. Without
  it: on the DG datasets (pacs, vlcs, officehome) 0.5, the official DG scripts' default
  (`--global_model_lr` in FedOMG-DG/algorithms/FedOMG/train_pacs_OMG.py, train_pacs_OMG_GA.py,
  train_vlcs_GA.py); Table 4 prints 5e-2 (`--global-lr 5e-2`). Under the code's rule ||η_g step||
  / ||g_FL|| is then 0.19 for three PACS-sized clients at κ = 0.5 (correlated random updates), 0.019
  at 5e-2: 100 rounds at 5e-2 move the model about as far as 2 FedAvg rounds. On the FL datasets
  (mnist, emnist, cifar10, cifar100) 1, the FL code's `--omg_meta_lr` (system/main.py); there
  w_u = 1, so at κ = 0 the step is the unweighted mean of the updates (FedAvg's with
  `--uniform-avg`), no 1/U, and for κ > 0 its anchor is that mean over 1 + κ² (0.8 of it at
  κ = 0.5). Elsewhere (rmnist, synthetic, stained, rcmnist, rcfmnist, waterbird) neither paper nor
  code gives η_g, and the rule is the paper's η_g = 1 (FedAvg's; Corollary 1) carried to the step in
  use: under the code's rule, whose step is Σ_u p_u (1/U + λ γ*_u) g_u / (1 + κ²) (code_step),
  η_g = U (1 + κ²), U the clients sampled in that round, so that the anchor term is g_FL itself and
  κ = 0 gives FedAvg's data-weighted step (to float rounding; tested); the κ term then has length
  κ||g_FL|| up to the ε's: Eq. 16's form, with Γ* searched over the p_u g_u. Under
  `--server-rule paper`, η_g = 1. The results' args then show "global_lr": null.
- Client optimiser. The official DG code keeps each client's SGD (its momentum) across rounds:
  the default here (`--fresh-opt` starts a new one every round). Its StepLR (step size int(0.8 E R)
  local epochs, stepped after every local epoch, γ = 0.1; FedOMG-DG/algorithms/FedOMG/utils/
  trainval_func.py) divides the local lr by 10 from round 0.8 R + 1 on: done here as `--lr-step 0.8`
  (`--lr-step 1` never does; tested against torch's StepLR). The FL code has no step (its -ld flag,
  off by default, would be ExponentialLR 0.99 per round) and SGD without momentum, so the FL
  datasets (mnist, emnist, cifar10, cifar100) default to `--lr-step 1` (and momentum 0).
- BatchNorm (ResNets) — a difference. The official DG clients train with BN in train mode: every
  minibatch is normalised by its own statistics (and gradients flow through them); their running
  statistics are updated and then overwritten by the global model's at the next round, and the
  server aggregates parameters only, so the evaluated global model keeps the ImageNet running
  statistics. Here (common.ResNet, every method, as the FedIIR code) BN stays in eval mode: training
  minibatches are normalised by those ImageNet statistics too. The evaluated model normalises the
  same way in both; the client updates g_u do not (a differently normalised network is trained).
  Following the code would need per-client BN buffers in common's training paths (one after
  another and torch.func), so it is not done here.
- Augmentation (photos) — a difference: the DG code's ColorJitter is (0.4, 0.4, 0.4, 0.4);
  common.augment, used by every method, has the FedIIR code's 0.3 (crop scale 0.7–1, flip and
  RandomGrayscale(0.1) are the same).
- Rounds. DG: 100 (Appendix D.6; the code's loop runs rounds 0..100, one more). FL: Appendix D.6
  trains 800 rounds; the default here is 100 (common's) for every dataset: `--rounds 800` for the
  paper's FL runs.
- Combining with other clients (Table 2's FedIIR+OMG): a method file does not import another, so
  the combination is not a flag. To build it, give `common.train_clients` FedIIR's penalised loss
  (loss_fn=fediir.iir_loss(...), with its global-gradient pass) in `fedomg_round` below; the server
  step `server_update` is unchanged.

Defaults. DG (pacs, vlcs, officehome; paper §D.6, Table 4, and the official DG scripts): pretrained
ResNet-18 with a linear head, SGD lr 1e-3, batch 16, momentum 0.9, weight decay 5e-4, 5 local epochs,
100 rounds, one client per source domain, κ = 0.5, η_g = 0.5 (the scripts; Table 4: 5e-2). FL
(mnist, cifar10, cifar100, emnist; Table 1): the small CNN, lr 0.005, batch 16, 5 local epochs, 100
clients, α = 0.1, η_g = 1 (the FL code's; the paper gives none). Elsewhere η_g = U (1 + κ²) per round
(above); rmnist keeps FedIIR's Table 3 client settings. κ = 0 is FedAvg bit for bit only with Eq. 16
as printed, a fresh client optimiser every round and no lr step (the last line; on the DG datasets
the client defaults differ from fedavg.py's as well):

    python fedomg.py --dataset pacs --data-root ./data
    python fedomg.py --dataset mnist --clients 100 --sample 20 --alpha 0.1 --rounds 800
    python fedomg.py --solver exact --rounds 20 --test-domain 0
    python fedomg.py --dataset synthetic --rounds 4 --server-rule paper --kappa 0 --fresh-opt --lr-step 1
        # = python fedavg.py --dataset synthetic --rounds 4, bit for bit
"""
import sys

import torch

import common
import data

DG = dict(model="resnet18", head="linear", lr=1e-3, batch_size=16, momentum=0.9, weight_decay=5e-4,
          local_epochs=5, global_lr=0.5)                                         # η_g: the DG scripts'
DG_SETS = ("pacs", "vlcs", "officehome")
DEFAULTS = {**{name: DG for name in DG_SETS}, "*": dict(lr_step=0.8),           # the DG code's StepLR
            **{name: dict(lr_step=1.0) for name in data.FL}}                    # the FL code: no step


# ---------------------------------------------------------------- the method as plain functions
# Functions of tensors and numbers alone (torch; numpy and scipy imported inside the solvers), to be
# copied into another training loop. The client's step is plain local SGD on the cross-entropy (any
# training loop does it) and it uploads its trained θ_u; what is FedOMG's own is the server's step,
# server_update (Eq. 8, 15–17), built on code_step / paper_step (Eq. 15–16) and the Γ solvers.

# ----------------------------------------------------------------------- Eq. 15 on the Gram matrix

def gram(G, cols=1 << 16):
    """K = G Gᵀ in float64, on the host: G (U × |θ|) read `cols` columns at a time, each block
    converted to float64 alone (memory: one U × cols block, not a float64 copy of G)."""
    K = torch.zeros(len(G), len(G), dtype=torch.float64, device=G.device)
    for i in range(0, G.shape[1], cols):
        B = G[:, i:i + cols].double()
        K += B @ B.T
    return K.cpu()                                               # one host sync per round


def objective(Gamma, K, a, kappa, eps=0.0):
    """Eq. 15 from K alone, anchor g_0 = aᵀ𝐠 (a = p: g_FL; a = 1/U: the code's ĝ_0):
    Γᵀ K a + κ sqrt(aᵀ K a + ε) sqrt(Γᵀ K Γ + ε)."""
    return Gamma @ K @ a + kappa * (a @ K @ a + eps).sqrt() * (Gamma @ K @ Gamma + eps).clamp(min=0).sqrt()


def solve_sgd(K, a, kappa, lr=25.0, momentum=0.5, evaluations=21, eps=0.0):
    """Table 4's solver (the code's): Γ = softmax(v) from v = 0, SGD with momentum on v (PyTorch's
    rule: the first step uses the gradient, then buf = momentum·buf + grad), keeping the best of
    `evaluations` objective values. The gradient in closed form: ∂f/∂Γ = Ka + c KΓ / ||g_Γ||_ε
    (c = κ ||g_0||_ε), through the softmax: ∂f/∂v = Γ ⊙ (∂f/∂Γ − Γ·∂f/∂Γ). K, a: float64 CPU
    tensors."""
    import numpy as np
    K, a = K.numpy(), a.numpy()
    b, c = K @ a, kappa * np.sqrt(max(a @ K @ a + eps, 0.0))
    v, buf = np.zeros(len(a)), None
    best, best_Gamma = np.inf, None
    for i in range(evaluations):
        Gamma = np.exp(v - v.max())
        Gamma /= Gamma.sum()
        KG = K @ Gamma
        norm = np.sqrt(max(Gamma @ KG + eps, 1e-30))
        f = Gamma @ b + c * norm
        if f < best:
            best, best_Gamma = f, Gamma
        if i < evaluations - 1:
            df = b + c * KG / norm
            grad = Gamma * (df - Gamma @ df)
            buf = grad if buf is None else momentum * buf + grad
            v = v - lr * buf
    return torch.from_numpy(best_Gamma)


def solve_exact(K, a, kappa, eps=0.0):
    """Eq. 15 to convergence: SLSQP over Γ ∈ [0, 1]^U with Σ Γ = 1, started from the uniform Γ."""
    import numpy as np
    from scipy.optimize import minimize
    Kn, an = K.numpy(), a.numpy()
    c = kappa * np.sqrt(max(an @ Kn @ an + eps, 0.0))

    def f(x):
        n = np.sqrt(max(x @ Kn @ x + eps, 1e-30))
        return x @ Kn @ an + c * n, Kn @ an + c * (Kn @ x) / n
    U = len(an)
    res = minimize(f, np.full(U, 1 / U), jac=True, method="SLSQP", bounds=[(0, 1)] * U,
                   constraints={"type": "eq", "fun": lambda x: x.sum() - 1, "jac": lambda x: np.ones(U)},
                   options={"ftol": 1e-15, "maxiter": 1000})
    x = np.clip(res.x, 0, None)
    return torch.from_numpy(x / x.sum())


def solve(K, a, kappa, solver, evaluations, eps=0.0):
    """Γ* of Eq. 15 by solver "sgd" (Table 4's) or "exact" (SLSQP)."""
    if solver == "sgd":
        return solve_sgd(K, a, kappa, evaluations=evaluations, eps=eps)
    return solve_exact(K, a, kappa, eps=eps)


# -------------------------------------------------------------------- the two server rules

def code_step(G, w, kappa, solver="sgd", evaluations=21, eps=1e-4):
    """The official code's step (fed_merge.py OMG, CAGrad): on the scaled updates ĝ_u = w_u g_u,
    ĝ_0 = mean_u ĝ_u, Γ* by Eq. 15 over the ĝ_u, and (ĝ_0 + λ ĝ_Γ*) / (1 + κ²). Returns it as
    Σ_u w_u (1/U + λ γ*_u) g_u / (1 + κ²), the code's last line.
    Its scale: with w = p (the DG code) and κ = 0 it is g_FL / U, 1/U of FedAvg's step, and for κ > 0
    its anchor term is g_FL / (U (1 + κ²)); with w = 1 (the FL code) the anchor is the plain mean of
    the g_u over 1 + κ². η_g = U (1 + κ²) restores FedAvg's scale (server_update). eps: the code's ε,
    under its square roots and in λ's denominator."""
    U = len(w)
    w = w.double().cpu()
    K = w[:, None] * gram(G) * w[None, :]                        # the Gram matrix of the ĝ_u
    K = K / (K.diagonal() + eps).sqrt().mean() ** 2              # s² = (mean_u ||ĝ_u||_ε)²
    a = torch.full((U,), 1.0 / U, dtype=torch.float64)           # ĝ_0 = aᵀ ĝ
    Gamma = solve(K, a, kappa, solver, evaluations, eps) if kappa > 0 else a                       # Eq. 15
    lam = kappa * (a @ K @ a + eps).sqrt() / ((Gamma @ K @ Gamma + eps).clamp(min=0).sqrt() + eps)
    coef = w * (a + lam * Gamma) / (1 + kappa ** 2)                                                # Eq. 16
    return coef.to(G.dtype).to(G.device) @ G


def paper_step(G, g_FL, p, kappa, solver="sgd", evaluations=21):
    """Eq. 15–16 as printed: Γ* over the g_u with g_FL = pᵀ𝐠, then g_IGD = g_FL + κ||g_FL||/||g_Γ*|| g_Γ*.
    κ = 0 returns g_FL itself (Corollary 1), so that the round is FedAvg's bit for bit."""
    if kappa == 0:
        return g_FL
    p = p.double().cpu()
    K = gram(G)
    K = K / K.diagonal().clamp(min=0).sqrt().mean().clamp(min=1e-30) ** 2   # the code's scale (argmin unchanged)
    Gamma = solve(K, p, kappa, solver, evaluations)                                               # Eq. 15
    norm_g_FL, norm_g_Gamma = (p @ K @ p).clamp(min=0).sqrt(), (Gamma @ K @ Gamma).clamp(min=0).sqrt()
    if norm_g_Gamma == 0:
        return g_FL
    g_Gamma = Gamma.to(G.dtype).to(G.device) @ G                 # g_Γ* = Γ*𝐠
    return g_FL + (kappa * norm_g_FL / norm_g_Gamma).item() * g_Gamma   # Eq. 16 (norms in K's scale: a ratio)


def server_update(theta, thetas, N, eta_g, kappa=0.5, rule="code", weighted=True, solver="sgd", evaluations=21):
    """The server's round (Algorithm 1): θ^(r-1) and the U sampled clients' trained θ_u in, θ^(r) out.
    theta: θ^(r-1), flat; thetas: the θ_u, flat, any iterable (read one at a time into the U × |θ|
    matrix G of the updates, the server's only large buffer); N: the clients' training-set sizes N_u.
        g_u = θ_u − θ^(r-1)                                                             (Eq. 8)
        g_FL = Σ_u N_u g_u / Σ_u N_u,  p_u = N_u / Σ_u N_u                  (FedAvg's update)
        step = code_step(G, w, κ) (rule "code", the official code) or paper_step(G, g_FL, p, κ)
               (rule "paper", Eq. 15–16 as printed); w_u = p_u (weighted, the DG code) or 1 (the FL code)
        θ^(r) = θ^(r-1) + η_g · step                               (Eq. 17; + as the code: g_u points downhill)
    The scale of η_g, which no default here hides: rule "code", weighted, steps g_FL / U at κ = 0, and
    for κ > 0 its anchor term is g_FL / (U (1 + κ²)): η_g = 1 moves 1/U of FedAvg's step, and
    η_g = U (1 + κ²), U = len(N), makes the anchor term FedAvg's step (κ = 0: FedAvg's θ to float
    rounding). Rule "code", weighted=False (the FL code, η_g = 1 there): the κ = 0 step is the
    unweighted mean of the g_u, over 1 + κ² for κ > 0. Rule "paper" is on FedAvg's scale at η_g = 1, and
    at κ = 0 returns FedAvg's θ bit for bit (Corollary 1). The official DG scripts use η_g = 0.5
    with rule "code", weighted (Table 4 prints 5e-2: about 2% of FedAvg's step per round)."""
    G = torch.empty(len(N), theta.numel(), dtype=theta.dtype, device=theta.device)   # the g_u, U × |θ|
    delta_sum, weight_sum = torch.zeros_like(theta), 0.0
    for u, (theta_u, N_u) in enumerate(zip(thetas, N)):
        G[u] = theta_u - theta                                                           # Eq. 8
        delta_sum += float(N_u) * G[u]
        weight_sum += float(N_u)
    g_FL = delta_sum / weight_sum                                                        # FedAvg's update
    p = torch.tensor([float(N_u) for N_u in N]) / weight_sum                             # p_u = N_u / Σ N
    if rule == "code":
        w = p if weighted else torch.ones(len(N))                 # the DG code: w_u = p_u; the FL code: 1
        step = code_step(G, w, kappa, solver, evaluations)                               # Eq. 15–16, the code's
    else:
        step = paper_step(G, g_FL, p, kappa, solver, evaluations)                        # Eq. 15–16
    return theta + eta_g * step                                                          # Eq. 17


# ------------------------------------------------------------------------------------ one round

def eta_g(args, U):
    """η_g of a round of U sampled clients (Eq. 17): --global-lr, or the dataset's default, when set;
    otherwise (args.global_lr None, see check) the paper's η_g = 1 on Eq. 16's scale: U (1 + κ²)
    under the code's rule (code_step's anchor is g_FL / (U (1 + κ²))), 1 under Eq. 16 itself."""
    if args.global_lr is not None:
        return args.global_lr
    return U * (1 + args.kappa ** 2) if args.server_rule == "code" else 1.0


def fedomg_round(t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                         # θ^(r-1)
    S = common.sample_clients(ctx, len(fed.clients), args.sample)         # send θ^(r-1) to the U clients
    lr = args.lr * (0.1 if t > args.lr_step * args.rounds else 1.0)       # the DG code's StepLR (γ = 0.1)
    keep = not args.fresh_opt and args.momentum > 0
    client_sgd = lambda params: torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    trained = common.train_clients(model, theta, [fed.clients[c] for c in S], args, ctx, client_sgd,
                                   momentum=state["momentum"] if keep else None)  # clients: E epochs of local SGD
    losses = {}

    def uploads():                                                         # θ_u, client by client, as they finish
        for c, (theta_u, loss) in zip(S, trained):
            losses[c] = loss
            yield theta_u
    N = [float(fed.clients[c].n) for c in S]
    common.set_flat(model, server_update(theta, uploads(), N, eta_g(args, len(S)), args.kappa, args.server_rule,
                                         weighted=args.dataset not in data.FL, solver=args.solver,
                                         evaluations=args.solver_evals))   # Eq. 8, 15–17
    return losses


def init_state(model, fed, args, ctx):
    return {"momentum": {}}                                                # client id -> momentum


def add_args(p):
    p.add_argument("--kappa", type=float, default=0.5, help="searching radius κ (Table 4)")
    p.add_argument("--server-rule", default="code", choices=["code", "paper"],
                   help="the official code's step (scaled updates, 1/U, 1/(1+κ²); default) or Eq. 15-17 as printed")
    p.add_argument("--solver", default="sgd", choices=["sgd", "exact"],
                   help="Γ* by Table 4's softmax-SGD (lr 25, momentum 0.5, 21 evaluations) or by SLSQP")
    p.add_argument("--solver-evals", type=int, default=21, help="objective evaluations of the sgd solver (Table 4: 21)")
    p.add_argument("--fresh-opt", action="store_true", help="a new client optimiser every round (default: kept)")
    p.add_argument("--lr-step", type=float, default=None,
                   help="divide the local lr by 10 after this fraction of the rounds (the DG code's StepLR; 1 = never; "
                        "default 0.8, and 1 for the FL datasets as the FL code)")


def check(args, global_lr_by_hand=True):
    """Bad flags -> UserError. Where --global-lr was not given by hand and neither the paper nor the
    code gives η_g (not the DG or FL datasets), args.global_lr = None: η_g is set per round."""
    if not args.kappa >= 0:
        raise common.UserError(f"--kappa must be >= 0, got {args.kappa}")
    if args.solver_evals < 1:
        raise common.UserError(f"--solver-evals must be positive, got {args.solver_evals}")
    if not 0 < args.lr_step <= 1:
        raise common.UserError(f"--lr-step must be in (0, 1], got {args.lr_step}")
    if not global_lr_by_hand and args.dataset not in DG_SETS + data.FL:
        args.global_lr = None


def given(argv, flag):
    """Whether the command line sets `flag` in one of argparse's forms: --flag v, --flag=v, or a
    prefix of it (common's parser has no other option starting with --g)."""
    names = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    return any(len(n) > 2 and flag.startswith(n) for n in names)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    by_hand = given(argv, "--global-lr")
    return common.main("fedomg", __doc__, fedomg_round, argv, add_args, DEFAULTS, init_state,
                       check=lambda args: check(args, by_hand), parallel_clients=True)


if __name__ == "__main__":
    main()
