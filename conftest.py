"""What every test of this checkout shares: each test runs in a folder of its own (a script's
default --out, results/..., lands there, never in the checkout), and the suite fails if the
checkout's tree is not the same after it as before (every file but the caches: results/ and the
other ignored folders included)."""

import os
import tempfile
from pathlib import Path

import pytest

# Hypothesis keeps its examples outside the checkout (by default: .hypothesis/ in the cwd).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "fedood-hypothesis"))

HERE = Path(__file__).resolve().parent
CACHES = {".git", "__pycache__", ".pytest_cache", ".venv", ".hypothesis", ".ruff_cache"}


def tree(root=HERE):
    """{path: (size, modification time)} of every file under root, the caches aside."""
    seen = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in CACHES]
        for f in files:
            p = os.path.join(top, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            seen[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return seen


def changes(before, after):
    """What differs between two trees: ['+ new', '- gone', '~ changed'] by path."""
    return sorted(
        [f"+ {p}" for p in after.keys() - before.keys()]
        + [f"- {p}" for p in before.keys() - after.keys()]
        + [f"~ {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    )


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller, or a run without xdist
        session.config._tree_before = tree()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_tree_before", None)
    if before is None:
        return
    moved = changes(before, tree())
    if moved:
        print(f"\nthe suite changed the checkout ({len(moved)} file(s)): " + ", ".join(moved[:10]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _own_folder(tmp_path, monkeypatch):
    """Every test starts in a fresh folder of its own: relative paths (results/) never reach the
    checkout."""
    monkeypatch.chdir(tmp_path)
