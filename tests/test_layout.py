"""The layout the design card fixes, checked on the files themselves: a method file is the method
once, within its budget, and imports only torch, common and data at module level (the harness only
to run as a program); the core is read alone, within its budgets, and no import runs back up; one
list of the methods; no test edits sys.path, and every script finds the checkout in one line of
one form."""

import ast
import re
import subprocess

import pytest

import harness
from tests.helpers import HERE, METHODS

PROJECT = {"common", "data", "harness", *METHODS}


def python_files():
    tracked = subprocess.run(["git", "-C", str(HERE), "ls-files", "--cached", "--others",
                              "--exclude-standard", "*.py"], capture_output=True,
                             text=True).stdout.split()
    return [HERE / f for f in tracked if (HERE / f).is_file()] or \
        [p for p in HERE.rglob("*.py") if ".venv" not in p.parts]


def imported(tree):
    """The top names of every module a syntax tree imports (a function's import included)."""
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {name.split(".")[0] for name in names}


def project_imports(path, main_block=True):
    """The project's modules a file imports, anywhere in it (its `if __name__ == "__main__":`
    blocks only with main_block)."""
    tree = ast.parse(path.read_text())
    if not main_block:
        tree.body = [n for n in tree.body if not as_program(n)]
    return imported(tree) & PROJECT


def as_program(node):
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


@pytest.mark.parametrize("method", METHODS)
def test_a_method_file_is_the_method_once(method):
    """At most 300 lines of at most 100 characters (CleanRL's ppo.py: 312, nanoGPT's model.py: 330),
    a module docstring of at most 30 that links the method's docs page, and no other method imported
    (common and data only, besides torch and the standard library)."""
    source = (HERE / f"{method}.py").read_text()
    tree = ast.parse(source)
    doc = tree.body[0]
    assert len(source.splitlines()) <= 300 and doc.end_lineno - doc.lineno + 1 <= 30
    assert [n for n, line in enumerate(source.splitlines(), 1) if len(line) > 100] == []
    assert f"docs/{method}.md" in ast.get_docstring(tree)
    assert not imported(tree) & (set(METHODS) - {method})


@pytest.mark.parametrize("method", METHODS)
def test_a_method_file_imports_the_harness_only_to_run_as_a_program(method):
    """At module level a method file imports torch (scipy where it needs it), common and data, and
    nothing else of the project (importlib.util, to ask whether the harness is there); the harness
    only in its `if __name__ == "__main__":` blocks where there is one (the first of them before
    torch, for a one-line Ctrl-C while torch loads) and in main(), which runs common.program
    where there is none (a copy: test_methods.py runs it)."""
    tree = ast.parse((HERE / f"{method}.py").read_text())
    top = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], [])
    assert imported(top) <= {"torch", "scipy", "common", "data", "copy", "functools", "math",
                             "importlib"}
    guard = next(n for n in tree.body if as_program(n))
    assert "find_spec('harness')" in ast.unparse(guard.test)        # (a copy has none)
    assert imported(guard) == {"harness"} and tree.body.index(guard) < min(
        (tree.body.index(n) for n in top.body if "torch" in imported(ast.Module([n], []))),
        default=len(tree.body))                   # (FedAvg's file needs no torch of its own)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    body = [ast.unparse(n) for n in main.body]
    assert body == ["if importlib.util.find_spec('harness') is None:\n"
                    "    return common.program(METHOD, argv)",
                    "return importlib.import_module('harness').main(METHOD, argv)"]
    assert project_imports(HERE / f"{method}.py", main_block=False) <= {"common", "data"}


def test_the_core_is_read_alone_and_no_import_runs_back_up():
    """common.py is the teaching core, in at most 600 lines up to its section "a method's record";
    then, in at most 440, what a method file copied with common.py and data.py needs to run where
    the harness is absent: the record of a method, the settings (PROTOCOL, RUN, settings, the
    checks, after_load) and the program. data.py holds the datasets, in at most 850: a reader
    learns a method from its file and one stretch of common.py. The imports run one way: data <-
    common <- the methods, and data, common <- the harness; common never imports the harness (not
    even by name) or a method, data nothing of the project (its downloads: python -m
    harness.datasets), the harness no method (harness.methods finds them by name)."""
    lines = (HERE / "common.py").read_text().splitlines()
    core = next(n for n, line in enumerate(lines) if line.startswith("# ---") and
                line.endswith(" a method's record"))
    assert core <= 600 and len(lines) - core <= 440
    assert len((HERE / "data.py").read_text().splitlines()) <= 850
    assert project_imports(HERE / "common.py") == {"data"}
    assert "import_module" not in "\n".join(lines)
    assert project_imports(HERE / "data.py") == set()
    for f in (HERE / "harness").glob("*.py"):
        if not f.name.startswith("test_"):
            assert project_imports(f) <= {"common", "data", "harness"}, f.name


def test_one_list_of_the_methods():
    """The methods are listed once, harness.METHODS: no other file of the project spells out all
    six in a list, tuple or set (a dict of each method's own settings is not a list of them)."""
    six = set(METHODS)
    seen = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                words = {e.value.removesuffix(".py") for e in node.elts
                         if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if six <= words:
                    seen.append(f"{path.relative_to(HERE)}:{node.lineno}")
    assert seen == ["harness/methods.py:5"] and tuple(METHODS) == harness.METHODS


def test_no_test_edits_sys_path_and_every_script_finds_the_checkout_in_one_line():
    """pyproject.toml's [tool.pytest.ini_options] pythonpath puts the checkout, benchmark/ and its
    diagnostics on the path for the tests: none edits sys.path. A script under benchmark/ or
    flower/ finds the checkout in one line of one form, the same in every script but for its depth
    (the folders from its own up to the checkout). flower/fl_adapter.py, which Flower imports
    from its own copy of the App, finds it by FEDOOD_ROOT, in one line too."""
    edits = re.compile(r"sys\.path\.(insert|append)|sys\.path\[|syspath_prepend")
    for path in python_files():
        if path.name == "test_layout.py":               # (this test names what it looks for)
            continue
        text = path.read_text()
        rel = path.relative_to(HERE)
        if path.name.startswith("test_") or rel.parts[0] == "tests" or path.name == "conftest.py":
            assert not edits.search(text), rel
        elif rel.parts[0] in ("benchmark", "flower"):
            lines = [line for line in text.splitlines() if edits.search(line)]
            depth = len(rel.parts)
            form = (f"sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:{depth}]]"
                    f"   # up to the checkout")
            if rel.as_posix() == "flower/fl_adapter.py":
                form = ('sys.path[:0] = [str(ROOT / d) for d in (".", "benchmark", '
                        '"benchmark/diagnostics")]')
            assert lines in ([], [form]), (rel, lines)


def test_the_readme_keeps_its_budget_and_pyproject_installs_no_module():
    """README.md in at most 250 lines (the design card). pyproject.toml carries the project's
    metadata, pytest's path (the folders the scripts find) and ruff's settings, and lists no module
    to install: `pip install .` puts its dependencies in an environment, never a module named
    common or data."""
    import tomllib
    assert len((HERE / "README.md").read_text().splitlines()) <= 250
    meta = tomllib.loads((HERE / "pyproject.toml").read_text())
    assert meta["project"]["name"] and meta["project"]["dependencies"]
    assert meta["tool"]["setuptools"] == {"py-modules": [], "packages": []}
    assert meta["tool"]["pytest"]["ini_options"]["pythonpath"][:3] == [
        ".", "benchmark", "benchmark/diagnostics"]
    assert meta["tool"]["ruff"]["line-length"] == 100 and not (HERE / "ruff.toml").exists()


def test_no_test_of_the_core_imports_benchmark_code():
    """The core's tests (tests/test_common.py, test_sync.py, test_data.py) import nothing of
    benchmark/, and the shared helpers nothing at import (the few that compare with a
    benchmark/ variant import it when called): the core stands without the benchmark."""
    bench = {p.stem for p in (HERE / "benchmark").rglob("*.py")} | {"benchmark", "diagnostics"}
    for name in ("test_common.py", "test_sync.py", "test_data.py"):
        assert not imported(ast.parse((HERE / "tests" / name).read_text())) & bench, name
    helpers = ast.parse((HERE / "tests" / "helpers.py").read_text())
    top = ast.Module([n for n in helpers.body if isinstance(n, (ast.Import, ast.ImportFrom))], [])
    assert not imported(top) & bench
