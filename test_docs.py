"""The documentation: its generated tables match the committed results (benchmark/report.py --check),
and no relative link or image of the README, docs/ or benchmark/results/README.md points nowhere."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_methods import HERE, bench_report

DOCS = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md")), HERE / "benchmark" / "results" / "README.md"]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def anchors(path):
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def broken_links(path):
    """Every relative link or image target of a markdown file (code left out) whose file, folder or
    heading anchor does not exist."""
    text = re.sub(r"(?ms)^```.*?^```", "", Path(path).read_text())     # fenced code
    text = re.sub(r"(?m)^(    |\t).*$", "", text)                    # indented code
    text = re.sub(r"`[^`\n]*`", "", text)                            # inline code
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):                 # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (Path(path).parent / file).resolve() if file else Path(path).resolve()
        if not dest.exists() or (anchor and (dest.suffix != ".md" or anchor not in anchors(dest))):
            bad.append(target)
    return bad


def test_generated_tables_match_the_committed_results():
    """`report.py --check` regenerates every block of the README, docs/ and benchmark/results/README.md
    from the committed results (text only) and exits 0 only if none would change."""
    p = subprocess.run([sys.executable, "benchmark/report.py", "--check"], cwd=HERE, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "every generated block up to date" in p.stdout


def test_report_check_names_a_stale_block_and_rewrites_it(tmp_path, monkeypatch, capsys):
    """A generated table edited by hand (one number changed) is named by --check, exit 1; without
    --check it is rewritten from the results, after which --check passes; an unknown block or an
    unclosed one is one line."""
    page = tmp_path / "page.md"
    monkeypatch.setattr(bench_report, "generated_files", lambda: [page])
    fresh = bench_report.block_text("irm-central", tmp_path)
    stale = fresh.replace("65.8 ± 2.4", "66.8 ± 2.4")
    assert stale != fresh
    page.write_text(f"# t\n\n<!-- report:irm-central -->\n{stale}<!-- /report:irm-central -->\ntext after\n")
    with pytest.raises(SystemExit) as e:
        bench_report.main(["--check"])
    assert e.value.code == 1 and "block 'irm-central' is out of date" in capsys.readouterr().err
    assert "66.8 ± 2.4 | 3 | 70.8 / 66.9" in page.read_text()           # --check writes nothing
    bench_report.main(["--no-figures"])
    assert page.read_text() == f"# t\n\n<!-- report:irm-central -->\n{fresh}<!-- /report:irm-central -->\ntext after\n"
    assert bench_report.main(["--check"]) == 0
    page.write_text("<!-- report:nosuch -->\nx\n<!-- /report:nosuch -->\n")
    assert "unknown block 'nosuch'" in str(pytest.raises(SystemExit, bench_report.main, ["--check"]).value)
    page.write_text("<!-- report:glance -->\nx\n")
    assert "without its closing" in str(pytest.raises(SystemExit, bench_report.main, ["--check"]).value)


def test_verdict_rule_on_made_up_seeds(monkeypatch):
    """The one rule: holds beyond 2·max(std), reversed beyond it the other way, else within 2 std;
    one seed gives no verdict; the paper's own difference is shown beside."""
    vals = {}
    monkeypatch.setattr(bench_report, "seed_values", lambda folder, label, metric="acc": vals[label])
    c = bench_report.Claim("fediir", "Table 8", "c", "f", "m", "b", "84.0 / 77.9")
    seeds = lambda *xs: [(k, x, "cuda") for k, x in enumerate(xs)]
    vals.update(m=seeds(80.0, 82.0), b=seeds(77.0, 77.2))          # d = 3.9 > 2 · 1.414
    assert bench_report.verdict(c)[:2] == ("holds", "holds (+3.9; 2 std 2.8; paper +6.1)")
    vals.update(m=seeds(80.0, 84.0))                                # d = 4.9 < 2 · 2.828
    assert bench_report.verdict(c)[0] == "within 2 std"
    vals.update(m=seeds(70.0, 70.2))                                # d = −7.0
    assert bench_report.verdict(c)[0] == "reversed"
    assert bench_report.verdict(bench_report.Claim(**{**c.__dict__, "sign": -1}))[0] == "holds"
    vals.update(m=seeds(80.0))
    assert bench_report.verdict(c)[0] == "one seed"


def test_no_relative_link_or_image_points_nowhere():
    assert {str(p.relative_to(HERE)): broken_links(p) for p in DOCS if broken_links(p)} == {}


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "fig.svg").write_text("<svg/>")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# A page\n\n## Results at a glance\n\n"
                    "[ok](../fig.svg) ![ok](../fig.svg) [ok](#results-at-a-glance) [ok](page.md#a-page) [web](https://x.org/y)\n"
                    "[gone](../nope.md) ![gone image](../missing.png) [bad anchor](#nowhere) [bad](page.md#none)\n"
                    "`[in code](../nope2.md)`\n\n```\n[in a block](../nope3.md)\n```\n")
    assert broken_links(page) == ["../nope.md", "../missing.png", "#nowhere", "page.md#none"]
