"""What a FedIPG round costs against a FedAvg round, and where the extra time goes.

On the embedded RotatedMNIST (test domain 0), P clients with C sampled per round: a FedAvg round
(fedavg.py) and FedIPG rounds with each way of computing d = ⟨∇R, w⟩ (tangent, fedipg.py's for
this ConvNet; torch.func.jvp, its form for models that are not a plain chain), all training the
same sampled clients with the same model, batch size and optimiser, timed alternately in one
process (this machine is shared and noisy); medians are compared. Then one batch of 64 is timed:
a plain step (forward + backward), the tangent mode's two forward streams alone, and each
penalised step; and the size of the penalty's gradient against the risk's is printed. --clock cpu
times this process's CPU use instead of the wall clock (steadier when other jobs share the CPU).

    python benchmark/diagnostics/fedipg_speed.py                       # 50 clients, 5 sampled
    python benchmark/diagnostics/fedipg_speed.py --clock cpu --rounds 10
"""
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import fedavg  # noqa: E402
import fedipg  # noqa: E402
# benchmark/speed.py: the shared CLI and timing loop
from speed import alternate, setup  # noqa: E402


def median_time(fn, repeat, clock):
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def step_parts(model, x, y, lam, repeat, clock):
    """Seconds of a plain step and of each penalised step (and the tangent step's forward), one
    batch."""
    w = list(model.parameters())
    layers = fedipg.chain(model)
    mean = torch.full((len(y),), 1 / len(y), device=y.device)
    f_i = lambda layers: fedipg.f_i(model, dict(model.named_parameters()),
                                    dict(model.named_buffers()), x, y, mean, lam, layers)

    def plain():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    def tangent_forward():
        with torch.no_grad():
            fedipg.tangent(layers, x)

    def step(mode):
        def f():
            model.zero_grad()
            f_i(layers if mode == "tangent" else None).backward()
        return f
    risk = F.cross_entropy(model(x), y)
    g_R = torch.autograd.grad(risk, w)
    d = sum((g * p).sum() for g, p in zip(g_R, w))                 # ⟨∇R, w⟩ by its definition
    g_P = [g - r for g, r in zip(torch.autograd.grad(f_i(layers), w), g_R)]
    norm = lambda gs: sum((v ** 2).sum() for v in gs).sqrt().item()
    print(f"at the model after the timed rounds, on one batch: R = {risk.item():.4f}, d = <grad "
          f"R, w> = {d.item():.4f}, |grad(lam d^2)| / |grad R| = {norm(g_P) / norm(g_R):.2e}")
    variants = (("plain step", plain), ("tangent: the two forward streams", tangent_forward),
                ("tangent step", step("tangent")), ("torch.func.jvp step", step("jvp")))
    for _, f in variants:                                       # warm-up
        f()
    return {k: median_time(f, repeat, clock) for k, f in variants}


def ipg_round(form):
    """fedipg.fedipg_round as it runs here (its defaults: --local-step sgd, --exit off, every
    update fresh), with d = ⟨∇R, w⟩ by `tangent` through fedipg.chain (form "tangent", fedipg.py's
    for this ConvNet) or by torch.func.jvp (form "jvp": as for a model that is not a plain
    chain)."""
    @common.stackable
    def client_update(site, sent):          # fedipg.client_update, --local-step sgd
        args, w = site.args, sent["w"]
        layers = fedipg.chain(site.model) if form == "tangent" else None
        w_i, loss = common.local_train(site, w, lambda *a: fedipg.f_i(*a, lam=args.lam,
                                                                      layers=layers))
        return {"delta": w_i - w, "loss": loss}

    return functools.partial(fedipg.fedipg_round, client=client_update)


def main():
    a, args, fed, model, ctx = setup(fedipg.METHOD)      # fedipg.py's arguments, resolved
    assert args.local_step == "sgd" and args.exit == "off", "ipg_round's setting"
    args.uniform_avg = False
    state = {**fedipg.init_state(model, fed, args, ctx), "clients": ctx.clients}
    tangent, jvp = ipg_round("tangent"), ipg_round("jvp")
    times = alternate({"FedAvg": lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ctx),
                       "FedIPG tangent": lambda r: tangent(r, model, fed, args, state, ctx),
                       "FedIPG torch.func.jvp": lambda r: jvp(r, model, fed, args, state, ctx)},
                      ctx, a.rounds, a.clock)
    base = statistics.median(times["FedAvg"])
    print(f"embedded rmnist, {a.clients} clients, {a.sample} per round, batch {args.batch_size}, "
          f"λ {args.lam}, {a.device}, {torch.get_num_threads()} threads, {a.rounds} rounds each, "
          f"medians of {'CPU' if a.clock is time.process_time else 'wall-clock'} time")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name + ':':27s} {m:.3f} s/round, {m / base:.2f} x FedAvg")
    x = ctx.prep(fed.clients[0].x[:64])
    parts = step_parts(model, x, fed.clients[0].y[:64], args.lam, 2 * a.rounds + 1, a.clock)
    print("one batch of 64:")
    for k, v in parts.items():
        print(f"  {k:36s} {v * 1e3:8.1f} ms  {v / parts['plain step']:.2f} x the plain step")


if __name__ == "__main__":
    main()
