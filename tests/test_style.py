"""One style for the whole checkout, checked by a linter.

Every Python file of the repository, the tests included, has lines of at most 100 characters
(ruff's E501) and no pyflakes finding (ruff's F rules: unused imports and variables, undefined
names, ...), so that a file reads the same way in any editor and a dead import or a misspelt
name is caught before it runs. The rules live in pyproject.toml at the repository root
([tool.ruff]); the linter is pinned in requirements.txt (a dev dependency: this test runs it).
On failure the test prints ruff's own report: each finding with its file, line and rule.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_python_file_passes_ruff():
    """python -m ruff check <repository root> with pyproject.toml exits 0: no line over 100
    characters, no pyflakes finding, in any Python file of the checkout."""
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                        "--config", str(ROOT / "pyproject.toml"), str(ROOT)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    status, report = p.returncode, p.stdout + p.stderr
    assert status == 0, f"ruff check exited {status}:\n{report}"
