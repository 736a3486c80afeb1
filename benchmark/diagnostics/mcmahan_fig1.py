"""McMahan et al. 2017 (the FedAvg paper, AISTATS), Figure 1: averaging two models trained apart.

The published experiment (Section 2): two 2NN MNIST models (784 → 200 → 200 → 10, ReLU) w and w′,
each trained with SGD at a fixed lr 0.1 for 240 updates on minibatches of 50 (20 passes) over its
own IID sample of 600 training digits, the two samples disjoint; then the loss on the full MNIST
training set of θ w + (1 − θ) w′ for 50 evenly spaced θ in [−0.2, 1.2]. From different random
initialisations the average is far worse than either model (a barrier between them); from one shared
initialisation it is better than both ("much better than the loss of either parent model"). This is
the reason FedAvg starts every client from the same model, and the published result behind the
reading of benchmark/diagnostics/fedloe_spawn.py (when one-shot averaging of clients can work).

Not given in the paper, chosen here: PyTorch's default initialisation, inputs scaled to [0, 1],
a seeded shuffle per pass; the different-initialisation pair draws w′'s weights from seed + 1000.

    python benchmark/diagnostics/mcmahan_fig1.py --data-root data --seeds 0 1 2 \\
        --out benchmark/results/mcmahan-fig1/fig1.json
"""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import common  # noqa: E402
import data  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402

N, LR, BATCH, UPDATES = 600, 0.1, 50, 240            # Section 2


def two_nn(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200),
                         nn.ReLU(), nn.Linear(200, 10))


def train(model, x, y, seed):
    """240 SGD updates of 50 over the 600 digits: 20 passes, each a seeded shuffle."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = 0
    while steps < UPDATES:
        for idx in torch.randperm(len(y), generator=g).split(BATCH):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            steps += 1
    return model


def mix(w, w_prime, theta):
    """θ w + (1 − θ) w′, parameter by parameter (state dicts)."""
    return {k: theta * w[k] + (1 - theta) * w_prime[k] for k in w}


def loss_and_acc(model, state, x, y, chunk=10000):
    model.load_state_dict(state)
    with torch.no_grad():
        out = [model(x[i:i + chunk]) for i in range(0, len(y), chunk)]
        z = torch.cat(out)
    return F.cross_entropy(z, y).item(), (z.argmax(1) == y).float().mean().item()


def pair(x, y, seed, shared, thetas):
    """One panel of Figure 1 for one seed: the two disjoint samples, the two models, the path."""
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    a, b = perm[:N], perm[N:2 * N]
    w = train(two_nn(seed), x[a], y[a], seed).state_dict()
    w_prime = train(two_nn(seed if shared else seed + 1000), x[b], y[b], seed + 1).state_dict()
    probe = two_nn(seed)
    path = [loss_and_acc(probe, mix(w, w_prime, t), x, y) for t in thetas]
    return {"init": "shared" if shared else "different", "seed": seed, "theta": thetas,
            "loss": [p[0] for p in path], "acc": [p[1] for p in path]}


def summary(run):
    th, loss = run["theta"], run["loss"]
    parents = min(loss[th.index(0.0)], loss[th.index(1.0)])
    mid = loss[th.index(0.5)]
    return parents, mid, min(loss)


def main(argv=None):
    p = Parser(prog="mcmahan_fig1.py", description=help_text(__doc__))
    p.add_argument("--data-root", default=None,
                   help="full MNIST (torchvision layout); none: the embedded digits")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--points", type=int, default=50,
                   help="θ values evenly spaced in [-0.2, 1.2] (the paper: 50), and θ = 0, 0.5, 1")
    p.add_argument("--out", default="results/mcmahan-fig1.json")
    args = p.parse_args(argv)
    try:   # every check before the first training; the last makes --out's folder (check_out)
        if args.points < 2:
            raise common.UserError(f"--points must be >= 2, got {args.points}")
        # the method scripts' range (harness.resolve)
        if any(not 0 <= s < 2 ** 31 for s in args.seeds):
            raise common.UserError(f"--seeds must be in [0, 2**31), "
                                   f"got {' '.join(map(str, args.seeds))}")
        x, y, source = data.mnist_arrays(args.data_root, test=False)
        if len(y) < 2 * N:
            raise common.UserError(f"{source}: fewer than {2 * N} digits")
        if Path(args.out).is_dir():
            raise common.UserError(f"--out {args.out}: {args.out} is a folder; give a file name")
        outputs.check_out(args.out)
    except (common.UserError, OSError) as e:
        print(f"mcmahan_fig1.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    x = x.reshape(len(y), -1).float() / 255
    grid = [round(-0.2 + 1.4 * i / (args.points - 1), 9) + 0.0 for i in range(args.points)]
    thetas = sorted(set(grid) | {0.0, 0.5, 1.0})        # the parents and their average always on it
    runs = [pair(x, y, s, shared, thetas) for shared in (False, True) for s in args.seeds]
    outputs.write_json(args.out, {"source": source, "runs": runs})
    print(f"data: {source}; loss on all {len(y):,} digits")
    print("| init | seed | best parent loss | loss at θ = 0.5 | lowest on the path "
          "| acc at θ = 0.5 |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        parents, mid, low = summary(r)
        print(f"| {r['init']} | {r['seed']} | {parents:.3f} | {mid:.3f} | {low:.3f} | "
              f"{100 * r['acc'][r['theta'].index(0.5)]:.1f} |")
    print(f"results: {args.out}")
    return runs


if __name__ == "__main__":
    main()
