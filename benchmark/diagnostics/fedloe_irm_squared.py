"""FedLOE with the IRMv1 penalty that fedloe.py computed before it took its base code's form: the derivative
∂R_c(w · Σφŷ)/∂w at w = 1 over client c's whole tuning split, squared, the mean over the clients. fedloe.py
now multiplies the derivatives of the split's even and odd rows (DomainBed's IRM._irm_penalty, the FedDG
benchmark's IRM), an unbiased estimate of that square. The committed FedLOE-IRM results were made with
the square (docs/fedloe.md); this swaps it back into fedloe.py's round, nothing else:

    python benchmark/diagnostics/fedloe_irm_squared.py FEDLOE_FLAGS        # e.g. --test-domain 0 --dg irm
    python benchmark/diagnostics/fedloe_irm_squared.py --measure           # the two penalties side by side
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fedloe  # noqa: E402


def squared_penalty(phi, T):
    """mean_c (∂R_c(w · Σφŷ)/∂w at w = 1)², the derivative over c's whole tuning split."""
    w = torch.ones(T.P, dtype=T.Y.dtype, device=T.Y.device, requires_grad=True)
    ell = F.cross_entropy(torch.einsum("nkm,k->nm", T.Y, phi) * (T.member @ w)[:, None], T.y, reduction="none")
    grad, = torch.autograd.grad(((ell @ T.member) / T.n_tune).sum(), w, create_graph=True)
    return (grad ** 2).mean()


def measure(sizes=(10, 40, 400), P=4, heads=4, classes=10, draws=200):
    """Both penalties at uniform φ on random heads' logits (float64), `draws` draws per tuning size per client:
    the median relative gap |halves − squared| / squared."""
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        gaps = []
        for _ in range(draws):
            Y = 2 * torch.randn(P * n, heads, classes, generator=g, dtype=torch.float64)
            T = fedloe.Tuning(Y, torch.randint(classes, (P * n,), generator=g), [n] * P)
            phi = torch.full((heads,), 1 / heads, dtype=torch.float64)
            sq, halves = squared_penalty(phi, T).item(), fedloe.irm_penalty(phi, T).item()
            gaps.append(abs(halves - sq) / sq)
        print(f"{n} tuning examples per client: median |halves - squared| / squared = {statistics.median(gaps):.3f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--measure"]:
        return measure()
    fedloe.irm_penalty = squared_penalty
    return fedloe.main(argv)


if __name__ == "__main__":
    main()
