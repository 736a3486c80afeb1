"""One command that checks the GPU path: every method runs there, without host syncs inside a local
step or anywhere else in a client's work, reproducibly, close to the CPU's numbers, and at the
speed the project aims for.

    python benchmark/gpu_check.py                  # embedded digits and a generated PACS tree
    python benchmark/gpu_check.py --data-root DIR  # RotatedMNIST and RC-MNIST from DIR's MNIST

On a CUDA machine, in one process (method scripts are called in-process, their output hidden):
1. runs     every method for 2 rounds on RotatedMNIST-50 (ConvNet, 5 sampled; FedLOE: its default
            clients, every one a communication) and on a generated DomainBed-style PACS tree
            (ResNet-18, --no-pretrained), fp32 and --amp (PerInvFL scores fixed clients:
            RC-MNIST, MLP, instead). A non-finite loss stops a run (the skeleton checks it); after
            every round, every tensor of the model and of the method's state must be on the GPU
            (harness.main's after_round). Each client's work in a round (on_clients' engine,
            harness.main's engine: the local steps of common.local_train and common.at_once,
            fedloe.overfit_head, fedipg.full_gradient, PerInvFL's client loop, and the features
            and gradients around them) runs under torch.cuda.set_sync_debug_mode("error").
2. repeat   the same runs again: the JSON must be identical (seconds aside).
3. cpu      each method on a tiny case on the CPU and on the GPU, fp32, and FedIIR / FedIPG /
            PerInvFL with --amp (bf16 penalty paths) against the CPU's fp32, within TOL. Local
            steps are full batch: the minibatch order is drawn from each device's own generator,
            so with minibatches the two devices would train on different batches; a full batch
            leaves them only a different summation order.
4. speed    images/s of the harness (a FedAvg round through common.py) against a bare loop of the
            same model, batch, input preparation and SGD in the same process: ConvNet on
            RotatedMNIST-50 (fp32, bf16), ResNet-18 on the PACS tree (fp32 NCHW, fp32 and bf16
            channels-last); FedIIR / FedIPG / FedOMG rounds against FedAvg's (RotatedMNIST-50, 5
            sampled, as benchmark/speed.py); FedIPG --exit auto against --exit off over a whole
            run; a FedAvg round deterministic (the default) against --nondeterministic.
Prints one table (check, measured, target, ok) and writes it as JSON (--out). Exit status 0 when
every check holds, 1 when one fails, 2 without a CUDA device; each row is written as it is
measured, and Ctrl-C or SIGTERM (after the method run in progress ends its round) stops it there:
130 / 143.
"""
import argparse
import contextlib
import dataclasses
import functools
import io
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import fedavg  # noqa: E402
import fedipg  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402
from harness.datasets import make_fake_tree  # noqa: E402
from harness.outputs import write_json  # noqa: E402
from speed import alternate, way  # noqa: E402

METHOD_NAMES = {"fedavg": "FedAvg", "fediir": "FedIIR", "fedipg": "FedIPG", "fedomg": "FedOMG"}
METHODS = {name: importlib.import_module(name) for name in harness.METHODS}
TWO_ROUNDS = {   # each method's own flags for two communication rounds, evaluated after each
    "fedloe": ["--stage1-comms", "1", "--stage1-epochs", "1", "--stage2-comms", "1",
               "--stage2-epochs", "1", "--eval-every", "1"],
    "fedipg": ["--rounds", "2", "--eval-every", "1", "--exit", "auto", "--exit-warmup", "1",
               "--exit-L", "1e-3"],
    "*": ["--rounds", "2", "--eval-every", "1"]}
# GPU against CPU on the tiny case: 10x the largest difference measured on an NVIDIA H100 (torch
# 2.11.0, 2026-11-26): fp32 loss 3.7e-5 (FedLOE; FedAvg, FedIIR, FedOMG and FedIPG 0), acc 0.004;
# bf16 loss 1.9e-4, acc 0.021 (one validation image).
# loss: largest relative difference of a round's mean training loss; acc: largest difference of a
# validation or test accuracy (a fraction; one of the tiny case's 48 validation images is 0.021).
# fp32 on CUDA is IEEE fp32 (common.deterministic turns TF32 off), bf16 the --amp
# autocast.
TOL = {"fp32": {"loss": 4e-4, "acc": 0.04}, "bf16": {"loss": 2e-3, "acc": 0.2}}
# The targets of the GPU path (README: GPU): how each measured ratio must compare, and the bound.
TARGETS = {"harness": (">=", 0.90), "fediir": ("<=", 1.5), "fedipg": ("<=", 2.0),
           "exit": ("<=", 1.5), "determinism": ("<=", 1.15), "busy": (">=", 0.75)}


# ------------------------------------------------------------ the pure parts (tested on the CPU)

def strip_seconds(results):
    """The results JSON without what may differ between identical runs: wall-clock seconds, --out
    and the provenance (its command names --out)."""
    r = json.loads(json.dumps(results))
    r["args"].pop("out", None)
    r.pop("provenance", None)
    for d in r["domains"].values():
        for row in d["history"]:
            row.pop("seconds", None)
    return r


def same_json(a, b):
    return strip_seconds(a) == strip_seconds(b)


def differences(a, b):
    """Largest relative difference of the rounds' training losses and largest absolute difference
    of their validation and test accuracies between two runs of the same arguments (e.g. CPU and
    GPU)."""
    loss, acc = 0.0, 0.0
    for name, d in a["domains"].items():
        for ra, rb in zip(d["history"], b["domains"][name]["history"], strict=True):
            loss = max(loss, abs(ra["loss"] - rb["loss"]) / max(abs(ra["loss"]), 1e-12))
            acc = max(acc, abs(ra["val_acc"] - rb["val_acc"]),
                      abs(ra["test_acc"] - rb["test_acc"]))
    return {"loss": loss, "acc": acc}


def within(diff, tol):
    return all(diff[k] <= tol[k] for k in tol)


def target_row(check, key, measured):
    """A table row for a measured ratio against its target; None: not measured (ok stays None)."""
    op, bound = TARGETS[key]
    ok = None if measured is None else (measured >= bound if op == ">=" else measured <= bound)
    return {"check": check, "measured": measured, "target": f"{op} {bound:g}", "ok": ok}


def format_table(rows):
    def cell(v):
        return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| check | measured | target | ok |", "|---|---|---|---|"]
    for r in rows:
        ok = {True: "yes", False: "**NO**", None: "—"}[r["ok"]]
        lines.append(f"| {r['check']} | {cell(r['measured'])} | {r['target']} | {ok} |")
    return "\n".join(lines)


def write_report(path, rows, about):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**about, "rows": rows, "all_ok": all(r["ok"] is not False for r in rows)})


def misplaced(obj, device_type, path="state"):
    """Where in a nest of dicts and lists a tensor is not on `device_type`. Scalars are let
    through: torch keeps an optimiser's step count on the CPU by design (no sync to read it)."""
    if torch.is_tensor(obj):
        return [] if obj.device.type == device_type or obj.dim() == 0 else \
            [f"{path} ({obj.device})"]
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else []
    return [m for k, v in items for m in misplaced(v, device_type, f"{path}[{k!r}]")]


# ------------------------------------------------------------------------ running methods

def attempt(fn):
    """(what fn returned, None) or (None, one line saying why it failed); the scripts' output is
    hidden."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return fn(), None
    except SystemExit as e:       # a script's own error: its one line is on stderr
        if e.code in (130, 143):  # the script stopped at a signal (SIGINT, SIGTERM): so does
            raise                 # the check
        return None, (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
    except Exception as e:
        return None, f"{type(e).__name__}: " \
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"


@contextlib.contextmanager
def no_sync(device):
    """A host synchronisation on CUDA raises inside this block (nothing is checked on the CPU)."""
    if torch.device(device).type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def guarded(device):
    """The hooks of a guarded run (harness.main's): on_clients' engine, the one the run would use
    (all at once with --parallel-clients on, else one by one), under no_sync, so that each
    client's work in a round (its local steps, and what it computes around them) runs without a
    host synchronisation; after_round: after every round, every tensor of the model and of the
    method's state (what a checkpoint holds) on the device."""
    def engine(fn, S, sents, t, phase, ctx):
        run = common.all_at_once if ctx.args.parallel_clients == "on" else common.one_by_one
        with no_sync(device):
            return run(fn, S, sents, t, phase, ctx)

    def after_round(t, model, state, ctx):
        bad = misplaced({"model": model.state_dict(), "state": state}, torch.device(device).type,
                        "checkpoint")
        if bad:
            raise RuntimeError(f"off the {device}: {', '.join(bad[:3])}")
    return {"engine": engine, "after_round": after_round}


def run_method(name, argv, out, **hooks):
    """The method script's run (harness.main of its METHOD) into a scratch file of this check's
    (replacing the last case's there), reading its data with loader(); hooks: harness.main's."""
    return harness.main(METHODS[name].METHOD, argv + ["--out", str(out), "--overwrite"],
                        load=loader(), **hooks)


def cases(pacs_root, data_root=None, methods=METHODS):
    """(label, method, argv) of the 2-round runs: every method on RotatedMNIST-50 (5 sampled;
    FedLOE, which takes every client, its default clients) and PACS (PerInvFL: RC-MNIST), fp32
    and --amp."""
    mnist = ["--data-root", data_root] if data_root else []
    sets = {"rmnist": ["--dataset", "rmnist", "--test-domain", "0"] + mnist,
            "pacs": ["--dataset", "pacs", "--data-root", str(pacs_root), "--model", "resnet18",
                     "--no-pretrained", "--test-domain", "photo", "--batch-size", "8",
                     "--clients", "3"],                          # (FedLOE's default: ResNet-50)
            "rcmnist": ["--dataset", "rcmnist"] + mnist}
    out = []
    for name in methods:
        for ds in (["rcmnist"] if name == "perinvfl" else ["rmnist", "pacs"]):
            for amp in ([], ["--amp"]):
                fifty = ["--clients", "50", "--sample", "5"] \
                    if ds == "rmnist" and name != "fedloe" else []
                argv = sets[ds] + fifty + TWO_ROUNDS.get(name, TWO_ROUNDS["*"]) + amp
                out.append((f"{name} {ds} {'bf16' if amp else 'fp32'}", name, argv))
    return out


_LOADS = []     # loaded_once's memoised data.load, innermost last


def loader():
    """data.load, or inside loaded_once() its memoised stand-in (harness.main's load)."""
    return _LOADS[-1] if _LOADS else data.load


@contextlib.contextmanager
def loaded_once():
    """data.load memoised in the block (what loader() gives there, and yields): each dataset of
    the runs read and built once, not once a run (a run that changed one would show in its
    repeat, which gets the same objects)."""
    _LOADS.append(functools.lru_cache(maxsize=4)(loader()))
    try:
        yield _LOADS[-1]
    finally:
        _LOADS.pop()


def check_runs(todo, device, tmp):
    """Section 1 and 2: each case guarded, then again; a row for each, as it is measured."""
    with loaded_once():
        yield from runs_and_repeats(todo, device, tmp)


def runs_and_repeats(todo, device, tmp):
    for label, name, argv in todo:
        argv = argv + ["--device", device]
        first, why = attempt(lambda: run_method(name, argv, Path(tmp) / "a.json",
                                                **guarded(device)))
        yield {"check": f"runs: {label}", "measured": why or "finite, on the device, no sync in "
               "a step", "target": "", "ok": why is None}
        second, why2 = attempt(lambda: run_method(name, argv, Path(tmp) / "b.json"))
        same = first is not None and second is not None and same_json(first, second)
        said = why or why2 or ("identical JSON" if same else "JSON differs")
        yield {"check": f"repeat: {label}", "measured": said, "target": "identical", "ok": same}


def tiny_cases(methods=METHODS):
    """(label, method, argv, precision) of the CPU / GPU comparison: full-batch local steps."""
    syn = ["--dataset", "synthetic", "--test-domain", "0", "--clients", "4", "--batch-size",
           "1000"]
    out = []
    for name in methods:
        base = (["--dataset", "rcmnist"] if name == "perinvfl" else syn) + \
            TWO_ROUNDS.get(name, TWO_ROUNDS["*"])
        out.append((name, base, "fp32"))
        if name in ("fediir", "fedipg", "perinvfl"):   # the penalties' double backward in bf16
            out.append((name, base, "bf16"))
    return out


def check_cpu_gpu(tmp, device="cuda", methods=METHODS):
    for name, argv, prec in tiny_cases(methods):
        cpu, why = attempt(lambda: run_method(name, argv + ["--device", "cpu"],
                                              Path(tmp) / "cpu.json"))
        amp = ["--amp"] if prec == "bf16" else []
        gpu, why2 = attempt(lambda: run_method(name, argv + ["--device", device] + amp,
                                               Path(tmp) / "gpu.json"))
        if why or why2:
            yield {"check": f"cpu vs gpu: {name} {prec}", "measured": why or why2, "target": "",
                   "ok": False}
            continue
        d = differences(cpu, gpu)
        yield {"check": f"cpu vs gpu: {name} {prec}",
               "measured": f"loss {d['loss']:.1e}, acc {d['acc']:.3f}",
               "target": f"loss ≤ {TOL[prec]['loss']:g}, acc ≤ {TOL[prec]['acc']:g}",
               "ok": within(d, TOL[prec])}


# ------------------------------------------------------------------------------------ speed

def resolved(module, name, argv, device, tmp):
    """`name`'s arguments for argv, resolved as its script resolves them (harness.resolve of
    module.METHOD)."""
    return harness.resolve(module.METHOD,
                           argv + ["--device", device, "--out", str(Path(tmp) / "s.json")])


def setting(module, name, argv, device, tmp):
    """What `name`'s script trains on for argv: its arguments, the federation holding out the
    first test domain it names, the model (seed 0) and a context, on `device`."""
    args = resolved(module, name, argv, device, tmp)
    ds = loader()(args.dataset, args.data_root, args.seed)
    test = common.after_load(args, ds)[0]
    dev = torch.device(device)
    fed = data.federate(ds, test, args.clients, args.seed, dev)
    model = common.global_model(args, ds, dev)
    return args, fed, model, common.make_context(args, fed, model)


def bare_round(model, clients, args, ctx):
    """What a researcher writes in a few lines: the same model, batch, input preparation,
    precision and SGD, a fresh optimiser per client; no resetting to θ, flattening or averaging."""
    model.train()
    gen = torch.Generator(ctx.device).manual_seed(0)
    for c in clients:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        perm = torch.randperm(c.n, generator=gen, device=ctx.device)
        for i in range(0, c.n, args.batch_size):
            idx = perm[i:i + args.batch_size]
            with ctx.autocast():
                loss = F.cross_entropy(model(ctx.prep(c.x[idx], train=True, gen=gen)), c.y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def harness_vs_bare(args, fed, model, ctx, rounds):
    """Images/s of a FedAvg round through common.py and of the bare loop, timed alternately on the
    same sampled clients (medians over the timed rounds)."""
    images = []

    def bare(r):
        sampled = [fed.clients[c]
                   for c in common.sample_clients(ctx, len(fed.clients), args.sample)]
        images.append(sum(c.n for c in sampled))
        bare_round(model, sampled, args, ctx)
    times = alternate({"harness": lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ctx),
                       "bare": bare}, ctx, rounds)
    return {k: statistics.median(n / t for n, t in zip(images[1:], v, strict=True))
            for k, v in times.items()}


def busy_seconds(spans):
    """The length of the union of (start, end) spans: the time at least one of them runs,
    overlaps once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total, end = total + stop - max(start, end), stop
    return total


def kernel_seconds(fn, ctx):
    """Seconds the GPU was running kernels or copies during fn(): the union of torch.profiler's
    device events, less its user annotations (a record_function range mirrored on the GPU spans
    the kernels inside it and the idle time between them: counted, it made a round's share 1.5 on
    an H100); None on the CPU, which has no device events."""
    if ctx.device.type != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        losses = fn()
        if losses:
            torch.stack(list(losses.values())).sum().item()
        torch.cuda.synchronize()
    return busy_seconds((e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA
                        and not getattr(e, "is_user_annotation", False)) / 1e6


def round_ratios(setup, rounds, device, tmp):
    """Median seconds of a FedIIR, FedIPG and FedOMG round over a FedAvg round's, alternated on
    the same sampled clients and model, each method with its own defaults; and, on CUDA, each
    method's kernel time in one more (profiled) round over its median wall time: the share of a
    round the GPU is busy (the profiler slows the host, not the kernels)."""
    args, fed, model, ctx = setup
    variants = {"fedavg": lambda r: fedavg.fedavg_round(r, model, fed, args, {}, ctx)}
    for name in ("fediir", "fedipg", "fedomg"):
        module = METHODS[name]
        m_args = resolved(module, name, ["--dataset", args.dataset, "--clients", str(args.clients),
                                         "--sample", str(args.sample)], device, tmp)
        m_ctx = way(ctx, m_args.parallel_clients, m_args)
        state = module.init_state(model, fed, m_args, m_ctx) \
            if hasattr(module, "init_state") else {}
        fn = getattr(module, f"{name}_round")
        variants[name] = lambda r, fn=fn, m_args=m_args, state=state, m_ctx=m_ctx: \
            fn(r, model, fed, m_args, state, m_ctx)
    med = {k: statistics.median(v) for k, v in alternate(variants, ctx, rounds).items()}
    ratios = {k: med[k] / med["fedavg"] for k in ("fediir", "fedipg", "fedomg")}
    busy, state = {}, ctx.sampler.get_state()
    for k, fn in variants.items():
        ctx.sampler.set_state(state)
        secs, why = attempt(lambda: kernel_seconds(lambda: fn(rounds + 2), ctx))
        busy[k] = why or (None if secs is None else secs / med[k])
    return ratios, busy, med


def at_once_round(module, args, model, fed, ctx, compile):
    """Round t -> `module`'s round with its clients at once, with or without --compile, on
    `ctx`'s sampler."""
    a = argparse.Namespace(**{**vars(args), "parallel_clients": "on", "compile": compile})
    c = way(ctx, "on", a)
    state = module.init_state(model, fed, a, c) if hasattr(module, "init_state") else {}
    return functools.partial(getattr(module, f"{module.__name__}_round"), model=model, fed=fed,
                             args=a, state=state, ctx=c)


def first_seconds(round_fn, ctx):
    """Seconds of round_fn(0), the device synchronised: a first round, with its compiling."""
    start = time.perf_counter()
    round_fn(0)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compile_cost(setup, rounds):
    """A FedAvg round with its clients at once and --compile (CUDA: CUDA graphs) against one
    without, alternated on the same sampled clients: (median compiled / eager, the compiled
    round's kernel share as round_ratios measures it (None on the CPU), the first compiled round's
    seconds (the compiling), whether two compiled rounds from the same model and sampler give the
    same model bit for bit). Where Inductor would run the step without a CUDA graph, it raises
    instead (cudagraph_or_error): the reason becomes the row."""
    import torch._inductor.config as inductor
    args, fed, model, ctx = setup
    strict = inductor.patch({"triton.cudagraph_or_error": True}) \
        if hasattr(inductor.triton, "cudagraph_or_error") else contextlib.nullcontext()
    compiled, eager = (at_once_round(fedavg, args, model, fed, ctx, c) for c in (True, False))
    with strict:
        first = first_seconds(compiled, ctx)
        times = alternate({"compiled": compiled, "eager": eager}, ctx, rounds)
        med = statistics.median(times["compiled"])
        busy = kernel_seconds(lambda: compiled(rounds + 2), ctx)
        theta, drawn, ends = common.get_flat(model).clone(), ctx.sampler.get_state(), []
        for _ in range(2):
            common.set_flat(model, theta)
            ctx.sampler.set_state(drawn)
            compiled(rounds + 3)
            ends.append(common.get_flat(model).clone())
    return med / statistics.median(times["eager"]), busy and busy / med, first, \
        torch.equal(*ends)


def compiled_ratio(argv, device, tmp, rounds):
    """FedIPG's round over FedAvg's, both with --compile and their clients at once, alternated on
    the same sampled clients after a first (compiling) round of each: (ratio, FedIPG's first
    round in s)."""
    args, fed, model, ctx = setting(fedavg, "fedavg", argv, device, tmp)
    ipg_args = resolved(fedipg, "fedipg", argv, device, tmp)
    variants = {"fedavg": at_once_round(fedavg, args, model, fed, ctx, True),
                "fedipg": at_once_round(fedipg, ipg_args, model, fed, ctx, True)}
    first = {k: first_seconds(fn, ctx) for k, fn in variants.items()}
    times = alternate(variants, ctx, rounds)
    return statistics.median(times["fedipg"]) / statistics.median(times["fedavg"]), \
        first["fedipg"]


def determinism_cost(args, fed, model, ctx, rounds):
    """Median seconds of a FedAvg round in deterministic mode over one with --nondeterministic."""
    def mode(on):
        def round_fn(r):
            common.deterministic(on)
            return fedavg.fedavg_round(r, model, fed, args, {}, ctx)
        return round_fn
    try:
        times = alternate({"on": mode(True), "off": mode(False)}, ctx, rounds)
    finally:
        common.deterministic(True)
    return statistics.median(times["on"]) / statistics.median(times["off"])


def by_batch(site, train=False):
    """fedipg.in_chunks in chunks of --batch-size alone."""
    client, b, gen = site.client, site.args.batch_size, site.gen if train else None
    for s in range(0, client.n, b):
        yield site.prep(client.x[s:s + b], train=train, gen=gen), client.y[s:s + b]


def paper_round(chunks):
    """fedipg.fedipg_round with --local-step paper and --exit off (every update fresh), its client
    reading its split in chunks(site, train) (fedipg's own: fedipg.in_chunks)."""
    @common.replies(fedipg.client_update.replies, **fedipg.client_update.reduced)
    def client_update(site, sent):       # fedipg.client_update's --local-step paper branch
        args, model, w = site.args, site.model, sent["w"]
        common.set_flat(model, w)
        grad, loss = fedipg.full_gradient(model, chunks(site, train=True), site.client.n,
                                          args.lam, fedipg.chain(model), site.autocast)
        delta = -args.lr * (grad + args.weight_decay * w)                           # Eq. 2
        return {"delta": float(site.client.n) * delta, "loss": loss}                # n_i Δ_i

    return functools.partial(fedipg.fedipg_round, client=client_update)


def chunk_cost(setup, rounds):
    """Median seconds of a FedIPG --local-step paper round in fedipg.in_chunks' chunks
    (--batch-size or 2^18 input values, if more) over one in chunks of --batch-size, alternated:
    what the larger chunks (fewer launches; slower on the CPU) buy."""
    args, fed, model, ctx = setup
    assert args.local_step == "paper" and args.exit == "off", "chunk_cost: paper_round's setting"
    state = fedipg.init_state(model, fed, args, ctx)
    variants = {name: functools.partial(paper_round(chunks), model=model, fed=fed, args=args,
                                        state=state, ctx=ctx)
                for name, chunks in (("large", fedipg.in_chunks), ("batch", by_batch))}
    times = alternate(variants, ctx, rounds)
    return statistics.median(times["large"]) / statistics.median(times["batch"])


def exit_cost(argv, device, tmp):
    """Seconds of a whole FedIPG run with --exit auto over one without (the same clients take
    part)."""
    secs = {}
    for how in ("auto", "off"):
        res = run_method("fedipg", argv + ["--exit", how, "--device", device],
                         Path(tmp) / f"exit-{how}.json")
        secs[how] = max(row["seconds"] for d in res["domains"].values() for row in d["history"])
    return secs["auto"] / secs["off"]


def check_speed(device, tmp, pacs_root, data_root, rounds, ipg_rounds, ratio_rounds=None):
    """Section 4: a row for each measurement, as it is made (ratio_rounds: of the method round
    ratios and kernel shares; default rounds)."""
    ratio_rounds = ratio_rounds or rounds
    mnist = ["--data-root", data_root] if data_root else []
    rm = ["--dataset", "rmnist", "--test-domain", "0", "--clients", "50", "--sample", "5"] + mnist
    pacs = ["--dataset", "pacs", "--data-root", str(pacs_root), "--no-pretrained",
            "--test-domain", "photo"]
    ratios, why = attempt(lambda: round_ratios(setting(fedavg, "fedavg", rm, device, tmp),
                                               ratio_rounds, device, tmp))
    ratios, busy, med = ratios or ({}, {}, {})
    for name, key in (("FedIIR", "fediir"), ("FedIPG", "fedipg")):
        yield target_row(f"{name} round / FedAvg round (RotatedMNIST-50)", key, ratios.get(key))
    yield {"check": "FedOMG round / FedAvg round (RotatedMNIST-50)",
           "measured": ratios.get("fedomg"), "target": "", "ok": None}
    for key in busy:
        check = f"{METHOD_NAMES[key]} round: GPU kernel time / wall ({med[key]:.3f} s)"
        if isinstance(busy[key], str):                  # the profiler failed: why
            yield {"check": check, "measured": busy[key], "target": "", "ok": False}
            continue
        row = target_row(check, "busy", busy[key])
        yield row if key == "fedavg" else {**row, "target": "", "ok": None}
    if why:
        yield {"check": "round ratios", "measured": why, "target": "", "ok": False}
    cost, why = attempt(lambda: compile_cost(setting(fedavg, "fedavg", rm, device, tmp),
                                             ratio_rounds))
    ratio, busy, first, same = cost or (None, None, None, None)
    yield {"check": "FedAvg round --compile / without (RotatedMNIST-50, at once)" +
           (f"; its first round {first:.1f} s" if cost else ""), "measured": why or ratio,
           "target": "", "ok": False if why else None}
    if cost:
        yield target_row("FedAvg round --compile: GPU kernel time / wall", "busy", busy)
        yield {"check": "FedAvg round --compile, twice from one start",
               "measured": "identical" if same else "differs", "target": "identical", "ok": same}
    paper = rm + ["--local-step", "paper"]
    cost, why = attempt(lambda: chunk_cost(setting(fedipg, "fedipg", paper, device, tmp), rounds))
    yield {"check": "FedIPG --local-step paper round: chunks of 2^18 values / of --batch-size",
           "measured": why or cost, "target": "", "ok": False if why else None}
    ratio, why = attempt(lambda: compiled_ratio(rm, device, tmp, ratio_rounds))
    row = target_row("FedIPG round / FedAvg round, both --compile (RotatedMNIST-50)" +
                     (f"; FedIPG's first round {ratio[1]:.1f} s" if ratio else ""), "fedipg",
                     ratio and ratio[0])
    yield {**row, "measured": why, "ok": False} if why else row
    for label, argv, variant in (("ConvNet fp32", rm, None), ("ConvNet bf16", rm + ["--amp"], None),
                                 ("ResNet-18 fp32 NCHW", pacs, "nchw"),
                                 ("ResNet-18 fp32 channels-last", pacs, None),
                                 ("ResNet-18 bf16 channels-last", pacs + ["--amp"], None)):
        def measure():
            args, fed, model, ctx = setting(fedavg, "fedavg", argv, device, tmp)
            if variant == "nchw":
                model = model.to(memory_format=torch.contiguous_format)
                prep = ctx.prep
                ctx = dataclasses.replace(ctx, prep=lambda x, train=False, gen=None:
                                          prep(x, train, gen).contiguous())
            return harness_vs_bare(args, fed, model, ctx, rounds)
        ips, why = attempt(measure)
        row = target_row(f"harness / bare loop, images/s: {label}", "harness",
                         ips and ips["harness"] / ips["bare"])
        if why:
            row.update(measured=why, ok=False)
        else:
            row["check"] += f" ({ips['harness']:,.0f} / {ips['bare']:,.0f})"
        yield row
    for label, argv in (("ConvNet", rm), ("ResNet-18", pacs)):
        cost, why = attempt(lambda: determinism_cost(*setting(fedavg, "fedavg", argv, device, tmp),
                                                     rounds))
        row = target_row(f"FedAvg round deterministic / --nondeterministic: {label}",
                         "determinism", cost)
        yield {**row, "measured": why, "ok": False} if why else row
    # every client in every round both ways (FedIPG's default, Eq. 3): the estimates' own cost.
    # With --sample 5 of 50 the warm-up's all-client rounds (the paper's pre-training phase) cost
    # 10x alone.
    ipg = ["--dataset", "rmnist", "--test-domain", "0", "--clients", "10"] + mnist + \
        ["--rounds", str(ipg_rounds), "--eval-every", "10"]
    ratio, why = attempt(lambda: exit_cost(ipg, device, tmp))
    row = target_row(f"FedIPG --exit auto / --exit off, whole run ({ipg_rounds} rounds)", "exit",
                     ratio)
    yield {**row, "measured": why, "ok": False} if why else row


# ------------------------------------------------------------------------------------ main

def main(argv=None):
    p = Parser(prog="gpu_check.py", description=help_text(__doc__))   # bad input: one line
    p.add_argument("--data-root", default=None, help="full MNIST for RotatedMNIST and RC-MNIST "
                   "(default: the embedded digits); the PACS tree is always generated")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                        "gpu_check.json"))
    p.add_argument("--rounds", type=int, default=10, help="timed rounds of each speed variant")
    p.add_argument("--ratio-rounds", type=int, default=None, help="timed rounds of the method "
                   "round ratios and kernel shares (default: --rounds)")
    p.add_argument("--ipg-rounds", type=int, default=100,
                   help="rounds of the whole FedIPG runs (--exit auto / off)")
    p.add_argument("--checks", nargs="+", default=["runs", "cpu", "speed"],
                   choices=["runs", "cpu", "speed"],
                   help="which of the checks to run, in this order (default: all)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                   help="the methods of the runs and cpu checks (default: all six)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.ipg_rounds < 1 or (a.ratio_rounds is not None and a.ratio_rounds < 1):
        p.error("--rounds, --ratio-rounds and --ipg-rounds must be positive")
    if not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device is visible; the CPU path is checked by pytest",
              file=sys.stderr)
        sys.exit(2)
    about = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "data_root": "full MNIST (--data-root DIR)" if a.data_root else "embedded digits",
             "tolerances": TOL, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
             "streams": "per client"}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "pacs"
        make_fake_tree(tree, classes=("dog", "horse", "house"), per_class=32)
        sections = {"runs": lambda: check_runs(cases(tree, a.data_root, a.methods), "cuda", tmp),
                    "cpu": lambda: check_cpu_gpu(tmp, methods=a.methods),
                    "speed": lambda: check_speed("cuda", tmp, tree, a.data_root, a.rounds,
                                                 a.ipg_rounds, a.ratio_rounds)}
        rows = []
        try:
            with loaded_once():                        # every section's datasets read once
                for name in dict.fromkeys(a.checks):   # in the order given; each row is written
                    print(f"gpu_check on {about['device']}: {name} ...", file=sys.stderr,
                          flush=True)                  # as it comes, so a run cut short keeps
                    for row in sections[name]():       # what it measured
                        rows.append(row)
                        print(format_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
                        write_report(a.out, rows, about)
        except (KeyboardInterrupt, SystemExit) as e:   # Ctrl-C, or a script stopped by a signal
            code = e.code if isinstance(e, SystemExit) else 130
            write_report(a.out, rows, about)
            print(f"gpu_check.py: stopped by {'SIGTERM' if code == 143 else 'SIGINT'}; the "
                  f"{len(rows)} rows measured before it: {a.out}", file=sys.stderr)
            sys.exit(code)
    write_report(a.out, rows, about)
    print(f"{about['device']}, torch {about['torch']}\n\n{format_table(rows)}\n\n"
          f"written: {a.out}")
    sys.exit(0 if all(r["ok"] is not False for r in rows) else 1)


if __name__ == "__main__":
    main()
