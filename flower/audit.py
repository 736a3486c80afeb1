"""Who reads which data, for the tests: a Python audit hook (sys.addaudithook, PEP 578) that sees
every file a process opens or lists, refuses (PermissionError) any under a denied folder but its
own, and writes each refusal to a log, so that a test can show that a node reads its own folder
alone and the server no data at all.

In one process (flower/test_flower.py) `watching(rules, who)` sets the rules and `acting(name)`
says on whose behalf the code runs (a node, the server): the fake grid runs each node's work
under its name (a thread pool's threads, which carry no context, act for the last one named:
nodes one after another, as FakeGrid runs them).

On real processes (flower/test_deploy.py) this file, copied as sitecustomize.py into a folder on
PYTHONPATH, installs itself in every Python process that starts with
FEDOOD_AUDIT in its environment (JSON: {"who": a name, "allow": [folders], "deny": [folders],
"log": a file}): a SuperNode and the ClientApp processes it starts inherit their node's, the
SuperLink and its ServerApp process the server's. Each process writes a line to the log when it
starts, so that the test sees that the hook ran where it must.

What the hook sees: Python's `open` (builtins.open, io.open, os.open: torch.load, numpy.load and
data.read_rgb go through it), os.listdir and os.scandir. A read by C code that bypasses Python's
open (none here: data.read_rgb reads the bytes with Python's open) would go unseen.
"""
import contextlib
import contextvars
import json
import os
import sys
import threading

_rules = {}                                      # who -> (allow, deny); "*": everyone else
_log = [None]
_who = contextvars.ContextVar("who", default=None)
_last = ["*"]               # who acts in threads that do not carry the context (a thread pool's)
_busy = threading.local()
_installed = []


def under(path, folders):
    return any(path == f or path.startswith(f + os.sep) for f in folders)


def hook(event, args):
    if not _rules or event not in ("open", "os.listdir", "os.scandir") or \
            getattr(_busy, "on", False):
        return                                   # (no rules: nothing watched)
    path = args[0] if args else None
    if not isinstance(path, (str, bytes, os.PathLike)):
        return                                   # a file descriptor
    path = os.path.abspath(os.fsdecode(path))
    who = _who.get() or _last[0]
    allow, deny = _rules.get(who) or _rules.get("*") or ((), ())
    if under(path, deny) and not under(path, allow):
        say(f"refused {who} {event} {path}")
        raise PermissionError(f"audit: {who} may not read {path}")


def say(line):
    """A line into the log (the hook's own write is not audited)."""
    if _log[0] is None:
        return
    _busy.on = True
    try:
        with open(_log[0], "a") as f:
            f.write(f"{os.getpid()} {line}\n")
    finally:
        _busy.on = False


def install(log):
    _log[0] = log
    if not _installed:
        sys.addaudithook(hook)
        _installed.append(True)


@contextlib.contextmanager
def watching(rules, log):
    """Within: the rules {who: (allow, deny)} (folders; "*": anyone not named) hold in this
    process, each refusal written to `log`."""
    install(log)
    _rules.clear()
    _last[0] = "*"            # (threads that named a node out of order leave no one acting)
    _rules.update({k: ([os.path.abspath(a) for a in allow], [os.path.abspath(d) for d in deny])
                   for k, (allow, deny) in rules.items()})
    try:
        yield
    finally:
        _rules.clear()
        _last[0] = "*"


@contextlib.contextmanager
def acting(who):
    """Within: the code runs on behalf of `who` (a node's name)."""
    token, before = _who.set(who), _last[0]
    _last[0] = who
    try:
        yield
    finally:
        _who.reset(token)
        _last[0] = before


def refusals(log):
    """The refusals written to `log` (lines)."""
    try:
        return [line for line in open(log).read().splitlines() if " refused " in line]
    except FileNotFoundError:
        return []


if "FEDOOD_AUDIT" in os.environ and __name__ == "sitecustomize":        # a deployment's process
    _conf = json.loads(os.environ["FEDOOD_AUDIT"])
    install(_conf["log"])
    _rules["*"] = ([os.path.abspath(a) for a in _conf["allow"]],
                   [os.path.abspath(d) for d in _conf["deny"]])
    _who.set(_conf["who"])
    say(f"started {_conf['who']} {os.path.basename(sys.argv[0] if sys.argv else '?')}")
