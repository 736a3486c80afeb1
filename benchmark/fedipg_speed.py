"""What a FedIPG round costs against a FedAvg round, and where the extra time goes.

On the embedded RotatedMNIST (test domain 0), P clients with C sampled per round: a FedAvg round
(fedavg.py), a FedIPG round with the penalty from the layer outputs (the default) and one with the
penalty from the parameter gradients (--penalty params), all training the same sampled clients with
the same model, batch size and optimiser, timed alternately in one process (this machine is shared
and noisy); medians are compared. Then one batch of 64 is timed step by step: a plain step (forward
+ backward) against the penalised step's parts (forward with the hooks, the backward to the layer
outputs with a graph, the double backward of R + λ d²), and the size of the penalty's gradient
against the risk's is printed.

    python benchmark/fedipg_speed.py                       # 50 clients, 5 sampled
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fedavg  # noqa: E402
import fedipg  # noqa: E402
from speed import alternate, setup  # noqa: E402  (benchmark/speed.py: the shared CLI and timing loop)


def median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_parts(model, x, y, lam, repeat):
    """Seconds of a plain step and of the parts of the penalised step, on one batch."""
    w = list(model.parameters())
    def plain():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
    z = []

    def keep(module, inputs, out):
        z.append(out)
        return out.clone()

    def forward():
        z.clear()
        hooks = [m.register_forward_hook(keep) for m in fedipg.affine_layers(model)]
        risk = F.cross_entropy(model(x), y)
        for h in hooks:
            h.remove()
        return risk

    def to_layers():
        risk = forward()
        dz = torch.autograd.grad(risk, z, create_graph=True)
        return risk, sum((a * b).sum() for a, b in zip(dz, z))

    def full():
        model.zero_grad()
        risk, d = to_layers()
        (risk + lam * d * d).backward()

    def params():
        model.zero_grad()
        fedipg.ipg_loss(lam, "params")(model, x, y).backward()
    model.zero_grad()
    risk, d = to_layers()
    g_R = torch.autograd.grad(risk, w, retain_graph=True)
    g_P = torch.autograd.grad(lam * d * d, w)
    norm = lambda gs: sum((v ** 2).sum() for v in gs).sqrt().item()
    print(f"at the model after the timed rounds, on one batch: R = {risk.item():.4f}, d = <grad R, w> = {d.item():.4f}, "
          f"|grad(lam d^2)| / |grad R| = {norm(g_P) / norm(g_R):.2e}")
    plain(), full(), params()                                    # warm-up
    out = {k: median_time(f, repeat) for k, f in
           (("plain step", plain), ("forward with hooks", forward), ("+ backward to the layer outputs", to_layers),
            ("+ double backward (the whole step)", full), ("--penalty params step", params))}
    return out


def main():
    a, args, fed, model, ctx = setup("fedipg", fedipg.__doc__, fedipg.add_args)
    fedipg.check(args)
    args.uniform_avg = False
    state = fedipg.init_state(model, fed, args, ctx)
    params_args = type("A", (), dict(vars(args), penalty="params"))
    times = alternate({"FedAvg": lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ctx),
                       "FedIPG": lambda r: fedipg.fedipg_round(r, model, fed, args, state, ctx),
                       "FedIPG --penalty params": lambda r: fedipg.fedipg_round(r, model, fed, params_args, state, ctx)},
                      ctx, a.rounds)
    base = statistics.median(times["FedAvg"])
    print(f"embedded rmnist, {a.clients} clients, {a.sample} per round, batch {args.batch_size}, λ {args.lam}, "
          f"{a.device}, {torch.get_num_threads()} threads, {a.rounds} rounds each, medians")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name + ':':26s} {m:.3f} s/round, {m / base:.2f} x FedAvg")
    x = ctx.prep(fed.clients[0].x[:64])
    parts = step_parts(model, x, fed.clients[0].y[:64], args.lam, 2 * a.rounds + 1)
    print("one batch of 64 (cumulative):")
    for k, v in parts.items():
        print(f"  {k:36s} {v * 1e3:8.1f} ms  {v / parts['plain step']:.2f} x the plain step")


if __name__ == "__main__":
    main()
