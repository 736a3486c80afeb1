"""What every test of this checkout shares: each test runs in a folder of its own (a script's
default --out, results/..., lands there, never in the checkout), and the suite fails if the
checkout's tree is not the same after it as before (every file but the caches: results/ and the
other ignored folders included). Under pytest -n N, each worker takes its share of the cores."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

# Hypothesis keeps its examples outside the checkout (by default: .hypothesis/ in the cwd).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "fedood-hypothesis"))

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest -n N: the cores shared among the N workers and the scripts they start
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

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
