"""Centralised full-batch IRMv1 and ERM, exactly as the IRM paper's ColoredMNIST code, as the
reference for the federated invariance methods (PerInvFL's ν is this, federated).

IRM's recipe (Arjovsky et al. 2019, github.com/facebookresearch/InvariantRiskMinimization,
colored_mnist/main.py and its README's commands): an MLP 392 → 390 → 390 → 1 (ReLU), Xavier-uniform
weights and zero biases; full batch, one environment per training context; binary cross-entropy on
one logit; the IRMv1 penalty (the squared derivative of an environment's risk w.r.t. a dummy scale
on the logit), risk and penalty averaged over the environments; L2 1.10794568e-3 · Σ ||w||² over
every parameter; Adam lr 4.898e-4; penalty weight 1 for the first 190 steps, then 91257.186, after
which the whole loss is divided by it; 501 steps; the accuracies are those of the last step's
forward pass. ERM is the same with penalty weight 0 (IRM's README). Data:

  colored   IRM's own ColoredMNIST: MNIST's first 50,000 training digits shuffled, even / odd
            positions → two environments whose colour agrees with the label 80% / 90%, the last
            10,000 → the test environment (10%). IRM reports IRM 70.8 train / 66.9 test, ERM 17.1
            test.
  rc-norot  RC-MNIST's four training contexts (agreement 0.95 / 0.90 / 0.85 / 0.80, 12,500 digits
            each) without rotation, tested on the four test contexts (0.1) pooled: data.rcmnist.
  rc        RC-MNIST as PerInvFL's Table 6 builds it: the same, client i rotated by 90·i degrees.

The label law is data.colored's (IRM's: digit < 5, flipped with probability 0.25; the colour
agrees with the label with probability p). The shuffles use torch generators seeded by --seed, not
IRM's numpy state, so the digits in each environment differ from IRM's run; the law is the same.

    python benchmark/diagnostics/irm_central.py --data-root data \\
        --out benchmark/results/irm-central/results.json
    python benchmark/diagnostics/irm_central.py --data-root data --data colored --methods irm \\
        --seeds 0 1 2 --out ...
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import data  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402

LR, L2, PENALTY, ANNEAL, STEPS = 4.898536566546834e-4, 1.10794568e-3, 91257.18613115903, 190, 501
REPORTED = {"colored": {"irm": (70.8, 66.9), "erm": (None, 17.1)}}   # IRM paper, Section 5.1


def environments(name, root, seed):
    """[(x, y)] of the training environments and the test environment (float images, float
    labels)."""
    if name == "colored":
        x, digit, _ = data.mnist_arrays(root, test=False)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(digit), generator=g)
        x, digit = x[perm], digit[perm]
        n = len(digit) * 5 // 6                      # 50,000 of 60,000: training, the rest: test
        parts = [(x[:n][0::2], digit[:n][0::2], 0.8), (x[:n][1::2], digit[:n][1::2], 0.9),
                 (x[n:], digit[n:], 0.1)]
        envs = [data.colored(xs, ds, p, g) for xs, ds, p in parts]
        train, test = envs[:2], [envs[2]]
    else:
        ds = data.rcmnist(root, seed, p_test=0.1, rotation=name == "rc")
        train, test = ([(d.x, d.y) for d in ds.domains],
                       [(torch.cat([d.x_test for d in ds.domains]),
                         torch.cat([d.y_test for d in ds.domains]))])
    return [(x.float() / 255, y.float()[:, None]) for x, y in train + test]


def mlp(hidden=390):
    net = nn.Sequential(nn.Flatten(), nn.Linear(2 * 14 * 14, hidden), nn.ReLU(),
                        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    for m in net:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return net


def penalty(logits, y):
    """IRMv1: the squared derivative of the risk w.r.t. a dummy scale on the logit."""
    scale = torch.ones((), dtype=logits.dtype, device=logits.device, requires_grad=True)
    g, = torch.autograd.grad(F.binary_cross_entropy_with_logits(logits * scale, y), scale,
                             create_graph=True)
    return g.pow(2)


def accuracy(logits, y):
    return ((logits > 0).float() == y).float().mean()


def train(envs, method, seed, device, steps=STEPS, log_every=100):
    """IRM's training loop; returns the last step's train / test accuracy and a short history."""
    torch.manual_seed(seed)
    net = mlp().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    envs = [(x.to(device), y.to(device)) for x, y in envs]
    history = []
    for step in range(steps):
        logits = [net(x) for x, _ in envs]
        nll = torch.stack([F.binary_cross_entropy_with_logits(z, y)
                           for z, (_, y) in zip(logits[:-1], envs)]).mean()
        pen = torch.stack([penalty(z, y) for z, (_, y) in zip(logits[:-1], envs)]).mean()
        train_acc = torch.stack([accuracy(z, y) for z, (_, y) in zip(logits[:-1], envs)]).mean()
        test_acc = accuracy(logits[-1].detach(), envs[-1][1])
        weight = (PENALTY if step >= ANNEAL else 1.0) if method == "irm" else 0.0
        loss = nll + L2 * sum(w.pow(2).sum() for w in net.parameters()) + weight * pen
        if weight > 1:
            loss = loss / weight                     # IRM's rescaling of the whole loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            history.append({"step": step, "nll": nll.item(), "penalty": pen.item(),
                            "train_acc": train_acc.item(), "test_acc": test_acc.item()})
            print(f"  step {step:4d} | nll {nll.item():.4f} | penalty {pen.item():.2e} "
                  f"| train {train_acc.item():.4f} | test {test_acc.item():.4f}", flush=True)
    return {"train_acc": history[-1]["train_acc"], "test_acc": history[-1]["test_acc"],
            "history": history}


def table(results):
    """Markdown: mean ± std (n − 1) over seeds of the last step's accuracies, in %."""
    lines = ["| data | method | train acc | test acc | seeds | IRM paper (train / test) |",
             "|---|---|---|---|---|---|"]
    for key in sorted({(r["data"], r["method"]) for r in results}):
        runs = [r for r in results if (r["data"], r["method"]) == key]
        cells = []
        for k in ("train_acc", "test_acc"):
            t = 100 * torch.tensor([r[k] for r in runs])
            cells.append(f"{t.mean():.1f} ± {t.std():.1f}" if len(runs) > 1 else f"{t.mean():.1f}")
        ref = REPORTED.get(key[0], {}).get(key[1])
        ref = " / ".join("—" if v is None else f"{v}" for v in ref) if ref else "—"
        lines.append(f"| {key[0]} | {key[1]} | {cells[0]} | {cells[1]} | {len(runs)} | {ref} |")
    return "\n".join(lines)


def main(argv=None):
    """Bad input -> one line on stderr, exit 2, before any training or any file is written."""
    p = Parser(prog="irm_central.py", description=help_text(__doc__))
    p.add_argument("--data-root", default=None,
                   help="full MNIST (torchvision layout); none: the embedded digits")
    p.add_argument("--data", nargs="+", default=["colored", "rc-norot", "rc"],
                   choices=["colored", "rc-norot", "rc"])
    p.add_argument("--methods", nargs="+", default=["irm", "erm"], choices=["irm", "erm"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", help="results JSON; runs already in it are kept and skipped")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="only print the table of these results files")
    a = p.parse_args(argv)
    if a.report:
        try:
            print(table([r for f in a.report for r in json.loads(Path(f).read_text())["runs"]]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"cannot read the results ({type(e).__name__}: {e})")
        return
    if not a.out:
        p.error("--out is required (or --report)")
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    if any(not 0 <= s < 2 ** 31 for s in a.seeds):    # the method scripts' range (harness.resolve)
        p.error(f"--seeds must be in [0, 2**31), got {' '.join(map(str, a.seeds))}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    out = Path(a.out)
    above = next(q for q in [out.parent.resolve(), *out.parent.resolve().parents] if q.exists())
    # refused now, not after a run
    if out.is_dir() or not above.is_dir() or not os.access(above, os.W_OK):
        p.error(f"cannot write --out {out}: "
                + ("a folder" if out.is_dir() else f"{above} is not a writable folder"))
    try:
        done = json.loads(out.read_text())["runs"] if out.exists() else []
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"{out} is not a results file of this script ({type(e).__name__})")
    try:
        for name in a.data:
            for seed in a.seeds:
                envs = None
                for method in a.methods:
                    if any((r["data"], r["method"], r["seed"], r["steps"])
                           == (name, method, seed, a.steps) for r in done):
                        continue
                    envs = envs or environments(name, a.data_root, seed)
                    print(f"{name} / {method} / seed {seed}: {[len(y) for _, y in envs]} examples "
                          f"(training environments, then test)", flush=True)
                    t0 = time.perf_counter()
                    res = train(envs, method, seed, a.device, a.steps)
                    done.append({"data": name, "method": method, "seed": seed, "steps": a.steps,
                                 "seconds": time.perf_counter() - t0, **res})
                    out.parent.mkdir(parents=True, exist_ok=True)
                    outputs.write_json(str(out), {"recipe": {"lr": LR, "l2": L2, "penalty": PENALTY,
                                                            "anneal": ANNEAL},
                                                 "runs": done})
    except data.UserError as e:
        p.error(str(e))
    print(table(done))


if __name__ == "__main__":
    main()
