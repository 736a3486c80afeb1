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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--sample", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds of each variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    argv = ["--clients", str(a.clients), "--sample", str(a.sample), "--device", a.device]
    args = common.resolve(common.make_parser("fedavg", fedavg.__doc__).parse_args(argv), "speed")
    args.uniform_avg, args.gamma, args.ema, args.gbar, args.half = False, fediir.GAMMA["rmnist"], 0.95, "batches", False
    ds = data.load("rmnist")
    dev = torch.device(a.device)
    fed = common.federate(ds, 0, a.clients, 0, dev)
    torch.manual_seed(0)
    model = common.build_model(args, ds).to(dev)
    ctx = common.Context(dev, torch.Generator(dev).manual_seed(0), torch.Generator().manual_seed(0),
                         common.make_prep("rmnist", dev))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    harness, bare, iir, images = [], [], [], []
    iir_state = fediir.init_state(model, fed, args, ctx)
    for r in range(a.rounds + 1):                     # round 0 warms up both
        state = ctx.sampler.get_state()
        t = time.perf_counter()
        losses = fedavg.fedavg_round(r, model, fed, args, {}, ctx)
        torch.stack(list(losses.values())).sum().item()  # the skeleton's one sync per round
        sync()
        th = time.perf_counter() - t
        ctx.sampler.set_state(state)                  # the bare loop trains the same clients
        sampled = [fed.clients[c] for c in common.sample_clients(ctx, len(fed.clients), args.sample)]
        t = time.perf_counter()
        bare_round(model, sampled, args.lr, args.batch_size)
        sync()
        tb = time.perf_counter() - t
        ctx.sampler.set_state(state)
        t = time.perf_counter()
        losses = fediir.fediir_round(r, model, fed, args, iir_state, ctx)
        torch.stack(list(losses.values())).sum().item()
        sync()
        ti = time.perf_counter() - t
        if r:
            harness.append(th)
            bare.append(tb)
            iir.append(ti)
            images.append(sum(c.n for c in sampled))
    n = statistics.median(images)
    h, b = statistics.median(harness), statistics.median(bare)
    print(f"embedded rmnist, {a.clients} clients, {a.sample} per round, batch {args.batch_size}, {a.device}, "
          f"{torch.get_num_threads()} threads, {a.rounds} rounds each, medians")
    print(f"harness (fedavg_round): {h:.3f} s/round, {n / h:,.0f} images/s")
    print(f"bare training loop:     {b:.3f} s/round, {n / b:,.0f} images/s")
    print(f"harness overhead: {100 * (h / b - 1):+.1f}%")
    i = statistics.median(iir)
    print(f"FedIIR round:           {i:.3f} s/round, {n / i:,.0f} images/s, {i / h:.2f} x the FedAvg round")


if __name__ == "__main__":
    main()
