"""The docs name only what exists: every `module.name` that README.md and docs/*.md write in code
font, where `module` is one of this repository's modules (the method files, common, data, the
harness package and its modules, flower/'s and benchmark/'s scripts), resolves to an attribute.
A function renamed or moved without its docs fails here, naming the file and the line."""
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = [ROOT, ROOT / "flower", ROOT / "benchmark", ROOT / "benchmark" / "diagnostics"]
FILE_ENDINGS = {"py", "md", "json", "ckpt", "lock", "next", "tmp", "txt", "toml", "pt", "npz",
                "log", "gz", "zip", "csv", "png", "svg", "sh", "cfg", "yaml"}
SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"(?<![\w./-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def modules():
    """The names a reference may start with: every Python module of the repository's folders
    (not the tests), and the harness package."""
    names = {"harness"}
    for folder in FOLDERS:
        names |= {p.stem for p in folder.glob("*.py")
                  if not p.stem.startswith(("test_", "conftest", "__"))}
    return names


def references(text, known):
    """(line, dotted name) of each dotted name in a code span that starts with a known module's
    name (not a file name such as fediir.py)."""
    for n, line in enumerate(text.splitlines(), 1):
        for span in SPAN.findall(line):
            for m in NAME.finditer(span):
                parts = m.group(0).split(".")
                if parts[0] in known and parts[-1] not in FILE_ENDINGS:
                    yield n, m.group(0)


def resolves(dotted):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            try:                                  # a package's module not imported yet
                obj = importlib.import_module(".".join(parts[:i + 1]))
                continue
            except ImportError:
                return False
        obj = getattr(obj, part)
    return True


def test_every_module_name_the_docs_write_exists():
    for folder in FOLDERS:
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    known = modules()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing, seen = [], 0
    for page in pages:
        for n, dotted in references(page.read_text(), known):
            seen += 1
            if not resolves(dotted):
                missing.append(f"{page.relative_to(ROOT)}:{n}: {dotted}")
    assert seen > 50                                         # the docs do name the code
    assert not missing, "names the code no longer has:\n" + "\n".join(missing)


def test_it_would_have_caught_a_name_that_is_gone():
    known = modules()
    text = "the clients train in `common.train_clients`; the penalty: `loss=fediir.iir_loss(g)`\n" \
           "it runs `common.on_clients(fn, S, sent, t, ctx)` and writes `results.json`, `run.py`"
    found = list(references(text, known))
    assert [d for _, d in found] == ["common.train_clients", "fediir.iir_loss", "common.on_clients"]
    assert [resolves(d) for _, d in found] == [False, False, True]
