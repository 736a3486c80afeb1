"""Run several methods x seeds on one dataset and scenario, each through its own script with the
same common arguments, so that every method sees identical splits, seeds and model selection.

    python benchmark/run.py --dataset rmnist --clients 50 --seeds 0 1 2
    python benchmark/run.py --dataset rcmnist --methods fedavg perinvfl \
        "perinvfl-ft=benchmark/diagnostics/perinvfl_variants --personalize ft"
    python benchmark/run.py --dataset rmnist --rounds 5 --jobs 2 -- --eval-every 1

A method is a script name (fedavg, fediir, ...) or `label=script extra args` for a variant. Every
argument after `--` goes to every run. Results go to <out-dir>/<dataset>/<label>-seed<S>.json (and
.log); a run whose JSON says "complete" is skipped, an interrupted one is continued with --resume,
so rerunning the same command finishes an interrupted benchmark, whatever the launcher; --dry-run
lists what would run. Launchers (as DomainBed's):

    --launcher local [--jobs N]       N scripts at once on this machine (the default; with several
                                      visible GPUs, slot k of N uses GPU k mod their number)
    --launcher multi_gpu --gpus 0,1   one run per listed GPU at a time, each seeing only its GPU
    --launcher slurm --partition P --time MIN --gpus-per-job G --array-parallelism A
                                      one Slurm job per run through submitit (optional dependency:
                                      pip install submitit), submitit's logs in <folder>/slurm;
                                      --cluster local tries the same jobs on this machine

run.py waits for the runs (rerun it only once a sweep's Slurm jobs have ended: a run still going
would be started twice). Then:

    python benchmark/report.py <out-dir>/<dataset>

Bad input (a missing --dataset, an unknown dataset, method or choice, a bad number, arguments
that a method script refuses) ends with one line on stderr and exit code 2 before any run starts
and before any folder is made: every method's own argument checks run first, in this process.
Ctrl-C (SIGINT) or SIGTERM stops the runs: each gets SIGINT, stops with its last checkpoint
kept, and run.py waits for them, says in one line what it stopped and exits 130 (143 for
SIGTERM); the same command continues. Each complete run's JSON records its label ("label"),
which report.py shows as the run's row.
"""
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C during the imports is one line, exit 130)
import data  # noqa: E402  (data.NAMES, data.UserError: the method scripts' own)
from data import UserError  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser as OneLine, help_text  # noqa: E402

ALL = harness.METHODS                # the method scripts (benchmark/diagnostics' variants besides)
SEED_LIMIT = 2 ** 31             # the method scripts' --seed range (harness.resolve)


class Parser(OneLine):
    """harness.config.Parser whose errors are UserErrors, so that leaderboard.py, which plans its
    run.py commands before it runs any, names the benchmark a refusal comes from (main prints them
    as data.Parser does: one line, exit 2)."""

    def error(self, message):
        raise UserError(message)


class Failed(Exception):
    """Runs ended with an error: exit 1, the message says how many."""


class Interrupted(Exception):
    """SIGINT or SIGTERM came while runs were going and they were stopped: `what` says
    which (exit 128 + signum)."""

    def __init__(self, signum, what):
        super().__init__(f"interrupted ({signal.Signals(signum).name}): {what}; "
                         "rerun the same command to continue "
                         "(complete runs are skipped, the others resume from their checkpoints)")
        self.signum, self.what = signum, what


STOP = []       # the signals received inside a stopping() block
_depth = [0]


@contextlib.contextmanager
def stopping():
    """Inside the block, SIGINT and SIGTERM are only recorded (STOP): the loops that wait on runs
    look at STOP between their polls and stop the runs themselves. A handler that raised instead
    could fall between starting a run and recording it, and leave that run going unsignalled. Blocks
    nest (leaderboard.py around run.py)."""
    # signals reach the main thread only
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _depth[0]:
        STOP.clear()
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, frame: STOP.append(signum))
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        for s, handler in old.items():
            signal.signal(s, handler)


def variants(methods):
    """[(label, script, extra args)] from 'fedavg' or 'label=script --flag value';
    UserError for a spec that names no method script, a label that cannot name a results
    file, or one label twice."""
    out = []
    for m in methods:
        label, _, spec = m.partition("=") if "=" in m else (m, "", m)
        try:
            script, *extra = shlex.split(spec)
        except ValueError as e:
            # an unclosed quote, or nothing after '='
            raise UserError(
                f"method {m!r}: {e if spec.strip() else 'no script after ='}"
            ) from None
        if (not (ROOT / f"{script}.py").is_file()
                or not (script in ALL or script.startswith("benchmark/diagnostics/"))):
            raise UserError(f"unknown method {script!r}; choose from {', '.join(ALL)} "
                            "(or a script under benchmark/diagnostics/, "
                            "e.g. benchmark/diagnostics/perinvfl_variants)")
        if script not in ALL and "METHOD = " not in (ROOT / f"{script}.py").read_text():
            raise UserError(f"{script}.py is not a method script: it does not take the methods' "
                            "--seed, --out and --resume (it declares no METHOD, a common.Method)")
        if extra and "=" not in m:
            raise UserError(f"method {m!r}: give a variant its label, "
                            f"e.g. '{Path(script).name}-x={m}' "
                            "(the label names its results files)")
        if not re.fullmatch(r"[\w.+-]+", label):
            raise UserError(f"label {label!r} of {m!r}: "
                            "a label names results files (<label>-seed<S>.json); "
                            "use letters, digits, '.', '_' and '-'")
        if label in [lab for lab, _, _ in out]:
            raise UserError(f"label {label!r} given twice: both would write {label}-seed<S>.json")
        out.append((label, script, extra))
    return out


# method_args: the data of the checks, by what data.load reads (one load for every variant)
LOADED = {}


def method_args(script, args):
    """(the script's resolved arguments, None) for the command line `args`, or (None, its refusal:
    the one line it prints, less 'NAME.py: error: '): harness.resolve of its METHOD (the parsing,
    the dataset's defaults and checks and the method's own), then the data loaded and the held-out
    domains and client counts checked against it (common.after_load), all that a method
    checks before its first round; nothing is trained or written."""
    from common import after_load, load_data
    module = importlib.import_module(script.replace("/", "."))   # benchmark.diagnostics.<name>
    err = io.StringIO()
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(err):
            a = harness.resolve(module.METHOD, [*args, "--out", str(Path(tmp) / "check.json")])
            key = (a.dataset, a.data_root, a.seed, a.clients or 100, a.alpha, a.p_test, a.stain,
                   not a.no_rotation)
            if key not in LOADED:
                LOADED[key] = load_data(a)
            after_load(a, LOADED[key])
        return a, None
    except UserError as e:
        return None, str(e)
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        if e.code == 0:                                          # --help
            return None, "prints its help and runs nothing"
        return None, (lines[-1].split(": error: ", 1)[-1] if lines else f"exit {e.code}")


NOT_SETTINGS = ("out", "resume", "overwrite", "allow_code_change", "checkpoint_minutes",
                "data_root", "seed")


def differing(resolved, done):
    """The settings (flag: the complete run's value -> this command's) in which a complete run's
    recorded arguments `done` differ from this command's resolved ones."""
    now = {k: v for k, v in vars(resolved).items() if k not in NOT_SETTINGS}
    was = {k: v for k, v in done.items() if k not in NOT_SETTINGS}
    return [f"--{k.replace('_', '-')} {was.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(now) | set(was))
            if now.get(k) != was.get(k)]


def visible_gpus():
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def command(script, args):
    """The command of one run (a function of its own so that the tests can put a stand-in here)."""
    return [sys.executable, f"{script}.py", *args]


def record_label(out, label):
    """The run's label into its complete results (report.py shows a run under it, whatever its file
    is named later); read and written back whole, atomically, once the run has ended."""
    try:
        r = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        return
    if label is None:
        return
    if isinstance(r, dict) and r.get("complete") and r.get("label") != label:
        tmp = Path(f"{out}.label.tmp")
        tmp.write_text(json.dumps(dict(r, label=label), indent=1))
        os.replace(tmp, out)


def names(outs, most=4):
    """'fedavg-seed0, fedavg-seed1' (at most `most`, then how many more)."""
    stems = [Path(o).stem for o in outs]
    return ", ".join(stems[:most]) + (f" and {len(stems) - most} more" if len(stems) > most else "")


def stopped(signum, ended, left):
    """Interrupted, saying what the stop did: ended [(results path, exit status)] of the runs that
    were going, left: the runs not started."""
    ends = (130, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL)
    by = {"stopped": [o for o, rc in ended if rc in ends],
          "finished meanwhile": [o for o, rc in ended if rc == 0]}
    by["failed"] = [o for o, rc in ended if rc not in ends and rc != 0]
    parts = [f"{k} {len(v)} run(s) ({names(v)})" for k, v in by.items() if v]
    kept = sum(outputs.Files(o).ckpt.is_file() for o in by["stopped"])
    if by["stopped"]:
        parts[0] += f", {kept} with a checkpoint to resume from"
    parts += [f"{len(left)} not started"] if left else []
    return Interrupted(signum, "; ".join(parts) or "no run was going")


def stop(running, left):
    """End every run still going, then wait for each; a further signal meanwhile kills those left (a
    checkpoint is written to a temporary file and renamed, so a kill leaves the last one whole). A
    run that has printed to its log is inside its method's main, which stops on SIGINT at once with
    its last checkpoint kept (exit 130); one that has printed nothing yet may still be importing,
    where a SIGINT would end it with a traceback in its log, and has nothing to keep: it gets
    SIGTERM. Raises Interrupted."""
    signum, ended = STOP[0], []
    for out, proc, log, _, start in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT if os.path.getsize(log.name) > start else signal.SIGTERM)
    asked = len(STOP)
    for out, proc, log, _, _ in running:
        while proc.poll() is None:
            if len(STOP) > asked:
                proc.kill()
            time.sleep(0.05)
        log.close()
        if proc.returncode == 0:
            record_label(out, label_of.get(out))
        ended.append((out, proc.returncode))
    raise stopped(signum, ended, [out for out, _ in left])


label_of = {}    # results path -> the run's label (record_label, once a run is complete)


def run_here(todo, slots):
    """Run [(results path, command)] on this machine, one per slot at a time. A slot is a GPU id,
    which its run alone sees through CUDA_VISIBLE_DEVICES until it ends, or None (the environment as
    is). Output goes to the run's .log. Returns the results paths of the failed runs; a signal
    (STOP) stops the runs (stop). Each run has a session of its own, so that a Ctrl-C at the
    terminal reaches run.py alone, which passes it on once to each run (a run that got it twice,
    from the terminal and from run.py, could be cut short inside its own handler)."""
    free, running, failed, todo = list(slots), [], [], list(todo)
    with stopping():
        while (todo or running) and not STOP:
            while todo and free and not STOP:
                (out, cmd), slot = todo.pop(0), free.pop(0)
                env = dict(os.environ, **({} if slot is None else {"CUDA_VISIBLE_DEVICES": slot}))
                print("run", shlex.join(cmd[1:]), "" if slot is None else f"(GPU {slot})",
                      flush=True)
                log = open(out.with_suffix(".log"), "a")
                running.append((out,
                                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                 env=env, cwd=ROOT, start_new_session=True),
                                log, slot, log.tell()))
            time.sleep(0.2)
            for item in list(running):
                out, proc, log, slot, _ = item
                if proc.poll() is not None:
                    running.remove(item)
                    log.close()
                    # the GPU is free only once its run has ended
                    free.append(slot)
                    print(
                        f"{'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}"
                        f": {out}",
                        flush=True)
                    if proc.returncode:
                        failed.append(out)
                    else:
                        record_label(out, label_of.get(out))
        if STOP:
            stop(running, todo)
    return failed


def slurm_job(cmd, log, label):
    """What one Slurm job runs: the run's command from the repository root, its output appended to
    the run's .log as the other launchers do; the exit status is the job's result. A
    SIGTERM or SIGINT to the job (a cancel) is passed on to the run as SIGINT, and the
    job waits for it to stop."""
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGINT))
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            rc = proc.wait()
    if rc == 0:
        record_label(Path(log).with_suffix(".json"), label)
    return rc


def submitit_modules():
    """(cloudpickle, submitit), or UserError before anything is made:
    --launcher slurm needs submitit."""
    try:
        import cloudpickle
        import submitit
    except ImportError:
        raise UserError(
            "--launcher slurm needs submitit, which is not installed (pip install submitit)"
        ) from None
    return cloudpickle, submitit


def run_slurm(todo, folder, a):
    """Submit one job per run through submitit (a job array, at most --array-parallelism at once),
    wait for them and return the results paths of the failed ones. submitit's own logs (Slurm's
    stdout / stderr, the pickled job) go to <folder>/slurm. --cluster local runs the same jobs
    through submitit's local executor, to try a sweep on a machine without Slurm. A signal (STOP)
    cancels the jobs not ended and waits up to a minute for them: on Slurm submitit's cancel
    (scancel: SIGTERM to the job's processes, the run's too, which ends it at once, its last
    checkpoint whole), with --cluster local a SIGTERM to submitit's job process, which passes it on
    to the job (slurm_job: SIGINT to the run)."""
    cloudpickle, submitit = submitit_modules()
    # submitit pickles slurm_job; by value, so that the job need not import this file as a module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ex = submitit.AutoExecutor(folder=folder / "slurm", cluster=a.cluster)
    except RuntimeError as e:                                  # no srun on this machine
        raise UserError(
            f"no Slurm here ({e}); --cluster local runs the jobs on this machine"
        ) from None
    ex.update_parameters(name=f"fl-{folder.name}", timeout_min=a.time,
                         gpus_per_node=a.gpus_per_job, slurm_partition=a.partition,
                         slurm_array_parallelism=a.array_parallelism)
    with stopping():
        # submitted as one array when the block ends
        with ex.batch():
            jobs = [ex.submit(slurm_job, cmd, out.with_suffix(".log"), label_of.get(out))
                    for out, cmd in todo]
        for (out, cmd), job in zip(todo, jobs):
            print(f"submitted {job.job_id}:", shlex.join(cmd[1:]), flush=True)
        waiting, failed = list(zip(todo, jobs)), []
        while waiting and not STOP:
            time.sleep(0.5)
            for item in [w for w in waiting if w[1].done()]:
                waiting.remove(item)
                (out, _), job = item
                try:
                    rc = job.result()
                except Exception as e:
                    # killed, timed out, or the node failed
                    rc = f"{type(e).__name__}, see {job.paths.stderr}"
                print(f"{'done' if rc == 0 else f'FAILED ({rc})'}: {out}", flush=True)
                if rc != 0:
                    failed.append(out)
        if STOP:
            for _, job in waiting:
                if a.cluster == "local":
                    # submitit's local cancel is a SIGINT, which its job process answers with a
                    # traceback on our stderr
                    job._process.send_signal(signal.SIGTERM)
                else:
                    job.cancel(check=False)
            deadline = time.time() + 60
            while time.time() < deadline and not all(job.done() for _, job in waiting):
                time.sleep(0.5)
            raise stopped(STOP[0], [(out, 130) for (out, _), _ in waiting], [])
    return failed


def plan(argv):
    """Everything checked and nothing made: (the arguments, the results folder, the runs to do
    [(results path, command)], the complete runs skipped). UserError for bad input."""
    argv = list(argv)
    common_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = Parser(prog="run.py", description=help_text(__doc__))
    p.add_argument("--dataset", required=True, help=f"one of {', '.join(data.NAMES)}")
    p.add_argument("--methods", nargs="+", default=["fedavg", "fediir", "fedomg"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--sample", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--out-dir", default="results/benchmark")
    p.add_argument("--tag", default=None, help="subfolder name (default: dataset[-P clients])")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs that would run, run nothing")
    p.add_argument("--launcher", default="local", choices=["local", "multi_gpu", "slurm"])
    p.add_argument("--jobs", type=int, default=1, help="local: runs at once")
    p.add_argument("--gpus", default=None,
                   help="multi_gpu: GPU ids, one run on each at a time (default: all)")
    s = p.add_argument_group("slurm (through submitit)")
    s.add_argument("--partition", default=None, help="default: the cluster's")
    s.add_argument("--time", type=int, default=240, help="minutes per run")
    s.add_argument("--gpus-per-job", type=int, default=1)
    s.add_argument("--array-parallelism", type=int, default=32, help="runs at once at most")
    s.add_argument("--cluster", default="slurm", choices=["slurm", "local"],
                   help="local: submitit's local executor (the same jobs, on this machine)")
    a = p.parse_args(argv)
    if a.dataset not in data.NAMES:
        raise UserError(f"unknown dataset {a.dataset!r}; choose from {', '.join(data.NAMES)}")
    for flag in ("jobs", "time", "array_parallelism"):
        if getattr(a, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, "
                            f"got {getattr(a, flag)}")
    if a.gpus_per_job < 0:
        raise UserError(f"--gpus-per-job must be at least 0, got {a.gpus_per_job}")
    bad = [s for s in a.seeds if not 0 <= s < SEED_LIMIT]
    if bad or len(set(a.seeds)) < len(a.seeds):
        raise UserError(f"--seed {bad[0]} is out of the methods' range [0, 2**31)" if bad else
                        f"--seeds {' '.join(map(str, a.seeds))}: "
                        "a seed twice (its runs would write one file)")
    if a.tag is not None and not re.fullmatch(r"[\w.+-]+", a.tag):
        raise UserError(f"--tag {a.tag!r} names one folder: "
                        "use letters, digits, '.', '_' and '-'")
    if a.gpus is not None and a.launcher != "multi_gpu":
        raise UserError("--gpus is for --launcher multi_gpu")
    ids = None
    if a.launcher == "multi_gpu":
        ids = (a.gpus.split(",") if a.gpus is not None
               else [str(k) for k in range(visible_gpus())])
        if not ids or not all(k.isdigit() for k in ids) or len(set(ids)) < len(ids):
            raise UserError("--launcher multi_gpu needs distinct GPU ids, e.g. --gpus 0,1,2,3 "
                            + (f"(got {a.gpus!r})" if a.gpus is not None
                               else "(no --gpus, and no GPU visible)"))
    a.slots = ids
    if a.launcher == "slurm":
        submitit_modules()
    folder = (Path(a.out_dir)
              / (a.tag or (a.dataset + (f"-{a.clients}clients" if a.clients else "")))).resolve()
    above = next(q for q in [folder, *folder.parents] if q.exists())
    # a file made and gone: the folder itself is made only to run
    try:
        if not above.is_dir():
            raise NotADirectoryError(20, "not a folder")
        with tempfile.NamedTemporaryFile(dir=above, prefix=".probe-"):
            pass
    except OSError as e:
        raise UserError(f"--out-dir {a.out_dir}: {above} is not a folder this user can write in "
                        f"({e.strerror})") from None
    shared = ["--dataset", a.dataset] + sum([[f"--{k}", str(v)] for k, v in
                                              (("clients", a.clients), ("sample", a.sample),
                                               ("rounds", a.rounds))
                                              if v is not None], []) + common_args
    todo, skipped = [], []
    LOADED.clear()
    for label, script, extra in variants(a.methods):
        resolved, refusal = method_args(script, shared + extra + ["--seed", str(a.seeds[0])])
        if refusal:
            raise UserError(f"{label} ({script}.py): {refusal}")
        for seed in a.seeds:
            out = folder / f"{label}-seed{seed}.json"
            label_of[out] = label
            files = outputs.Files(out)
            # a user's file where a run would write
            outputs.refuse_foreign(files)
            if outputs.complete(out):
                differ = differing(resolved, outputs.read_result(out)["args"])
                if differ:
                    raise UserError(f"{out} is complete with other settings "
                                    f"({', '.join(differ[:4])}"
                                    f"{f' and {len(differ) - 4} more' if len(differ) > 4 else ''}"
                                    "): give another --tag or --out-dir, or move it away")
                skipped.append(out)
                continue
            if outputs.read_result(out) is not None and not files.ckpt.exists():
                raise UserError(f"{out} is an unfinished run whose checkpoint {files.ckpt} "
                                f"is gone: move it away to run it again, "
                                f"or give another --tag or --out-dir")
            # no local paths in results
            where = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else str(out)
            # an interrupted run: continued
            resume = ["--resume"] if files.ckpt.exists() else []
            todo.append((out, command(script, shared + extra
                                      + ["--seed", str(seed), "--out", where, *resume])))
    LOADED.clear()                          # the runs load their own
    return a, folder, todo, skipped


def execute(a, folder, todo, skipped):
    """Make the folder and run the planned runs with a.launcher. Failed: a run failed; Interrupted:
    a signal stopped them."""
    for out in skipped:
        print(f"skip {out} (complete)")
    folder.mkdir(parents=True, exist_ok=True)
    if a.launcher == "slurm":
        failed = run_slurm(todo, folder, a) if todo else []
    elif a.launcher == "multi_gpu":
        failed = run_here(todo, a.slots)
    else:                                   # with several visible GPUs, the runs take turns on them
        n_gpu = visible_gpus()
        failed = run_here(todo, [str(k % n_gpu) if n_gpu > 1 else None for k in range(a.jobs)])
    if failed:
        raise Failed(f"{len(failed)} run(s) failed; see their .log files")
    print(f"all runs complete in {folder}; report: python benchmark/report.py {folder}")
    return folder


def main(argv=None):
    """The command line: bad input -> one line, exit 2; a failed run -> exit 1; a signal ->
    one line, 128 + signum."""
    try:
        a, folder, todo, skipped = plan(sys.argv[1:] if argv is None else argv)
        if a.dry_run:
            for out in skipped:
                print(f"skip {out} (complete)")
            for out, cmd in todo:
                print("would run", shlex.join(cmd[1:]))
            print(f"{len(todo)} run(s) to do in {folder}")
            return folder
        return execute(a, folder, todo, skipped)
    except UserError as e:
        print(f"run.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Failed as e:
        print(f"run.py: {e}", file=sys.stderr)
        sys.exit(1)
    except Interrupted as e:
        print(f"run.py: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        # before any run started (the checks, or the imports they need)
        print("run.py: interrupted before any run started", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
