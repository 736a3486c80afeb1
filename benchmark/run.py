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
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL = ["fedavg", "fediir", "fedomg", "fedloe", "perinvfl", "fedipg"]


def variants(methods):
    """[(label, script, extra args)] from 'fedavg' or 'label=script --flag value'."""
    out = []
    for m in methods:
        label, _, spec = m.partition("=") if "=" in m else (m, "", m)
        script, *extra = shlex.split(spec)
        if not (ROOT / f"{script}.py").is_file() or not (script in ALL or script.startswith("benchmark/diagnostics/")):
            sys.exit(f"run.py: error: unknown method {script!r}; choose from {', '.join(ALL)} "
                     "(or a script under benchmark/diagnostics/, e.g. benchmark/diagnostics/perinvfl_variants)")
        out.append((label, script, extra))
    return out


def complete(path):
    try:
        return json.loads(path.read_text()).get("complete", False)
    except (OSError, ValueError):
        return False


def visible_gpus():
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def command(script, args):
    """The command of one run (a function of its own so that the tests can put a stand-in here)."""
    return [sys.executable, f"{script}.py", *args]


def run_here(todo, slots):
    """Run [(results path, command)] on this machine, one per slot at a time. A slot is a GPU id, which
    its run alone sees through CUDA_VISIBLE_DEVICES until it ends, or None (the environment as is).
    Output goes to the run's .log. Returns the results paths of the failed runs."""
    free, running, failed = list(slots), [], []
    while todo or running:
        while todo and free:
            (out, cmd), slot = todo.pop(0), free.pop(0)
            env = dict(os.environ, **({} if slot is None else {"CUDA_VISIBLE_DEVICES": slot}))
            print("run", shlex.join(cmd[1:]), "" if slot is None else f"(GPU {slot})", flush=True)
            log = open(out.with_suffix(".log"), "a")
            running.append((out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                            log, slot))
        time.sleep(0.2)
        for item in list(running):
            out, proc, log, slot = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                free.append(slot)                              # the GPU is free only once its run has ended
                print(f"{'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}: {out}", flush=True)
                if proc.returncode:
                    failed.append(out)
    return failed


def slurm_job(cmd, log):
    """What one Slurm job runs: the run's command from the repository root, its output appended to
    the run's .log as the other launchers do; the exit status is the job's result."""
    with open(log, "a") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode


def run_slurm(todo, folder, a):
    """Submit one job per run through submitit (a job array, at most --array-parallelism at once),
    wait for them and return the results paths of the failed ones. submitit's own logs (Slurm's
    stdout / stderr, the pickled job) go to <folder>/slurm. --cluster local runs the same jobs through
    submitit's local executor, to try a sweep on a machine without Slurm."""
    try:
        import cloudpickle
        import submitit
    except ImportError:
        sys.exit("run.py: error: --launcher slurm needs submitit, which is not installed (pip install submitit)")
    # submitit pickles slurm_job; by value, so that the job need not import this file as a module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ex = submitit.AutoExecutor(folder=folder / "slurm", cluster=a.cluster)
    except RuntimeError as e:                                  # no srun on this machine
        sys.exit(f"run.py: error: no Slurm here ({e}); --cluster local runs the jobs on this machine")
    ex.update_parameters(name=f"fl-{folder.name}", timeout_min=a.time, gpus_per_node=a.gpus_per_job,
                         slurm_partition=a.partition, slurm_array_parallelism=a.array_parallelism)
    with ex.batch():                                          # submitted as one array when the block ends
        jobs = [ex.submit(slurm_job, cmd, out.with_suffix(".log")) for out, cmd in todo]
    for (out, cmd), job in zip(todo, jobs):
        print(f"submitted {job.job_id}:", shlex.join(cmd[1:]), flush=True)
    failed = []
    for (out, _), job in zip(todo, jobs):
        try:
            rc = job.result()
        except Exception as e:                                 # killed, timed out, or the node failed
            rc = f"{type(e).__name__}, see {job.paths.stderr}"
        print(f"{'done' if rc == 0 else f'FAILED ({rc})'}: {out}", flush=True)
        if rc != 0:
            failed.append(out)
    return failed


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    common_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--methods", nargs="+", default=["fedavg", "fediir", "fedomg"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--sample", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--out-dir", default="results/benchmark")
    p.add_argument("--tag", default=None, help="subfolder name (default: dataset[-P clients])")
    p.add_argument("--dry-run", action="store_true", help="list the runs that would run, run nothing")
    p.add_argument("--launcher", default="local", choices=["local", "multi_gpu", "slurm"])
    p.add_argument("--jobs", type=int, default=1, help="local: runs at once")
    p.add_argument("--gpus", default=None, help="multi_gpu: GPU ids, one run on each at a time (default: all)")
    s = p.add_argument_group("slurm (through submitit)")
    s.add_argument("--partition", default=None, help="default: the cluster's")
    s.add_argument("--time", type=int, default=240, help="minutes per run")
    s.add_argument("--gpus-per-job", type=int, default=1)
    s.add_argument("--array-parallelism", type=int, default=32, help="runs at once at most")
    s.add_argument("--cluster", default="slurm", choices=["slurm", "local"],
                   help="local: submitit's local executor (the same jobs, on this machine)")
    a = p.parse_args(argv)
    for flag in ("jobs", "time", "array_parallelism"):
        if getattr(a, flag) < 1:
            sys.exit(f"run.py: error: --{flag.replace('_', '-')} must be at least 1")
    if a.gpus_per_job < 0:
        sys.exit("run.py: error: --gpus-per-job must be at least 0")
    if a.gpus is not None and a.launcher != "multi_gpu":
        sys.exit("run.py: error: --gpus is for --launcher multi_gpu")
    if a.launcher == "multi_gpu":
        ids = a.gpus.split(",") if a.gpus is not None else [str(k) for k in range(visible_gpus())]
        if not ids or not all(k.isdigit() for k in ids) or len(set(ids)) < len(ids):
            sys.exit("run.py: error: --launcher multi_gpu needs distinct GPU ids, e.g. --gpus 0,1,2,3 "
                     + (f"(got {a.gpus!r})" if a.gpus is not None else "(no --gpus, and no GPU visible)"))
    shared = ["--dataset", a.dataset] + sum([[f"--{k}", str(v)] for k, v in
                                              (("clients", a.clients), ("sample", a.sample), ("rounds", a.rounds))
                                              if v is not None], []) + common_args
    folder = (Path(a.out_dir) / (a.tag or (a.dataset + (f"-{a.clients}clients" if a.clients else "")))).resolve()
    todo = []
    for label, script, extra in variants(a.methods):
        for seed in a.seeds:
            out = folder / f"{label}-seed{seed}.json"
            if complete(out):
                print(f"skip {out} (complete)")
                continue
            where = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else str(out)  # no local paths in results
            todo.append((out, command(script, shared + extra + ["--seed", str(seed), "--out", where, "--resume"])))
    if a.dry_run:
        for out, cmd in todo:
            print("would run", shlex.join(cmd[1:]))
        print(f"{len(todo)} run(s) to do in {folder}")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if a.launcher == "slurm":
        failed = run_slurm(todo, folder, a) if todo else []
    elif a.launcher == "multi_gpu":
        failed = run_here(todo, ids)
    else:                                   # with several visible GPUs, the runs take turns on them
        n_gpu = visible_gpus()
        failed = run_here(todo, [str(k % n_gpu) if n_gpu > 1 else None for k in range(a.jobs)])
    if failed:
        sys.exit(f"run.py: {len(failed)} run(s) failed; see their .log files")
    print(f"all runs complete in {folder}; report: python benchmark/report.py {folder}")
    return folder


if __name__ == "__main__":
    main()
