"""Bad input to the benchmark scripts ends in one line on stderr that starts with the script's name,
exit code 2 and no traceback, before any work: nothing timed, run, printed or written (every path a
script would write is checked first). report.py skips a *.json that holds no run (a JSON list, ...)
as it skips every file it cannot read as one, and names it under the folder's table.

Each script's main runs in this process, in the test's own tmp_path (the root conftest.py chdirs
there); every path given to a script is under it, or under /proc (a folder no file can be made in,
even by root), never in the checkout.
"""

import contextlib
import importlib
import io
import json
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = 30  # s: a refusal comes after the imports (torch: 3-5 s), before any work (speed.py's
#                  default timing alone takes 85 s)
PROC = pytest.mark.skipif(not Path("/proc").is_dir(), reason="no /proc on this system")


def files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def script(name, *argv, cwd):
    """benchmark/<name>'s main with these arguments, in this process (each test is in its own
    folder, cwd): (what it did: returncode, stdout, stderr; its seconds). An exception fails the
    test."""
    assert Path.cwd() == Path(cwd)
    module = importlib.import_module(name.removesuffix(".py"))
    out, err, code, start = io.StringIO(), io.StringIO(), 0, time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main([*map(str, argv)])
        except SystemExit as e:
            code = e.code
    return types.SimpleNamespace(
        returncode=code, stdout=out.getvalue(), stderr=err.getvalue()
    ), time.monotonic() - start


def refused(tmp_path, name, *argv):
    """The one line with which `name` refuses these arguments, once it is checked to be a refusal as
    the contract has it: exit code 2, that one line on stderr (no traceback), nothing on stdout,
    quickly, and nothing made or removed under tmp_path."""
    before = files(tmp_path)
    p, took = script(name, *argv, cwd=tmp_path)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"{name}: error: "), lines[0]
    assert p.stdout == "", p.stdout[-3000:]
    assert took < FAST, f"{took:.1f} s: {lines[0]}"
    assert files(tmp_path) == before
    return lines[0]


def unwritable(tmp_path, case, name):
    """A path no file can be written at: an existing folder, a path under a regular file, or one in
    a folder that takes no new file."""
    if case == "folder":
        (tmp_path / name).mkdir()
        return tmp_path / name
    if case == "under-a-file":
        (tmp_path / "file").write_text("a user's file\n")
        return tmp_path / "file" / name
    return Path("/proc") / name


CASES = ["folder", "under-a-file", pytest.param("unwritable-folder", marks=PROC)]


@pytest.mark.parametrize("case", CASES)
def test_speed_refuses_a_json_it_could_not_write_before_timing(tmp_path, case):
    path = unwritable(tmp_path, case, "speed.json")
    line = refused(tmp_path, "speed.py", "--json", path)
    assert {
        "folder": "is a folder",
        "under-a-file": f"{tmp_path / 'file'} is not a folder",
        "unwritable-folder": "cannot write --json",
    }[case] in line
    assert str(path) in line


@pytest.mark.parametrize("value", ["-1", "0"])
def test_speed_refuses_a_curve_below_one(tmp_path, value):
    line = refused(tmp_path, "speed.py", "--curve", value)
    assert f"--curve must be positive, got {value}" in line


def test_report_skips_a_json_that_holds_no_run(tmp_path):
    """A JSON list (or another non-dict, or a dict of another shape) in a results folder is left out
    and named, as an unreadable or incomplete file is: the other files still make their report."""
    res = tmp_path / "res"
    res.mkdir()
    skipped = {
        "list.json": "[1, 2]",
        "number.json": "42",
        "text.json": "not json",
        "domains-list.json": json.dumps({"args": {}, "domains": [0.5]}),
        "incomplete.json": json.dumps({"complete": False, "args": {}, "domains": {}}),
    }
    for f, text in skipped.items():
        (res / f).write_text(text)
    (res / "folder.json").mkdir()
    p, took = script("report.py", res, cwd=tmp_path)
    assert "Traceback" not in p.stderr and "error" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0
    left = [line for line in p.stdout.splitlines() if line.startswith("Left out")]
    names = ", ".join(sorted([*skipped, "folder.json"]))
    assert left == [f"Left out (incomplete or unreadable): {names}."], p.stdout
    assert took < FAST


@pytest.mark.parametrize("case", CASES)
def test_report_refuses_an_out_it_could_not_write_before_reading(tmp_path, case):
    (tmp_path / "res").mkdir()
    path = unwritable(tmp_path, case, "report.md")
    line = refused(tmp_path, "report.py", tmp_path / "res", "--out", path)
    assert {
        "folder": "a folder; give a file name",
        "under-a-file": f"{tmp_path / 'file'} is not a folder",
        "unwritable-folder": "cannot write --out",
    }[case] in line


@pytest.mark.parametrize("case", ["file", "readme-is-a-folder"])
def test_leaderboard_refuses_an_out_dir_it_could_not_write_in(tmp_path, case):
    out = tmp_path / "leaderboard"
    if case == "file":
        out.write_text("a user's file\n")
    else:
        (out / "README.md").mkdir(parents=True)
    line = refused(tmp_path, "leaderboard.py", "--out-dir", out, "--table-only")
    assert {
        "file": f"--out-dir {out}: {out} is not a folder",
        "readme-is-a-folder": f"{out / 'README.md'} is not a file the table can be written to",
    }[case] in line


HELPED = ["report.py", "run.py", "leaderboard.py", "official_fediir.py", "aten_count.py",
          "gpu_session.py", "gpu_check.py", "rcmnist_ptest.py", "irm_central.py", "mcmahan_fig1.py",
          "sensitivity.py"]


@pytest.mark.parametrize("name", HELPED)
def test_help_says_what_the_script_does_in_whole_sentences(name, tmp_path):
    """--help opens with the docstring's first paragraph, whole (its last sentence ended)."""
    p, _ = script(name, "--help", cwd=tmp_path)
    first = " ".join(importlib.import_module(name[:-3]).__doc__.split("\n\n")[0].split())
    said = " ".join(p.stdout.split("\n\n")[1].split())
    assert p.returncode == 0 and said == first and said.endswith("."), said
