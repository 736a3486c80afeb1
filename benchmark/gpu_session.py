"""Everything the project needs a GPU for, in one command that fits a borrowed GPU's lease \
(15 minutes of
device time in all, at most 10 a command): by default 9 minutes, packing included.

    python benchmark/gpu_session.py --data-root DIR --out-dir DIR2                # 9 minutes
    # the steps, caps, sources
    python benchmark/gpu_session.py --data-root DIR --out-dir DIR2 --dry-run

In order (STEPS), each with a hard cap, its estimate; each estimate's source is named beside it in
STEPS and printed by --dry-run:
  1. tests        pytest -q (-n 8 where pytest-xdist is importable) with CUDA visible: the bit-exact
                  tests run on the CPU and on CUDA
  2. gpu_check    benchmark/gpu_check.py --rounds 3 --ratio-rounds 10 --ipg-rounds 5
                  --checks cpu speed runs: CPU against GPU, speed targets (the method rounds' ratios
                  over 10 rounds: 3 left FedIPG's unsettled), then every method on CUDA (no host
                  sync in a local step, repeatable) until its cap; each row is kept as it is
                  measured
  3. speed-rmnist benchmark/speed.py --setting rmnist: one client after another against all at once,
                  and every method's round, on RotatedMNIST-50
  4. speed-fl     benchmark/speed.py --setting fl --rounds 1: the same in FedOMG's FL setting
  5. leaderboard  benchmark/leaderboard.py --where gpu: the leaderboard's missing GPU cells
                  (resumable), for whatever time is left
At its cap a step gets SIGINT (to its process group: pytest stops, the leaderboard's runs stop after
their round and its checkpoint), and SIGKILL (its group and every process below it) GRACE seconds
later (LEADERBOARD_GRACE for the leaderboard). A step runs only if its cap, its grace and REAP fit
what is left before packing (PACK seconds at the end); one that does not is skipped with one line;
the leaderboard's cap is what is left. So the command ends within --minutes.
Every step's output goes to DIR2/<step>.log, its JSON to DIR2/<step>.json, this command's own lines
to DIR2/gpu_session.log. At the end DIR2 holds one archive, gpu-session.tar.gz, of at most 15 MiB
(what a borrowed machine sends back is at most 16 MiB a file): the step logs and JSONs first, then
the leaderboard's JSONs and logs, then its checkpoints, smallest first, each while it fits; every
file left out is named in one line and in gpu-session/left-out.txt inside the archive. A later call
with the same DIR2 first unpacks its archive (or an earlier version's gpu-session-K.tar.gz parts)
into the checkout, so its leaderboard step continues where this one stopped; to bring the results
home, unpack it from the repository root (tar -xzf DIR2/gpu-session.tar.gz).
Bad input: one line, exit 2, before any work; without a CUDA device (and without --dry-run): one
line, exit 2. Ctrl-C or SIGTERM: the running step is stopped as at its cap (a second signal kills
it at once), what exists is packed, exit 130 / 143.
"""
import collections
import gzip
import importlib.util
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
from harness.config import finite, Parser, help_text  # noqa: E402

LEADERBOARD = ROOT / "benchmark" / "results" / "leaderboard"
ARCHIVE = "gpu-session.tar.gz"
# bytes in the archive: what a borrowed machine sends back is at most 16 MiB a file
LIMIT = 15 * 2 ** 20
# bytes of left-out.txt at most (longer: cut, with the number of the others)
LEFT_MAX = 4096
GRACE, LEADERBOARD_GRACE = 5, 30   # seconds from a step's SIGINT to its SIGKILL
REAP = 2                     # seconds to wait for a killed step to be reaped
PACK = 20                    # seconds kept for packing at the end
MIN_CAP = 10                 # seconds: a step with less is not started
MAX_MINUTES = 10             # what one command may run on a borrowed machine

Step = collections.namedtuple("Step", "name cap source cmd")   # cap in seconds (None: what is left)
STEPS = [  # DATA, OUT and JOBS are filled in; XDIST becomes -n 8 where pytest-xdist is importable
    Step("tests", 140,
         "measured: 96 and 108 s with pytest -q -n 8, 620 tests (H100, torch 2.11.0+cu130, "
         "2026-11-26); cap 1.3x the longer; without xdist unmeasured", [
             "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "XDIST"]),
    Step("gpu_check", 185,
         "measured: CPU against GPU, speed and 12 of the 48 runs filled a 190 s cap "
         "(H100, 2026-11-26; the runs since lighter: 5 of 50 clients, each dataset loaded once; "
         "the speed rows since heavier by --compile's FedAvg and FedIPG rounds, whose compiling "
         "is unmeasured on a GPU: 33 s and 32 s on the 2-core CPU); the runs left are cut at the "
         "cap, each row kept as it is measured", [
             "benchmark/gpu_check.py", "--data-root", "DATA", "--rounds", "3",
             "--ratio-rounds", "10", "--ipg-rounds", "5", "--checks", "cpu", "speed", "runs",
             "--out", "OUT/gpu_check.json"]),
    Step("speed-rmnist", 45,
         "measured: 31 s with 6 timed rounds (H100, 2026-11-26); cap 1.45x that", [
             "benchmark/speed.py", "--setting", "rmnist", "--data-root", "DATA", "--rounds", "6",
             "--json", "OUT/speed-rmnist.json"]),
    Step("speed-fl", 75,
         "measured: 56 s with its 1 timed round (H100, 2026-11-26; 2 rounds did not finish "
         "in 80 s); cap 1.3x that", [
             "benchmark/speed.py", "--setting", "fl", "--data-root", "DATA", "--rounds", "1",
             "--json", "OUT/speed-fl.json"]),
    Step("leaderboard", None,
         "what is left before packing (the runs resume from their checkpoints)", [
             "benchmark/leaderboard.py", "--data-root", "DATA", "--where", "gpu", "--jobs", "JOBS",
             "--no-figure"]),
]
STOP = []                    # the signals this command received (SIGINT, SIGTERM)


def grace(name):
    return LEADERBOARD_GRACE if name == "leaderboard" else GRACE


def fill(cmd, a):
    """The step's command line, run from the repository root."""
    xdist = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    out = [sys.executable]
    for x in cmd:
        out += xdist if x == "XDIST" else [{"DATA": str(a.data_root), "JOBS": str(a.jobs)}.get(x, x)
                                           .replace("OUT/", f"{a.out_dir}/")]
    return out


def needs(step):
    """Seconds a step needs before packing: its cap (the leaderboard: MIN_CAP), its grace and
    REAP."""
    return (step.cap or MIN_CAP) + grace(step.name) + REAP


def cap_for(step, left):
    """The cap (seconds) the step runs with when `left` seconds remain before packing, or None: it
    does not fit (its cap, its grace and REAP)."""
    cap = left - grace(step.name) - REAP if step.cap is None else step.cap
    return cap if cap >= MIN_CAP and cap + grace(step.name) + REAP <= left else None


def descendants(pid):
    """Every process below `pid`, in any session (Linux /proc; elsewhere none)."""
    children = collections.defaultdict(list)
    try:
        entries = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for d in entries:
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children[ppid].append(int(d))
    found, todo = [], [pid]
    while todo:
        for c in children[todo.pop()]:
            found.append(c)
            todo.append(c)
    return found


def kill_tree(pid):
    """SIGKILL the process group `pid` and every process below it (the leaderboard's runs have
    sessions of their own): the group is stopped first, so that it starts no process meanwhile."""
    def group(sig):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    group(signal.SIGSTOP)
    below = descendants(pid)
    group(signal.SIGKILL)
    for p in below:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def default_sigint():
    """In a step's process before it runs: SIGINT's default action. main's own handlers give the
    steps that anyway (exec resets a caught signal); run_step called without them, from a process
    that ignores SIGINT (a background job of a non-interactive shell, say), would pass the ignoring
    on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(name, cmd, out_dir, cap, grace_s=GRACE, env=None):
    """Run one step, its output in out_dir/<name>.log; at `cap` seconds (or at a signal to this
    command) SIGINT to its process group, SIGKILL (kill_tree) grace_s seconds later (at once at a
    second signal). Returns (exit status, how it ended: "" on its own, else what stopped it)."""
    with open(Path(out_dir) / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, preexec_fn=default_sigint)
        t0, asked, signals, how = time.monotonic(), None, len(STOP), ""
        while proc.poll() is None:
            now = time.monotonic()
            if asked is None and (now - t0 >= cap or len(STOP) > signals):
                asked, signals = now, len(STOP)
                how = f"SIGINT at its cap ({cap / 60:.2f} min)" if not STOP else \
                    f"SIGINT ({signal.Signals(STOP[0]).name} to gpu_session.py)"
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            elif asked is not None and (now - asked >= grace_s or len(STOP) > signals):
                kill_tree(proc.pid)
                how += f", SIGKILL {now - asked:.0f} s later"
                try:
                    proc.wait(timeout=REAP)
                except subprocess.TimeoutExpired:
                    how += f", not reaped {REAP} s later"
                break
            time.sleep(0.05)
        return proc.returncode, how


def unpack(out_dir):
    """Unpack the archive of an earlier call with this DIR2 into the checkout (its paths are
    relative to it): an earlier version's parts gpu-session-K.tar.gz first, then
    gpu-session.tar.gz."""
    parts = sorted(out_dir.glob("gpu-session-*.tar.gz"), key=lambda f: (len(f.name), f.name))
    for f in parts + [f for f in [out_dir / ARCHIVE] if f.is_file()]:
        with tarfile.open(f) as t:
            t.extractall(ROOT, filter="data")
        print(f"unpacked {f.name}", flush=True)


def bound(n, arcname):
    """The most one member of n bytes can add to the archive: its tar header(s) (a long name takes a
    pax header), its data padded to 512, deflate's worst case (stored blocks) and a sync flush."""
    raw = 3 * 512 + 2 * len(arcname.encode()) + -(-n // 512) * 512
    return raw + raw // 1000 + 64


# the tar's end blocks and record padding, gzip's trailer
END = 10240 + 1024 + (10240 + 1024) // 1000 + 64 + 8


def pack(out_dir, until=None):
    """One archive out_dir/gpu-session.tar.gz of at most LIMIT bytes: out_dir's logs and JSONs, then
    the leaderboard's JSONs and logs, then its checkpoints, each group smallest first, each file
    while it fits (and while time.monotonic() < until); the others are named, one line each and in
    gpu-session/left-out.txt. Replaces the archives of an earlier call. Returns the files left
    out."""
    def arcname(p):
        return os.path.relpath(p, ROOT) if p.is_relative_to(ROOT) else f"gpu-session/{p.name}"
    board = [p for p in LEADERBOARD.rglob("*") if p.is_file()] if LEADERBOARD.is_dir() else []
    groups = [[p for p in out_dir.iterdir() if p.is_file() and p.suffix in (".json", ".log")],
              [p for p in board if p.suffix in (".json", ".log")],
              [p for p in board if p.suffix == ".ckpt"]]
    reserve = END + bound(LEFT_MAX, "gpu-session/left-out.txt")
    tmp, left_out = out_dir / (ARCHIVE + ".part"), []
    with open(tmp, "wb") as raw:
        gz = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0)
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as t:
            for group in groups:
                for p in sorted(group, key=lambda p: (p.stat().st_size, str(p))):
                    name, n = arcname(p), p.stat().st_size
                    if until is not None and time.monotonic() >= until:
                        left_out.append((p, "no time left to pack it"))
                    elif raw.tell() + bound(n, name) + reserve > LIMIT:
                        left_out.append((p, f"{n:,} bytes: more than is left of the archive's "
                                            f"{LIMIT:,}"))
                    else:
                        # as read now: a file that changes cannot break the archive
                        body = p.read_bytes()
                        info = t.gettarinfo(p, name)
                        # (a float mtime: a pax header)
                        info.size, info.mtime = len(body), int(info.mtime)
                        t.addfile(info, io.BytesIO(body))
                        gz.flush()                               # raw.tell() is now what is written
            text = "".join(f"{arcname(p)}: {why}\n" for p, why in left_out)
            if len(text.encode()) > LEFT_MAX:
                text = text.encode()[:LEFT_MAX - 64].decode(errors="ignore").rsplit("\n", 1)[0] + \
                    f"\n... {len(left_out)} files left out in all\n"
            info = tarfile.TarInfo("gpu-session/left-out.txt")
            info.size, info.mtime = len(text.encode()), int(time.time())
            t.addfile(info, io.BytesIO(text.encode()))
        gz.close()
    os.replace(tmp, out_dir / ARCHIVE)
    for old in out_dir.glob("gpu-session-*.tar.gz"):
        old.unlink()
    for p, why in left_out:
        print(f"left out of {ARCHIVE}: {arcname(p)} ({why})", flush=True)
    return [p for p, _ in left_out]


def plan(steps, seconds):
    """The dry run's schedule: each step as if it ran to its cap and its grace."""
    left, out = seconds - PACK, []
    for s in steps:
        cap = cap_for(s, left)
        out.append((s, cap, left))
        left -= cap + grace(s.name) + REAP if cap else 0
    return out


def main(argv=None):
    p = Parser(prog="gpu_session.py", description=help_text(__doc__))
    p.add_argument("--data-root", required=True,
                   help="full MNIST (python -m harness.datasets --download mnist --data-root DIR)")
    p.add_argument("--out-dir", required=True,
                   help="step logs and JSONs, and the archive to bring home")
    p.add_argument("--minutes", type=finite, default=9,
                   help=f"the whole command, packing included "
                        f"(at most {MAX_MINUTES}: one command's limit)")
    p.add_argument("--jobs", type=int, default=12, help="leaderboard runs at once on the GPU")
    p.add_argument("--skip", nargs="+", default=[], choices=[s.name for s in STEPS],
                   help="steps to leave out")
    p.add_argument("--dry-run", action="store_true",
                   help="list the steps, their caps and the caps' sources; run nothing")
    a = p.parse_args(argv)
    if not 0 < a.minutes <= MAX_MINUTES:
        p.error(f"--minutes must be above 0 and at most {MAX_MINUTES}, got {a.minutes:g}")
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, got {a.jobs}")
    start = time.monotonic()
    a.out_dir, a.data_root = Path(a.out_dir).resolve(), Path(a.data_root).resolve()
    steps = [s for s in STEPS if s.name not in a.skip]
    if a.dry_run:
        return dry_run(steps, a)
    import torch
    if not torch.cuda.is_available():
        print("gpu_session.py: error: no CUDA device is visible "
              "(this command is for a GPU machine; --dry-run lists its steps anywhere)",
              file=sys.stderr)
        sys.exit(2)
    if not a.data_root.is_dir():
        p.error(f"--data-root {a.data_root} is not a folder")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    STOP.clear()
    handlers = {s: signal.signal(s, lambda signum, frame: STOP.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        session(a, steps, start, start + 60 * a.minutes)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    if STOP:
        sys.exit(128 + STOP[0])


def session(a, steps, start, end):
    """Unpack, the steps in order within their caps, then pack; ends by `end` (time.monotonic())."""
    own = open(a.out_dir / "gpu_session.log", "w")

    def say(line):
        print(line, flush=True)
        own.write(line + "\n")
        own.flush()
    unpack(a.out_dir)
    for s in steps:
        left = end - PACK - time.monotonic()
        cap = cap_for(s, left)
        if STOP:
            say(f"{s.name}: not started ({signal.Signals(STOP[0]).name})")
            continue
        if cap is None:
            say(f"{s.name}: skipped, it does not fit: it needs {needs(s) / 60:.2f} min, "
                f"{left / 60:.2f} left before packing")
            continue
        cmd = fill(s.cmd, a)
        say(f"{s.name}: {' '.join(cmd)} (cap {cap / 60:.2f} min)")
        t0 = time.monotonic()
        rc, how = run_step(s.name, cmd, a.out_dir, cap, grace(s.name))
        say(f"{s.name}: exit {rc} after {(time.monotonic() - t0) / 60:.2f} min"
            + (f", {how}" if how else "") + f" (log: {a.out_dir / s.name}.log)")
    own.close()
    pack(a.out_dir, until=end - PACK / 4)
    print(f"packed {a.out_dir / ARCHIVE} "
          f"({(a.out_dir / ARCHIVE).stat().st_size / 2 ** 20:.1f} MiB) "
          f"after {time.monotonic() - start:.1f} s of {end - start:.0f}", flush=True)


def dry_run(steps, a):
    """Print the schedule as if every step ran to its cap; returns [(step, cap or None)]."""
    print(f"gpu_session.py: {a.minutes:g} min in all; each step stops at its cap "
          f"(SIGINT to its process group, SIGKILL {GRACE} s later, "
          f"the leaderboard's {LEADERBOARD_GRACE} s; {REAP} s to reap), then packing ({PACK} s)")
    rows, caps, stops = plan(steps, 60 * a.minutes), 0, 0
    for s, cap, left in rows:
        if cap:
            caps, stops = caps + cap, stops + grace(s.name) + REAP
            what = f"cap {cap / 60:5.2f} min  runs   "
        else:
            what = f"skipped: needs {needs(s) / 60:.2f} min, {max(left, 0) / 60:.2f} left"
        print(f"{s.name:12s} {what}  source: {s.source}")
        print(f"{'':13s}{' '.join(fill(s.cmd, a)).replace(sys.executable, 'python')}")
    print(f"{'packing':12s} {PACK / 60:.2f} min: one archive {ARCHIVE} "
          f"of at most {LIMIT / 2 ** 20:g} MiB")
    print(f"{'total':12s} {(caps + stops + PACK) / 60:.2f} min = caps {caps / 60:.2f} "
          f"+ stopping {stops / 60:.2f} + packing {PACK / 60:.2f} "
          f"(at most --minutes {a.minutes:g})")
    return [(s, cap) for s, cap, _ in rows]


if __name__ == "__main__":
    main()
