"""How much the harness costs (FedAvg rounds through common.py against a bare training loop) and
what a FedIIR round costs against a FedAvg round.

On the embedded RotatedMNIST (test domain 0), P clients with C sampled per round, both variants train
the same sampled clients with the same model, batch size and optimiser (fresh SGD, momentum 0.9)
for one local epoch. The harness round also resets each client to θ, flattens its update and
aggregates. A FedIIR round (its g_bar pass plus the penalised steps, Table 3's γ) trains the same
clients too. The variants are timed alternately in one process (this machine is shared and noisy)
and the medians are compared.

    python benchmark/speed.py                       # 50 clients, 5 sampled
    python benchmark/speed.py --clients 5 --rounds 3
"""
import argparse
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


def setup(method, doc, add_args=None):
    """The shared CLI of the speed scripts and what they time: `method`'s arguments resolved for the
    embedded rmnist, test domain 0 held out, P clients, the model and a context on --device."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--sample", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds of each variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall-clock, or this process's CPU time (steadier on a loaded machine; CPU only)")
    a = p.parse_args()
    a.clock = time.process_time if a.clock == "cpu" and a.device == "cpu" else time.perf_counter
    parser = common.make_parser(method, doc)
    if add_args:
        add_args(parser)
    argv = ["--clients", str(a.clients), "--sample", str(a.sample), "--device", a.device]
    args = common.resolve(parser.parse_args(argv), "speed")
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


def main():
    a, args, fed, model, ctx = setup("fedavg", fedavg.__doc__)
    args.uniform_avg, args.gamma, args.ema, args.gbar, args.half = False, fediir.GAMMA["rmnist"], 0.95, "batches", False
    iir_state, images = fediir.init_state(model, fed, args, ctx), []

    def bare(r):
        sampled = [fed.clients[c] for c in common.sample_clients(ctx, len(fed.clients), args.sample)]
        images.append(sum(c.n for c in sampled))
        bare_round(model, sampled, args.lr, args.batch_size)
    times = alternate({"harness": lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ctx), "bare": bare,
                       "iir": lambda r: fediir.fediir_round(r, model, fed, args, iir_state, ctx)}, ctx, a.rounds, a.clock)
    n = statistics.median(images[1:])
    h, b, i = (statistics.median(times[k]) for k in ("harness", "bare", "iir"))
    print(f"embedded rmnist, {a.clients} clients, {a.sample} per round, batch {args.batch_size}, {a.device}, "
          f"{torch.get_num_threads()} threads, {a.rounds} rounds each, medians")
    print(f"harness (fedavg_round): {h:.3f} s/round, {n / h:,.0f} images/s")
    print(f"bare training loop:     {b:.3f} s/round, {n / b:,.0f} images/s")
    print(f"harness overhead: {100 * (h / b - 1):+.1f}%")
    print(f"FedIIR round:           {i:.3f} s/round, {n / i:,.0f} images/s, {i / h:.2f} x the FedAvg round")


if __name__ == "__main__":
    main()
