"""Where a result came from, as a run records it: the versions, the device by name, the commit of
the checkout, the command line, and the code its numbers come from (a digest of each file)."""
import hashlib
import inspect
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent       # the project: the method files, common.py


def code_files(round_fn):
    """The code a run's numbers come from: the method's file, common.py and data.py, by a digest
    each."""
    fn = inspect.unwrap(getattr(round_fn, "func", round_fn))     # (a partial, a wrapped round)
    method_file = Path(inspect.getfile(fn)).resolve()
    files = {method_file, HERE / "common.py", HERE / "data.py"}
    return {os.path.relpath(f, HERE): hashlib.sha256(f.read_bytes()).hexdigest()[:12]
            for f in sorted(files)}


def device_name(device):
    """The device by name: the GPU's, or the CPU model's (Linux: /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def provenance(method, argv, device, own=()):
    """What a reader needs to redo a result: the versions, the device by name, the commit of this
    checkout (and whether tracked files other than the run's own outputs `own` differ from it;
    none outside git, or where this project is not the top of its git work tree: a copy inside
    another repository, whose commit says nothing of it), the command line, and the streams the
    clients drew from (each its own: common.stream)."""
    commit = dirty = None
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(HERE), *a], capture_output=True,
                                        text=True, timeout=10)
        top = git("rev-parse", "--show-toplevel")
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == HERE:
            commit = git("rev-parse", "HEAD").stdout.strip() or None
            status = git("status", "--porcelain", "-z", "-uno").stdout.split("\0")
            changed = {HERE / c[3:] for c in status if c}
            dirty = commit and bool(changed - {Path(o).resolve() for o in own})   # not the code
    except (OSError, subprocess.SubprocessError):
        pass
    import numpy
    return {"command": shlex.join(["python", f"{method}.py", *argv]), "commit": commit,
            "dirty": dirty, "date": time.strftime("%Y-%m-%d"), "device": device_name(device),
            "torch": torch.__version__, "numpy": numpy.__version__,
            "python": platform.python_version(), "streams": "per client"}
