"""What the proxy costs on real processes (docs/flower.md, "Several devices"): FedAvg on 3 secure
SuperNodes (and the held-out domain's evaluation node), every client sampled, the synthetic data,
each node with its own exported folder; one deployment whose nodes reach the
SuperLink through nginx (run_local.py --secure), one whose nodes reach it directly (TLS and
registered keys too, the SuperLink's port open to them), alternated pair by pair. Per run: the
seconds of a round's messages and client work (<out>.flower.json, the rounds after the first)
and of the whole `flwr run`; per pair the ratio proxy / direct.

    python flower/proxy_cost.py                    # 2 pairs, 3 rounds each
    python flower/proxy_cost.py --pairs 3 --rounds 4
"""
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import run_local                  # (first: it puts the checkout on the path)
import harness  # noqa: E402,I001
from harness import sites  # noqa: E402
from proxy import Parser          # bad input: one line, exit 2


def one(via_proxy, rounds):
    """(seconds of each round after the first, seconds of the whole flwr run) of one deployment."""
    with tempfile.TemporaryDirectory(prefix="proxy-cost-") as tmp:
        tmp = Path(tmp)
        argv = (f"--dataset synthetic --test-domain 0 --clients 3 --sample 3 --rounds "
                f"{rounds} --eval-every {rounds} --out {tmp / 'r.json'}")
        args = harness.resolve(harness.method("fedavg"), argv.split())
        with contextlib.redirect_stdout(io.StringIO()):
            folders = sites.export(args, tmp / "sites")           # 3 clients, the held-out domain
        d = run_local.Deployment(tmp / "deployment", run_local.free_port(), secure=True, keys=4,
                                 proxy=via_proxy)
        try:
            d.start()
            for k in range(4):
                d.register(k)
                d.node(f"supernode-{k}", k, 4, key=k,
                       config=run_local.site_config(folders, args.clients, k))
            time.sleep(5)
            t0 = time.time()
            r = d.run(f'method="fedavg" argv="{argv}" keys="{d.certs}"', timeout=1800)
            whole = time.time() - t0
        finally:
            d.stop()
        if r.returncode != 0 or not (tmp / "r.json.flower.json").exists():
            sys.exit(f"proxy_cost.py: error: a run failed: {(r.stdout + r.stderr)[-300:]}")
        timing = json.loads((tmp / "r.json.flower.json").read_text())["rounds"]
        return [timing[str(t)]["seconds"] for t in range(2, rounds + 1)], whole


def main(argv=None):
    p = Parser(prog="proxy_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2, help="proxy/direct pairs (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each run (default 3)")
    a = p.parse_args(argv)
    if a.pairs < 1 or a.rounds < 2:
        p.error(f"--pairs must be positive and --rounds at least 2, got {a.pairs}, {a.rounds}")
    rows = []
    for k in range(a.pairs):
        proxied, direct = one(True, a.rounds), one(False, a.rounds)
        rows.append((proxied, direct))
        print(f"pair {k + 1}: a round through the proxy {statistics.median(proxied[0]):.2f} s, "
              f"direct {statistics.median(direct[0]):.2f} s (medians); the whole run "
              f"{proxied[1]:.1f} s and {direct[1]:.1f} s", flush=True)
    ratios = [statistics.median(p[0]) / statistics.median(d[0]) for p, d in rows]
    print(f"proxy / direct, a round: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
