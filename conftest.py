"""What every test of this checkout shares: each test runs in a folder of its own (a script's
default --out, results/..., lands there, never in the checkout), and the suite fails if the
checkout's tree is not the same after it as before (every file but the caches: results/ and the
other ignored folders included). Under pytest -n N, each worker takes its share of the cores.
The `dtype` fixture runs a test in float32 and in float64 (`float64`)."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

import data

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


# Parallel and sequential runs of a seed agree to float rounding, not bit for bit: the batched
# kernels (grouped convolutions, per-client sums) add in another order. Each comparison is therefore
# made twice (the `dtype` fixture): in float64, where the two paths agree to ~1e-15 and a tight
# tolerance checks the mathematics, and in float32 with a tolerance at least 10x the largest
# difference measured on a 2-core AMD EPYC CPU (torch 2.15, at 1 and at 2 threads; the numbers are
# given beside each test). Two things amplify the rounding and are avoided here, not hidden: Adam at
# lr 1e-2 (it normalises near-zero gradients, whose rounding then moves weights by ~lr: 5.8e-3 after
# 2 rounds; in float64 the same comparison gives 8e-7, so it is rounding) and the synthetic data's
# `smallconv` (GroupNorm over single channels,
# near-constant ones divided by sqrt(eps): up to 2e-1 on
# one client after 2 epochs; 4e-8 in float64). ReLU kinks and max pools amplify it too, and more so
# at 2 threads: FedIPG's penalty after 2 rounds differs by 1.6e-7 (relative) at one thread and by
# 5.5e-5 at two in float32, by 4e-16 in float64.
@pytest.fixture
def float64(monkeypatch):
    """The methods in float64: models built while the default dtype is float64 (so their parameters,
    buffers and the methods' zeros/ones are float64) and the inputs' uint8 -> float made in float64.
    Reported losses still pass through common's float32 running sums (loss.float()): they agree to
    float32 rounding only, the parameters to float64 rounding."""
    prep = data.make_prep

    def make_prep(dataset, device):    # the digits' x / 255 in float64; the photos' prep, then cast
        if dataset in data.PHOTOS:
            return lambda x, **k: prep(dataset, device)(x, **k).double()
        return lambda x, train=False, gen=None: x.double() / 255
    monkeypatch.setattr(data, "make_prep", make_prep)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield torch.float64
    torch.set_default_dtype(old)


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """Both precisions: float32 (what the methods run in) and float64 (the mathematics)."""
    return request.getfixturevalue("float64") if request.param == "float64" else torch.float32
