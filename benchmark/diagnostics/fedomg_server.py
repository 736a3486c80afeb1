"""FedOMG's server cost: the share of a round spent in the server step (Gram matrix, Eq. 15 solve,
Eq. 16) for U = 3, 20 and 100 participating clients.

1. Embedded RotatedMNIST with the ConvNet, 100 clients (test domain 0), U sampled per round: whole
   FedOMG rounds, the server step timed inside them.
2. ResNet-18-sized updates (11.2M parameters), simulated with random tensors: the server step alone.

    python benchmark/diagnostics/fedomg_server.py [--solver sgd|exact] [--server-rule code|paper] \\
        [--rounds 2]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import harness  # noqa: E402
import common  # noqa: E402
import data  # noqa: E402
import fedomg  # noqa: E402
import fedomg_readings as readings  # noqa: E402   --solver exact, --server-rule paper
from harness.config import Parser, help_text  # noqa: E402


def main():
    # bad input: one line, exit 2
    p = Parser(prog="fedomg_server.py", description=help_text(__doc__))
    p.add_argument("--solver", default="sgd", choices=["sgd", "exact"])
    p.add_argument("--server-rule", default="code", choices=["code", "paper"])
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per U")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds must be positive, got {a.rounds}")
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timed = []

    def timer(step):
        def timed_step(*args, **kw):
            sync()
            t = time.perf_counter()
            out = step(*args, **kw)
            sync()
            timed.append(time.perf_counter() - t)
            return out
        return timed_step

    ds = data.load("rmnist")
    fed = data.federate(ds, 0, 100, 0, dev)
    print(f"embedded rmnist, ConvNet, 100 clients, solver {a.solver}, rule {a.server_rule}, "
          f"{a.device}, medians of {a.rounds} rounds (the server step: Eq. 8, 15-17)")
    for U in (3, 20, 100):
        argv = ["--clients", "100", "--sample", str(U), "--solver", a.solver,
                "--server-rule", a.server_rule, "--device", a.device]
        args = harness.resolve(readings.METHOD, argv)
        torch.manual_seed(0)
        model = common.build_model(args, ds).to(dev)
        ctx, state = common.make_context(args, fed, model), {}
        fn = readings.swaps(args)
        fn["server_update"] = timer(fn["server_update"])        # the round's server step, timed
        rounds, servers = [], []
        for r in range(a.rounds + 1):                       # round 0 warms up
            t = time.perf_counter()
            readings.readings_round(r + 1, model, fed, args, state, ctx, fn)
            sync()
            if r:
                rounds.append(time.perf_counter() - t)
                servers.append(timed[-1])
        R, S = statistics.median(rounds), statistics.median(servers)
        print(f"U = {U:3d}: round {R:7.3f} s, server step {S:.4f} s "
              f"= {100 * S / R:.2f}% of the round")
    n = 11_176_512                                    # ResNet-18 featurizer + a 7-class linear head
    print(f"ResNet-18-sized updates ({n / 1e6:.1f}M parameters, random), server step alone:")
    for U in (3, 20, 100):
        G = torch.randn(U, n, device=dev)
        g_FL = G.mean(0)
        w = torch.full((U,), 1.0 / U)
        solve = readings.solve_exact if a.solver == "exact" else fedomg.solve
        step = timer(readings.code_step if a.server_rule == "code" else readings.paper_step)
        for _ in range(a.rounds + 1):
            step(G, w, 0.5, solve=solve) if a.server_rule == "code" else \
                step(G, g_FL, w, 0.5, solve)
        print(f"U = {U:3d}: {statistics.median(timed[-a.rounds:]):.3f} s "
              f"({U * n * 4 / 2**30:.2f} GiB of updates held)")
        del G


if __name__ == "__main__":
    main()
