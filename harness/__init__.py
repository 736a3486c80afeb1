"""The run harness: what makes a method script a well-behaved program. Nothing here is a
method's numerics: to learn a method, read its file and common.py; a method file imports the
harness only when it runs as a program.

    config.py      the command line and the configuration: resolve (method, argv) -> args, and
                   where each value comes from (--print-config)
    runner.py      main, run: the loop over the held-out domains, and the signals that stop it
    outputs.py     what a run owns (its results, checkpoint and lock), the rules that guard it,
                   and the one atomic writer of its files
    progress.py    the progress line on a terminal, the pace and time left
    provenance.py  where a result came from: versions, device, commit, the code's digests
    datasets.py    downloads and fake photo trees: python -m harness.datasets
    methods.py     the list of the methods; what a federated node may run for each

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

from harness.config import resolve  # noqa: E402  (after starting(): they load torch)
from harness.methods import METHODS, client_functions, method  # noqa: E402
from harness.runner import main, run  # noqa: E402

__all__ = ["METHODS", "client_functions", "method", "resolve", "main", "run", "starting",
           "started"]
started()
