"""The run harness: what makes a method script a well-behaved program (its files, its lock, its
signals). Nothing here is a method's numerics: to learn a method, read its file and common.py.

Importing this package first makes a Ctrl-C during the imports that follow (torch's take seconds)
end in one line and exit 130 instead of a traceback; common.py calls `started()` once its own
imports are done, which puts the previous SIGINT handler back.
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
