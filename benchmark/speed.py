"""How much the harness costs (FedAvg rounds through common.py against a bare training loop), what
a round of every method that runs on this setting costs against a FedAvg round, and what training
the sampled clients at once (--parallel-clients on) gains over training them one after another.

Two settings. rmnist (default): RotatedMNIST (test domain 0), P = 50 clients with C = 5 sampled per
round, one local epoch, each method with its own defaults for rmnist (FedIIR: Table 3's γ; FedOMG:
its server step; FedIPG: λ 1e-3, its tangent penalty). fl: FedOMG's FL setting, MNIST split over 100
clients by Dirichlet(0.1) label skew, 20 sampled, 5 local epochs, batch 16, the small CNN: FedAvg
and FedOMG, each one client after another and all at once (2 timed rounds by default: its rounds of
one client after another are long; rmnist: 6). Every variant trains the same sampled clients with
the same model, batch size and optimiser. The bare loop is what a researcher would write in a few
lines (a fresh SGD per client); the harness round also resets each client to θ, flattens its update
and aggregates. FedAvg is timed three ways on rmnist: one client after another (--parallel-clients
off: the base of the ratios), all at once (on), and as the flag's default chooses (auto: at once on
CUDA, one after another on the CPU); FedOMG one after another and at once; the bare loop on rmnist
only. The variants are timed alternately in one process (machines are shared and noisy) and the
medians are compared. FedLOE (every client in every communication, Adam) and PerInvFL (fixed-client
datasets only) do not fit these settings: their speed is in the benchmark's tables.

--curve R instead runs R rounds of FedAvg and of FedOMG from one start, one client after another and
at once, and prints the test accuracy after every round of both (they agree to float tolerance,
not bit for bit).

Bad input (a --json that could not be written: a folder, a path under a file, a folder this user
cannot write in; a --curve below 1) is refused in one line on stderr, exit code 2, before any data
is loaded or timed.

    python benchmark/speed.py                       # rmnist, 50 clients, 5 sampled
    python benchmark/speed.py --clients 5 --rounds 3 --clock cpu
    python benchmark/speed.py --setting fl --data-root DIR --device cuda
    python benchmark/speed.py --setting fl --curve 20
    # also the timings, for report.py --speed (bar chart)
    python benchmark/speed.py --json speed.json
"""
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
import common  # noqa: E402
import data  # noqa: E402
import fedavg  # noqa: E402
import fediir  # noqa: E402
import fedipg  # noqa: E402
import fedomg  # noqa: E402
import harness  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser  # noqa: E402
from harness.provenance import provenance  # noqa: E402


def bare_round(model, clients, lr, batch_size, momentum=0.9, epochs=1):
    """The loop a researcher would write in a few lines: no flattening, no aggregation."""
    for c in clients:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        for _ in range(epochs):
            perm = torch.randperm(c.n)
            for i in range(0, c.n, batch_size):
                idx = perm[i:i + batch_size]
                loss = F.cross_entropy(model(c.x[idx].float() / 255), c.y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()


SETTINGS = {"rmnist": "rmnist", "fl": "mnist"}   # --setting -> dataset


def setup(method, own_args=None, argv=None, prog=None, about=None, check=None):
    """The shared CLI of the speed scripts (own_args adds a script's own flags) and what they time:
    `method`'s (a common.Method) arguments resolved for the setting's dataset (rmnist: test
    domain 0 held out; fl: the label-skew clients), the federation, the model and a context on
    --device; `about`: --help's first line; check(a): a script's own refusals (data.UserError:
    one line, exit 2), made before any data is loaded."""
    # one-line errors
    p = Parser(prog=prog or Path(sys.argv[0]).name,
               description=about or method.doc.splitlines()[0])
    p.add_argument("--setting", default="rmnist", choices=list(SETTINGS),
                   help="rmnist: RotatedMNIST, 50 clients, 5 sampled; "
                        "fl: FedOMG's MNIST label skew, 100 / 20")
    p.add_argument("--data-root", default=None,
                   help="full MNIST (default: the embedded 5,000 digits)")
    p.add_argument("--clients", type=int, default=None, help="default: rmnist 50, fl 100")
    p.add_argument("--sample", type=int, default=None, help="default: rmnist 5, fl 20")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds of each variant "
                        "(default: rmnist 6, fl 1: its sequential rounds are long)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall-clock, or this process's CPU time "
                        "(steadier on a loaded machine; CPU only)")
    if own_args:
        own_args(p)
    a = p.parse_args(argv)
    for flag in ("clients", "sample", "rounds"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag} must be positive, got {getattr(a, flag)}")
    if check:
        try:
            check(a)
        except data.UserError as e:
            p.error(str(e))
    a.clock = time.process_time if a.clock == "cpu" and a.device == "cpu" else time.perf_counter
    a.dataset = SETTINGS[a.setting]
    # fl: 56 s in all on an H100 (full MNIST)
    a.rounds = a.rounds or (6 if a.setting == "rmnist" else 1)
    if a.setting == "rmnist":
        a.clients, a.sample = a.clients or 50, a.sample or 5
    try:                                     # what the method script would refuse: one line, exit 2
        args = harness.resolve(method, method_argv(a))
        common.deterministic()                 # as the method scripts run by default
        a.clients, a.sample = args.clients, args.sample
        ds = data.load(a.dataset, a.data_root, 0, clients=args.clients, alpha=args.alpha)
        common.after_load(args, ds)        # the clients the data hold (as the method scripts check)
        dev = torch.device(a.device)
        fed = data.federate(ds, 0, a.clients, 0, dev) if a.setting == "rmnist" else \
            data.federate_fixed(ds, 0, dev)
    except data.UserError as e:
        p.error(str(e))
    # as the method scripts make it (seed 0; its memory format)
    model = common.global_model(args, ds, dev)
    ctx = common.make_context(args, fed, model)
    a.source = ds.source
    return a, args, fed, model, ctx


def way(ctx, mode, args=None):
    """ctx for a method's `args` with on_clients' engine for --parallel-clients `mode` (its own
    client states; the server's sampler shared by all)."""
    on = mode == "on" or (mode == "auto" and ctx.device.type == "cuda")
    return dataclasses.replace(ctx, args=args or ctx.args,
                               engine=common.all_at_once if on else common.one_by_one,
                               clients={})


def method_argv(a):
    argv = ["--dataset", a.dataset, "--device", a.device] \
        + (["--test-domain", "0"] if a.setting == "rmnist" else [])
    argv += ["--data-root", a.data_root] if a.data_root else []
    return argv + sum((["--" + k, str(getattr(a, k))] for k in ("clients", "sample")
                       if getattr(a, k)), [])


def alternate(variants, ctx, rounds, clock=time.perf_counter, say=None):
    """{name: [seconds of each timed round]}: in every round each variant in turn, all on the same
    sampled clients; round 0 warms them up. A variant returning losses is synchronised once, as the
    skeleton does. say: called with a line after each round of each variant (progress)."""
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
            if say:
                say(f"{'timed' if r else 'warm-up'} round {r}: {name} {clock() - t:.3f} s")
    return times


def method_args(module, a, parallel_clients="off"):
    """The method's arguments for this setting, resolved as its script resolves them."""
    return harness.resolve(module.METHOD, method_argv(a) + ["--parallel-clients", parallel_clients])


def setting_line(a, args):
    what = ("rmnist (leave one domain out, domain 0 held out)" if a.setting == "rmnist" else
            "FedOMG's FL setting")
    return (f"{what}, {a.source}, {a.clients} clients, {a.sample} per round, "
            f"{args.local_epochs} local epoch(s), batch {args.batch_size}, {args.model}, {a.device}"
            + (f" ({torch.cuda.get_device_name()})" if a.device.startswith("cuda") else "")
            + f", {torch.get_num_threads()} threads")


def curves(a, args, fed, model, ctx, rounds):
    """FedAvg's and FedOMG's test accuracy after each of `rounds` rounds from the same start, one
    client after another and all at once; and how far apart their parameters end."""
    start, sampler = copy.deepcopy(model.state_dict()), ctx.sampler.get_state()
    print(setting_line(a, args) + "\n")
    for name, module in (("FedAvg", fedavg), ("FedOMG", fedomg)):
        acc, end, secs = {}, {}, {}
        for mode in ("off", "on"):
            m_args = method_args(module, a, mode)
            m_args.rounds = rounds                           # FedOMG's lr step at 80% of the rounds
            model.load_state_dict(start)
            ctx.sampler.set_state(sampler)
            m_ctx, state = way(ctx, mode, m_args), {}
            fn = getattr(module, f"{name.lower()}_round")
            acc[mode], t0 = [], time.perf_counter()
            for t in range(1, rounds + 1):
                fn(t, model, fed, m_args, state, m_ctx)
                acc[mode].append(common.evaluate_global(t, model, fed, m_args, state, ctx)[1])
            secs[mode], end[mode] = time.perf_counter() - t0, common.get_flat(model)
        gap = max(abs(x - y) for x, y in zip(acc["off"], acc["on"]))
        rel = ((end["on"] - end["off"]).norm() / end["off"].norm()).item()
        print(f"{name}: {rounds} rounds, evaluation included: one after another "
              f"{secs['off']:.1f} s, at once {secs['on']:.1f} s; largest accuracy difference "
              f"{100 * gap:.2f} points; parameters at the end {rel:.1e} apart (relative)\n")
        print("| round | test acc, one after another | test acc, at once |\n|---|---|---|")
        for t, (x, y) in enumerate(zip(acc["off"], acc["on"]), 1):
            print(f"| {t} | {100 * x:.2f} | {100 * y:.2f} |")
        print()


def main(argv=None):
    def own(p):
        p.add_argument("--json", default=None, help="also write every timed round here")
        p.add_argument("--curve", type=int, default=None,
                       help="instead of timing: R rounds (R >= 1), accuracy both ways")

    def check(a):                     # before any data is loaded, let alone timed
        if a.curve is not None and a.curve < 1:
            raise data.UserError(f"--curve must be positive, got {a.curve}")
        if a.json is not None:        # a folder, a path under a file, an unwritable folder
            outputs.writable_file(a.json, "--json")
    a, args, fed, model, ctx = setup(fedavg.METHOD, own, argv, "speed.py",
                                     " ".join(__doc__.split("\n\n")[0].split()), check)
    if a.curve:
        return curves(a, args, fed, model, ctx, a.curve)
    ways = {m: way(ctx, m) for m in ("off", "on", "auto")}
    rounds = {
        "FedAvg, one after another":
            lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ways["off"]),
        "FedAvg, clients at once":
            lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ways["on"]),
    }
    if a.setting == "rmnist":    # fl: the four rounds the setting is about (auto is one of the two)
        auto = "at once" if ways["auto"].engine is common.all_at_once else "one after another"
        rounds[f"FedAvg, auto ({auto})"] = \
            lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ways["auto"])
    methods = [("FedIIR", fediir, "off"), ("FedOMG", fedomg, "off"),
               ("FedOMG, clients at once", fedomg, "on"), ("FedIPG", fedipg, "off")]
    for name, module, mode in methods if a.setting == "rmnist" else methods[1:3]:
        m_args = method_args(module, a, mode)
        m_ctx = way(ctx, mode, m_args)
        state = module.init_state(model, fed, m_args, m_ctx) if hasattr(module, "init_state") \
            else {}
        fn = getattr(module, f"{module.__name__}_round")
        rounds[name] = lambda r, fn=fn, m_args=m_args, state=state, m_ctx=m_ctx: \
            fn(r, model, fed, m_args, state, m_ctx)

    def bare(r):
        sampled = [fed.clients[c]
                   for c in common.sample_clients(ctx, len(fed.clients), args.sample)]
        bare_round(model, sampled, args.lr, args.batch_size, args.momentum, args.local_epochs)
    # the images of the timed rounds: their sampled clients, replayed
    start = ctx.sampler.get_state()
    images = [args.local_epochs
              * sum(fed.clients[c].n
                    for c in common.sample_clients(ctx, len(fed.clients), args.sample))
              for _ in range(a.rounds + 1)]
    ctx.sampler.set_state(start)
    times = alternate({**rounds, **({"bare training loop": bare} if a.setting == "rmnist" else {})},
                      ctx, a.rounds, a.clock,
                      say=lambda line: print(line, file=sys.stderr, flush=True))
    n = statistics.median(images[1:])
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["FedAvg, one after another"]
    setting = (setting_line(a, args) + f", {a.rounds} rounds each, medians of "
               f"{'CPU' if a.clock is time.process_time else 'wall-clock'} time")
    print(setting + "\n")
    print("| round | s / round | images / s | × FedAvg one after another |\n|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {n / v:,.0f} | {v / base:.2f} |")
    if "bare training loop" in med:
        print(f"\nharness overhead against the bare loop: "
              f"{100 * (base / med['bare training loop'] - 1):+.1f}%")
    print(f"clients at once: FedAvg {base / med['FedAvg, clients at once']:.2f}x, FedOMG "
          f"{med['FedOMG'] / med['FedOMG, clients at once']:.2f}x "
          f"the speed of one client after another")
    if a.json:                                        # machine-readable: report.py --speed draws it
        argv = sys.argv[1:] if argv is None else argv
        # no machine paths
        shown = ["DIR" if i and argv[i - 1] == "--data-root" else x for i, x in enumerate(argv)]
        made = provenance("benchmark/speed", shown, ctx.device, (a.json,))
        # no machine path
        where = setting.replace(f" under {a.data_root} (", " under DIR (") if a.data_root \
            else setting
        Path(a.json).write_text(json.dumps({"setting": where, "images_per_round": n,
                                            "seconds": times, "provenance": made}, indent=1))
        print(f"speed: {a.json}")


if __name__ == "__main__":
    main()
