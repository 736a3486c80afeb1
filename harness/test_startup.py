"""Ctrl-C at any moment of a script, its imports included (torch's take seconds), ends in one line
and exit 130: harness/__init__.py's guard, from the first import of a script until its own
handlers."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "script,words",
    [
        ("fedavg.py", "fedavg.py: interrupted while starting; nothing was run"),
        ("fedipg.py", "fedipg.py: interrupted while starting; nothing was run"),
        ("fediir.py", "fediir.py: interrupted while starting; nothing was run"),
        ("benchmark/run.py", "run.py: interrupted while starting; nothing was run"),
        ("flower/run_local.py", "run_local.py: interrupted while starting; nothing was run"),
    ],
)
def test_ctrl_c_while_the_imports_run_is_one_line(script, words):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.Popen(
        [sys.executable, "-X", "importtime", str(ROOT / script), "--help"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = ""
    while "import time:" not in seen or "harness" not in seen:  # the guard is in place
        line = p.stderr.readline()
        assert line, f"{script} ended before importing the harness: {seen[-500:]}"
        seen += line
    p.send_signal(signal.SIGINT)  # torch still to come
    t = time.time()
    _, err = p.communicate(timeout=60)
    err = "\n".join(x for x in err.splitlines() if not x.startswith("import time:"))
    assert p.returncode == 130, err
    assert err.strip().splitlines() == [words] and "Traceback" not in err
    assert time.time() - t < 30
