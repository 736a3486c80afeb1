"""The run harness: what makes a method script a well-behaved program. Nothing here is a
method's numerics: to learn a method, read its file and common.py.

    config.py    the command line and the configuration: Method, resolve (method, argv) -> args
    runner.py    main, run: the held-out domains, checkpoints, --resume, signals, provenance
    outputs.py   what a run owns (its results, checkpoint and lock) and the rules that guard it
    progress.py  the progress line on a terminal
    datasets.py  downloads, fake photo trees, data.py's command line

Importing this package first makes a Ctrl-C during the imports that follow (torch's take
seconds) end in one line and exit 130 instead of a traceback; once they are done, `started()`
puts the previous SIGINT handler back.
"""

import os
import signal
import sys
import threading

_before = []


def _interrupted_while_starting(signum, frame):
    name = os.path.basename(sys.argv[0] or "python") or "python"
    sys.stderr.write(f"\n{name}: interrupted while starting; nothing was run\n")
    sys.stderr.flush()
    os._exit(130)


def starting():
    """From here until started(): a SIGINT ends the process in one line, exit 130."""
    if threading.current_thread() is threading.main_thread() and not _before:
        before = signal.signal(signal.SIGINT, _interrupted_while_starting)
        _before.append(signal.default_int_handler if before is None else before)


def started():
    """The imports are done: the SIGINT handler from before starting() again."""
    if _before and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _before.pop())


starting()

from harness.config import Method, resolve  # noqa: E402  (after starting(): they load torch)
from harness.runner import main, run  # noqa: E402

__all__ = ["Method", "resolve", "main", "run", "starting", "started"]
started()
