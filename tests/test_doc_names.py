"""The docs name only what exists.

Every `module.name` (or `package.module.name.attr`) that README.md or docs/*.md writes in code
font, in an inline code span or a fenced block, where `module` is one of this repository's Python
modules, must resolve: the module imports and getattr walks the rest. A Python block counts by
its imports (`from fedipg import aggregate` checks fedipg.aggregate). A function renamed or moved
without its docs fails here as `file:line: module.name`, with where that name lives now if anywhere.
"""
import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The folders whose files import as bare names: the checkout's root, and what flower/'s and
# benchmark/'s scripts put on sys.path. Packages (folders with __init__.py) are found below them.
FOLDERS = [ROOT, ROOT / "flower", ROOT / "benchmark", ROOT / "benchmark" / "diagnostics"]
# `run.py`, `fedavg.json`, `seed0.log`: a file, not an attribute.
FILE_ENDINGS = {"py", "md", "json", "jsonl", "txt", "toml", "log", "ckpt", "lock", "csv", "tsv",
                "pt", "pth", "npz", "npy", "png", "jpg", "jpeg", "svg", "pdf", "html", "gz", "zip",
                "tar", "whl", "sh", "cfg", "ini", "yaml", "yml", "out", "err", "tmp", "next"}
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$",
                   re.M | re.S)
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
# A whole dotted name, not inside a path (docs/fediir.md, harness/outputs.py, data/x.y), a longer
# chain (self.common.x) or a flag (--data.x).
DOTTED = re.compile(r"(?<![\w./$-])(?>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/])")


def discover():
    """({importable name: [files]}, names left out): every module of FOLDERS and every module of
    the packages under them (harness, harness.outputs, ...). A bare name that two files share
    (conftest) or that the standard library also has names neither for a reader: left out."""
    found = {}

    def package(folder, prefix):
        found.setdefault(prefix, []).append(folder / "__init__.py")
        for p in sorted(folder.iterdir()):
            if p.suffix == ".py" and p.stem != "__init__":
                found.setdefault(f"{prefix}.{p.stem}", []).append(p)
            elif (p / "__init__.py").is_file():
                package(p, f"{prefix}.{p.name}")

    for folder in FOLDERS:
        for p in sorted(folder.iterdir()):
            if p.suffix == ".py":
                found.setdefault(p.stem, []).append(p)
            elif (p / "__init__.py").is_file():
                package(p, p.name)
    left_out = {m for m, files in found.items()
                if len(files) > 1 or m.split(".")[0] in sys.stdlib_module_names}
    return {m: f for m, f in found.items() if m not in left_out}, left_out


MODULES, AMBIGUOUS = discover()


def split(dotted):
    """(module, [attributes]) for a dotted name that starts with a repository module (the longest
    such prefix: harness.outputs.write is harness.outputs's write), else None; None too for a
    file name (module.py, module.json)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in MODULES:
            rest = parts[i:]
            return None if rest and rest[0] in FILE_ENDINGS else (module, rest)
    return None


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def in_text(text, first_line=1):
    """(line, dotted) of every repository reference in text's dotted names."""
    for m in DOTTED.finditer(text):
        if split(m.group(0)):
            yield first_line + text.count("\n", 0, m.start()), m.group(0)


def in_python(code, first_line):
    """(line, dotted) of what a Python block takes from the repository's modules: each name it
    imports from one, and each attribute it reads of a module it imports (by the name it binds).
    A block that does not parse is read as text."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        yield from in_text(code, first_line)
        return
    bound = {}
    for node in ast.walk(tree):
        line = first_line + getattr(node, "lineno", 1) - 1
        if isinstance(node, ast.Import):
            for a in node.names:
                if split(a.name):
                    yield line, a.name
                    top = a.name.split(".")[0]
                    bound[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and not node.level and split(node.module or ""):
            for a in node.names:
                if a.name != "*":
                    yield line, f"{node.module}.{a.name}"
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                dotted = ".".join([bound[base.id], *chain])
                if split(dotted):
                    yield first_line + node.lineno - 1, dotted


def references(text):
    """Sorted (line, dotted) of every reference a markdown page makes: inline code spans, fenced
    Python blocks by their imports, other fenced blocks (shell, output) as code text."""
    found, prose, end = [], [], 0
    for f in FENCE.finditer(text):
        prose.append(text[end:f.start()] + "\n" * text.count("\n", f.start(), f.end()))
        end = f.end()
        first = line_of(text, f.start(3))
        lang = f.group(2).lower()
        reader = in_python if lang in ("python", "py", "python3", "pycon") else in_text
        found += reader(f.group(3), first)
    prose = "".join(prose) + text[end:]                # fences blanked, line numbers kept
    for s in SPAN.finditer(prose):
        found += in_text(s.group(2), line_of(prose, s.start(2)))
    return sorted(set(found))


def resolve(dotted):
    """None where dotted names something that exists, else why not (one line)."""
    module, rest = split(dotted)
    try:
        obj = importlib.import_module(module)
    except Exception as e:                                        # noqa: BLE001 (any, reported)
        return f"import {module} failed: {type(e).__name__}: {e}"
    where = Path(getattr(obj, "__file__", "") or "").resolve()
    if where not in [p.resolve() for p in MODULES[module]]:
        return f"import {module} found {where}, not the checkout's"
    for i, name in enumerate(rest):
        if not hasattr(obj, name) and hasattr(obj, "__path__"):   # a package's unimported module
            try:
                importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                pass
        if not hasattr(obj, name):
            return f"{'.'.join([module, *rest[:i]])} has no {name!r}"
        obj = getattr(obj, name)
    return None


def now_at(name):
    """Where the root's modules and the packages define a name now (not the scripts: importing
    them all is slow), for the failure message."""
    places = []
    for module in sorted(m for m, files in MODULES.items() if files[0].parent == ROOT
                         or (files[0].parent / "__init__.py").is_file()):
        try:
            obj = importlib.import_module(module)
        except Exception:                                         # noqa: BLE001
            continue
        if name in vars(obj):
            places.append(f"{module}.{name}")
    return places


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_name_the_page_writes_exists(page):
    """Each repository reference of the page resolves; a failure lists every one that does not,
    as `file:line: module.name` (why; where the last name is defined now, if anywhere)."""
    missing = []
    for line, dotted in references(page.read_text(encoding="utf-8")):
        why = resolve(dotted)
        if why:
            moved = now_at(dotted.split(".")[-1])
            hint = f"; now {', '.join(moved)}" if moved else ""
            missing.append(f"{page.relative_to(ROOT)}:{line}: {dotted}  ({why}{hint})")
    if missing:
        pytest.fail(f"{len(missing)} name(s) the code does not have:\n" + "\n".join(missing),
                    pytrace=False)


def test_what_counts_as_a_reference():
    """The reader's rules on a made-up page: repository names checked, file names, paths, other
    libraries and variables skipped; and a name that is gone does not resolve."""
    page = ("The clients train in `common.train_clients(fn, S)`, the penalty `fediir.iir_loss`,\n"
            "`harness.outputs` writes; run `python run.py` or `benchmark/run.py`, see\n"
            "`docs/fediir.md`, `results.json`, `torch.func.grad`, `args.gamma`, `x.shape`,\n"
            "``a `F.ckpt` in double ticks, common.on_clients``; `data.federate\n"
            "wrapped`.\n\n"
            "```python\nimport harness\nfrom fediir import iir_gone\nharness.outputs.nope\n"
            "data.shape\n```\n"
            "```\n$ python -c 'import common; common.gone()'\n```\n")
    found = references(page)
    assert found == [(1, "common.train_clients"), (1, "fediir.iir_loss"), (2, "harness.outputs"),
                     (4, "common.on_clients"), (4, "data.federate"), (8, "harness"),
                     (9, "fediir.iir_gone"), (10, "harness.outputs.nope"), (14, "common.gone")]
    assert [resolve(d) is None for _, d in found] == [False, False, True, True, True, True,
                                                     False, False, False]
