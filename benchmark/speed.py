"""How much the harness costs (FedAvg rounds through common.py against a bare training loop) and
what a round of every method that runs on this setting costs against a FedAvg round.

On the embedded RotatedMNIST (test domain 0), P clients with C sampled per round, every variant
trains the same sampled clients with the same model, batch size and optimiser for one local epoch,
each method with its own defaults for rmnist (FedIIR: Table 3's γ; FedOMG: its server step; FedIPG:
λ 1e-3, --penalty auto). The bare loop is what a researcher would write in a few lines (fresh SGD,
momentum 0.9); the harness round also resets each client to θ, flattens its update and aggregates.
The variants are timed alternately in one process (this machine is shared and noisy) and the
medians are compared. FedLOE (every client in every communication, Adam) and PerInvFL (fixed-client
datasets only) do not fit this setting: their speed is in the benchmark's tables.

    python benchmark/speed.py                       # 50 clients, 5 sampled
    python benchmark/speed.py --clients 5 --rounds 3 --clock cpu
    python benchmark/speed.py --json speed.json     # also the timings, for report.py --speed (bar chart)
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import data  # noqa: E402
import fedavg  # noqa: E402
import fediir  # noqa: E402
import fedipg  # noqa: E402
import fedomg  # noqa: E402


def bare_round(model, clients, lr, batch_size):
    """The loop a researcher would write in a few lines: no flattening, no aggregation."""
    for c in clients:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        perm = torch.randperm(c.n)
        for i in range(0, c.n, batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(model(c.x[idx].float() / 255), c.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def setup(method, doc, add_args=None, own_args=None):
    """The shared CLI of the speed scripts (own_args adds a script's own flags) and what they time:
    `method`'s arguments resolved for the embedded rmnist, test domain 0 held out, P clients, the
    model and a context on --device."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--sample", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds of each variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall-clock, or this process's CPU time (steadier on a loaded machine; CPU only)")
    if own_args:
        own_args(p)
    a = p.parse_args()
    a.clock = time.process_time if a.clock == "cpu" and a.device == "cpu" else time.perf_counter
    parser = common.make_parser(method, doc)
    if add_args:
        add_args(parser)
    argv = ["--clients", str(a.clients), "--sample", str(a.sample), "--device", a.device]
    args = common.resolve(parser.parse_args(argv), "speed")
    common.set_deterministic()                     # as the method scripts run by default
    ds = data.load("rmnist")
    dev = torch.device(a.device)
    fed = common.federate(ds, 0, a.clients, 0, dev)
    torch.manual_seed(0)
    model = common.build_model(args, ds).to(dev)
    ctx = common.Context(dev, torch.Generator(dev).manual_seed(0), torch.Generator().manual_seed(0),
                         common.make_prep("rmnist", dev))
    return a, args, fed, model, ctx


def alternate(variants, ctx, rounds, clock=time.perf_counter):
    """{name: [seconds of each timed round]}: in every round each variant in turn, all on the same
    sampled clients; round 0 warms them up. A variant returning losses is synchronised once, as the
    skeleton does."""
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    times = {k: [] for k in variants}
    for r in range(rounds + 1):
        s = ctx.sampler.get_state()
        for name, fn in variants.items():
            ctx.sampler.set_state(s)
            t = clock()
            losses = fn(r + 1)
            if losses:
                torch.stack(list(losses.values())).sum().item()
            sync()
            if r:
                times[name].append(clock() - t)
    return times


def method_args(module, name, a):
    """`name`'s arguments for this setting, resolved as its script resolves them."""
    p = common.make_parser(name, module.__doc__)
    module.add_args(p)
    args = common.resolve(p.parse_args(["--clients", str(a.clients), "--sample", str(a.sample), "--device", a.device]),
                          "speed", getattr(module, "DEFAULTS", None))
    if hasattr(module, "check"):
        module.check(args)
    return args


def main():
    json_flag = lambda p: p.add_argument("--json", default=None, help="also write every timed round here")
    a, args, fed, model, ctx = setup("fedavg", fedavg.__doc__, fedavg.add_args, json_flag)
    rounds = {"FedAvg (harness)": lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ctx)}
    for name, module in (("FedIIR", fediir), ("FedOMG", fedomg), ("FedIPG", fedipg)):
        m_args = method_args(module, name.lower(), a)
        state = module.init_state(model, fed, m_args, ctx)
        fn = getattr(module, f"{name.lower()}_round")
        rounds[name] = lambda r, fn=fn, m_args=m_args, state=state: fn(r, model, fed, m_args, state, ctx)
    images = []

    def bare(r):
        sampled = [fed.clients[c] for c in common.sample_clients(ctx, len(fed.clients), args.sample)]
        images.append(sum(c.n for c in sampled))
        bare_round(model, sampled, args.lr, args.batch_size)
    times = alternate({**rounds, "bare training loop": bare}, ctx, a.rounds, a.clock)
    n = statistics.median(images[1:])
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["FedAvg (harness)"]
    setting = (f"embedded rmnist (leave one domain out, domain 0 held out), {a.clients} clients, {a.sample} per "
               f"round, batch {args.batch_size}, {a.device}, {torch.get_num_threads()} threads, {a.rounds} rounds each, medians of "
               f"{'CPU' if a.clock is time.process_time else 'wall-clock'} time")
    print(setting + "\n")
    print("| round | s / round | images / s | × FedAvg |\n|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {n / v:,.0f} | {v / base:.2f} |")
    print(f"\nharness overhead against the bare loop: {100 * (base / med['bare training loop'] - 1):+.1f}%")
    if a.json:                                                  # machine-readable: report.py --speed draws it
        Path(a.json).write_text(json.dumps({"setting": setting, "images_per_round": n, "seconds": times}, indent=1))
        print(f"speed: {a.json}")


if __name__ == "__main__":
    main()
