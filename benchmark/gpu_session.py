"""Everything the project needs a GPU for, in one command that fits a borrowed GPU's half hour.

    python benchmark/gpu_session.py --data-root DIR --out-dir DIR2 --minutes 25
    python benchmark/gpu_session.py --data-root DIR --out-dir DIR2 --dry-run     # the steps, their minutes

In order, each step only if its estimated minutes fit what is left of --minutes (the last one runs
until the budget and stops cleanly):
  1. tests        pytest -q with CUDA visible (the bit-exact tests run on the CPU and on CUDA)
  2. gpu_check    benchmark/gpu_check.py: every method on CUDA, no host sync in a local step,
                  repeatability, CPU against GPU, speed targets
  3. speed        benchmark/speed.py one client after another against all at once, in the FL setting
                  and on RotatedMNIST-50 (every method that trains its clients at once)
  4. tf32-off     gpu_check's CPU-against-GPU check under NVIDIA_TF32_OVERRIDE=0 (is FedLOE's CPU/GPU
                  difference TF32's?)
  5. leaderboard  benchmark/leaderboard.py --where gpu: the leaderboard's missing GPU cells
                  (resumable); at the budget every run is interrupted after its last checkpoint
Every step's output goes to DIR2/<step>.log, its JSON to DIR2/<step>.json. At the end DIR2 holds
gpu-session-K.tar.gz (each at most 15 MB): the step files and the leaderboard's JSONs, logs and
checkpoints (a checkpoint over 15 MB is left out, and named). A later call with the same DIR2 first
unpacks those archives into the checkout, so its leaderboard step continues where this one stopped;
unpack them by hand (tar -xzf FILE from the repository root) to bring the results home.
Without a CUDA device: one line, exit 2 (--dry-run works anywhere).
"""
import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEADERBOARD = ROOT / "benchmark" / "results" / "leaderboard"
PART = 15 * 2 ** 20          # bytes per archive: what a borrowed machine sends back is at most 16 MB a file
STEPS = [  # name, estimated minutes on one H100, command (DATA and OUT filled in), extra environment
    ("tests", 4, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], {}),
    ("gpu_check", 6, [sys.executable, "benchmark/gpu_check.py", "--data-root", "DATA", "--out", "OUT/gpu_check.json"], {}),
    ("speed-fl", 2, [sys.executable, "benchmark/speed.py", "--setting", "fl", "--data-root", "DATA", "--json",
                     "OUT/speed-fl.json"], {}),
    ("speed-rmnist", 2, [sys.executable, "benchmark/speed.py", "--setting", "rmnist", "--data-root", "DATA", "--json",
                         "OUT/speed-rmnist.json"], {}),
    ("tf32-off", 2, [sys.executable, "benchmark/gpu_check.py", "--checks", "cpu", "--out", "OUT/tf32-off.json"],
     {"NVIDIA_TF32_OVERRIDE": "0"}),
    ("leaderboard", 10, [sys.executable, "benchmark/leaderboard.py", "--data-root", "DATA", "--where", "gpu",
                         "--jobs", "JOBS", "--no-figure"], {}),
]


def fill(cmd, a):
    return [{"DATA": a.data_root, "OUT": str(a.out_dir)}.get(x, x).replace("OUT/", f"{a.out_dir}/")
            .replace("JOBS", str(a.jobs)) for x in cmd]


def unpack(out_dir):
    """Unpack earlier archives of this DIR2 into the checkout (their paths are relative to it)."""
    for f in sorted(out_dir.glob("gpu-session-*.tar.gz")):
        with tarfile.open(f) as t:
            t.extractall(ROOT, filter="data")
        print(f"unpacked {f.name}", flush=True)


def pack(out_dir):
    """The step files and the leaderboard's results into archives of at most PART bytes each."""
    files = [p for p in out_dir.iterdir() if p.suffix in (".json", ".log")]
    files += [p for p in LEADERBOARD.rglob("*") if p.is_file() and p.suffix in (".json", ".log", ".ckpt")]
    for old in out_dir.glob("gpu-session-*.tar.gz"):
        old.unlink()
    parts, size, left_out = [[]], 0, []
    for p in sorted(files, key=lambda p: p.stat().st_size):
        n = p.stat().st_size
        if n > PART:
            left_out.append(p)
            continue
        if size + n > PART and parts[-1]:
            parts.append([])
            size = 0
        parts[-1].append(p)
        size += n
    for k, group in enumerate(parts):
        with tarfile.open(out_dir / f"gpu-session-{k}.tar.gz", "w:gz") as t:
            for p in group:
                t.add(p, arcname=os.path.relpath(p, ROOT) if p.is_relative_to(ROOT) else f"gpu-session/{p.name}")
    for p in left_out:
        print(f"left out of the archive (over {PART >> 20} MB): {p}", flush=True)
    return len(parts)


def run_step(name, cmd, env, out_dir, seconds):
    """Run one step for at most `seconds`; then interrupt it (SIGINT to its process group: every
    method script stops after its last checkpoint) and wait for it to end."""
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **env),
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                return proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpu_session.py", description=__doc__.splitlines()[0])
    p.add_argument("--data-root", required=True, help="full MNIST (python data.py --download mnist --data-root DIR)")
    p.add_argument("--out-dir", required=True, help="step logs and JSONs, and the archives to bring home")
    p.add_argument("--minutes", type=float, default=25, help="the whole budget, packing included")
    p.add_argument("--jobs", type=int, default=12, help="leaderboard runs at once on the GPU")
    p.add_argument("--skip", nargs="*", default=[], choices=[s[0] for s in STEPS], help="steps to leave out")
    p.add_argument("--dry-run", action="store_true", help="list the steps and their estimated minutes, run nothing")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.jobs < 1:
        p.exit(2, "gpu_session.py: error: --minutes and --jobs must be positive\n")
    a.out_dir = Path(a.out_dir).resolve()
    steps = [s for s in STEPS if s[0] not in a.skip]
    if a.dry_run:
        left = a.minutes - 1                                    # a minute for packing
        for name, est, cmd, env in steps:
            fits = "runs" if est <= left or name == "leaderboard" else "skipped (budget)"
            print(f"{name:12s} ~{est:>2d} min  {fits:16s} " + " ".join(f"{k}={v}" for k, v in env.items())
                  + " ".join(fill(cmd, a)).replace(sys.executable, "python"))
            left -= est if fits == "runs" else 0
        return steps
    import torch
    if not torch.cuda.is_available():
        print("gpu_session.py: error: no CUDA device is visible (this command is for a GPU machine; "
              "--dry-run lists its steps anywhere)", file=sys.stderr)
        sys.exit(2)
    if not Path(a.data_root).is_dir():
        p.exit(2, f"gpu_session.py: error: --data-root {a.data_root} is not a folder\n")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    unpack(a.out_dir)
    end = time.monotonic() + 60 * (a.minutes - 1)
    for name, est, cmd, env in steps:
        left = end - time.monotonic()
        if name != "leaderboard" and est * 60 > left:
            print(f"{name}: skipped (~{est} min, {left / 60:.1f} left)", flush=True)
            continue
        t0 = time.monotonic()
        rc = run_step(name, fill(cmd, a), env, a.out_dir, left)
        print(f"{name}: exit {rc} after {(time.monotonic() - t0) / 60:.1f} min (log: {a.out_dir / name}.log)", flush=True)
    n = pack(a.out_dir)
    print(f"packed {n} archive(s) in {a.out_dir}", flush=True)


if __name__ == "__main__":
    main()
