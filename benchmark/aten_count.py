"""How many aten operations one communication round of each method executes, counted on the CPU.

On a GPU the MNIST-family models are launch-bound: a round's wall time follows the number of
kernels it launches, not their size. Each aten operation that does work is a kernel there, so
counting a round's operations on the CPU follows that cost without a GPU, and exactly: counted on
one thread (THREADS), a round's count is the same from run to run.

    python benchmark/aten_count.py                      # embedded 5,000 digits, every method
    python benchmark/aten_count.py --data-root DIR      # full MNIST under DIR: the papers' scale
    python benchmark/aten_count.py --methods fedavg fedipg --round 3 --json counts.json
    python benchmark/aten_count.py --data-root DIR --parallel-clients on
        # the sampled clients at once (CUDA's)

Every run is RotatedMNIST-50 (--dataset rmnist --clients 50 --test-domain 0 --device cpu --seed
0) with the method's own rmnist defaults and 5 clients sampled a round, one client after another
(--parallel-clients on: all at once, one vmap per step, as on CUDA by default; a run that cannot
is named and not counted); FedLOE samples none (every client, every communication): its rounds
here are stage 1 communications of one local epoch each (RUNS says what each run is).
The method script's own run (harness.main of its METHOD) runs in this process with its round
wrapped (dataclasses.replace(METHOD, round=...)): round --round (default 2, so that one-time setup
is out) runs under the counter with the run's check of it (harness.runner.checked, counted
apart), evaluation and checkpoints do not, and the run stops right after it.

Counters (--counter):
  profiler  (default) torch.profiler's leaf aten ops: the aten:: events with no aten:: event
            inside them, what each op finally ran down to. A convolution counts as its output's
            allocation (empty, as_strided_, resize_), a linear layer as t's as_strided and addmm's
            expand, bias copy_ and resolve_conj.
  dispatch  a TorchDispatchMode: each aten op as it reaches the dispatcher below autograd
            (aten::convolution once), none of what it calls inside.
Both see the backward pass (checked: as many threshold_backward as ReLUs): on the CPU autograd runs
it in the thread that called backward(), and its engine carries the profiler and the dispatch mode
into any thread it uses. "compute" counts the ops that do work, the kernels of a GPU: not views
(schemas returning an alias of an input) nor allocations and metadata changes (NO_KERNEL); in a
profile, each op that does work while nothing inside it does, so an op that copies an argument
first counts once, as that copy_. The table: method, what was run, the total, × FedAvg's,
compute, × FedAvg's, the ten most frequent ops; then the ten most frequent compute ops. JSON
(--json): every op's count by name, both ways, and each run's resolved arguments.
docs/gpu-and-speed.md.
"""
import collections
import contextlib
import dataclasses
import functools
import importlib
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line)
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import common  # noqa: E402
from harness import runner  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402
from harness.provenance import device_name  # noqa: E402

# Counts are taken on one thread: on more, a parallel cat writes through views (as_strided) that
# add to the leaf count (2 threads: FedAvg +102 on full MNIST, FedIPG +3,077); the compute count
# is the same on any number.
THREADS = 1
SETTING = ["--dataset", "rmnist", "--clients", "50", "--test-domain", "0", "--device", "cpu",
           "--seed", "0"]


def rounds_of(R):
    """The flags that make round R the last of a run, evaluated only after it (so never, as the
    count stops)."""
    return ["--sample", "5", "--rounds", str(R), "--eval-every", str(R)]


def fedloe_rounds(R):
    """FedLOE samples no clients (every one, every communication) and sets its rounds from its
    stages: R communications of stage 1 (Eq. 4, FedAvg with Adam) of one local epoch each, no
    stage 2."""
    return ["--stage1-comms", str(R), "--stage1-epochs", str(R), "--stage2-comms", "0",
            "--eval-every", str(R)]


def clients(a):
    return f"{getattr(a, 'sample', '?')} of {getattr(a, 'clients', '?')} clients"


# label -> (script, its flags for counting round R, what was run: a phrase from the resolved
# arguments)
RUNS = {
    "fedavg": ("fedavg", rounds_of, lambda a: f"{clients(a)}, {a.local_epochs} epoch(s) of SGD, "
                                              f"batch {a.batch_size}"),
    "fediir": ("fediir", rounds_of, lambda a: f"{clients(a)}, {a.local_epochs} epoch(s) of SGD on "
                                              f"CE + γ·IIR (γ {a.gamma}), batch {a.batch_size}"),
    "fedomg": ("fedomg", rounds_of, lambda a: f"{clients(a)}, {a.local_epochs} epoch(s) of SGD, "
                                              f"batch {a.batch_size}, server gradient matching"),
    "fedloe": ("fedloe", fedloe_rounds, lambda a: f"stage 1 (Eq. 4): every client ({a.clients}), "
                                                  f"{a.local_epochs} epoch(s) of Adam, batch "
                                                  f"{a.batch_size}; rounds = stage 1 "
                                                  f"communications"),
    "perinvfl": ("perinvfl", rounds_of, lambda a: f"{clients(a)}, --R {a.R}: a line 8 step (θ_i) "
                                                  f"and a line 9 step (ν) per minibatch, IRMv1 λ "
                                                  f"{a.lam:g}, batch {a.batch_size}"),
    "fedipg-paper": ("fedipg", lambda R: rounds_of(R) + ["--local-step", "paper"],
                     lambda a: f"{clients(a)}, --local-step paper: one full-batch step on Eq. 9 "
                               f"(λ {a.lam:g})"),
    "fedipg-sgd": ("fedipg", lambda R: rounds_of(R) + ["--local-step", "sgd"],
                   lambda a: f"{clients(a)}, --local-step sgd: {a.local_epochs} epoch(s) of SGD "
                             f"on Eq. 9 (λ {a.lam:g}), batch {a.batch_size}"),
}
# Ops that do no work, besides views (found by their schema): allocations, in-place metadata
# changes, no-ops, questions (a dtype, a bool).
NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_",
             "aten::as_strided_", "aten::set_", "aten::detach_", "aten::_unsafe_view",
             "aten::unsqueeze_", "aten::squeeze_", "aten::t_", "aten::transpose_",
             "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::result_type",
             "aten::is_same_size", "aten::_has_compatible_shallow_copy_type",
             "aten::_nnpack_available"}


class Counted(Exception):
    """Raised right after the counted round: stops the method's run there (caught here, never seen
    outside)."""


class DispatchCount(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher below autograd, by name (aten::add_, ...),
    into ops[part]; other namespaces (the optimisers' profiler::_record_function_*) are no
    operations."""

    def __init__(self):
        super().__init__()
        self.ops = {"round": collections.Counter(), "check": collections.Counter()}
        self.part = "check"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.ops[self.part][name] += name.startswith("aten::")
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def round_part(self):
        self.part = "round"
        try:
            yield
        finally:
            self.part = "check"


@functools.lru_cache(maxsize=None)
def idle(name):
    """An op that does no work, so no kernel on a GPU: NO_KERNEL; a view (the schema of every
    overload that returns a tensor, or a list of them, returns aliases of an input: view, t,
    detach, expand, slice, split; also `to` and `contiguous`, which do work only through an op
    inside them, counted there)."""
    if name in NO_KERNEL:
        return True
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    try:
        overloads = [getattr(packet, o) for o in packet.overloads()]
    except (AttributeError, RuntimeError):
        return False
    views = [op for op in overloads
             if [str(r.type) for r in op._schema.returns] in (["Tensor"], ["List[Tensor]"])]
    return bool(views) and all(op.is_view for op in views)


def tally(events):
    """(leaf ops, compute ops) by name from a profiler's events. Leaf: an aten event with no aten
    event inside. Compute: an aten op that does work while nothing inside it does (a convolution
    whose only children are its output's allocation; a copy_ inside a clone, not the clone)."""
    busy = {}

    def works(e):                                   # e, or an op inside it, does work
        if id(e) not in busy:
            busy[id(e)] = (e.name.startswith("aten::") and not idle(e.name)) or \
                any(works(c) for c in e.cpu_children)
        return busy[id(e)]
    leaf, compute = collections.Counter(), collections.Counter()
    for e in events:
        if e.name.startswith("aten::"):
            leaf[e.name] += not any(c.name.startswith("aten::") for c in e.cpu_children)
            compute[e.name] += not idle(e.name) and not any(works(c) for c in e.cpu_children)
    return +leaf, +compute


def subtree(e):
    return [e] + [d for c in e.cpu_children for d in subtree(c)]


@contextlib.contextmanager
def quiet_stderr():
    """Kineto writes a line to file descriptor 2 when a profiler starts and stops (and one error
    without a GPU): dropped, around those calls only."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)


MARK = "aten_count: the method's round"


@contextlib.contextmanager
def counting(counter, out):
    """Counts the aten ops run in the block into out's Counters: "round" those inside the block's
    round_part() (every op the counter sees), "compute" their ones that do work, "check" the
    others (leaf ops)."""
    if counter == "dispatch":
        with DispatchCount() as mode:
            yield mode.round_part
        out["round"].update(+mode.ops["round"])
        out["compute"].update({name: n for name, n in mode.ops["round"].items()
                               if n and not idle(name)})
        out["check"].update(+mode.ops["check"])
        return
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with quiet_stderr():
        prof.__enter__()
    try:
        yield lambda: torch.profiler.record_function(MARK)
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
            roots = [e for e in prof.events() if e.cpu_parent is None]
    # The backward pass runs in this thread, inside the round's mark (on the CPU; on a GPU the
    # engine's device threads would make their own roots, counted as the check's: this counter
    # is for the CPU).
    inside = [d for e in roots if e.name == MARK for d in subtree(e)]
    ops, work = tally(inside)
    out["round"].update(ops)
    out["compute"].update(work)
    out["check"].update(tally([d for e in roots if e.name != MARK for d in subtree(e)])[0])


class Unhooked(Exception):
    """The counted round never ran: the harness calls its rounds another way."""


def nchw(model):
    """The ConvNet as a CUDA run holds it, NCHW: the CPU's channels-last (common.global_model)
    adds CPU-only layout copies (FedIPG --local-step sgd: +276 leaf ops a round on the embedded
    digits, 2026-11-26), and the count stands for a GPU's launches."""
    return model.to(memory_format=torch.contiguous_format)


def counted_round(round_fn, R, counter, out, seen):
    """round_fn (a method's round) as the counted run calls it: rounds other than R as they are;
    round R under the counter (the round's ops told apart by round_part) inside the skeleton's
    check of it, harness.runner.checked, as the run calls it, and then Counted: the run stops
    there. seen["args"]: the run's arguments."""
    @functools.wraps(round_fn)      # (the checkpoint names the method's file: code_files unwraps)
    def counted(t, model, fed, args, state, ctx):
        if t != R:
            return round_fn(t, model, fed, args, state, ctx)
        seen["args"] = args
        with counting(counter, out) as round_part:

            with round_part():      # the method's round, told apart from the skeleton's check
                losses = round_fn(t, model, fed, args, state, ctx)
            runner.checked(t, losses, model, state, fed)
        raise Counted
    return counted


def count(label, data_root=None, R=2, counter="profiler", extra=()):
    """Runs `label`'s script (RUNS) in this process up to round R and counts round R's aten ops:
    {"ops": the round's ops by name, "compute": those that do work, "check": the ops of the
    skeleton's check of the round (harness.runner.checked), "args": the run's
    resolved arguments, "run": what was run, "seconds": the whole run}; `extra`: further flags of
    the script. A script's own error: SystemExit, its line on stderr."""
    script, flags, phrase = RUNS[label]
    method = importlib.import_module(script).METHOD
    seen, out = {}, {k: collections.Counter() for k in ("round", "compute", "check")}
    method = dataclasses.replace(method, round=counted_round(method.round, R, counter, out, seen))
    t0, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*SETTING, *flags(R), *extra, "--out", str(Path(tmp) / f"{label}.json")]
        argv += ["--data-root", str(data_root)] if data_root else []
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                harness.main(method, argv, model_fn=lambda args, ds, device:
                             nchw(common.global_model(args, ds, device)))
        except Counted:
            pass
        finally:
            torch.set_num_threads(threads)
    if "args" not in seen:
        raise Unhooked(f"{label}: round {R} never went through its counted round; nothing "
                       f"was counted")
    args = {k: v for k, v in vars(seen["args"]).items() if k not in ("out", "data_root")}
    try:
        run = phrase(seen["args"])
    except AttributeError:                  # a flag renamed since: the flags say what was run
        run = shlex.join(flags(R) + list(extra))
    return {"ops": out["round"], "compute": out["compute"], "check": out["check"], "args": args,
            "run": run, "seconds": time.perf_counter() - t0}


def table(runs, top=10):
    """Two markdown tables: method, run, total, × FedAvg, compute, × FedAvg, the top ops of the
    total; then the top ops of the compute count (the ops that would be kernels)."""
    ratio = lambda r, key: "—" if r.get(f"{key}_x_fedavg") is None else \
        f"{r[f'{key}_x_fedavg']:.2f}"
    tops = lambda ops: ", ".join(f"{name.removeprefix('aten::')} {n:,}"
                                 for name, n in list(ops.items())[:top])
    lines = ["| method | run | total ops | × FedAvg | compute ops | × FedAvg | top ops |",
             "|---" * 7 + "|"]
    lines += [f"| {label} | {r['run']} | {r['total']:,} | {ratio(r, 'total')} | "
              f"{r['compute']:,} | {ratio(r, 'compute')} | {tops(r['ops'])} |"
              for label, r in runs.items()]
    lines += ["", "| method | top compute ops |", "|---|---|"]
    lines += [f"| {label} | {tops(r['compute_ops'])} |" for label, r in runs.items()]
    return "\n".join(lines)


def cpu_name():
    return device_name(torch.device("cpu"))           # the results' provenance names it so too


def provenance(argv):
    """The commit (and whether tracked files differ from it), date, torch, CPU and the command,
    the data folder written as DIR (a machine's path says nothing to a reader)."""
    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True,
                                    timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        commit = head.stdout.strip() if head.returncode == 0 else None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip()) \
            if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    shown = [("DIR" if i and argv[i - 1] == "--data-root" else a) for i, a in enumerate(argv)]
    return {"command": shlex.join(["python", "benchmark/aten_count.py", *shown]),
            "commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "cpu": cpu_name(), "threads": THREADS}


def parse(argv):
    p = Parser(prog="aten_count.py", description=help_text(__doc__))
    p.add_argument("--data-root", default=None, help="full MNIST for torchvision under this "
                   "folder (default: the embedded 5,000 digits, fast)")
    p.add_argument("--methods", nargs="+", default=list(RUNS), metavar="RUN",
                   help=f"which runs, of {', '.join(RUNS)} (default: all)")
    p.add_argument("--round", type=int, default=2, help="the round counted (default: 2, so that "
                   "what a method does once, before or in its first round, is out)")
    p.add_argument("--counter", default="profiler", choices=["profiler", "dispatch"],
                   help="profiler: torch.profiler's leaf aten ops (default); dispatch: ops below "
                        "autograd")
    p.add_argument("--parallel-clients", default="off", choices=["off", "on"],
                   help="off: one client after another (default); on: all at once, as CUDA runs "
                        "them")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the counts as JSON here")
    args = p.parse_args(argv)
    unknown = [m for m in args.methods if m not in RUNS]
    if unknown:
        p.error(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    if len(set(args.methods)) < len(args.methods):
        p.error("--methods names a run twice")
    if args.round < 1:
        p.error(f"--round must be at least 1, got {args.round}")
    if args.data_root is not None and not Path(args.data_root).is_dir():
        p.error(f"--data-root {args.data_root}: no such folder (full MNIST for torchvision: "
                f"python -m harness.datasets --download mnist --data-root DIR)")
    if args.json is not None:
        out = Path(args.json)
        if args.json == "" or out.is_dir():
            p.error(f"--json {args.json!r}: give a file name")
        try:                                  # writable before any work, not after the counts
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".probe-"):
                pass
        except OSError as e:
            p.error(f"cannot write --json {args.json}: {e.strerror or e}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    runs, made, refused = {}, provenance(argv), {}   # the checkout as the counts begin
    named = any(a == "--methods" or a.startswith("--methods=") for a in argv)
    for label in args.methods:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                r = count(label, args.data_root, args.round, args.counter,
                          ["--parallel-clients", args.parallel_clients])
        except SystemExit as e:           # the script's own error, one line: passed on as ours
            line = (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
            line = line.split(": error: ", 1)[-1]
            if e.code == 2 and (not named or "--parallel-clients on" in line):
                # named, not fatal: by default (all runs) one the data cannot hold (FedLOE on the
                # embedded digits: 50 clients too many); with --parallel-clients on, one that
                # cannot train at once
                refused[label] = line
                print(f"aten_count.py: {label} not counted: {line}", file=sys.stderr, flush=True)
                continue
            print(f"aten_count.py: error: {label}: {line}", file=sys.stderr)
            sys.exit(e.code if isinstance(e.code, int) else 2)
        except Unhooked as e:
            print(f"aten_count.py: error: {e}", file=sys.stderr)
            sys.exit(1)
        runs[label] = {"script": RUNS[label][0], "run": r["run"], "total": r["ops"].total(),
                       "compute": r["compute"].total(), "check": r["check"].total(),
                       "seconds": round(r["seconds"], 1), "ops": dict(r["ops"].most_common()),
                       "compute_ops": dict(r["compute"].most_common()), "args": r["args"]}
        print(f"{label}: {runs[label]['total']:,} ops in round {args.round} (the skeleton's check "
              f"of it: {runs[label]['check']:,} more; {r['seconds']:.0f} s)", file=sys.stderr,
              flush=True)
    base = runs.get("fedavg")
    for r in runs.values():
        for key in ("total", "compute"):
            r[f"{key}_x_fedavg"] = round(r[key] / base[key], 3) if base else None
    data = "full MNIST (--data-root)" if args.data_root else "embedded 5,000 digits"
    how = "the sampled clients at once" if args.parallel_clients == "on" else \
        "one client after another"
    about = {"what": f"aten ops of round {args.round} of each run ({args.counter} counter), "
                     f"RotatedMNIST-50 (test domain 0), {data}, on the CPU, {how}: the method's "
                     f"round function; the skeleton's check of the round (each run's 'check'), "
                     f"evaluation and checkpoints not counted",
             "counter": args.counter, "round": args.round, "data": data,
             "setting": " ".join(SETTING), "parallel_clients": args.parallel_clients,
             "provenance": made, "not_counted": refused}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**about, "runs": runs}, f, indent=1)
    print(f"{about['what']}\n\n{table(runs)}"
          + "".join(f"\n\n{k}: not counted: {v}" for k, v in refused.items()), flush=True)
    return runs


if __name__ == "__main__":
    main()
