"""The cost of Flower's message round trip, in one process (docs/flower.md: Overhead): every
method's run in-process and through the in-process grid (fake_grid.py: Flower's serialisation, no
network; each node holding its site's exported folder), seconds per round and bytes per round (the
evaluation's included), and whether the two end with the same model. --secagg: the grid's run
under secure aggregation too (flower/secagg.py, within ±secagg-clip), its seconds and bytes, and
its model's largest difference from the method file's own (or the line that refuses it).

    python flower/overhead.py                           # synthetic, 3 clients, 3 rounds
    python flower/overhead.py --dataset rmnist --clients 5 --rounds 2 --methods fedavg fediir
    python flower/overhead.py --secagg --methods fedavg fediir perinvfl fedipg
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
import secagg  # noqa: E402
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
    p.add_argument("--secagg", action="store_true", help="also under secure aggregation")
    p.add_argument("--secagg-clip", type=float, default=secagg.CLIP)
    a = p.parse_args(argv)
    if not 0 < a.secagg_clip < float("inf"):
        p.error(f"--secagg-clip must be a positive number, got {a.secagg_clip}")
    if a.clients < 1 or a.rounds < 2:
        p.error(f"--clients must be positive and --rounds at least 2 (FedLOE: one stage-1 "
                f"communication, the rest stage 2), got {a.clients} and {a.rounds}")
    rows, secure = [], {}
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
            if a.secagg:
                secure[m] = under_secagg(m, argv, folders, args.clients, out, own, a)
    print(f"\n{a.dataset}, {a.clients} clients, {a.rounds} rounds (load and evaluation included)")
    print(f"{'method':<9} {'in-process s/round':>18} {'fake grid s/round':>17} "
          f"{'down KiB/round':>14} {'up KiB/round':>12}  torch.equal")
    for m, s_own, s_fl, down, up, eq in rows:
        print(f"{m:<9} {s_own:18.3f} {s_fl:17.3f} {down / 1024:14.1f} {up / 1024:12.1f}  {eq}")
    if a.secagg:
        print(f"\nunder secagg (±{a.secagg_clip:g}): the fake grid's s/round, KiB down / up a "
              f"round, the model's largest difference from the method file's own")
        for m, row in secure.items():
            print(f"{m:<9} " + (row["refused"] if "refused" in row else
                                f"{row['seconds']:.3f} s  {row['down'] / 1024:.1f} / "
                                f"{row['up'] / 1024:.1f} KiB  {row['largest']:.3g}"))
    print(json.dumps({m: dict(own=o, fake=f, down=d, up=u, equal=e, **(
        {"secagg": secure[m]} if m in secure else {})) for m, o, f, d, u, e in rows}))


def under_secagg(m, argv, folders, P, out, own, a):
    """The grid's run of `m` under secagg: seconds and bytes a round and the model's largest
    difference from the method file's own (own: its model), or the line that refused it."""
    grid = fake_grid.FakeGrid(fl_adapter.client_app(), folders, train=P)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            _, link = fl_adapter.serve(grid, m, argv + ["--out", str(out / f"{m}-sa.json")],
                                       clip=a.secagg_clip)
    except fl_adapter.RunFailed as e:
        return {"refused": str(e)}
    seconds = (time.perf_counter() - t0) / a.rounds
    model = torch.load(out / f"{m}-sa.json.ckpt", weights_only=True)["model"]
    rounds = [r for r in link.moved if r != 0]
    return {"seconds": seconds, "down": sum(link.moved[r][0] for r in rounds) / a.rounds,
            "up": sum(link.moved[r][1] for r in rounds) / a.rounds,
            "largest": max((own[k].float() - model[k].float()).abs().max().item() for k in own)}


if __name__ == "__main__":
    main()
