"""The cost of Flower's message round trip, in one process (docs/flower.md: Overhead): every
method's run in-process and through the in-process grid (fake_grid.py: Flower's serialisation, no
network; each node holding its site's exported folder), seconds per round and bytes per round (the
evaluation's included), and whether the two end with the same model.

    python flower/overhead.py                           # synthetic, 3 clients, 3 rounds
    python flower/overhead.py --dataset rmnist --clients 5 --rounds 2 --methods fedavg fediir
"""
import contextlib
import importlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout

import torch  # noqa: E402

import fake_grid  # noqa: E402
import fl_adapter  # noqa: E402
import harness  # noqa: E402
from harness import sites  # noqa: E402
from harness.methods import METHODS  # noqa: E402


def argv_of(method, a):
    argv = ["--dataset", a.dataset, "--test-domain", "0", "--clients", str(a.clients),
            "--eval-every", str(a.rounds)]
    if method == "fedloe":     # its rounds are its communications: one of stage 1, the rest stage 2
        # (its 128: more than a client holds)
        small = ["--batch-size", "64"] if a.dataset == "synthetic" else []
        return argv + small + ["--stage1-epochs", "1", "--stage1-comms", "1",
                               "--stage2-epochs", str(a.rounds - 1),
                               "--stage2-comms", str(a.rounds - 1)]
    return argv + ["--rounds", str(a.rounds)]


def main(argv=None):
    # (fl_adapter put the repository on the path) bad input: one line, exit 2
    from harness.config import Parser
    p = Parser(prog="overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   choices=list(METHODS))
    a = p.parse_args(argv)
    if a.clients < 1 or a.rounds < 2:
        p.error(f"--clients must be positive and --rounds at least 2 (FedLOE: one stage-1 "
                f"communication, the rest stage 2), got {a.clients} and {a.rounds}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in a.methods:
            argv, out = argv_of(m, a), Path(tmp)
            t0 = time.perf_counter()
            importlib.import_module(m).main(argv + ["--out", str(out / f"{m}-own.json")])
            t1 = time.perf_counter()
            args = harness.resolve(harness.method(m), argv + ["--out", str(out / "x.json")])
            with contextlib.redirect_stdout(io.StringIO()):
                folders = sites.export(args, out / f"{m}-sites")
            grid = fake_grid.FakeGrid(fl_adapter.client_app(), folders, train=args.clients)
            _, link = fl_adapter.serve(grid, m, argv + ["--out", str(out / f"{m}-fl.json")])
            t2 = time.perf_counter()
            own, fl = (torch.load(out / f"{m}-{k}.json.ckpt", weights_only=True)["model"]
                       for k in ("own", "fl"))
            rounds = [r for r in link.moved if r != 0]          # (0: the nodes' reports)
            rows.append((m, (t1 - t0) / a.rounds, (t2 - t1) / a.rounds,
                         sum(link.moved[r][0] for r in rounds) / a.rounds,
                         sum(link.moved[r][1] for r in rounds) / a.rounds,
                         all(torch.equal(own[k], fl[k]) for k in own)))
    print(f"\n{a.dataset}, {a.clients} clients, {a.rounds} rounds (load and evaluation included)")
    print(f"{'method':<9} {'in-process s/round':>18} {'fake grid s/round':>17} "
          f"{'down KiB/round':>14} {'up KiB/round':>12}  torch.equal")
    for m, s_own, s_fl, down, up, eq in rows:
        print(f"{m:<9} {s_own:18.3f} {s_fl:17.3f} {down / 1024:14.1f} {up / 1024:12.1f}  {eq}")
    print(json.dumps({m: dict(own=o, fake=f, down=d, up=u, equal=e) for m, o, f, d, u, e in rows}))


if __name__ == "__main__":
    main()
