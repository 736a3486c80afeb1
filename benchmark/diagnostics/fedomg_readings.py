"""FedOMG's other readings: fedomg.py with one of its plain functions swapped, run through
harness.main with readings_round, fedomg_round written from fedomg's plain functions with the
reading's in its place (the results JSON is fedomg's; its args name the reading). No committed
result uses them; fedomg.py runs the official code's step, Table 4's solver, kept client
optimisers, the DG code's lr step.

--server-rule paper   Eq. 15–17 as printed (server_update swapped for paper_update): Γ* over the
                      g_u themselves, g_FL = Σ_u N_u g_u / Σ N (FedAvg's update) as the anchor,
                      g_IGD = g_FL + κ ||g_FL|| / ||g_Γ*|| g_Γ*, no 1/U, no 1/(1 + κ²), no ε, and
                      η_g = 1 unless --global-lr (eta_g swapped). Its step is about U (1 + κ²)
                      times the code's and points elsewhere (three PACS-sized clients, correlated
                      random updates, κ = 0.5: 3.8× as long, cosine 0.95).
--solver exact        Γ* by scipy's SLSQP on the simplex (solve swapped), as CAGrad's repository
                      offers; Eq. 15 is convex.
--solver-evals N      Table 4's solver with N objective evaluations instead of 21.
--fresh-opt           a new client optimiser every round (the kept momenta cleared before each
                      round).
--lr-step F           the local lr divided by 10 after the fraction F of the rounds, on every
                      dataset (1: never; local_lr swapped).

Table 4's solver against SLSQP (κ = 0.5, Gram matrices of U updates of 500 Gaussian entries, seeds
0–9; "correlated": one shared random direction plus 0.8× independent noise, as updates from one
model; test_fedomg_solver_accuracy_as_stated re-measures it): the objective the 21 evaluations
reach lies above the exact minimum by, relative: U = 10, ≤ 1.7e-3 (correlated ≤ 2.2e-3); U = 20,
2.5e-3–1.1e-2 (3.4e-3–6.0e-3); U = 100, 26–38% (3.5–5.6%). With 201 evaluations: ≤ 2.7e-4,
≤ 1.6e-3 and 9–13% (correlated ≤ 3.7e-3 at 100). Nearly parallel updates: within 1e-3. When the
update norms span orders of magnitude the optimum is a vertex of the simplex that 20 softmax
steps do not reach.

κ = 0 is FedAvg bit for bit (Corollary 1) only with Eq. 16 as printed, a fresh client optimiser
every round and no lr step (the last line, tested):

    python benchmark/diagnostics/fedomg_readings.py --server-rule paper --solver exact \
        --rounds 20 --test-domain 0
    python benchmark/diagnostics/fedomg_readings.py --dataset synthetic --rounds 4 \
        --server-rule paper --kappa 0 --fresh-opt --lr-step 1
        # = python fedavg.py --dataset synthetic --rounds 4, bit for bit
"""
import dataclasses
import functools
import sys
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line)
import torch  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import fedomg  # noqa: E402

DEFAULTS = fedomg.DEFAULTS


def code_update(theta, thetas, N, eta_g, kappa=0.5, weighted=True, solve=None):
    """fedomg.server_update, line for line, with code_step's Γ* solver a parameter (`solve`,
    default fedomg.solve)."""
    G = fedomg.updates(theta, thetas, len(N))                                    # Eq. 8
    p = torch.tensor([float(N_u) for N_u in N]) / sum(float(N_u) for N_u in N)   # p_u = N_u / Σ N
    w = p if weighted else torch.ones(len(N))
    return theta + eta_g * code_step(G, w, kappa, solve=solve)                    # Eq. 15–17


def code_step(G, w, kappa, eps=1e-4, solve=None):
    """fedomg.code_step, line for line, with Γ* of Eq. 15 by `solve` (default fedomg.solve)."""
    U = len(w)
    w = w.double().cpu()
    K = w[:, None] * fedomg.gram(G) * w[None, :]                 # the Gram matrix of the ĝ_u
    K = K / (K.diagonal() + eps).sqrt().mean() ** 2              # / s²
    a = torch.full((U,), 1.0 / U, dtype=torch.float64)           # g_0 = aᵀ ĝ
    Gamma = (solve or fedomg.solve)(K, a, kappa, eps) if kappa > 0 else a        # Eq. 15
    lam = kappa * (a @ K @ a + eps).sqrt() / ((Gamma @ K @ Gamma + eps).clamp(min=0).sqrt() + eps)
    coef = w * (a + lam * Gamma) / (1 + kappa ** 2)                              # Eq. 16
    return coef.to(G.dtype).to(G.device) @ G


def paper_update(theta, thetas, N, eta_g, kappa=0.5, weighted=True, solve=None):
    """fedomg.server_update with Eq. 15–16 as printed (`weighted` is not used: g_FL weighs by
    N_u); Γ* by `solve` (default fedomg.solve)."""
    G = fedomg.updates(theta, thetas, len(N))                                            # Eq. 8
    delta_sum, weight_sum = torch.zeros_like(theta), 0.0
    for g_u, N_u in zip(G, N):
        delta_sum += float(N_u) * g_u
        weight_sum += float(N_u)
    g_FL = delta_sum / weight_sum                                             # FedAvg's update
    p = torch.tensor([float(N_u) for N_u in N]) / weight_sum
    return theta + eta_g * paper_step(G, g_FL, p, kappa, solve)                   # Eq. 15–17


def paper_step(G, g_FL, p, kappa, solve=None):
    """Eq. 15–16 as printed: Γ* (by `solve`, default fedomg.solve) over the g_u with g_FL = pᵀ𝐠,
    then g_IGD = g_FL + κ||g_FL||/||g_Γ*|| g_Γ*. κ = 0 returns g_FL itself (Corollary 1), so that
    the round is FedAvg's bit for bit."""
    if kappa == 0:
        return g_FL
    p = p.double().cpu()
    K = fedomg.gram(G)
    K = K / K.diagonal().clamp(min=0).sqrt().mean().clamp(min=1e-30) ** 2   # the code's scale
    Gamma = (solve or fedomg.solve)(K, p, kappa, 0.0)          # Eq. 15 as printed: no ε
    norm_g_FL, norm_g_Gamma = (p @ K @ p).clamp(min=0).sqrt(), \
        (Gamma @ K @ Gamma).clamp(min=0).sqrt()
    if norm_g_Gamma == 0:
        return g_FL
    g_Gamma = Gamma.to(G.dtype).to(G.device) @ G                 # g_Γ* = Γ*𝐠
    return g_FL + (kappa * norm_g_FL / norm_g_Gamma).item() * g_Gamma   # Eq. 16 (K's scale: a
    #                                                                     ratio of its norms)


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
                   constraints={"type": "eq", "fun": lambda x: x.sum() - 1,
                                "jac": lambda x: np.ones(U)},
                   options={"ftol": 1e-15, "maxiter": 1000})
    x = np.clip(res.x, 0, None)
    return torch.from_numpy(x / x.sum())


def swaps(args):
    """The four functions of fedomg's round that a reading replaces, {name: function}: fedomg's
    own where the reading in args keeps it (server_update: code_update, fedomg.server_update with
    its solver a parameter)."""
    solver = solve_exact if args.solver == "exact" else fedomg.solve
    out = {"server_update": code_update, "eta_g": fedomg.eta_g, "local_lr": fedomg.local_lr,
           "solve": functools.partial(solver, evaluations=args.solver_evals)
           if args.solver == "sgd" else solver}
    if args.server_rule == "paper":
        out["server_update"] = paper_update
        out["eta_g"] = lambda args, U: 1.0 if args.global_lr == "auto" else args.global_lr
    if args.lr_step is not None:
        out["local_lr"] = lambda t, args: args.lr * (0.1 if t > args.lr_step * args.rounds else 1.0)
    return out


def readings_round(t, model, fed, args, state, ctx, fn=None):
    """fedomg.fedomg_round, line for line, with the reading's functions (fn, default swaps(args))
    in place of fedomg's; --fresh-opt: every client's kept momentum cleared first."""
    fn = fn or swaps(args)
    if args.fresh_opt:
        for kept in ctx.clients.values():                    # every client starts a new SGD
            kept.pop("momentum", None)
    theta = common.get_flat(model)                                     # θ^(r-1)
    S = common.sample_clients(ctx, len(fed.clients), args.sample)
    sent = {"theta": theta, "lr": fn["local_lr"](t, args)}
    up = common.on_clients(fedomg.client_update, S, sent, t, ctx)     # E epochs each, θ_u back
    N = [float(fed.clients[c].n) for c in S]
    weighted = args.dataset not in data.FL
    theta_r = fn["server_update"](theta, [r["theta"] for r in up], N, fn["eta_g"](args, len(S)),
                                  args.kappa, weighted, solve=fn["solve"])   # Eq. 8, 15–17
    common.set_flat(model, theta_r)
    return {c: r["loss"] for c, r in zip(S, up)}


def add_args(p):
    fedomg.add_args(p)
    p.add_argument("--server-rule", default="code", choices=["code", "paper"],
                   help="the official code's step (fedomg.py's) or Eq. 15-17 as printed")
    p.add_argument("--solver", default="sgd", choices=["sgd", "exact"],
                   help="Γ* by Table 4's softmax-SGD (lr 25, momentum 0.5) or by SLSQP")
    p.add_argument("--solver-evals", type=int, default=21,
                   help="objective evaluations of the sgd solver (Table 4: 21)")
    p.add_argument("--fresh-opt", action="store_true",
                   help="a new client optimiser every round (default: kept)")
    p.add_argument("--lr-step", type=float, default=None,
                   help="divide the local lr by 10 after this fraction of the rounds (1 = never; "
                        "default: fedomg.py's, 0.8, none on the FL datasets)")


def check(args, given):
    fedomg.check(args, given)
    if args.solver_evals < 1:
        raise common.UserError(f"--solver-evals must be positive, got {args.solver_evals}")
    if args.lr_step is not None and not 0 < args.lr_step <= 1:
        raise common.UserError(f"--lr-step must be in (0, 1], got {args.lr_step}")


# fedomg.py's method (its defaults, auto rule, parallel clients) with this round and these flags
METHOD = dataclasses.replace(fedomg.METHOD, doc=__doc__, round=readings_round, add_args=add_args,
                             check=check)


def main(argv=None):
    return harness.main(METHOD, argv)


if __name__ == "__main__":
    main()
