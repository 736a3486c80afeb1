"""Tables and figures from results JSON files (benchmark/run.py's folders, or any results of the
method scripts): test accuracy per held-out domain, mean ± std over seeds, the best mean in bold;
seconds per round and images per second with the ratio to FedAvg; figures (PNG and SVG) of accuracy
against round, of accuracy against p_test on RC-MNIST, and of benchmark/speed.py's seconds per
round. Without folders: every results table of the documentation, from the committed results.

    python benchmark/report.py results/benchmark/rmnist-50clients [more folders] [--out report.md]
    python benchmark/report.py --speed speed.json [folders]   # speed.py --json's table and bars
    python benchmark/report.py              # rewrite every generated block, redraw the figures
    python benchmark/report.py --check      # exit 1 naming each block that would change (text only)

Runs are grouped by folder, then by label: the one benchmark/run.py records in a run's JSON
("label"), else the name run.py gives its file, <label>-seed<S>.json with S the run's own seed (the
committed folders' files are named so, by hand), else the JSON's "method" where the file has the
method script's default name (<method>-<dataset>-seed<S>.json), else the whole file name. A *.json
in a folder that holds no complete run is skipped, not refused, and named under the folder's table
("Left out (incomplete or unreadable)"): an incomplete run, or a file that is unreadable, not JSON,
or JSON of another shape (a list, a number, a dict that is no run). The std is over seeds (n − 1 in
the denominator; 0 with one seed). Images per second = training examples of the sampled clients ×
local epochs × training rounds / seconds of the run (evaluation time included; a method's extra
passes, e.g. FedIIR's global-gradient pass, are not counted as images; FedLOE's training rounds are
its stage-1 communications). With --out, an existing file's text above its first "## " heading (a
hand-written introduction: how the results were made) is kept. The papers' numbers are printed
beside a table when the dataset and scenario match one of the papers (PAPERS below, each number with
the paper's table it comes from: FedIIR Tables 1, 2, 8; FedOMG Tables 1, 2; FedLOE Table 2;
FedIPG Tables II, III; PerInvFL Tables 2, 5); they used the full datasets, GPUs and their own round
counts; the figures draw them as dashed lines.

Every figure is written beside its data: <folder>/accuracy.{png,svg} (mean over seeds ± std band,
per method); on rcmnist / rcfmnist <folder>/ptest.{png,svg} (every p_test: scored from the
checkpoints by rcmnist_ptest.py when every run has its .ckpt, else from the ptest.md it wrote); with
--speed, the bar chart beside the JSON. The figures need matplotlib (pip install matplotlib;
benchmark/ only).

Generated blocks. README.md, docs/*.md and benchmark/results/README.md hold every results table
between two marker lines, <!-- report:NAME --> and <!-- /report:NAME -->. Without folders this
script rewrites the text between them from the committed results (benchmark/results/, the committed
files only: p_test tables from ptest.md, never from local checkpoints), and redraws the figures of
the `folder:`, `speed:` and `speed-table:` blocks unless --no-figures; --check only compares, names
every block that would change on stderr and exits 1. A new results folder gets its section in
benchmark/results/README.md by the two marker lines with NAME = folder:<folder>; BLOCKS lists the
other kinds. Every verdict follows one rule (RULE below, printed in the README by the `rule` block):
the measured gain against the paper's own gain and twice the larger seed std. Beside every generated
table a line names the torch and numpy versions and the device the results behind it were made with
(their "provenance", written into every results file since 2026-11-24), or says it was not recorded.
"""
import json
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
# the method scripts' own: bad input is one line, exit 2
from data import UserError  # noqa: E402
from harness import METHODS, outputs  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402

# (dataset[-held-out domain | -stain | -alpha], scenario) -> [(label, mean test accuracy %, source)]
PAPERS = {
    ("rmnist", "small"): [("fedavg", 94.5, "FedIIR Tab. 1"), ("fediir", 95.0, "FedIIR Tab. 1"),
                          ("fedipg", 96.40, "FedIPG Tab. II")],
    ("rmnist", "large"): [("fedavg", 90.8, "FedIIR Tab. 2"), ("fediir", 93.0, "FedIIR Tab. 2"),
                          ("fedipg", 95.68, "FedIPG Tab. II")],
    ("pacs", "small"): [("fedavg", 83.1, "FedIIR Tab. 1"), ("fediir", 83.7, "FedIIR Tab. 1"),
                        ("fedomg", 88.4, "FedOMG Tab. 2"), ("fedloe-fish", 86.60, "FedLOE Tab. 2")],
    ("vlcs", "small"): [("fedavg", 76.3, "FedIIR Tab. 1"), ("fediir", 76.6, "FedIIR Tab. 1"),
                        ("fedomg", 82.0, "FedOMG Tab. 2")],
    ("rmnist-0", "large"): [("fedavg", 77.9, "FedIIR Tab. 8, 0°"),
                            ("fediir", 84.0, "FedIIR Tab. 8, 0°")],
    ("rmnist-75", "large"): [("fedavg", 81.2, "FedIIR Tab. 8, 75°"),
                             ("fediir", 84.5, "FedIIR Tab. 8, 75°")],
    ("mnist-alpha0.1", "fl"): [("fedavg", 93.77, "FedOMG Tab. 1, α 0.1"),
                               ("fedomg", 98.75, "FedOMG Tab. 1, α 0.1")],
    ("mnist-alpha0.5", "fl"): [("fedavg", 91.47, "FedOMG Tab. 1, α 0.5"),
                               ("fedomg", 98.58, "FedOMG Tab. 1, α 0.5")],
    ("stained-fg", "stained"): [("erm", 55.78, "FedIPG Tab. III"),
                                ("fedavg", 45.73, "FedIPG Tab. III"),
                                ("fedipg", 63.99, "FedIPG Tab. III")],
    ("stained-bg", "stained"): [("erm", 52.79, "FedIPG Tab. III"),
                                ("fedavg", 49.71, "FedIPG Tab. III"),
                                ("fedipg", 62.77, "FedIPG Tab. III")],
    ("stained-both", "stained"): [("erm", 66.46, "FedIPG Tab. III"),
                                  ("fedavg", 52.78, "FedIPG Tab. III"),
                                  ("fedipg", 62.08, "FedIPG Tab. III")],
    ("rcmnist", "fl"): [("fedavg", 20.77, "PerInvFL Tab. 2, p_test 0.1"),
                        ("perinvfl (global)", 51.48, "IRM row"),
                        ("perinvfl", 53.46, "PerInvFL Tab. 2")],
}


def label_of(path, r):
    """A run's row (see the docstring): its results' own label, else what the file name says of it.
    The JSON comes first because a file can be renamed or copied; the file name only where the JSON
    records no label (every run before run.py recorded one, and every run made without run.py)."""
    if isinstance(r.get("label"), str) and r["label"]:
        return r["label"]
    stem, seed = Path(path).stem, r.get("seed")
    # the method script's default --out: nobody chose a label
    if r.get("method") and stem == f"{r['method']}-{r.get('dataset')}-seed{seed}":
        return r["method"]
    if seed is not None and stem.endswith(f"-seed{seed}") and len(stem) > len(f"-seed{seed}"):
        return stem[:-len(f"-seed{seed}")]
    return stem


def run_of(path):
    """The results of one complete run in a *.json file, or None where it holds none: an incomplete
    run, or a file that is not a run's results (unreadable, not JSON, or JSON of another shape: a
    list, a number, a dict without its "args" and a non-empty "domains" of one dict per domain)."""
    try:
        r = json.loads(Path(path).read_text())
    except (OSError, ValueError):                  # a folder named *.json, bytes that are not text
        return None
    if not isinstance(r, dict) or not r.get("complete", True):
        return None
    if not isinstance(r.get("args"), dict):
        return None
    doms = r.get("domains")
    ok = isinstance(doms, dict) and doms and all(isinstance(d, dict) for d in doms.values())
    return r if ok else None


def load(folder):
    """({label: [results]}, [names of the *.json files left out]) for a folder: every file that
    run_of finds no complete run in is left out (and named under the folder's table), never read
    further; label_of names the runs."""
    runs, skipped = {}, []
    for f in sorted(Path(folder).glob("*.json")):
        r = run_of(f)
        if r is None:
            skipped.append(f.name)
            continue
        SOURCES.add(f)
        label = label_of(f, r)
        runs.setdefault(label, []).append(r)
        if "global_test_acc" in next(iter(r["domains"].values())):   # PerInvFL's global ν
            g = json.loads(json.dumps(r))
            for d in g["domains"].values():
                d["test_acc"] = d["global_test_acc"]
                for row in d["history"]:
                    row["test_acc"] = row["global_test_acc"]
            runs.setdefault(label + " (global)", []).append(g)
    return runs, skipped


# the results files read since the last provenance_line() (behind the table being made)
SOURCES = set()
BEFORE = "2026-11-24"   # the first day every results file records its provenance
# the commit from which each client draws from its own random stream (docs/protocol.md)
STREAMS = "3c1e8ca"


def provenance(path):
    """[(torch, numpy, device, date) or None per run] of one results file: its "provenance" dict
    (the method scripts' files, and each run of a file that holds several); a file without one but
    with its own top-level "torch" and "device" (gpu_check.py's) gives those."""
    try:
        r = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return [None]
    if not isinstance(r, dict):
        return [None]
    recs = [r.get("provenance")] if "provenance" in r or "runs" not in r else \
        [x.get("provenance") for x in r["runs"] if isinstance(x, dict)] or [None]
    if recs == [None] and "torch" in r and "device" in r:
        recs = [{"torch": r["torch"], "device": r["device"], "date": str(r.get("started", ""))[:10],
                 **({"streams": r["streams"]} if "streams" in r else {})}]
    return [(p.get("torch"), p.get("numpy"), p.get("device"), p.get("date"), "streams" in p)
            if isinstance(p, dict) else None for p in recs]


def provenance_line(paths=None, brief=False):
    """One line: the torch and numpy versions, the device and the dates of the results behind a
    table (`paths`, default the files read since the last call), or that they were not recorded;
    brief (the README, which says once when the clients' streams became their own): how many drew
    from one shared stream, without the why."""
    global SOURCES
    paths, SOURCES = sorted(set(SOURCES if paths is None else paths)), set()
    recs = [p for f in paths for p in provenance(f)]
    known, missing = {}, sum(p is None for p in recs)
    # runs whose clients drew from one shared stream
    shared = sum(p is None or not p[4] for p in recs)
    for tv, nv, dev, date, _ in (p for p in recs if p):
        known.setdefault((tv, nv, dev), []).append(date or "")
    parts = []
    for (tv, nv, dev), dates in sorted(known.items(), key=lambda kv: str(kv[0])):
        ds = sorted(d for d in dates if d)
        when = (ds[0] if ds[0] == ds[-1] else f"{ds[0]} to {ds[-1]}") if ds else "undated"
        parts.append(", ".join(x for x in (tv and f"torch {tv}", nv and f"numpy {nv}", dev) if x)
                     + f" ({len(dates)} run{'s' * (len(dates) > 1)}, {when})")
    if missing:
        runs = f"{missing} run{'s' * (missing > 1)}"
        were = "were" if missing > 1 else "was"
        parts.append(f"not recorded for the other {runs} (made before {BEFORE})" if known else
                     f"not recorded (the {runs} behind this table {were} made before {BEFORE})")
    if shared and brief:
        parts.append(("all" if shared == len(recs) else f"{shared} of the {len(recs)}")
                     + " on the clients' one shared stream")
    elif shared:
        parts.append(("all" if shared == len(recs) else f"{shared} of the {len(recs)}")
                     + " made when the clients shared one random stream "
                     f"(each draws its own since commit {STREAMS})")
    return "Provenance: " + "; ".join(parts) + "." if parts else ""


def mean_std(xs):
    xs = 100 * np.asarray(xs, dtype=float)
    return xs.mean(), (xs.std(ddof=1) if len(xs) > 1 else 0.0)


def scenario(r):
    a = r["args"]
    if r["protocol"] == "clients":
        return "fl"
    if r["dataset"] == "stained":           # Table III: one setting per stain, whatever the clients
        return "stained"
    # one client per domain
    return "small" if a["clients"] == a["sample"] and a["clients"] <= 5 else "large"


def published_name(r):
    """The key under which PAPERS holds a run's published numbers: the dataset, with the stain
    (Table III), the Dirichlet α (FedOMG's Table 1: 0.1 and 0.5) or the one held-out domain
    (FedIIR's Table 8 reports 0° and 75° alone; Table 2 the mean over all six)."""
    a, d = r["args"], r["dataset"]
    if d == "stained":
        return f"{d}-{a.get('stain')}"
    if d == "mnist":
        return f"{d}-alpha{a.get('alpha')}"
    if d == "rmnist" and len(r["domains"]) == 1:
        return f"{d}-{next(iter(r['domains']))}"
    return d


def accuracy_table(runs):
    labels = sorted(runs)
    domains = list(next(iter(runs.values()))[0]["domains"])
    cols = domains + (["mean"] if len(domains) > 1 else [])
    cells = {}
    for lab in labels:
        for d in domains:
            cells[lab, d] = mean_std([r["domains"][d]["test_acc"] for r in runs[lab]
                                      if d in r["domains"]])
        if len(domains) > 1:
            cells[lab, "mean"] = mean_std([r["mean_test_acc"] for r in runs[lab]])
    best = {c: max(cells[lab, c][0] for lab in labels) for c in cols}
    lines = ["| method | " + " | ".join(cols) + " | seeds |", "|---" * (len(cols) + 2) + "|"]
    for lab in labels:
        row = []
        for c in cols:
            m, s = cells[lab, c]
            txt = f"{m:.1f} ± {s:.1f}"
            row.append(f"**{txt}**" if m == best[c] and len(labels) > 1 else txt)
        lines.append(f"| {lab} | " + " | ".join(row) + f" | {len(runs[lab])} |")
    return lines


def exit_table(runs):
    """FedIPG runs with an aberrant client (Section VI-A): per variant, who exited (per seed) and
    the accuracies at the selected round on the regular clients, the aberrant client (validation
    splits) and the held-out domain (test), per seed and their mean."""
    if not all("aberrant_acc" in d
               for rs in runs.values() for r in rs for d in r["domains"].values()):
        return []
    lines = ["| variant | exited (per seed) | regular clients | aberrant client "
             "| held-out domain |",
             "|---|---|---|---|---|"]
    for lab, rs in sorted(runs.items()):
        ds = [d for r in rs for d in r["domains"].values()]
        cell = lambda k: (", ".join(f"{100 * d[k]:.1f}" for d in ds)
                          + f" (mean {100 * sum(d[k] for d in ds) / len(ds):.1f})")
        exited = "; ".join(", ".join(map(str, d["exited"])) or "none" for d in ds)
        lines.append(f"| {lab} | {exited} | {cell('regular_acc')} | {cell('aberrant_acc')} "
                     f"| {cell('test_acc')} |")
    return ["", "Accuracy (%) at the selected round, per seed: the regular clients' and the "
            "aberrant client's validation splits, and the held-out domain's test set.", "", *lines]


def speed_table(runs):
    """Seconds per round and images / s per method, and the ratio to FedAvg's round; where the runs
    of a folder come from more than one device, one row per method and device, each against FedAvg
    on the same device."""
    lines = ["| method | s / round | images / s | × FedAvg |", "|---|---|---|---|"]
    several = len({r["args"].get("device") for rs in runs.values() for r in rs}) > 1
    sec, ips = {}, {}                                 # (label, device or None) -> one value per run
    for lab, rs in sorted(runs.items()):
        if lab.endswith("(global)"):
            continue
        for r in rs:
            a = r["args"]
            key = (lab, a.get("device") if several else None)
            for d in r["domains"].values():
                last = d["history"][-1]
                sec.setdefault(key, []).append(last["seconds"] / last["round"])
                if "train_examples" in d:                 # images through local training, whole run
                    # fedloe: stage 1 trains, stage 2 heads only
                    trained = a.get("stage1_comms", last["round"])
                    ips.setdefault(key, []).append(d["train_examples"] * a["sample"] / a["clients"]
                                                   * a["local_epochs"] * trained / last["seconds"])
    for (lab, dev), s in sorted(sec.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        base = sec.get(("fedavg", dev))
        ratio = f"{np.mean(s) / np.mean(base):.2f}" if base else "–"
        i = np.mean(ips[(lab, dev)]) if (lab, dev) in ips else float("nan")
        lines.append(f"| {lab}{f' ({dev})' if several else ''} | {np.mean(s):.3f} | {i:,.0f} "
                     f"| {ratio} |")
    if any(r["method"] == "fedloe" for rs in runs.values() for r in rs):
        lines += ["", "fedloe: a round is one communication (stage 1: every client trains E1/K1 "
                  "local epochs; stage 2: heads only), so its s / round is not a FedAvg round's; "
                  "its images / s counts the stage-1 images over the whole run."]
    return lines


def per_seed(runs):
    """{label: (rounds, [[accuracy % per round] per seed])}, each seed's accuracy the mean over its
    test domains, on the rounds all of the label's runs share."""
    out = {}
    for lab, rs in sorted(runs.items()):
        hist = [d["history"] for r in rs for d in r["domains"].values()]
        common = sorted(set.intersection(*[{row["round"] for row in h} for h in hist]))
        acc = [[np.mean([next(row["test_acc"] for row in d["history"] if row["round"] == t)
                         for d in r["domains"].values()]) for t in common] for r in rs]
        out[lab] = (np.array(common), 100 * np.array(acc))
    return out


def band(ys):
    """Mean and std (n − 1; 0 with one seed) over the rows (seeds)."""
    ys = np.asarray(ys, dtype=float)
    return ys.mean(0), (ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(ys.shape[1]))


def merged(series):
    """[(labels, (x, y))] from {label: (x, y)}: identical y drawn once and named together
    (PerInvFL's global ν does not depend on --personalize, so its three variants give the same
    curve)."""
    out = []
    for lab, v in series.items():
        same = next((g for g in out if np.array_equal(g[1][1], v[1])), None)
        if same:
            same[0].append(lab)
        else:
            out.append(([lab], v))
    return out


def matplotlib_figure():
    """matplotlib's Figure class, imported here only: the method files never need matplotlib and
    report.py imports it when it draws. A Figure without pyplot needs no backend or display."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("the figures need matplotlib, which is not installed "
                        "(pip install matplotlib)")
    matplotlib.rcParams["svg.hashsalt"] = "report"  # the same SVG for the same data (no random ids)
    return Figure


def new_axes(title, xlabel, ylabel, width=8.0):
    fig = matplotlib_figure()(figsize=(width, 4.2))
    ax = fig.subplots()
    ax.set_title(title, fontsize=9, loc="left")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


MARKERS = "osD^vPX*ph"


def curve(ax, k, x, m, s, labels, n):
    """Method k's mean (line) ± std (band). Each method has its own marker, and the earlier a
    method the thicker its line, so that a curve lying on another one (FedIPG on FedAvg) stays
    visible."""
    ax.plot(x, m, marker=MARKERS[k % len(MARKERS)], ms=4, lw=max(4.0 - 0.8 * k, 1.0),
            color=f"C{k}", label="\n= ".join(labels) + f" ({n} seed{'s' * (n > 1)})")
    ax.fill_between(x, m - s, m + s, color=f"C{k}", alpha=0.15, lw=0)


def legend(ax):
    # beside, not on, the curves
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def accuracy_figure(runs, title, paper=()):
    """Test accuracy against round: mean over seeds (line) ± std over seeds (band) per method, each
    published number as a dashed line in its method's colour."""
    fig, ax = new_axes(title, "communication round", "test accuracy (%)")
    colour = {}
    for k, (labs, (x, ys)) in enumerate(merged(per_seed(runs))):
        curve(ax, k, x, *band(ys), labs, len(ys))
        colour.update({lab: f"C{k}" for lab in labs})
    for lab, acc, src in paper:
        if lab in colour:
            ax.axhline(acc, ls="--", lw=1, color=colour[lab], label=f"{lab}: published, {src}")
    ax.set_ylim(0, 100)
    ax.xaxis.get_major_locator().set_params(integer=True)     # rounds: no 12.5
    legend(ax)
    return fig


# PerInvFL's Table 2 (RC-MNIST) at p_test 0.1 ... 0.5: our row drawn in its colour, a marker
PTEST_PAPER = {
    "FedAvg": ("fedavg", "x", [20.77, 29.66, 37.74, 45.15, 54.12]),
    "IRM": ("perinvfl irm dual (global ν)", "1", [51.48, 51.70, 52.17, 51.53, 51.18]),
    "PerInvFL": ("perinvfl irm dual", "+", [53.46, 52.75, 53.63, 51.41, 52.73]),
}


def ptest_table(folder, paths, score=True):
    """(the p_test values, {row: (mean %, std %, seeds) at each}, where from): scored from the
    runs' checkpoints by rcmnist_ptest.py when every run has one beside its results (and score),
    else read from the ptest.md that rcmnist_ptest.py wrote (checkpoints are not committed);
    (None, None, None) without."""
    if score and paths and all(Path(f"{f}.ckpt").is_file() for f in paths):
        from diagnostics import rcmnist_ptest                # torch and the data: only when scoring
        try:
            scored = rcmnist_ptest.table(paths)
        except (AssertionError, OSError, RuntimeError, KeyError, UserError) as e:
            # e.g. a cut run's checkpoint
            raise UserError(f"could not score the checkpoints in {folder}: {e}") from None
        ps = list(rcmnist_ptest.P_TEST)
        return ps, {name: (*band(100 * np.array(runs)[:, :len(ps)]), len(runs))
                    for name, runs in sorted(scored.items())}, "the runs' checkpoints"
    md = Path(folder) / "ptest.md"
    if not md.is_file():
        return None, None, None
    try:
        rows = [[c.strip() for c in line.strip().strip("|").split("|")]
                for line in md.read_text().splitlines()
                if line.startswith("|") and not line.startswith("|---")]
        cols = [i for i, c in enumerate(rows[0]) if c.startswith("p_test ")]
        cell = lambda c: [float(v) for v in c.split("±")]
        return ([float(rows[0][i].split()[1]) for i in cols],
                {r[0]: (*np.array([cell(r[i]) for i in cols]).T, int(r[-1])) for r in rows[1:]},
                md.name)
    except (IndexError, ValueError) as e:
        raise UserError(f"{md} is not rcmnist_ptest.py's table ({e})") from None


def ptest_figure(table, title, p_test, paper=True):
    """Accuracy against p_test (PerInvFL's Table 2 as a figure): mean ± std over seeds per row,
    the paper's rows dashed in the colour of the row they correspond to."""
    fig, ax = new_axes(title, "p_test (probability that the test colour agrees with the label)",
                       "test accuracy (%)")
    colour = {}
    rows = {name: (n, np.array([m, s])) for name, (m, s, n) in table.items()}
    for k, (names, (n, (m, s))) in enumerate(merged(rows)):
        curve(ax, k, p_test, m, s, names, n)
        colour.update({name: f"C{k}" for name in names})
    for name, (ours, marker, acc) in (PTEST_PAPER.items()
                                      if paper and p_test == [0.1, 0.2, 0.3, 0.4, 0.5] else ()):
        # two of them may share a colour (merged rows): markers tell them apart
        ax.plot(p_test, acc, ls="--", lw=1, marker=marker, ms=7, color=colour.get(ours, "0.4"),
                label=f"{name}: published, PerInvFL Tab. 2")
    ax.set_xticks(p_test)
    ax.set_ylim(0, 100)
    legend(ax)
    return fig


def speed_figure(speed):
    """Seconds per round of every variant timed by speed.py: the median (bar) and the fastest and
    slowest timed round (whiskers)."""
    names = list(speed["seconds"])
    secs = [np.array(speed["seconds"][k]) for k in names]
    med = np.array([np.median(v) for v in secs])
    fig, ax = new_axes(textwrap.fill("benchmark/speed.py: " + speed["setting"], 90),
                       "seconds per round", "one round of", width=7.0)
    ax.set_axisbelow(True)
    ax.barh(names, med, xerr=[med - [v.min() for v in secs], [v.max() for v in secs] - med],
            color=[f"C{k}" for k in range(len(names))], capsize=3)
    ax.invert_yaxis()                                     # first timed variant on top, as the table
    ax.legend(ax.patches, names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    return fig


def save(fig, stem):
    """stem.png (any viewer) and stem.svg (crisp in the GitHub README), without dates inside."""
    fig.savefig(f"{stem}.png", dpi=130, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(f"{stem}.svg", bbox_inches="tight", metadata={"Date": None})
    return fig


def title(first, name):
    """The benchmark's name, dataset and protocol on the first line, the data source below."""
    a = first["args"]
    how = ("fixed clients, test: every client's own test set, pooled"
           if first["protocol"] == "clients"
           else "leave one domain out, each held out in turn")
    return (f"{name}: {first['dataset']}, {how}; {a['clients']} clients, {a['sample']} per round\n"
            + "\n".join(textwrap.fill(part, 100)
                        for part in ("data: " + first["source"]).split("; ")))


def report(folder, where=".", figures=True, score=True):
    """The markdown section of one folder (and its figures beside it unless figures=False;
    score=False reads the p_test table from the committed ptest.md even where checkpoints are
    there)."""
    runs, skipped = load(folder)
    if not runs:
        return [f"## {folder}", "", "no complete results here", ""] + \
            ([f"Left out (incomplete or unreadable): {', '.join(skipped)}.", ""] if skipped else [])
    # the setting's name: FedAvg's run if any
    first = runs.get("fedavg", next(iter(runs.values())))[0]
    a = first["args"]
    shape = {lab: (rs[0]["args"]["rounds"], rs[0]["args"]["local_epochs"])
             for lab, rs in runs.items()}
    rounds = (f"{a['rounds']} rounds, {a['local_epochs']} local epoch(s)"
              if len(set(shape.values())) == 1 else
              "rounds × local epochs " + ", ".join(f"{lab} {r} × {e}"
                                                   for lab, (r, e) in shape.items()))
    lines = [f"## {Path(folder).name}", "",
             f"`{first['dataset']}`, {a['clients']} clients, {a['sample']} per round, {rounds}; "
             f"data: {first['source']}; test accuracy in % "
             f"({'last round' if a.get('select') == 'last' else 'at the best validation round'}), "
             f"mean ± std over seeds.", ""]
    lines += accuracy_table(runs)
    lines += exit_table(runs)
    name = published_name(first)
    paper = PAPERS.get((name, scenario(first)), [])
    if not any(lab in runs for lab, _, _ in paper):       # other variants (e.g. FedIPG's exit runs)
        paper = []
    if paper:
        scale = "not comparable in scale" if first["source"].startswith("embedded") \
            else "the runs above use full data"
        lines += ["", f"Published (full data, GPUs, the papers' own round counts; {scale}): "
                  + "; ".join(f"{lab} {m:.2f} ({src})" for lab, m, src in paper) + "."]
    lines += ["", *speed_table(runs)]
    # relative to the markdown file
    link = lambda stem, ext: os.path.relpath(f"{stem}.{ext}", where)
    stem = Path(folder) / "accuracy"
    if figures:
        save(accuracy_figure(runs, title(first, Path(folder).name), paper), stem)
    lines += ["", f"![test accuracy against round]({link(stem, 'svg')})", "",
              "Test accuracy (%) against round: each seed's accuracy is its mean over the test "
              "domains; line: the mean over seeds, band: ± the std over seeds"
              + ("; dashed: the published number" if paper else "")
              + f"; identical curves are drawn once, named together "
              f"([PNG]({link(stem, 'png')}))."]
    if first["dataset"] in ("rcmnist", "rcfmnist"):            # PerInvFL's p_test table as a figure
        paths = [f for f in sorted(Path(folder).glob("*.json")) if f.name not in skipped]
        p_test, table, source = ptest_table(folder, paths, score)
        if table:
            stem, rc = Path(folder) / "ptest", first["dataset"] == "rcmnist"
            # every p_test here
            head = title(first, Path(folder).name).replace(f", p_test {a['p_test']}", "")
            if figures:
                save(ptest_figure(table, head, p_test, paper=rc), stem)
            lines += ["", f"![test accuracy against p_test]({link(stem, 'svg')})", "",
                      f"The same runs scored on the test contexts of every p_test (from {source}): "
                      "line: the mean over seeds, band: ± the std over seeds"
                      + ("; dashed: PerInvFL's Table 2" if rc else "")
                      + f"; rows equal in every cell are drawn once, named together "
                      f"([PNG]({link(stem, 'png')}))."]
    # tables written beside the runs (rcmnist_ptest.py)
    for md in sorted(Path(folder).glob("*.md")):
        lines += ["", f"More from these runs: [{md.name}]({os.path.relpath(md, where)})."]
    if skipped:
        lines += ["", f"Left out (incomplete or unreadable): {', '.join(skipped)}."]
    lines += ["", provenance_line([f for f in sorted(Path(folder).glob("*.json"))
                                   if f.name not in skipped])]
    return lines + [""]


def speed_report(path, where=".", figures=True):
    """The table and bar chart of a speed.py --json file (the chart beside it unless
    figures=False)."""
    try:
        speed = json.loads(Path(path).read_text())
        med = {k: float(np.median(v)) for k, v in speed["seconds"].items()}
        n, base = speed["images_per_round"], next(iter(med.values()))
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise UserError(f"{path} is not a speed.py --json file "
                        f"({e.__class__.__name__}: {e})") from None
    stem = Path(path).with_suffix("")
    SOURCES.add(Path(path))
    if figures:
        save(speed_figure(speed), stem)
    return ["## speed", "", f"`benchmark/speed.py`: {speed['setting']}.", "",
            f"| round | s / round | images / s | × {next(iter(med))} |", "|---|---|---|---|",
            *[f"| {k} | {v:.3f} | {n / v:,.0f} | {v / base:.2f} |" for k, v in med.items()], "",
            f"![seconds per round]({os.path.relpath(f'{stem}.svg', where)})", "",
            f"Bars: the median over the timed rounds; whiskers: the fastest and the slowest round "
            f"([PNG]({os.path.relpath(f'{stem}.png', where)})).", "", provenance_line(), ""]


#--------------------------------------------------------------------------------------------------
# Generated blocks. README.md, docs/*.md and benchmark/results/README.md hold every results table
# between two marker lines, <!-- report:NAME --> and <!-- /report:NAME -->; `python
# benchmark/report.py` (no folders) rewrites each block from the committed results, `--check` says
# which block would change. NAME is KIND or KIND:ARGUMENTS (BLOCKS below lists the kinds).

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark" / "results"
# A results file records "cpu" or "cuda", not the machine: the committed CUDA runs all ran on one
# NVIDIA H100, the CPU runs on a 2-core CPU (benchmark/results/README.md says which folder ran where
# and when).
DEVICE_NAMES = {"cuda": "H100", "cpu": "CPU"}


@dataclass
class Claim:
    """One published claim: the paper's method (runs labelled `method` in `folder`) against a
    baseline (runs `base` in `base_folder`, default the same folder), in the paper's direction
    `sign` (+1: the paper's method above the baseline; -1: below, as for a loss)."""
    paper: str                 # the method page: docs/<paper>.md
    group: str                 # the paper's table or figure
    claim: str
    folder: str
    method: str
    base: str
    published: str             # the paper's numbers, method / baseline, as printed
    sign: int = 1
    base_folder: str = ""
    scale: str = ""            # empty: the paper's scale; else why not
    # acc: test accuracy (%); loss: McMahan et al.'s Figure 1 (fig1.json)
    metric: str = "acc"
    short: str = ""            # the claim in a few words, for the README's methods table


NOT_PAPER_SCALE = "full RotatedMNIST, narrow ConvNet (the paper: PACS, ResNet-50)"
CLAIMS = [
    Claim("fedavg", "Fig. 1", "averaging two models trained apart from one shared initialisation: "
          "loss below the better parent's", "mcmahan-fig1", "shared:average", "shared:parent",
          "below both parents", sign=-1, metric="loss", short="shared initialisation"),
    Claim("fedavg", "Fig. 1",
          "... from two different initialisations: loss above the better parent's",
          "mcmahan-fig1", "different:average", "different:parent", "far above", metric="loss",
          short="different initialisations"),
    Claim("fediir", "Table 8", "FedIIR above FedAvg, RotatedMNIST-50, 0° held out",
          "rmnist50-full-0", "fediir", "fedavg", "84.0 / 77.9", short="0° held out"),
    Claim("fediir", "Table 8", "FedIIR above FedAvg, RotatedMNIST-50, 75° held out",
          "rmnist50-full-75", "fediir", "fedavg", "84.5 / 81.2", short="75° held out"),
    Claim("fedomg", "Table 1", "FedOMG above FedAvg, MNIST, Dirichlet α = 0.5 (200 of 800 rounds)",
          "mnist-fl-full-alpha0.5", "fedomg", "fedavg", "98.58 / 91.47", short="α 0.5"),
    Claim("fedomg", "Table 1", "FedOMG above FedAvg, MNIST, Dirichlet α = 0.1 (200 of 800 rounds)",
          "mnist-fl-full-alpha0.1", "fedomg", "fedavg", "98.75 / 93.77", short="α 0.1"),
    Claim("fedloe", "Fig. 1a",
          "few communications beat many: K1 = 4 above every-epoch averaging (K1 = 64)",
          "fedloe-fig1a-smallconv", "k4", "k64", "best at K1 = 4", scale=NOT_PAPER_SCALE,
          short="K1 4 vs 64"),
    Claim("fedloe", "Table 2", "FedLOE-Fish above its own stage 1 (\"our FedAvg\"), 0° held out",
          "fedloe-dg-smallconv", "fish", "stage1", "86.60 / 85.98 (PACS)", scale=NOT_PAPER_SCALE,
          short="Fish vs stage 1"),
    Claim("perinvfl", "Table 2", "PerInvFL above FedAvg, RC-MNIST, p_test 0.1",
          "rcmnist-full-reset", "perinvfl", "fedavg", "53.46 / 20.77", base_folder="rcmnist-full",
          short="over FedAvg"),
    Claim("perinvfl", "Table 2", "PerInvFL above IRM (its global ν), RC-MNIST, p_test 0.1",
          "rcmnist-full-reset", "perinvfl", "perinvfl (global)", "53.46 / 51.48",
          short="over IRM (ν)"),
    Claim("fedipg", "Table II", "FedIPG above FedAvg, RotatedMNIST-50, 0° held out",
          "rmnist50-full-0", "fedipg", "fedavg", "95.68 / 90.82 (mean of six)",
          short="0° held out"),
    Claim("fedipg", "Table II", "FedIPG above FedAvg, RotatedMNIST-50, 75° held out",
          "rmnist50-full-75", "fedipg", "fedavg", "95.68 / 90.82 (mean of six)",
          short="75° held out"),
    Claim("fedipg", "Table III", "FedIPG above FedAvg, stained MNIST, foreground", "stained-vic-fg",
          "fedipg", "fedavg", "63.99 / 45.73", short="foreground"),
    Claim("fedipg", "Table III", "FedIPG above FedAvg, stained MNIST, background", "stained-vic-bg",
          "fedipg", "fedavg", "62.77 / 49.71", short="background"),
    Claim("fedipg", "Table III", "FedIPG above FedAvg, stained MNIST, both", "stained-vic-both",
          "fedipg", "fedavg", "62.08 / 52.78", short="both"),
    Claim("fedipg", "Fig. 3",
          "a client turned to 180° harms: 75° accuracy with it excluded above kept",
          "fedipg-exit-full", "exit-hand", "kept", "up to 20 points", short="180° client"),
    Claim("fedipg", "Fig. 3", "a slow:3 client harms: excluded above kept", "fedipg-exit-slow-full",
          "exit-hand", "kept", "up to 35 points", short="slow:3 client"),
    # excluded by hand the aberrant client never takes part, so the unreliable and the slow
    # exit-hand runs are one run (seed 0's two agree bit for bit; seed 1 ran once, in the slow
    # folder): both seeds from there
    Claim("fedipg", "Fig. 3",
          "an unreliable:0.5 client harms: excluded (the slow folder's exit-hand runs) above kept",
          "fedipg-exit-slow-full", "exit-hand", "kept", "up to 20 points",
          base_folder="fedipg-exit-unreliable-full", short="unreliable:0.5 client"),
    Claim("fedipg", "Sec. IV",
          "the exit strategy (Eq. 13) helps: 180° client, --exit auto above kept",
          "fedipg-exit-full", "exit-auto", "kept", "exit above kept", short="180° client"),
    Claim("fedipg", "Sec. IV", "... slow:3 client, --exit auto above kept", "fedipg-exit-slow-full",
          "exit-auto", "kept", "exit above kept", short="slow:3 client"),
    Claim("fedipg", "Sec. IV", "... unreliable:0.5 client, --exit auto above kept",
          "fedipg-exit-unreliable-full", "exit-auto", "kept", "exit above kept",
          short="unreliable:0.5 client"),
]
TITLES = {  # each method's name and paper, for the tables (the methods: harness.METHODS, in order)
    "fedavg": ("FedAvg", "McMahan et al., *Communication-Efficient Learning of Deep Networks "
               "from Decentralized Data*, AISTATS 2017"),
    "fediir": ("FedIIR", "Guo et al., *Out-of-Distribution Generalization of Federated "
               "Learning via Implicit Invariant Relationships*, ICML 2023"),
    "fedomg": ("FedOMG", "Nguyen et al., *Federated Domain Generalization with Data-free "
               "On-server Matching Gradient*, ICLR 2025"),
    "fedloe": ("FedLOE",
               "*Federated Domain Generalization via Locally Overfit Ensemble* (under review)"),
    "perinvfl": ("PerInvFL", "Tang, Guo, Zhang, *Exploiting Personalized Invariance for Better "
                 "OOD Generalization in FL*"),
    "fedipg": ("FedIPG", "Hao et al., *Invariant FL for Edge Intelligence with Exit Strategy "
               "and Invariant Penalty*"),
}

_loaded = {}


def committed(folder):
    """load() of a committed results folder, once per process."""
    global SOURCES
    if folder not in _loaded:
        before, SOURCES = SOURCES, set()
        _loaded[folder] = load(RESULTS / folder)[0], SOURCES
        SOURCES = before
    SOURCES |= _loaded[folder][1]
    return _loaded[folder][0]


def seed_values(folder, label, metric="acc"):
    """[(seed, value, device)] of one label's runs: test accuracy in % (the mean over the run's test
    domains, at the run's reported round), or, for McMahan et al.'s Figure 1 ("init:average" /
    "init:parent"), the training loss at θ = ½ / of the better parent (θ = 0 or 1)."""
    if metric == "loss":
        init, what = label.split(":")
        runs = json.loads((RESULTS / folder / "fig1.json").read_text())["runs"]
        SOURCES.add(RESULTS / folder / "fig1.json")
        out = []
        for r in runs:
            if r["init"] == init:
                at = {round(t, 6): v for t, v in zip(r["theta"], r["loss"])}
                out.append((r["seed"], at[0.5] if what == "average" else min(at[0.0], at[1.0]),
                            "cpu"))
        return sorted(out)
    return sorted((r["seed"], 100 * float(np.mean([d["test_acc"] for d in r["domains"].values()])),
                   r["args"].get("device", "cpu")) for r in committed(folder).get(label, []))


def fmt(v, metric="acc"):
    return f"{v:.3f}" if metric == "loss" else f"{v:.1f}"


def ms(vals, metric="acc"):
    """'mean ± std' over seeds (n − 1; one seed: its value alone)."""
    xs = [v for _, v, _ in vals]
    if len(xs) < 2:
        return fmt(xs[0], metric) if xs else "–"
    return f"{fmt(np.mean(xs), metric)} ± {fmt(np.std(xs, ddof=1), metric)}"


def devices(*runs):
    """'2 seeds, H100', or the device of each seed where they differ."""
    by_seed = {}
    for vals in runs:
        for seed, _, dev in vals:
            by_seed.setdefault(seed, set()).add(DEVICE_NAMES.get(dev, dev))
    names = {d for ds in by_seed.values() for d in ds}
    n = f"{len(by_seed)} seed{'s' * (len(by_seed) > 1)}"
    if len(names) == 1:
        return f"{n}, {names.pop()}"
    return f"{n}: " + ", ".join(f"{s} {'/'.join(sorted(d))}" for s, d in sorted(by_seed.items()))


RULE = ("With d the gain measured here (the paper's method minus its baseline, means over seeds, "
        "signed so that the paper's direction is positive), s = 2·max(s_m, s_b) with s_m, s_b "
        "their seed stds (n − 1), and D the paper's own gain: *reproduced* when d > s and "
        "d ≥ D/2; *smaller* when d > s but d < D/2; *not reproduced* when |d| ≤ s; *reversed* when "
        "d < −s. Where the paper prints no gain (a figure's shape or largest gap, e.g. "
        "\"up to 20 points\") only the direction counts: *direction holds* when d > s (shown as "
        "\"direction only\"). Each verdict shows d, D and s, e.g. \"smaller: +1.4 vs +32.7 "
        "(2 std 0.3)\"; fewer than two seeds on a side: *one seed*, no verdict.")
WORDS = ("reproduced", "smaller", "direction holds", "not reproduced", "reversed", "one seed")


def published_gain(c):
    """D: the paper's own gain in its direction, where it prints both numbers ("84.0 / 77.9");
    else None."""
    try:
        pm, pb = (float(x.split()[0]) for x in c.published.split(" / "))
    except ValueError:
        return None
    return c.sign * (pm - pb)


def verdict(c):
    """The one rule for every verdict (RULE): with m ± s_m the paper's method and b ± s_b the
    baseline here (mean ± std over seeds, n − 1), d = sign · (m − b) the gain in the paper's
    direction, s = 2·max(s_m, s_b) and D the paper's own gain (None where it prints none):
    "reproduced" when d > s and d ≥ D/2, "smaller" when d > s and d < D/2, "direction holds" when
    d > s and D is None, "not reproduced" when |d| ≤ s, "reversed" when d < −s; fewer than two seeds
    on either side: "one seed". Returns (word, text, method values, baseline values); the text is
    e.g. "smaller: +1.4 vs +32.7 (2 std 0.3)"."""
    mv, bv = seed_values(c.folder, c.method, c.metric), \
        seed_values(c.base_folder or c.folder, c.base, c.metric)
    if not mv or not bv:
        sys.exit(f"report.py: error: no committed runs '{c.method}' / '{c.base}' "
                 f"in benchmark/results/{c.folder}")
    m, b = np.mean([v for _, v, _ in mv]), np.mean([v for _, v, _ in bv])
    if len(mv) < 2 or len(bv) < 2:
        return "one seed", "one seed: no verdict", mv, bv
    s = 2 * max(np.std([v for _, v, _ in mv], ddof=1), np.std([v for _, v, _ in bv], ddof=1))
    d, D = c.sign * (m - b), published_gain(c)
    if d < -s:
        word = "reversed"
    elif d <= s:
        word = "not reproduced"
    elif D is None:
        word = "direction holds"
    else:
        word = "reproduced" if d >= D / 2 else "smaller"
    signed = lambda x: f"{'+' if x >= 0 else '−'}{fmt(abs(x), c.metric)}"
    paper = f" vs {signed(D)} (2 std {fmt(s, c.metric)})" if D is not None else \
        f" (2 std {fmt(s, c.metric)}; direction only)"
    return word, f"{word}: {signed(d)}{paper}", mv, bv


def link(target, where):
    return os.path.relpath(target, where).replace(os.sep, "/")


def block_glance(where):
    """README: every claim, the paper's numbers, this implementation's, the verdict, the page."""
    lines = ["| paper | claim | paper: method / baseline "
             "| here: method / baseline (seeds, device) | verdict |",
             "|---|---|---|---|---|"]
    for c in CLAIMS:
        word, text, mv, bv = verdict(c)
        name = TITLES[c.paper][0]
        scale = f" *(not the paper's scale: {c.scale})*" if c.scale else ""
        lines.append(f"| [{name}]({link(ROOT / 'docs' / (c.paper + '.md'), where)}), {c.group} "
                     f"| {c.claim}{scale} | {c.published} "
                     f"| {ms(mv, c.metric)} / {ms(bv, c.metric)} ({devices(mv, bv)}) | {text} |")
    return lines


def summary(paper, most=4):
    """Every verdict of one paper's claims with its numbers, one line each, e.g. 'Table 8, 0° held
    out — not reproduced: −0.5 vs +6.1 (2 std 7.8)'; more than `most` claims: how many of each
    verdict, the claims themselves in the glance table."""
    claims = [c for c in CLAIMS if c.paper == paper]
    parts = [f"{c.group}, {c.short} — {verdict(c)[1]}" for c in claims]
    if len(parts) > most:
        words = [verdict(c)[0] for c in claims]
        counts = ", ".join(f"{w}: {words.count(w)}" for w in dict.fromkeys(words))
        parts = [f"{len(claims)} claims — {counts} (each: [Results at a glance]"
                 f"(#results-at-a-glance))"]
    scale = next((c.scale for c in claims if c.scale), "")
    return ("not at the paper's scale:<br>" if scale else "") + "<br>".join(parts)


def block_methods(where):
    """README: the methods table, each claim's verdict by the rule, with its measured and published
    gain."""
    lines = ["| file | method and paper | verdict at the paper's scale: measured vs published gain "
             "(the rule: Results at a glance) | page |", "|---|---|---|---|"]
    for method in METHODS:
        f = f"{method}.py"
        name, paper = TITLES[method]
        page = link(ROOT / "docs" / f"{method}.md", where)
        form = f"{FORMS[f]}:<br>" if f in FORMS else ""
        lines.append(f"| [`{f}`]({link(ROOT / f, where)}) | {name}: {paper} "
                     f"| {form}{summary(f[:-3])} | [{name}]({page}) |")
    provenance_line([])                        # the glance table's runs: its provenance line says
    return lines + ["", "Provenance: the runs of [Results at a glance](#results-at-a-glance)."]


# The form of a method that its verdicts were made with, where the script offers another (the
# default is that form).
FORMS = {"fedipg.py": "every verdict with `--local-step sgd`, the default "
                      "(the paper's Eq. 2 as one step, `--local-step paper`: 32.0% at "
                      "RotatedMNIST-50, 0°, seed 0, against FedAvg's 84.2 ± 3.9)"}


# OMP_NUM_THREADS=1 python fedavg.py --rounds 20 --test-domain 0: its run and time.txt
QUICKLOOK = "quicklook"
# How far the quick look's validation accuracy moved between CPU models (one thread each, the same
# command): 0.754, 0.757 and 0.761 on three CPUs (2026-11-24, the code before each client drew its
# own stream, which ended at other numbers: only the spread is quoted).
QUICKLOOK_CPU_SPREAD = (0.754, 0.761)


def block_quicklook(where, folder=QUICKLOOK):
    """README: what the quick look ends at and how long it took, from its committed run and
    time.txt beside it: the command's conditions written before the run ("torch X, numpy Y,
    python Z", "date: D", lscpu's "Model name:" line, optionally "load: ..." when the machine was
    not idle) and /usr/bin/time's line ("<user>user <system>system <m:ss.cc>elapsed ..."): one
    measured time, and how far other CPUs move the accuracies. Its provenance line: the run's own,
    else time.txt's."""
    f, tf = RESULTS / folder / "fedavg-rmnist-seed0.json", RESULTS / folder / "time.txt"
    r, txt = json.loads(f.read_text()), tf.read_text()
    (dom, d), = r["domains"].items()
    find = lambda pattern: (m := re.search(pattern, txt)) and m[1].strip()
    p = r.get("provenance") or {"torch": find(r"torch ([^,\s]+)"),
                                "numpy": find(r"numpy ([^,\s]+)"),
                                "device": find(r"Model name:(.+)"), "date": find(r"date: (\S+)")}
    tm = re.search(r"([\d.]+)user ([\d.]+)system (?:(\d+):)?(\d+):([\d.]+)elapsed", txt)
    user, system = float(tm[1]), float(tm[2])
    wall = 3600 * int(tm[3] or 0) + 60 * int(tm[4]) + float(tm[5])
    load = find(r"load: ([^(\n]+)")                      # e.g. "the machine shared with other jobs"
    where_from = "the run" if r.get("provenance") else "time.txt"
    lo, hi = QUICKLOOK_CPU_SPREAD
    return [f"It ends at test accuracy {d['test_acc']:.3f} on the held-out {dom}° domain, "
            f"validation {d['val_acc']:.3f} (round {d['best_round']}, the best validation; "
            f"seed {r['seed']}), on one thread of {article(p['device'])} {p['device']}. "
            f"Another CPU model sums in another order and ends a few thousandths away "
            f"(three CPUs spread the validation over {hi - lo:.3f} with the code of 2026-11-24, "
            f"whose numbers differ from these). "
            f"The committed run ([{f.parent.name}/]({link(f.parent, where)}/)) took "
            f"{user + system:.0f} s of CPU time ({user:.0f} s user, {system:.0f} s system) "
            f"and {wall / 60:.1f} minutes of wall clock"
            f"{f' ({load.strip()})' if load else ''}.", "",
            f"Provenance: torch {p['torch']}, numpy {p['numpy']}, {p['device']} "
            f"({where_from}, {p['date']})."]


def article(word):
    return "an" if word[:1].lower() in "aeiou" else "a"


def block_rule(where):
    """README: the verdict rule, as verdict() applies it."""
    return textwrap.wrap(f"**The rule**: {RULE[0].lower()}{RULE[1:]}", 100, break_on_hyphens=False)


def block_claims(where, paper):
    """A method page: each of the paper's claims with its protocol, numbers, seeds, device,
    verdict."""
    lines = ["| claim (paper's table) | protocol | paper | here: method | here: baseline "
             "| seeds, device | verdict | results |", "|---|---|---|---|---|---|---|---|"]
    for c in (c for c in CLAIMS if c.paper == paper):
        word, text, mv, bv = verdict(c)
        folder = RESULTS / c.folder
        lines.append(f"| {c.claim} ({c.group}) | {protocol(c)} | {c.published} "
                     f"| {c.method}: {ms(mv, c.metric)} | "
                     f"{c.base}: {ms(bv, c.metric)} | {devices(mv, bv)} | {text} | "
                     f"[{c.folder}]({link(folder, where)}/) |")
    return lines


def protocol(c):
    """The setting of a claim's runs, from their arguments."""
    if c.metric == "loss":
        return "full MNIST, two 2NNs, 600 digits each, 240 updates of 50 (loss on 60,000)"
    r = committed(c.folder)[c.method][0]
    a = r["args"]
    data = "embedded digits" if r["source"].startswith("embedded") else "full MNIST"
    held = list(r["domains"])
    where_ = (f"held out: {held[0]}°" if r["dataset"] == "rmnist" else
              "all 10 held out in turn" if r["dataset"] == "stained" else "each client's test set")
    return (f"{r['dataset']}, {data}, {a['clients']} clients / {a['sample']} per round, "
            f"{a['rounds']} rounds × {a['local_epochs']} epoch(s), {where_}, "
            f"{'last round' if a.get('select') == 'last' else 'best validation'}")


def s_per_round(r):
    return float(np.mean([d["history"][-1]["seconds"] / d["history"][-1]["round"]
                          for d in r["domains"].values()]))


def seed_list(vals, metric="acc"):
    """'87.0, 81.5': one value per seed, in seed order."""
    return ", ".join(fmt(v, metric) for _, v, _ in vals)


def block_grid(where, folders, labels):
    """Rows: results folders (a held-out domain, a stain, an α); columns: labels, each mean ± std
    over seeds (per seed in brackets); the papers' numbers for the same setting; seconds per
    round."""
    folders, labels = folders.split(","), labels.split(",")
    head = ["setting", *labels, "paper", "seeds, device", "s / round (" + " / ".join(labels) + ")"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lowest = []
    for f in folders:
        runs = committed(f)
        first = runs[labels[0]][0]
        vals = {lab: seed_values(f, lab) for lab in labels}
        paper = PAPERS.get((published_name(first), scenario(first)), [])
        pub = " / ".join(f"{m:.2f}" for lab in labels for n, m, _ in paper if n == lab)
        src = sorted({s for _, _, s in paper})
        setting = f"[{f}]({link(RESULTS / f, where)}/)"
        cells = [f"{ms(vals[lab])} ({seed_list(vals[lab])})" for lab in labels]
        devs = sorted({r["args"].get("device", "cpu") for lab in labels for r in runs[lab]})
        secs = "; ".join(
            " / ".join(format(np.mean([s_per_round(r) for r in runs[lab]
                                       if r['args'].get('device', 'cpu') == dv]), ".2f")
                       for lab in labels)
            + (f" ({DEVICE_NAMES.get(dv, dv)})" if len(devs) > 1 else "")
            for dv in devs)
        lines.append(f"| {setting} | " + " | ".join(cells)
                     + f" | {pub or '–'}{' (' + ', '.join(src) + ')' if src else ''}"
                     f" | {devices(*vals.values())} | {secs} |")
        if len(first["domains"]) > 1:
            low = []
            for lab in labels:
                doms = list(runs[lab][0]["domains"])
                acc = {d: np.mean([100 * r["domains"][d]["test_acc"] for r in runs[lab]])
                       for d in doms}
                d = min(acc, key=acc.get)
                low.append(f"{lab} {d}: {acc[d]:.1f}")
            lowest.append(f"{f}: " + ", ".join(low))
    if lowest:
        lines += ["", "Lowest held-out domain (mean over seeds): " + "; ".join(lowest) + "."]
    return lines


def block_exit(where, folders):
    """FedIPG's aberrant-client runs: per variant, who exited (per seed), the accuracy of the
    regular clients and of the aberrant client (validation splits) and of the held-out domain
    (test), per seed and (mean), and seconds per round (range over seeds)."""
    lines = ["| aberrant client, variant | exited (per seed) | regular clients | aberrant client "
             "| held-out domain (test) | s / round |", "|---|---|---|---|---|---|"]
    for f in folders.split(","):
        for lab, rs in sorted(committed(f).items()):
            ab = rs[0]["args"].get("aberrant")
            ds = [d for r in rs for d in r["domains"].values()]
            cell = lambda k: (", ".join(f"{100 * d[k]:.1f}" for d in ds)
                              + (f" ({100 * np.mean([d[k] for d in ds]):.1f})"
                                 if len(ds) > 1 else "")) \
                if all(k in d for d in ds) else "–"
            ex = "; ".join(", ".join(map(str, d.get("exited", []))) or "none" for d in ds)
            s = sorted(s_per_round(r) for r in rs)
            sec = f"{s[0]:.0f}" if round(s[0]) == round(s[-1]) else f"{s[0]:.0f}–{s[-1]:.0f}"
            name = f"{ab[0]}:{ab[1]:g}" if ab else "none"
            lines.append(f"| {name}, {lab} ([{f}]({link(RESULTS / f, where)}/)) | {ex} | "
                         f"{cell('regular_acc') if 'regular_acc' in ds[0] else cell('id_acc')} | "
                         f"{cell('aberrant_acc')} | {cell('test_acc')} | {sec} |")
    return lines


def block_fedloe_k1(where, folder):
    """FedLOE's Figure 1a: a budget of E1 local epochs over K1 communications (stage 1
    only)."""
    runs = committed(folder)
    lines = ["| K1 | epochs between averages | held-out test | in-domain test "
             "| per seed (held-out) | s / epoch |",
             "|---|---|---|---|---|---|"]
    for lab, rs in sorted(runs.items(), key=lambda kv: kv[1][0]["args"]["stage1_comms"]):
        a = rs[0]["args"]
        ind = [(r["seed"], 100 * next(iter(r["domains"].values()))["in_domain_acc"], "")
               for r in rs]
        secs = ", ".join(format(next(iter(r["domains"].values()))["history"][-1]["seconds"]
                                / a["stage1_epochs"], ".1f")
                         for r in sorted(rs, key=lambda r: r["seed"]))
        vals = seed_values(folder, lab)
        lines.append(f"| {a['stage1_comms']} | {a['stage1_epochs'] // a['stage1_comms']} "
                     f"| {ms(vals)} | {ms(ind)} | {seed_list(vals)} | {secs} |")
    return lines


def block_fedloe_dg(where, folder):
    """FedLOE's stage 2 (Table 2's variants) over one stage 1, and the stage-2 seconds."""
    runs = committed(folder)
    lines = ["| variant | held-out test | in-domain test | per seed (held-out) "
             "| stage 2 s (per seed) |",
             "|---|---|---|---|---|"]
    for lab in ("stage1", "irm", "fish", "rex"):
        rs = sorted(runs[lab], key=lambda r: r["seed"])
        ind = [(r["seed"], 100 * next(iter(r["domains"].values()))["in_domain_acc"], "")
               for r in rs]
        k1 = rs[0]["args"]["stage1_comms"]
        s2 = []
        for r in rs:
            h = next(iter(r["domains"].values()))["history"]
            if h[-1]["round"] > k1:
                s2.append(
                    f"{h[-1]['seconds'] - next(x for x in h if x['round'] == k1)['seconds']:.1f}")
        vals = seed_values(folder, lab)
        lines.append(f"| {lab} | {ms(vals)} | {ms(ind)} | {seed_list(vals)} "
                     f"| {', '.join(s2) or '–'} |")
    return lines + ["| paper, PACS Table 2 (our FedAvg / IRM / Fish / REx) "
                    "| 85.98 / 85.68 / 86.60 / 85.68 | | | |"]


def block_spawn(where, folder):
    """fedloe_spawn.py: branches after k epochs of every-epoch averaging; each cell held-out
    (in-domain)."""
    runs = [json.loads(f.read_text()) for f in sorted((RESULTS / folder).glob("seed*.json"))]
    SOURCES.update((RESULTS / folder).glob("seed*.json"))
    hist = [next(iter(r["domains"].values()))["history"] for r in runs]
    at = lambda h, t: next(x for x in h if x["round"] == t)
    pair = lambda xs, ys: (f"{ms([(0, 100 * x, '') for x in xs])} "
                           f"({ms([(0, 100 * y, '') for y in ys])})")
    ks = [row["spawn"]["k"] for row in hist[0] if row.get("spawn")]
    lines = ["| start: after k epochs (its accuracy) | one-shot average after 16 epochs alone "
             "| clients alone (mean of 20) | ensemble of the 20 "
             "| trunk: 16 more epochs, averaged every epoch |",
             "|---|---|---|---|---|"]
    for k in ks:
        sp = [next(x["spawn"] for x in h if x.get("spawn") and x["spawn"]["k"] == k) for h in hist]
        n = runs[0]["args"]["spawn_epochs"]
        start = "0: random" if k == 0 else \
            f"{k}: " + pair([at(h, k)["test_acc"] for h in hist],
                            [at(h, k)["in_domain_acc"] for h in hist])
        cols = [pair([s[f"{w}_test"] for s in sp], [s[f"{w}_in_domain"] for s in sp])
                for w in ("average", "clients", "ensemble")]
        trunk = pair([at(h, k + n)["test_acc"] for h in hist],
                     [at(h, k + n)["in_domain_acc"] for h in hist])
        lines.append(f"| {start} | " + " | ".join(cols) + f" | {trunk} |")
    return lines


def block_fig1(where, folder="mcmahan-fig1"):
    """McMahan et al.'s Figure 1: the better parent and the average at θ = ½, loss (accuracy)."""
    runs = json.loads((RESULTS / folder / "fig1.json").read_text())["runs"]
    SOURCES.add(RESULTS / folder / "fig1.json")
    lines = ["| initialisation | better parent: lower loss (higher accuracy %) "
             "| average, θ = ½: loss (accuracy %) | "
             "average / better parent, per seed |", "|---|---|---|---|"]
    for init in ("different", "shared"):
        rs = sorted((r for r in runs if r["init"] == init), key=lambda r: r["seed"])
        par, mid = [], []
        for r in rs:
            at = {round(t, 6): (l, a) for t, l, a in zip(r["theta"], r["loss"], r["acc"])}
            # lower loss, higher acc
            par.append((min(at[0.0][0], at[1.0][0]), max(at[0.0][1], at[1.0][1])))
            mid.append(at[0.5])
        cell = lambda xs: (f"{ms([(0, l, '') for l, _ in xs], 'loss')} "
                           f"({ms([(0, 100 * a, '') for _, a in xs])})")
        ratio = ", ".join(f"{m[0] / p[0]:.2f}" for m, p in zip(mid, par))
        lines.append(f"| {init} | {cell(par)} | {cell(mid)} | {ratio} |")
    return lines


# PerInvFL Table 5: p_test 0.1, mean
PTEST_TABLE5 = {"IRM-L2": (31.19, 38.39), "IRM-FT": (21.43, 33.50)}


def row(cells):
    return "| " + " | ".join(map(str, cells)) + " |"


def block_ptest(where, folder, central="", paper=""):
    """RC-MNIST at every p_test (rcmnist_ptest.py's committed ptest.md; rows equal in every cell
    shown once: a personalised row equal to a global ν row is named with it, "... = ...", while the
    ν rows of runs that share ν appear once), with `central` the centralised IRM reference on those
    data (irm_central.py's file), with `paper` PerInvFL's Table 2 rows and Table 5's IRM-L2 /
    IRM-FT (p_test 0.1 and the mean)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in (RESULTS / folder / "ptest.md").read_text().splitlines()
            if line.startswith("|")]
    SOURCES.update((RESULTS / folder).glob("*.json"))           # the runs that ptest.md scored
    head, body, seen = rows[0], [], {}
    for r in rows[2:]:
        if "(global ν)" in r[0]:      # ν does not depend on how θ_i is trained: drop θ_i's settings
            r = [re.sub(r", theta \w+|, line 8 \w+", "", r[0]), *r[1:]]
        if tuple(r[1:]) not in seen:
            seen[tuple(r[1:])] = r
            body.append(r)
        elif "(global ν)" not in r[0]:
            seen[tuple(r[1:])][0] += f" = {r[0]}"
    blank = [""] * (len(head) - 1)
    if central:
        rs = [r for r in
              json.loads((RESULTS / "irm-central" / f"{central}.json").read_text())["runs"]
              if r["method"] == "irm"]
        SOURCES.add(RESULTS / "irm-central" / f"{central}.json")
        cells = list(blank)
        cells[0] = ms([(0, 100 * r["test_acc"], "") for r in rs])
        cells[-2], cells[-1] = ms([(0, 100 * r["train_acc"], "") for r in rs]), len(rs)
        body.append([f"centralised IRM (irm_central.py, {central})", *cells])
    if paper:
        for name, (_, _, acc) in PTEST_PAPER.items():
            body.append([f"paper: {name} (PerInvFL Table 2)", *[f"{a:.2f}" for a in acc],
                         f"{np.mean(acc):.2f}", "", ""])
        for name, (p1, mean) in PTEST_TABLE5.items():
            body.append([f"paper: {name} (PerInvFL Table 5)", f"{p1:.2f}", "", "", "", "",
                         f"{mean:.2f}", "", ""])
    return [row(head), "|---" * len(head) + "|", *map(row, body)]


def block_irm_central(where):
    """irm_central.py's centralised full-batch IRM and ERM (IRM's recipe), last step."""
    lines = ["| data | method | train acc | test acc | seeds | IRM paper (train / test) |",
             "|---|---|---|---|---|---|"]
    published = {("colored", "irm"): "70.8 / 66.9", ("colored", "erm"): "— / 17.1"}
    for f in sorted((RESULTS / "irm-central").glob("*.json")):
        runs = json.loads(f.read_text())["runs"]
        SOURCES.add(f)
        for m in sorted({r["method"] for r in runs}):
            rs = [r for r in runs if r["method"] == m]
            lines.append(f"| {f.stem} | {m} | {ms([(0, 100 * r['train_acc'], '') for r in rs])} | "
                         f"{ms([(0, 100 * r['test_acc'], '') for r in rs])} | {len(rs)} | "
                         f"{published.get((f.stem, m), '—')} |")
    return lines


def block_beta(where, folder):
    """PerInvFL's β (Eq. 4) against the personalised models' and ν's test accuracy (p_test 0.1)."""
    lines = ["| β | personalised θ_i (test) | global ν (test) | seed |", "|---|---|---|---|"]
    rows = []
    for f in (RESULTS / folder).glob("*.json"):
        r = json.loads(f.read_text())
        SOURCES.add(f)
        d = next(iter(r["domains"].values()))
        rows.append((r["args"]["beta"], 100 * d["test_acc"], 100 * d["global_test_acc"], r["seed"]))
    for beta, t, g, seed in sorted(rows):
        lines.append(f"| {beta:g} | {t:.1f} | {g:.1f} | {seed} |".replace("e+0", "e"))
    return lines


def block_speed_table(where, path):
    """A speed.py --json file's table and bar chart, without the results README's heading."""
    return speed_report(RESULTS / path, where, figures=False)[2:]


def gpu_rows():
    g = json.loads((RESULTS / "gpu" / "gpu_check.json").read_text())
    SOURCES.add(RESULTS / "gpu" / "gpu_check.json")
    return g, [r for r in g["rows"] if not r["check"].startswith(("runs:", "repeat:"))]


def block_gpu_check(where):
    """benchmark/gpu_check.py's last committed run: every check that is not a run or a repeat."""
    g, rows = gpu_rows()
    lines = [f"`benchmark/gpu_check.py` on one {g['device']} "
             f"(torch {g['torch']}, {g['started'][:10]}):", "",
             "| check | measured | target | ok |", "|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        lines.append(f"| {r['check']} | {f'{m:.3f}' if isinstance(m, float) else m} "
                     f"| {r['target'] or '–'} | "
                     f"{ {True: 'yes', False: '**no**', None: '–'}[r['ok']]} |")
    runs = [r for r in g["rows"] if r["check"].startswith(("runs:", "repeat:"))]
    methods = list(dict.fromkeys(r["check"].split()[1] for r in runs))
    cut = sum(r["ok"] is None for r in runs)
    lines += ["", f"Besides: {len(runs)} runs and repeats ({', '.join(methods)}; 2 rounds, "
              f"RotatedMNIST's ConvNet and a generated PACS tree's ResNet-18, fp32 and bf16), "
              f"{sum(r['ok'] is True for r in runs)} of them passed"
              + (f", {cut} cut by the time limit" if cut else "") + "."]
    for m in g.get("made", []):
        lines.append(f"- {m['rows']}: started {m['started']}, {m['command']}; {m['tree']}.")
    return lines


def block_speed_glance(where):
    """README: a few generated lines on speed, each with its device."""
    g, rows = gpu_rows()
    find = lambda key: next(r for r in rows if r["check"].startswith(key))
    conv = find("harness / bare loop, images/s: ConvNet fp32")["check"].split("(")[1].split(" /")[0]
    sp = json.loads((RESULTS / "speed.json").read_text())
    SOURCES.add(RESULTS / "speed.json")
    med = {k: float(np.median(v)) for k, v in sp["seconds"].items()}
    base = next(iter(med.values()))
    # the methods
    ratios = ", ".join(f"{k} {v / base:.2f}×" for k, v in list(med.items())[1:] if "," not in k)
    # (speed.py's variants: one line of their own)
    once = [k for k in med if k.endswith(", clients at once")]
    alone = lambda name: med.get(name) or med[f"{name}, one after another"]
    ratios += "".join(f"; {k} {alone(k.split(',')[0]) / med[k]:.2f}× the speed of one after another"
                      for k in once)
    full = {f: np.mean([s_per_round(r) for r in committed(f)["fedavg"]
                        if r["args"]["device"] == dev])
            for f, dev in (("rmnist50-full-0", "cuda"), ("mnist-fl-full-alpha0.5", "cuda"))}
    busy = next((r for r in rows if r["check"].startswith("FedAvg round: GPU kernel time")), None)
    return [f"- One {g['device']} ({g['started'][:10]}): the harness trains DomainBed's MNIST "
            f"ConvNet at {conv} images/s, "
            f"{find('harness / bare loop, images/s: ConvNet fp32')['measured']:.3f}× "
            f"a bare training loop; a round of FedIIR costs "
            f"{find('FedIIR round')['measured']:.2f}×, "
            f"FedIPG {find('FedIPG round')['measured']:.2f}×, "
            f"FedOMG {find('FedOMG round')['measured']:.2f}× a FedAvg round "
            "(RotatedMNIST-50"
            + (f"; the GPU runs kernels {100 * busy['measured']:.0f}% of a FedAvg round" if busy
               else "") + ").",
            f"- Full MNIST on an H100 of the committed results, the GPU shared by several runs: "
            f"a RotatedMNIST-50 FedAvg round "
            f"{full['rmnist50-full-0']:.1f} s, an FL-setting round (20 clients × 5 epochs) "
            f"{full['mnist-fl-full-alpha0.5']:.1f} s.",
            f"- The 2-core CPU, one thread (`benchmark/speed.py`, embedded digits, "
            f"RotatedMNIST-50): a FedAvg round {base:.2f} s; against it {ratios}."]


def block_leaderboard(where):
    """Every method on every MNIST-family benchmark (benchmark/leaderboard.py's table)."""
    import leaderboard
    text, _ = leaderboard.table(list(leaderboard.BENCHMARKS), RESULTS / "leaderboard",
                                leaderboard.SEEDS)
    SOURCES.update((RESULTS / "leaderboard").rglob("*.json"))
    return [text, "", "Test accuracy (%), mean ± std over seeds (their number); [paper N]: "
            "the paper's number; bold: beats every other federated row beyond two seed stds; "
            "—: not yet run; refused: the method refuses that benchmark's protocol. "
            "Where each cell comes from, its settings and each refusal's reason: "
            "[benchmark/results/leaderboard/README.md]"
            f"({link(RESULTS / 'leaderboard' / 'README.md', where)})."]


def block_penalty_swap(where, name="penalty-swap/swap.json"):
    """Which penalties learn invariance in ν's federated optimisation
    (diagnostics/penalty_swap.py)."""
    import contextlib
    import io

    from diagnostics import penalty_swap
    SOURCES.add(RESULTS / name)
    with contextlib.redirect_stdout(io.StringIO()):
        return penalty_swap.report(RESULTS / name).splitlines()


BLOCKS = {  # kind -> (function, takes arguments)
    "folder": lambda where, f: report(RESULTS / f, where, figures=False, score=False)[:-1],
    "speed": lambda where, f: speed_report(RESULTS / f, where, figures=False)[:-1],
    "glance": block_glance, "methods": block_methods, "rule": block_rule,
    "quicklook": block_quicklook,
    "claims": block_claims, "grid": block_grid,
    "exit": block_exit, "fedloe-k1": block_fedloe_k1, "fedloe-dg": block_fedloe_dg,
    "spawn": block_spawn,
    "fig1": block_fig1, "ptest": block_ptest, "irm-central": block_irm_central, "beta": block_beta,
    "speed-table": block_speed_table, "gpu-check": block_gpu_check,
    "speed-glance": block_speed_glance,
    "leaderboard": block_leaderboard, "penalty-swap": block_penalty_swap,
}
MARKER = re.compile(r"<!-- report:(\S+) -->\n(.*?)<!-- /report:\1 -->", re.S)


def generated_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]


def block_text(name, where):
    """One block's text, with the provenance line of the results behind it (a folder's section and a
    speed table write their own)."""
    kind, _, args = name.partition(":")
    if kind not in BLOCKS:
        sys.exit(f"report.py: error: unknown block '{name}' (kinds: {', '.join(BLOCKS)})")
    provenance_line([])                                    # forget the files read before this block
    lines = BLOCKS[kind](where, *args.split(":")) if args else BLOCKS[kind](where)
    line = provenance_line(brief=Path(where).resolve() == ROOT)            # (the README: brief)
    return "\n".join(lines + (["", line] if line else [])) + "\n"


def regenerate(path):
    """(new text, [names of the blocks that change]) of one file."""
    text = Path(path).read_text()
    if text.count("<!-- report:") != text.count("<!-- /report:"):
        sys.exit(f"report.py: error: {path}: "
                 f"a block without its closing <!-- /report:NAME --> line")
    changed = []

    def one(m):
        new = block_text(m.group(1), Path(path).parent)
        if new != m.group(2):
            changed.append(m.group(1))
        return f"<!-- report:{m.group(1)} -->\n{new}<!-- /report:{m.group(1)} -->"
    return MARKER.sub(one, text), changed


def update_docs(check, figures):
    """Rewrite (or, with check, compare) every generated block; with figures, redraw the figures of
    the folders the blocks name. Returns the number of stale blocks."""
    stale = 0
    for path in generated_files():
        new, changed = regenerate(path)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for name in changed:
            print(f"report.py: {shown}: block '{name}' is out of date"
                  + (" (python benchmark/report.py rewrites it)" if check else ": rewritten"),
                  file=sys.stderr if check else sys.stdout)
        stale += len(changed)
        if changed and not check:
            path.write_text(new)
        if figures:
            for m in MARKER.finditer(new):
                kind, _, arg = m.group(1).partition(":")
                if kind == "folder":
                    report(RESULTS / arg, path.parent)
                elif kind in ("speed", "speed-table"):
                    speed_report(RESULTS / arg, path.parent)
    return stale


def main(argv=None):
    """The command line: bad input (and a missing matplotlib) -> one line on stderr, exit 2, before
    anything is written; --check with a stale block -> exit 1."""
    p = Parser(prog="report.py", description=help_text(__doc__))
    p.add_argument("folders", nargs="*", help="folders of results JSON files (a *.json that "
                   "holds no complete run, e.g. a JSON list, is skipped and named under its table)")
    p.add_argument("--speed", default=None,
                   help="a benchmark/speed.py --json file: its table and bar chart")
    p.add_argument("--out", default=None, help="write the markdown here (default: print it)")
    p.add_argument("--check", action="store_true",
                   help="without folders: exit 1 naming every generated block of README.md, "
                        "docs/*.md and benchmark/results/README.md that regenerating would change "
                        "(text only)")
    p.add_argument("--no-figures", action="store_true",
                   help="without folders: rewrite the blocks, draw no figure")
    a = p.parse_args(argv)
    try:
        return make(a)
    except UserError as e:
        print(f"report.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def make(a):
    if not a.folders and not a.speed:                    # the generated blocks of the documentation
        if a.out:
            raise UserError("--out needs a folder of results or --speed FILE")
        figures = not (a.check or a.no_figures)
        if figures:
            matplotlib_figure()
        stale = update_docs(a.check, figures)
        if a.check and stale:
            sys.exit(1)
        print(f"report.py: {len(generated_files())} files, "
              + ("every generated block up to date" if a.check else f"{stale} block(s) rewritten"))
        return stale
    if a.check or a.no_figures:
        raise UserError("--check and --no-figures apply to the generated blocks (give no folder)")
    for f in a.folders:
        if not Path(f).is_dir():
            raise UserError(f"{f} is not a folder of results")
    if a.speed:
        speed_report(a.speed, figures=False)         # a bad file refused before any figure is drawn
    if a.out:
        out = Path(a.out)
        if out.is_dir() or not out.parent.exists():         # report.py makes no folder
            raise UserError(f"--out {a.out}: " + ("a folder; give a file name" if out.is_dir() else
                                                   f"no folder {out.parent} to write it in"))
        outputs.writable_file(out, "--out")   # a path under a file, a device, a folder not writable
        if out.is_file() and "<!-- report:" in out.read_text():
            raise UserError(f"{a.out} holds generated blocks: "
                            f"python benchmark/report.py (no folders) rewrites them")
    matplotlib_figure()                              # no matplotlib: say so before writing anything
    where = Path(a.out).parent if a.out else Path((a.folders or [Path(a.speed).parent])[0])
    lines = [line for f in a.folders for line in report(f, where)]
    text = "\n".join(lines + (speed_report(a.speed, where) if a.speed else []))
    if a.out and Path(a.out).is_file():                       # keep the introduction
        old = Path(a.out).read_text()
        intro = old[:old.index("\n## ") + 1] if "\n## " in old else ""
        text = intro + text
    if a.out:
        Path(a.out).write_text(text)
        print(f"report: {a.out}")
    else:
        print(text)
    return text


if __name__ == "__main__":
    main()
