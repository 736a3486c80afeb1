"""FedLOE with the IRMv1 penalty that fedloe.py computed before it took its base code's form: the
derivative ∂R_c(w · Σφŷ)/∂w at w = 1 over client c's whole tuning split, squared, the mean over
the clients. fedloe.py now multiplies the derivatives of the split's even and odd rows
(DomainBed's IRM._irm_penalty, the FedDG benchmark's IRM), an unbiased estimate of that square.
The committed FedLOE-IRM results were made with the square (docs/fedloe.md); this swaps it back
into fedloe.py's round (irm_round: the round written from fedloe's plain functions, its Eq. 11
with this penalty), nothing else:

    python benchmark/diagnostics/fedloe_irm_squared.py FEDLOE_FLAGS  # --test-domain 0 --dg irm
    python benchmark/diagnostics/fedloe_irm_squared.py --measure     # both penalties side by side
"""
import dataclasses
import functools
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import fedloe  # noqa: E402


def squared_penalty(phi, T):
    """mean_c (∂R_c(w · Σφŷ)/∂w at w = 1)², the derivative over c's whole tuning split."""
    w = torch.ones(T.P, dtype=T.Y.dtype, device=T.Y.device, requires_grad=True)
    ell = F.cross_entropy(torch.einsum("nkm,k->nm", T.Y, phi) * (T.member @ w)[:, None], T.y,
                          reduction="none")
    grad, = torch.autograd.grad(((ell @ T.member) / T.n_tune).sum(), w, create_graph=True)
    return (grad ** 2).mean()


def fit_phi(T, penalty, lam=100.0, lr=0.05, weight_decay=5e-4, steps=100):
    """fedloe.fit_phi for --dg irm with the IRMv1 penalty `penalty`: φ from uniform by `steps`
    full-batch Adam steps on (1/P) Σ_c R_c + λ penalty (Eq. 11)."""
    phi = torch.full((T.P,), 1.0 / T.P, dtype=T.Y.dtype, device=T.Y.device)
    opt = torch.optim.Adam([phi.requires_grad_()], lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        loss = fedloe.risks(phi, T)[0].mean() + lam * penalty(phi, T)           # Eq. 11
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return phi.detach()


@functools.wraps(fedloe.fedloe_round, assigned=())   # (the checkpoint names fedloe.py, as it did)
def irm_round(t, model, fed, args, state, ctx, penalty=squared_penalty):
    """fedloe.fedloe_round with `penalty` as --dg irm's IRMv1 term of Eq. 11: stage 1 and the other
    --dg are fedloe's round itself; stage 2 with --dg irm mirrors it line for line, its fit_phi
    this file's."""
    if t <= args.stage1_comms or args.dg != "irm":
        return fedloe.fedloe_round(t, model, fed, args, state, ctx)
    theta, every = common.get_flat(model), list(range(len(fed.clients)))
    up = common.on_clients(fedloe.head_update, every, {"theta": theta}, t, ctx)      # Eq. 10
    Ws, bs = torch.stack([r["W"] for r in up]), torch.stack([r["b"] for r in up])
    sent = {"theta": theta, "Ws": Ws, "bs": bs}
    pred = common.on_clients(fedloe.tuning_predictions, every, sent, t, ctx)          # 2.2
    T = fedloe.Tuning(torch.cat([r["Y"] for r in pred]), torch.cat([r["y"] for r in pred]),
                      [len(r["y"]) for r in pred])
    phi = fit_phi(T, penalty, args.dg_lambda, args.stage2_lr, args.stage2_wd,
                  args.server_steps)                                                 # Eq. 11
    if not bool(torch.isfinite(phi).all()):                                # one host sync a round
        raise harness.runner.NonFinite(f"non-finite ensemble weights φ in round {t} (server, --dg "
                               f"{args.dg}, testing on {fed.name}); lower --dg-lambda or "
                               f"--stage2-lr")
    W, b = fedloe.ensemble(phi, Ws, bs)                                              # Eq. 12
    model.classifier.load_state_dict({"weight": W, "bias": b})
    state["phi"] = phi
    print(f"round {t}: φ in [{phi.min():.4f}, {phi.max():.4f}], sum {phi.sum():.4f} "
          f"(uniform: {1 / len(every):.4f})", flush=True)
    return {c: r["loss"] for c, r in zip(every, up)}


METHOD = dataclasses.replace(fedloe.METHOD, round=irm_round)   # fedloe.py's, but for the penalty


def measure(sizes=(10, 40, 400), P=4, heads=4, classes=10, draws=200):
    """Both penalties at uniform φ on random heads' logits (float64), `draws` draws per tuning
    size per client: the median relative gap |halves − squared| / squared."""
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        gaps = []
        for _ in range(draws):
            Y = 2 * torch.randn(P * n, heads, classes, generator=g, dtype=torch.float64)
            T = fedloe.Tuning(Y, torch.randint(classes, (P * n,), generator=g), [n] * P)
            phi = torch.full((heads,), 1 / heads, dtype=torch.float64)
            sq, halves = squared_penalty(phi, T).item(), fedloe.irm_penalty(phi, T).item()
            gaps.append(abs(halves - sq) / sq)
        print(f"{n} tuning examples per client: median |halves - squared| / squared = "
              f"{statistics.median(gaps):.3f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--measure"]:
        return measure()
    return harness.main(METHOD, argv)


if __name__ == "__main__":
    main()
