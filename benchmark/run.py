"""Run several methods x seeds on one dataset and scenario, each through its own script with the
same common arguments, so that every method sees identical splits, seeds and model selection.

    python benchmark/run.py --dataset rmnist --clients 50 --seeds 0 1 2
    python benchmark/run.py --dataset rcmnist --methods fedavg perinvfl "perinvfl-ft=perinvfl --personalize ft"
    python benchmark/run.py --dataset rmnist --rounds 5 --jobs 2 -- --eval-every 1

A method is a script name (fedavg, fediir, ...) or `label=script extra args` for a variant. Every
argument after `--` goes to every run. Results go to <out-dir>/<dataset>/<label>-seed<S>.json (and
.log); a run whose JSON says "complete" is skipped, an interrupted one is continued with --resume,
so rerunning the same command finishes an interrupted benchmark. `--jobs N` runs N scripts at once
(with several visible GPUs, job k gets GPU k mod N through CUDA_VISIBLE_DEVICES). Then:

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
        if not (ROOT / f"{script}.py").is_file() or script not in ALL:
            sys.exit(f"run.py: error: unknown method {script!r}; choose from {', '.join(ALL)}")
        out.append((label, script, extra))
    return out


def complete(path):
    try:
        return json.loads(path.read_text()).get("complete", False)
    except (OSError, ValueError):
        return False


def gpus():
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


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
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args(argv)
    if a.jobs < 1:
        sys.exit("run.py: error: --jobs must be at least 1")
    shared = ["--dataset", a.dataset] + sum([[f"--{k}", str(v)] for k, v in
                                              (("clients", a.clients), ("sample", a.sample), ("rounds", a.rounds))
                                              if v is not None], []) + common_args
    folder = (Path(a.out_dir) / (a.tag or (a.dataset + (f"-{a.clients}clients" if a.clients else "")))).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    todo = []
    for label, script, extra in variants(a.methods):
        for seed in a.seeds:
            out = folder / f"{label}-seed{seed}.json"
            if complete(out):
                print(f"skip {out} (complete)")
                continue
            where = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else str(out)  # no local paths in results
            cmd = [sys.executable, f"{script}.py"] + shared + extra + ["--seed", str(seed), "--out", where, "--resume"]
            todo.append((out, cmd))
    n_gpu, running, failed, k = gpus(), [], [], 0
    while todo or running:
        while todo and len(running) < a.jobs:
            out, cmd = todo.pop(0)
            env = dict(os.environ)
            if n_gpu > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(k % n_gpu)
            k += 1
            print("run", shlex.join(cmd[1:]), flush=True)
            log = open(out.with_suffix(".log"), "a")
            running.append((out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))
        time.sleep(0.2)
        for item in list(running):
            out, proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                print(f"{'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}: {out}", flush=True)
                if proc.returncode:
                    failed.append(out)
    if failed:
        sys.exit(f"run.py: {len(failed)} run(s) failed; see their .log files")
    print(f"all runs complete in {folder}; report: python benchmark/report.py {folder}")
    return folder


if __name__ == "__main__":
    main()
