"""The documentation: its generated tables match the committed results (benchmark/report.py
--check), the README's counts and rules hold, no relative link points nowhere, and each method
page's "Copy it" loop runs as printed and gives the numbers of the method's copied functions,
every default a docstring or a page quotes is the tables' (QUOTED), and every signature a page
quotes is the code's (signatures)."""
import ast
import copy
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fedavg
import fediir
import fedloe
import fedomg
import harness
import report as bench_report
from tests.helpers import (
    FUNCTIONS, HERE, METHODS, LOE_FUNCTIONS, PLAIN, SIZES, as_floats, copied, copied_fediir_rounds,
    copied_perinvfl_rounds, flat, load, loe_own_rounds, own_model, own_rounds, perinvfl_rounds,
    pinv_copied, pinv_flags, split, thetas, three_clients, tiny,
)

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


# The documentation: its generated tables match the committed results (benchmark/report.py --check),
# and no relative link or image of the README, docs/ or benchmark/results/README.md points nowhere.
DOCS = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md")),
        HERE / "benchmark" / "results" / "README.md"]

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def anchors(path):
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces as
    '-'."""
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
    """`report.py --check` regenerates every block of the README, docs/ and
    benchmark/results/README.md from the committed results (text only) and exits 0 only if none
    would change."""
    p = subprocess.run([sys.executable, "benchmark/report.py", "--check"], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
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
    page.write_text(f"# t\n\n<!-- report:irm-central -->\n{stale}<!-- /report:irm-central "
                    "-->\ntext after\n")
    with pytest.raises(SystemExit) as e:
        bench_report.main(["--check"])
    assert e.value.code == 1 and "block 'irm-central' is out of date" in capsys.readouterr().err
    assert "66.8 ± 2.4 | 3 | 70.8 / 66.9" in page.read_text()           # --check writes nothing
    bench_report.main(["--no-figures"])
    assert page.read_text() == (f"# t\n\n<!-- report:irm-central -->\n{fresh}"
                                "<!-- /report:irm-central -->\ntext after\n")
    assert bench_report.main(["--check"]) == 0
    page.write_text("<!-- report:nosuch -->\nx\n<!-- /report:nosuch -->\n")
    assert "unknown block 'nosuch'" in str(pytest.raises(SystemExit, bench_report.main,
                                                         ["--check"]).value)
    page.write_text("<!-- report:glance -->\nx\n")
    assert "without its closing" in str(pytest.raises(SystemExit, bench_report.main,
                                                      ["--check"]).value)


def test_report_ptest_block_names_equal_rows_together(tmp_path, monkeypatch):
    """block_ptest: a personalised row equal in every cell to a ν row is named with it ("ν = θ_i"),
    ν rows of runs sharing ν appear once with θ_i's settings dropped from their label, and a row
    that differs in one cell stays on its own."""
    monkeypatch.setattr(bench_report, "RESULTS", tmp_path)
    (tmp_path / "f").mkdir()
    a, b = "| 11.5 ± 0.2 | 21.2 ± 0.1 | 3 |", "| 10.9 ± 0.2 | 20.7 ± 0.2 | 3 |"
    (tmp_path / "f" / "ptest.md").write_text("\n".join([
        "| method | p_test 0.1 | p_test 0.2 | seeds |", "|---|---|---|---|",
        f"| dual, theta kept, line 8 sgd {b}", f"| dual, theta kept, line 8 sgd (global ν) {a}",
        f"| dual, theta reset, line 8 sgd {a}", f"| dual, theta reset, line 8 sgd (global ν) {a}",
        "| other | 11.5 ± 0.2 | 21.3 ± 0.1 | 3 |"]) + "\n")
    lines = bench_report.block_ptest(tmp_path, "f")
    labels = [line.split("|")[1].strip() for line in lines[2:]]
    assert labels == ["dual, theta kept, line 8 sgd",
                      "dual (global ν) = dual, theta reset, line 8 sgd", "other"]


def test_readme_states_the_verdict_rule_and_the_methods_table_shows_the_gains():
    """The README's glance section prints report.RULE (the `rule` block), and every verdict of the
    methods table stands beside its measured and published gain ("... vs ... (2 std ...)"), but for
    a paper of more than four claims, whose cell counts them by verdict (each in the glance table),
    one sentence under both tables, which hold the same runs."""
    readme = (HERE / "README.md").read_text()
    rule = readme.split("<!-- report:rule -->\n")[1].split("<!-- /report:rule -->")[0]
    assert (" ".join(rule.split()) == "**The rule**: " + bench_report.RULE[0].lower()
            + bench_report.RULE[1:])
    methods = readme.split("<!-- report:methods -->\n")[1].split("<!-- /report:methods -->")[0]
    verdicts = re.findall(r"— ([a-z ]+): ([+−][\d.]+)(?: vs ([+−][\d.]+))? \(2 std [\d.]+", methods)
    many = {c.paper for c in bench_report.CLAIMS} - {
        p for p in {c.paper for c in bench_report.CLAIMS}
        if sum(c.paper == p for c in bench_report.CLAIMS) <= 4}
    assert many == {"fedipg"} and "11 claims — not reproduced: 9, direction holds: 2" in methods
    assert len(verdicts) == sum(c.paper not in many for c in bench_report.CLAIMS)
    assert {w for w, *_ in verdicts} <= set(bench_report.WORDS)
    assert methods.rstrip().endswith("Provenance: the runs of [Results at a glance]"
                                     "(#results-at-a-glance).")
    assert readme.count("when the clients shared one random stream") == 0
    assert "holds ×" not in readme and "within 2 std" not in readme


def test_provenance_line(tmp_path, monkeypatch):
    """report.provenance_line: the versions and the device of the results behind a table, grouped,
    with the runs that record none counted apart; none recorded: one sentence saying so; a block's
    text ends with the line of the files it read."""
    new = {"torch": "2.15.0", "numpy": "2.4.6", "python": "3.11.7", "device": "AMD EPYC",
           "commit": None, "dirty": None, "command": "python fedavg.py", "date": "2026-11-24"}
    (tmp_path / "a.json").write_text(json.dumps({"method": "fedavg", "provenance": new}))
    (tmp_path / "b.json").write_text(json.dumps({"method": "fedavg",
                                                 "provenance": dict(new, date="2026-11-25")}))
    (tmp_path / "old.json").write_text(json.dumps({"method": "fedavg"}))
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [{"seed": 0}, {"seed": 1}]}))
    (tmp_path / "gpu.json").write_text(json.dumps({"device": "NVIDIA H100", "torch": "2.11.0",
                                                   "started": "2026-11-22 18:00"}))
    line = bench_report.provenance_line([tmp_path / n
                                         for n in ("a.json", "b.json", "old.json", "runs.json")])
    shared = ("made when the clients shared one random stream (each draws its own since commit "
              f"{bench_report.STREAMS})")
    assert line == ("Provenance: torch 2.15.0, numpy 2.4.6, AMD EPYC (2 runs, 2026-11-24 to "
                    "2026-11-25); not recorded for the other 3 runs (made before 2026-11-24); all "
                    f"{shared}.")
    assert bench_report.provenance_line([tmp_path / "old.json"]) == \
        ("Provenance: not recorded (the 1 run behind this table was made before 2026-11-24); "
         f"all {shared}.")
    (tmp_path / "c.json").write_text(json.dumps({"method": "fedavg",
                                                 "provenance": dict(new, streams="per client")}))
    # its clients each drew their own
    assert bench_report.provenance_line([tmp_path / "c.json"]) == \
        "Provenance: torch 2.15.0, numpy 2.4.6, AMD EPYC (1 run, 2026-11-24)."
    assert bench_report.provenance_line([tmp_path / n for n in ("a.json", "c.json")]).endswith(
        f"AMD EPYC (2 runs, 2026-11-24); 1 of the 2 {shared}.")
    assert bench_report.provenance_line([tmp_path / "gpu.json"]) == \
        f"Provenance: torch 2.11.0, NVIDIA H100 (1 run, 2026-11-22); all {shared}."
    assert bench_report.provenance_line([]) == ""
    text = bench_report.block_text("irm-central", tmp_path)       # a committed table: its line last
    assert text.endswith("\n\nProvenance: not recorded (the 18 runs behind this table were made "
                         f"before 2026-11-24); all {shared}.\n")


def test_quicklook_block_from_its_committed_run(tmp_path, monkeypatch):
    """The README's quick-look sentence comes from the committed run and its time.txt (the
    conditions written before the run, then /usr/bin/time's line): the accuracies at the
    best-validation round, CPU and wall time, the CPU and versions (the run's provenance where it
    records one, else time.txt's)."""
    monkeypatch.setattr(bench_report, "RESULTS", tmp_path)
    (tmp_path / "quicklook").mkdir()
    run = {"seed": 0, "args": {"device": "cpu"}, "domains": {"0": {
        "test_acc": 0.40771, "val_acc": 0.76104, "best_round": 20,
        "history": [{"round": 10, "seconds": 100.0}, {"round": 20, "seconds": 230.0}]}}}
    (tmp_path / "quicklook" / "fedavg-rmnist-seed0.json").write_text(json.dumps(run))
    (tmp_path / "quicklook" / "time.txt").write_text(
        "command: OMP_NUM_THREADS=1 python fedavg.py --rounds 20 --test-domain 0\n"
        "torch 2.15.0+cu132, numpy 2.4.6, python 3.11.7\ndate: 2026-11-24\n"
        "load: the machine shared with other jobs\n"
        "Model name:                              AMD EPYC\n"
        "236.52user 3.10system 4:05.61elapsed 97%CPU (0avgtext+0avgdata 900000maxresident)k\n")
    text = bench_report.block_text("quicklook", tmp_path)
    assert ("test accuracy 0.408 on the held-out 0° domain, validation 0.761 (round 20, the best "
            "validation; seed 0), on one thread of an AMD EPYC." in text)
    assert ("three CPUs spread the validation over 0.007 with the code of 2026-11-24, whose "
            "numbers differ from these" in text)
    assert ("took 240 s of CPU time (237 s user, 3 s system) and 4.1 minutes of wall clock "
            "(the machine shared with other jobs)." in text)
    assert len(re.findall(r"\d+ s of CPU time", text)) == 1                    # one measured figure
    assert text.endswith("\n\nProvenance: torch 2.15.0+cu132, numpy 2.4.6, AMD EPYC (time.txt, "
                         "2026-11-24).\n")
    run["provenance"] = {"torch": "2.15.0", "numpy": "2.4.6", "device": "Intel Xeon",
                         "date": "2026-11-25"}
    (tmp_path / "quicklook" / "fedavg-rmnist-seed0.json").write_text(json.dumps(run))
    text = bench_report.block_text("quicklook", tmp_path)
    assert ("one thread of an Intel Xeon." in text
            and "Provenance: torch 2.15.0, numpy 2.4.6, Intel Xeon (the run, 2026-11-25)." in text)


def test_readme_test_count():
    """The README's "N tests" is the number of tests pytest collects from the checkout on a machine
    without CUDA (every parametrisation; a GPU adds the `[cuda]` runs of the bit-exactness tests):
    a count that cannot go stale unnoticed."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider"], cwd=HERE, capture_output=True, text=True,
                       timeout=300)
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    assert p.returncode == 0 and ids, p.stdout[-2000:] + p.stderr[-2000:]
    cpu = [i for i in ids if not re.search(r"[\[-]cuda[\]-]", i)]
    tests = (HERE / "README.md").read_text().split("## Tests\n")[1].split("\n## ")[0]
    stated = re.search(r"(\d+)\s+tests", tests)                       # (a line may break between)
    assert stated and int(stated[1]) == len(cpu), (
        f"README.md's Tests section says {stated and stated[1]} tests, "
        f"pytest collects {len(cpu)} (without CUDA)")


def test_verdict_rule_on_made_up_seeds(monkeypatch):
    """The one rule (report.RULE): with d the gain in the paper's direction, s = 2·max(std) and D
    the paper's own gain: reproduced when d > s and d ≥ D/2, smaller when d > s and d < D/2, not
    reproduced when |d| ≤ s, reversed when d < −s; a paper without a number: direction holds when d
    > s; one seed gives no verdict; the text shows d, D and s."""
    vals = {}
    monkeypatch.setattr(bench_report, "seed_values", lambda folder, label,
                        metric="acc": vals[label])
    c = bench_report.Claim("fediir", "Table 8", "c", "f", "m", "b", "84.0 / 77.9")    # D = +6.1
    seeds = lambda *xs: [(k, x, "cuda") for k, x in enumerate(xs)]
    vals.update(m=seeds(80.0, 82.0), b=seeds(77.0, 77.2))          # d = 3.9 > s = 2.8, d ≥ 3.05
    assert bench_report.verdict(c)[:2] == ("reproduced", "reproduced: +3.9 vs +6.1 (2 std 2.8)")
    vals.update(m=seeds(79.9, 80.1), b=seeds(77.9, 78.1))          # d = 2.0 > s = 0.28, d < 3.05
    assert bench_report.verdict(c)[:2] == ("smaller", "smaller: +2.0 vs +6.1 (2 std 0.3)")
    vals.update(m=seeds(80.0, 84.0), b=seeds(77.0, 77.2))          # d = 4.9 ≤ s = 5.7
    assert bench_report.verdict(c)[:2] == ("not reproduced",
                                           "not reproduced: +4.9 vs +6.1 (2 std 5.7)")
    vals.update(m=seeds(70.0, 70.2))                                # d = −7.0 < −s
    assert bench_report.verdict(c)[:2] == ("reversed", "reversed: −7.0 vs +6.1 (2 std 0.3)")
    flipped = bench_report.Claim(**{**c.__dict__, "sign": -1})      # a loss: lower is the
                                                                    # paper's direction
    assert bench_report.verdict(flipped)[:2] == ("reproduced",
                                                 "reproduced: +7.0 vs −6.1 (2 std 0.3)")
    # no number: direction only
    shape = bench_report.Claim(**{**c.__dict__, "published": "exit above kept"})
    vals.update(m=seeds(80.0, 80.2))
    assert bench_report.verdict(shape)[:2] == ("direction holds",
                                               "direction holds: +3.0 (2 std 0.3; direction only)")
    vals.update(m=seeds(77.0, 77.4))
    assert bench_report.verdict(shape)[0] == "not reproduced"
    vals.update(m=seeds(70.0, 70.2))
    assert bench_report.verdict(shape)[0] == "reversed"
    vals.update(m=seeds(80.0))
    assert bench_report.verdict(c)[:2] == ("one seed", "one seed: no verdict")
    for word in bench_report.WORDS:                             # the README's rule names every word
        assert f"*{word}*" in bench_report.RULE


def test_no_relative_link_or_image_points_nowhere():
    assert {str(p.relative_to(HERE)): broken_links(p) for p in DOCS if broken_links(p)} == {}


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "fig.svg").write_text("<svg/>")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# A page\n\n## Results at a glance\n\n[ok](../fig.svg) ![ok](../fig.svg) "
                    "[ok](#results-at-a-glance) [ok](page.md#a-page) "
                    "[web](https://x.org/y)\n[gone](../nope.md) ![gone image](../missing.png) [bad "
                    "anchor](#nowhere) [bad](page.md#none)\n`[in code](../nope2.md)`\n\n```\n[in a "
                    "block](../nope3.md)\n```\n")
    assert broken_links(page) == ["../nope.md", "../missing.png", "#nowhere", "page.md#none"]


def test_fedavg_docs_loop_runs():
    """docs/fedavg.md's 'Copy it' loop, run as printed (2 rounds instead of 100) with the copied
    server_update, on three clients of its own: it gets what the test's own loop gets."""
    text = (HERE / "docs" / "fedavg.md").read_text()
    block = text.split("## Copy it")[1].split("```python\n")[1].split("```")[0]
    assert "range(100)" in block
    m = copied(fedavg, "server_update")
    clients = [(x.float() / 255, y) for x, y in three_clients()]
    ns = {"model": own_model(), "clients": clients, "server_update": m.server_update}
    torch.manual_seed(5)
    exec(block.replace("range(100)", "range(2)"), ns)
    model = own_model()
    torch.manual_seed(5)
    theta = flat(model)
    for t in range(2):
        delta_sum = torch.zeros_like(theta)
        for x, y in clients:
            load(model, theta)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
            for idx in torch.randperm(len(y)).split(64):
                loss = F.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            delta_sum += float(len(y)) * (flat(model) - theta)
        theta = m.server_update(theta, delta_sum, sum(float(len(y)) for _, y in clients))
    assert torch.equal(ns["theta"], theta) and torch.equal(flat(ns["model"]), theta)
    assert not torch.equal(theta, flat(own_model()))


def test_fediir_docs_loop_is_the_copied_loop():
    """The "Copy it" loop of docs/fediir.md, executed as printed with the copied functions (its
    draws from the global generator), gives the θ and g̃ of the loop above with the same draws: bit
    for bit, so the page's loop is the one checked against fediir_round."""
    m = copied(fediir, *PLAIN)
    clients = three_clients()
    page = (HERE / "docs" / "fediir.md").read_text()
    loop = re.search(r"## Copy it\n.*?```python\n(.*?)```", page, re.S).group(1)
    model = own_model()      # seeds the global generator: the loop below draws from it as it stands
    ns = dict(vars(m), torch=torch, featurizer=model.featurizer, classifier=model.classifier, T=2,
              C=3, B=4, lr=0.1, E=2, gamma=0.5, clients=[(x.float() / 255, y) for x, y in clients])
    exec(loop, ns)
    theta, g_tilde = copied_fediir_rounds(m, clients, 2, 0.5, 0.95, 4, False, False,
                                          draws=(torch.default_generator, lambda t,
                                                 c: torch.default_generator))
    assert torch.equal(ns["theta"], theta), (ns["theta"] - theta).abs().max()
    assert torch.equal(flat(model), theta)                                 # and the model holds θ^T
    assert torch.equal(ns["g_tilde"], g_tilde)


def test_fedomg_docs_loop_is_the_tested_loop():
    """The loop of docs/fedomg.md's "Copy it", run as written (but 20 rounds, for time) on the
    copied functions (own_model, three clients as float images, U = 3), finds the θ of own_rounds
    with the docs' settings and torch's global generator: the page shows the loop that
    test_fedomg_copied checks."""
    page = (HERE / "docs" / "fedomg.md").read_text()
    section = page.split("## Copy it")[1].split("\n## ")[0].split("### The whole round")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    m = copied(fedomg, *FUNCTIONS)
    clients = three_clients()
    model = own_model()                                # seeds torch's generator, as own_rounds does
    ns = dict(vars(m), model=model, clients=[(x.float() / 255, y) for x, y in clients], U=3)
    loop = blocks[1].replace("R, kappa, lr, E, B = 100,", "R, kappa, lr, E, B = 20,")
    assert loop != blocks[1]
    exec(loop, ns)
    expected = own_rounds(m, clients, 0.5, True, lambda U: U * 1.25, True, rounds=20, lr=1e-3,
                          weight_decay=5e-4, batch_size=16, epochs=5, docs=True)
    assert torch.equal(flat(model), expected) and torch.equal(ns["theta"], expected)


def test_fedloe_docs_loop_is_the_tested_loop():
    """The loop of docs/fedloe.md's "Copy it", run as written (but a smaller budget, for time) on
    the copied functions, the test's model and its three clients, finds the θ of loe_own_rounds with
    the docs' settings and torch's global generator: the page shows the loop that test_fedloe_copied
    checks."""
    page = (HERE / "docs" / "fedloe.md").read_text()
    section = page.split("## Copy it")[1].split("\n## ")[0].split("### The whole round")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    m = copied(fedloe, *LOE_FUNCTIONS)
    clients = as_floats(split(three_clients(sizes=SIZES)))
    model = tiny()                                 # seeds torch's generator, as loe_own_rounds does
    ns = dict(vars(m), model=model, clients=clients)
    loop = blocks[1].replace("K1, E1, K2, E2, B = 8, 256, 4, 8, 128",
                             "K1, E1, K2, E2, B = 2, 4, 2, 4, 16")
    assert loop != blocks[1]
    exec(loop, ns)
    expected, phi = loe_own_rounds(m, clients, 2, 4, 2, 4, 16, 1e-3, 0.0, 0.05, 5e-4, "fish", 100.0,
                                   100, 0.05, docs=True)
    assert torch.equal(flat(model), expected) and torch.equal(ns["phi"], phi)


def test_perinvfl_docs_loop_is_the_method():
    """The "Copy it" loop of docs/perinvfl.md (the RC-MNIST reading: full batch, R = S = 1, θ_i ←
    ν^t, plain line-8 steps, the server's Adam, λ's switch), executed as printed with the copied
    functions and its client draw seeded like perinvfl_rounds' sampler: ν^2 and the θ_i are
    perinvfl_round's and the loop above's, bit for bit."""
    m = pinv_copied()
    clients = three_clients()
    page = (HERE / "docs" / "perinvfl.md").read_text()
    loop = [b for b in re.findall(r"```python\n(.*?)```", page.split("## Copy it", 1)[1], re.S)
            if "for t in" in b][0]
    model = own_model()
    hyper = dict(lam=50.0, anneal=1, beta=0.5, wd=0.01, gamma=0.1, eta=0.05, alpha=1.0)
    ns = dict(vars(m), torch=torch, copy=copy, model=model, T=2, C=3, **hyper,
              clients=[(x.float() / 255, y) for x, y in clients])
    torch.manual_seed(2)                                            # the loop's draw of the clients
    exec(loop, ns)
    loop_args = dict(hyper, momentum=0.0, R=1, S=1, B=10 ** 6)
    expected, state = perinvfl_rounds(clients, 2, pinv_flags(loop_args,
                                                        dict(inv="irm", personalize="dual",
                                                             theta="reset",
                                                                        opt="adam", R=1, S=1)))
    assert torch.equal(ns["nu"], expected), (ns["nu"] - expected).abs().max()
    assert torch.equal(flat(model), expected)                              # the model holds ν^T
    assert all(torch.equal(ns["theta"][i], thetas(state)[i]) for i in range(3))
    nu, _, _ = copied_perinvfl_rounds(m, clients, 2, **loop_args)
    assert torch.equal(ns["nu"], nu)


# Every default that a docstring or a page quotes, beside the tables it comes from: (file, the
# quoted text as it stands there, the method, the dataset, {flag: the value a run resolves}). A
# changed table fails here until each quote that restates it is changed too.
QUOTED = [
    ("fedavg.py", "(RotatedMNIST: lr 1e-2, batch 64;", "fedavg", "rmnist",
     dict(lr=1e-2, batch_size=64)),
    ("fedavg.py", "VLCS 1e-3 / 32; PACS 2.5e-3 / 32; OfficeHome 1e-3 / 32), 100 rounds, 1 local "
     "epoch, SGD with momentum 0.9", "fedavg", "vlcs",
     dict(lr=1e-3, batch_size=32, rounds=100, local_epochs=1, momentum=0.9)),
    ("fedavg.py", "PACS 2.5e-3 / 32", "fedavg", "pacs", dict(lr=2.5e-3, batch_size=32)),
    ("fedavg.py", "OfficeHome 1e-3 / 32", "fedavg", "officehome", dict(lr=1e-3, batch_size=32)),
    ("fedavg.py", "η_g = 1, evaluation every 10 rounds", "fedavg", "rmnist",
     dict(global_lr=1.0, eval_every=10)),
    ("fediir.py", "γ from Table 3 (RotatedMNIST 1e-2,", "fediir", "rmnist", dict(gamma=1e-2)),
    ("fediir.py", "VLCS 5e-3,", "fediir", "vlcs", dict(gamma=5e-3)),
    ("fediir.py", "PACS 1e-3,", "fediir", "pacs", dict(gamma=1e-3)),
    ("fediir.py", "OfficeHome 5e-4,", "fediir", "officehome", dict(gamma=5e-4)),
    ("fediir.py", "lr / batch from Table 3 (RotatedMNIST 1e-2 / 64); v = 0.95 (Appendix C); 100 "
     "rounds, 1 local epoch, SGD momentum 0.9", "fediir", "rmnist",
     dict(lr=1e-2, batch_size=64, ema=0.95, rounds=100, local_epochs=1, momentum=0.9)),
    ("docs/fediir.md", "RotatedMNIST 1e-2 / 64 / 1e-2,", "fediir", "rmnist",
     dict(lr=1e-2, batch_size=64, gamma=1e-2)),
    ("docs/fediir.md", "VLCS 1e-3 / 32 / 5e-3,", "fediir", "vlcs",
     dict(lr=1e-3, batch_size=32, gamma=5e-3)),
    ("docs/fediir.md", "PACS 2.5e-3 / 32 / 1e-3,", "fediir", "pacs",
     dict(lr=2.5e-3, batch_size=32, gamma=1e-3)),
    ("docs/fediir.md", "OfficeHome 1e-3 / 32 / 5e-4", "fediir", "officehome",
     dict(lr=1e-3, batch_size=32, gamma=5e-4)),
    ("docs/fediir.md", "γ = 1e-2 (Table 3, the code's form), B = 64, lr = 1e-2, E = 1", "fediir",
     "rmnist", dict(gamma=1e-2, batch_size=64, lr=1e-2, local_epochs=1)),
    ("fedomg.py", "κ = 0.5 (Table 4). η_g: 0.5 on pacs, vlcs, officehome", "fedomg", "pacs",
     dict(kappa=0.5, global_lr=0.5)),
    ("fedomg.py", "1 on the FL datasets", "fedomg", "mnist", dict(global_lr=1.0)),
    ("fedomg.py", "elsewhere `auto`", "fedomg", "rmnist", dict(global_lr="auto")),
    ("fedomg.py", "DG: pretrained ResNet-18 + linear head, SGD lr 1e-3, batch 16, momentum 0.9, "
     "weight decay 5e-4, 5 local epochs", "fedomg", "vlcs",
     dict(model="resnet18", head="linear", lr=1e-3, batch_size=16, momentum=0.9,
          weight_decay=5e-4, local_epochs=5)),
    ("fedloe.py", "Table 5 (batch 128, E1 256, K1 8, Adam lr 5e-5 PACS /", "fedloe", "pacs",
     dict(batch_size=128, stage1_epochs=256, stage1_comms=8, lr=5e-5)),
    ("fedloe.py", "3e-5 OfficeHome, E2 8, K2 4, stage 2 lr 0.05 / wd 5e-4, λ 100, meta lr 0.05), "
     "Figure 1a (20 clients)", "fedloe", "officehome",
     dict(lr=3e-5, stage2_epochs=8, stage2_comms=4, stage2_lr=0.05, stage2_wd=5e-4,
          dg_lambda=100.0, meta_lr=0.05, clients=20)),
    ("perinvfl.py", "lr γ 4.898e-4, L2 1.10794568e-3, λ = 1 for 190 rounds then 91257.186",
     "perinvfl", "rcmnist", dict(lr=4.898e-4, weight_decay=2 * 1.10794568e-3, anneal=190,
                                 lam=91257.186)),
    ("perinvfl.py", "500 rounds, R = S = 1, α = 1", "perinvfl", "rcmnist",
     dict(rounds=500, R=1, S=1, global_lr=1.0)),
    ("perinvfl.py", "plain steps of η = 0.1", "perinvfl", "rcmnist", dict(eta=0.1, beta=1.0)),
    ("fedipg.py", "λ 1e-3, the middle of Figure 4's range", "fedipg", "rmnist", dict(lam=1e-3)),
    ("fedipg.py", "1e-4 (its low end) for the ResNet datasets", "fedipg", "pacs", dict(lam=1e-4)),
    ("fedipg.py", "η = --lr, --exit-L 0.5, --exit-warmup 5", "fedipg", "rmnist",
     dict(exit_L=0.5, exit_warmup=5)),
    ("docs/protocol.md", "rmnist 64 / 1e-2,", "fedavg", "rmnist", dict(batch_size=64, lr=1e-2)),
    ("docs/protocol.md", "vlcs 32 / 1e-3, pacs 32 / 2.5e-3, officehome 32 / 1e-3", "fedavg",
     "pacs", dict(batch_size=32, lr=2.5e-3)),
    ("docs/protocol.md", "label skew 16 / 5e-3; stained 64 / 0.1", "fedavg", "mnist",
     dict(batch_size=16, lr=5e-3, local_epochs=5, momentum=0.0)),
    ("docs/protocol.md", "stained 64 / 0.1", "fedavg", "stained", dict(batch_size=64, lr=0.1)),
    ("README.md", "1 local epoch, SGD lr 1e-2, batch 64", "fedavg", "rmnist",
     dict(local_epochs=1, lr=1e-2, batch_size=64)),
]


@pytest.mark.parametrize("path,text,method,dataset,values", QUOTED,
                         ids=[f"{q[0]}:{q[3]}:{','.join(q[4])}" for q in QUOTED])
def test_every_quoted_default_is_the_one_a_run_resolves(path, text, method, dataset, values,
                                                        tmp_path):
    """The numbers a docstring or a page quotes are those of the tables (harness.resolve with the
    dataset alone on the command line)."""
    page = " ".join((HERE / path).read_text().split())
    assert " ".join(text.split()) in page, (path, text)
    argv = ["--dataset", dataset, "--out", str(tmp_path / "r.json")]
    args = harness.resolve(harness.method(method), argv)
    assert {k: getattr(args, k) for k in values} == values


# Every signature a page of docs/ quotes, beside the code's, so that neither drifts alone: a code
# span `f(a, b=1)` or `module.f(...)`, or a line of a code block that starts with one (a "Copy it"
# listing), that names a function or class of a method file or common.py (a bare name: the page's
# own method's, on docs/<method>.md) and whose arguments read as parameters (names, each with a
# literal default or none; a call with expressions is no signature). It must list the code's
# parameters in order, with the code's defaults: all of them where it quotes a default or lists
# its own method's function; elsewhere a call's shape (`common.on_clients(fn, S, sent, t, ctx)`)
# may leave out trailing parameters that have defaults.
SPAN = re.compile(r"`(?:(\w+)\.)?(\w+)\(([^`()]*)\)`")
LISTED = re.compile(r"^(?:(\w+)\.)?(\w+)\(([^()]*)\)\s*(?:#.*)?$")


def quoted_signatures(page):
    """(module, name, [(parameter, default or inspect.Parameter.empty)], strict, where) for every
    signature the page quotes (the comment above says which)."""
    own = page.stem if page.stem in METHODS else None
    text, found = page.read_text(), []
    blocks = text.split("```")
    for k, part in enumerate(blocks):
        if k % 2:                                       # inside a code block: its listing lines
            hits = [LISTED.match(line) for line in part.splitlines()]
            hits = [(m, part.count("\n", 0, part.find(m.group(0)))) for m in hits if m]
        else:
            hits = [(m, part.count("\n", 0, m.start())) for m in SPAN.finditer(part)]
        line0 = "```".join(blocks[:k]).count("\n") + 1
        for m, at in hits:
            module, name, params = m.group(1) or own, m.group(2), " ".join(m.group(3).split())
            if module not in ("common", *METHODS):
                continue
            obj = getattr(importlib.import_module(module), name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or \
                    obj.__module__ != module:
                continue
            try:
                args = ast.parse(f"def f({params}): pass").body[0].args
                defaults = [ast.literal_eval(d) for d in args.defaults]
            except (SyntaxError, ValueError):
                continue                                  # a call, not a signature
            names = [a.arg for a in args.args]
            empty = [inspect.Parameter.empty] * (len(names) - len(defaults))
            quote = m.group(0).strip("`").split(")")[0] + ")"
            pairs = list(zip(names, empty + defaults))
            if args.kwarg:                                  # **given: after the others
                pairs.append((f"**{args.kwarg.arg}", inspect.Parameter.empty))
            found.append((module, name, pairs,
                          bool(defaults) or m.group(1) is None,
                          f"{page.relative_to(HERE)}:{line0 + at}: {quote}"))
    return found


def signature_problems(module, name, quoted, strict):
    """What a quoted signature gets wrong against the code's (none: [])."""
    code = [(f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name, p.default) for p in
            inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()]
    shown = lambda p: p[0] if p[1] is inspect.Parameter.empty else f"{p[0]}={p[1]!r}"
    problems = [f"{shown(q)} where the code has {shown(c)}" for q, c in zip(quoted, code)
                if q != c and (strict or q[0] != c[0] or q[1] is not inspect.Parameter.empty)]
    problems += [f"{shown(q)}: not in the code" for q in quoted[len(code):]]
    problems += [f"{shown(c)} left out" for c in code[len(quoted):]
                 if strict or c[1] is inspect.Parameter.empty]
    return problems


def test_every_quoted_signature_is_the_codes():
    """Every signature a page of docs/ quotes has the code's parameter names and defaults (found:
    the "Copy it" listings and tables of the method pages, and common's functions elsewhere)."""
    found = [q for page in sorted((HERE / "docs").glob("*.md")) for q in quoted_signatures(page)]
    assert len({q[:2] for q in found}) >= 30 and {m for m, *_ in found} >= {"common", *METHODS}
    bad = [f"{where}: {'; '.join(problems)}" for module, name, params, strict, where in found
           if (problems := signature_problems(module, name, params, strict))]
    assert not bad, "\n".join(bad)


def test_a_drifted_signature_is_found(tmp_path, monkeypatch):
    """The check itself: a default, a name, a missing parameter or a parameter too many, in a code
    span or a listing line, each fails; a call (an expression among its arguments), another
    module's function and a shorter call shape of common's pass."""
    monkeypatch.setattr(sys.modules[__name__], "HERE", tmp_path)
    page = tmp_path / "fedomg.md"
    page.write_text("`objective(Gamma, K, a, kappa, eps=0.0)` and `fedavg.server_update(theta, "
                    "thetas, m, global_lr=1.0)`, `common.stream(seed, domain, t, client, phase)`,\n"
                    "`server_update(theta, [1.0] * 3, N, eta_g)`, `data.load(dataset, root)`, "
                    "`common.on_clients(fn, S, sent, t, ctx)`, `gram(G)`\n```python\n"
                    "solve(K, a, kappa, eps=1e-4, evaluations=21, lr=25.0, momentum=0.5, x=1)\n"
                    "    updates(theta, thetas, U)\n```\n")
    found = quoted_signatures(page)
    assert [(name, bool(signature_problems(module, name, params, strict)), where.split(":")[1])
            for module, name, params, strict, where in found] == [
        ("objective", True, "1"), ("server_update", True, "1"), ("stream", True, "1"),
        ("on_clients", False, "2"), ("gram", True, "2"), ("solve", True, "4")]
    assert [signature_problems(module, name, params, strict)
            for module, name, params, strict, _ in found if name != "on_clients"] == [
        ["eps=0.0 where the code has eps=0.0001"],
        ["thetas where the code has delta_sum", "m where the code has weight_sum"],
        ["device left out"],
        ["cols=65536 left out"],
        ["x=1: not in the code"]]
