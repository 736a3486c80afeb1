"""Tables and figures from results JSON files (benchmark/run.py's folders, or any results of the
method scripts): test accuracy per held-out domain, mean ± std over seeds, the best mean in bold;
seconds per round and images per second with the ratio to FedAvg; figures (PNG and SVG) of accuracy
against round, of accuracy against p_test on RC-MNIST, and of benchmark/speed.py's seconds per round.

    python benchmark/report.py results/benchmark/rmnist-50clients [more folders] [--out report.md]
    python benchmark/report.py --speed speed.json [folders]        # speed.py --json's table and bars

Runs are grouped by folder, then by label (the file name before `-seed`). The std is over seeds
(n − 1 in the denominator; 0 with one seed). Images per second = training examples of the sampled
clients × local epochs × training rounds / seconds of the run (evaluation time included; a method's
extra passes, e.g. FedIIR's global-gradient pass, are not counted as images; FedLOE's training rounds
are its stage-1 communications). With --out, an existing file's text above its first "## " heading
(a hand-written introduction: how the results were made) is kept. The paper's numbers are printed beside a
table when the dataset and scenario match one of the papers (from ../shared/notes/PAPERS.md); they
used the full datasets, GPUs and their own round counts; the figures draw them as dashed lines.

Every figure is written beside its data: <folder>/accuracy.{png,svg} (mean over seeds ± std band, per
method); on rcmnist / rcfmnist <folder>/ptest.{png,svg} (every p_test: scored from the checkpoints by
rcmnist_ptest.py when every run has its .ckpt, else from the ptest.md it wrote); with --speed, the
bar chart beside the JSON. The figures need matplotlib (pip install matplotlib; benchmark/ only).
"""
import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np

PAPERS = {  # (dataset[-held-out domain | -stain | -alpha], scenario) -> [(label, mean test accuracy %, source)]
    ("rmnist", "small"): [("fedavg", 94.5, "FedIIR Tab. 1"), ("fediir", 95.0, "FedIIR Tab. 1"),
                          ("fedipg", 96.40, "FedIPG Tab. II")],
    ("rmnist", "large"): [("fedavg", 90.8, "FedIIR Tab. 2"), ("fediir", 93.0, "FedIIR Tab. 2"),
                          ("fedipg", 95.68, "FedIPG Tab. II")],
    ("pacs", "small"): [("fedavg", 83.1, "FedIIR Tab. 1"), ("fediir", 83.7, "FedIIR Tab. 1"),
                        ("fedomg", 88.4, "FedOMG Tab. 2"), ("fedloe-fish", 86.60, "FedLOE Tab. 2")],
    ("vlcs", "small"): [("fedavg", 76.3, "FedIIR Tab. 1"), ("fediir", 76.6, "FedIIR Tab. 1"),
                        ("fedomg", 82.0, "FedOMG Tab. 2")],
    ("rmnist-0", "large"): [("fedavg", 77.9, "FedIIR Tab. 8, 0°"), ("fediir", 84.0, "FedIIR Tab. 8, 0°")],
    ("rmnist-75", "large"): [("fedavg", 81.2, "FedIIR Tab. 8, 75°"), ("fediir", 84.5, "FedIIR Tab. 8, 75°")],
    ("mnist-alpha0.1", "fl"): [("fedavg", 93.77, "FedOMG Tab. 1, α 0.1"), ("fedomg", 98.75, "FedOMG Tab. 1, α 0.1")],
    ("mnist-alpha0.5", "fl"): [("fedavg", 91.47, "FedOMG Tab. 1, α 0.5"), ("fedomg", 98.58, "FedOMG Tab. 1, α 0.5")],
    ("stained-fg", "stained"): [("erm", 55.78, "FedIPG Tab. III"), ("fedavg", 45.73, "FedIPG Tab. III"),
                                ("fedipg", 63.99, "FedIPG Tab. III")],
    ("stained-bg", "stained"): [("erm", 52.79, "FedIPG Tab. III"), ("fedavg", 49.71, "FedIPG Tab. III"),
                                ("fedipg", 62.77, "FedIPG Tab. III")],
    ("stained-both", "stained"): [("erm", 66.46, "FedIPG Tab. III"), ("fedavg", 52.78, "FedIPG Tab. III"),
                                  ("fedipg", 62.08, "FedIPG Tab. III")],
    ("rcmnist", "fl"): [("fedavg", 20.77, "PerInvFL Tab. 2, p_test 0.1"), ("perinvfl (global)", 51.48, "IRM row"),
                        ("perinvfl", 53.46, "PerInvFL Tab. 2")],
}


def load(folder):
    """{label: [results]} for the results files in a folder (incomplete runs are left out)."""
    runs, skipped = {}, []
    for f in sorted(Path(folder).glob("*.json")):
        try:
            r = json.loads(f.read_text())
        except ValueError:
            skipped.append(f.name)
            continue
        if not r.get("complete", True) or "domains" not in r:
            skipped.append(f.name)
            continue
        label = f.stem.rsplit("-seed", 1)[0]
        runs.setdefault(label, []).append(r)
        if "global_test_acc" in next(iter(r["domains"].values())):   # PerInvFL's global ν
            g = json.loads(json.dumps(r))
            for d in g["domains"].values():
                d["test_acc"] = d["global_test_acc"]
                for row in d["history"]:
                    row["test_acc"] = row["global_test_acc"]
            runs.setdefault(label + " (global)", []).append(g)
    return runs, skipped


def mean_std(xs):
    xs = 100 * np.asarray(xs, dtype=float)
    return xs.mean(), (xs.std(ddof=1) if len(xs) > 1 else 0.0)


def scenario(r):
    a = r["args"]
    if r["protocol"] == "clients":
        return "fl"
    if r["dataset"] == "stained":                  # Table III: one setting per stain, whatever the clients
        return "stained"
    return "small" if a["clients"] == a["sample"] and a["clients"] <= 5 else "large"   # one client per domain


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
            cells[lab, d] = mean_std([r["domains"][d]["test_acc"] for r in runs[lab] if d in r["domains"]])
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
    """FedIPG runs with an aberrant client (Section VI-A): per variant, who exited (per seed) and the
    accuracies at the selected round on the regular clients, the aberrant client (validation splits)
    and the held-out domain (test), per seed and their mean."""
    if not all("aberrant_acc" in d for rs in runs.values() for r in rs for d in r["domains"].values()):
        return []
    lines = ["| variant | exited (per seed) | regular clients | aberrant client | held-out domain |",
             "|---|---|---|---|---|"]
    for lab, rs in sorted(runs.items()):
        ds = [d for r in rs for d in r["domains"].values()]
        cell = lambda k: (", ".join(f"{100 * d[k]:.1f}" for d in ds)
                          + f" (mean {100 * sum(d[k] for d in ds) / len(ds):.1f})")
        exited = "; ".join(", ".join(map(str, d["exited"])) or "none" for d in ds)
        lines.append(f"| {lab} | {exited} | {cell('regular_acc')} | {cell('aberrant_acc')} | {cell('test_acc')} |")
    return ["", "Accuracy (%) at the selected round, per seed: the regular clients' and the aberrant client's "
            "validation splits, and the held-out domain's test set.", "", *lines]


def speed_table(runs):
    """Seconds per round and images / s per method, and the ratio to FedAvg's round; where the runs
    of a folder come from more than one device, one row per method and device, each against FedAvg
    on the same device."""
    lines = ["| method | s / round | images / s | × FedAvg |", "|---|---|---|---|"]
    several = len({r["args"].get("device") for rs in runs.values() for r in rs}) > 1
    sec, ips = {}, {}                                  # (label, device or None) -> one value per run
    for lab, rs in sorted(runs.items()):
        if lab.endswith("(global)"):
            continue
        for r in rs:
            a = r["args"]
            key = (lab, a.get("device") if several else None)
            for d in r["domains"].values():
                last = d["history"][-1]
                sec.setdefault(key, []).append(last["seconds"] / last["round"])
                if "train_examples" in d:                  # images through local training, whole run
                    trained = a.get("stage1_comms", last["round"])   # fedloe: stage 1 trains, stage 2 heads only
                    ips.setdefault(key, []).append(d["train_examples"] * a["sample"] / a["clients"]
                                                   * a["local_epochs"] * trained / last["seconds"])
    for (lab, dev), s in sorted(sec.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        base = sec.get(("fedavg", dev))
        ratio = f"{np.mean(s) / np.mean(base):.2f}" if base else "–"
        i = np.mean(ips[(lab, dev)]) if (lab, dev) in ips else float("nan")
        lines.append(f"| {lab}{f' ({dev})' if several else ''} | {np.mean(s):.3f} | {i:,.0f} | {ratio} |")
    if any(r["method"] == "fedloe" for rs in runs.values() for r in rs):
        lines += ["", "fedloe: a round is one communication (stage 1: every client trains E1/K1 local epochs; "
                  "stage 2: heads only), so its s / round is not a FedAvg round's; its images / s counts the "
                  "stage-1 images over the whole run."]
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
    """[(labels, (x, y))] from {label: (x, y)}: identical y drawn once and named together (PerInvFL's
    global ν does not depend on --personalize, so its three variants give the same curve)."""
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
        sys.exit("report.py: error: the figures need matplotlib, which is not installed "
                 "(pip install matplotlib)")
    matplotlib.rcParams["svg.hashsalt"] = "report"          # the same SVG for the same data (no random ids)
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
    """Method k's mean (line) ± std (band). Each method has its own marker, and the earlier a method
    the thicker its line, so that a curve lying on another one (FedIPG on FedAvg) stays visible."""
    ax.plot(x, m, marker=MARKERS[k % len(MARKERS)], ms=4, lw=max(4.0 - 0.8 * k, 1.0), color=f"C{k}",
            label="\n= ".join(labels) + f" ({n} seed{'s' * (n > 1)})")
    ax.fill_between(x, m - s, m + s, color=f"C{k}", alpha=0.15, lw=0)


def legend(ax):
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)   # beside, not on, the curves


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


PTEST_PAPER = {  # PerInvFL's Table 2 (RC-MNIST) at p_test 0.1 ... 0.5: our row drawn in its colour, a marker
    "FedAvg": ("fedavg", "x", [20.77, 29.66, 37.74, 45.15, 54.12]),
    "IRM": ("perinvfl irm dual (global ν)", "1", [51.48, 51.70, 52.17, 51.53, 51.18]),
    "PerInvFL": ("perinvfl irm dual", "+", [53.46, 52.75, 53.63, 51.41, 52.73]),
}


def ptest_table(folder, paths):
    """(the p_test values, {row: (mean %, std %, seeds) at each}, where from): scored from the runs'
    checkpoints by rcmnist_ptest.py when every run has one beside its results, else read from the
    ptest.md that rcmnist_ptest.py wrote (checkpoints are not committed); (None, None, None) without."""
    if paths and all(Path(f).with_suffix(".ckpt").is_file() for f in paths):
        import rcmnist_ptest                                  # torch and the data: only when scoring
        try:
            scored = rcmnist_ptest.table(paths)
        except (AssertionError, OSError, RuntimeError, KeyError) as e:   # e.g. a checkpoint of a cut run
            sys.exit(f"report.py: error: could not score the checkpoints in {folder}: {e}")
        ps = list(rcmnist_ptest.P_TEST)
        return ps, {name: (*band(100 * np.array(runs)[:, :len(ps)]), len(runs))
                    for name, runs in sorted(scored.items())}, "the runs' checkpoints"
    md = Path(folder) / "ptest.md"
    if not md.is_file():
        return None, None, None
    try:
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.read_text().splitlines()
                if line.startswith("|") and not line.startswith("|---")]
        cols = [i for i, c in enumerate(rows[0]) if c.startswith("p_test ")]
        cell = lambda c: [float(v) for v in c.split("±")]
        return ([float(rows[0][i].split()[1]) for i in cols],
                {r[0]: (*np.array([cell(r[i]) for i in cols]).T, int(r[-1])) for r in rows[1:]}, md.name)
    except (IndexError, ValueError) as e:
        sys.exit(f"report.py: error: {md} is not rcmnist_ptest.py's table ({e})")


def ptest_figure(table, title, p_test, paper=True):
    """Accuracy against p_test (PerInvFL's Table 2 as a figure): mean ± std over seeds per row, the
    paper's rows dashed in the colour of the row they correspond to."""
    fig, ax = new_axes(title, "p_test (probability that the test colour agrees with the label)",
                       "test accuracy (%)")
    colour = {}
    rows = {name: (n, np.array([m, s])) for name, (m, s, n) in table.items()}
    for k, (names, (n, (m, s))) in enumerate(merged(rows)):
        curve(ax, k, p_test, m, s, names, n)
        colour.update({name: f"C{k}" for name in names})
    for name, (ours, marker, acc) in PTEST_PAPER.items() if paper and p_test == [0.1, 0.2, 0.3, 0.4, 0.5] else ():
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
    fig, ax = new_axes(textwrap.fill("benchmark/speed.py: " + speed["setting"], 90), "seconds per round",
                       "one round of", width=7.0)
    ax.set_axisbelow(True)
    ax.barh(names, med, xerr=[med - [v.min() for v in secs], [v.max() for v in secs] - med],
            color=[f"C{k}" for k in range(len(names))], capsize=3)
    ax.invert_yaxis()                                           # first timed variant on top, as the table
    ax.legend(ax.patches, names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def save(fig, stem):
    """stem.png (any viewer) and stem.svg (crisp in the GitHub README), without dates inside."""
    fig.savefig(f"{stem}.png", dpi=130, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(f"{stem}.svg", bbox_inches="tight", metadata={"Date": None})
    return fig


def title(first, name):
    """The benchmark's name, dataset and protocol on the first line, the data source below."""
    a = first["args"]
    how = ("fixed clients, test: every client's own test set, pooled" if first["protocol"] == "clients"
           else "leave one domain out, each held out in turn")
    return (f"{name}: {first['dataset']}, {how}; {a['clients']} clients, {a['sample']} per round\n"
            + "\n".join(textwrap.fill(part, 100) for part in ("data: " + first["source"]).split("; ")))


def report(folder, where="."):
    runs, skipped = load(folder)
    if not runs:
        return [f"## {folder}", "", "no complete results here", ""]
    first = runs.get("fedavg", next(iter(runs.values())))[0]    # the setting's name: FedAvg's run if any
    a = first["args"]
    shape = {lab: (rs[0]["args"]["rounds"], rs[0]["args"]["local_epochs"]) for lab, rs in runs.items()}
    rounds = f"{a['rounds']} rounds, {a['local_epochs']} local epoch(s)" if len(set(shape.values())) == 1 else \
        "rounds × local epochs " + ", ".join(f"{lab} {r} × {e}" for lab, (r, e) in shape.items())
    lines = [f"## {Path(folder).name}", "",
             f"`{first['dataset']}`, {a['clients']} clients, {a['sample']} per round, {rounds}; "
             f"data: {first['source']}; test accuracy in % "
             f"({'last round' if a.get('select') == 'last' else 'at the best validation round'}), "
             f"mean ± std over seeds.", ""]
    lines += accuracy_table(runs)
    lines += exit_table(runs)
    name = published_name(first)
    paper = PAPERS.get((name, scenario(first)), [])
    if not any(lab in runs for lab, _, _ in paper):             # other variants (e.g. FedIPG's exit runs)
        paper = []
    if paper:
        scale = "not comparable in scale" if first["source"].startswith("embedded") else "the runs above use full data"
        lines += ["", f"Published (full data, GPUs, the papers' own round counts; {scale}): "
                  + "; ".join(f"{lab} {m:.2f} ({src})" for lab, m, src in paper) + "."]
    lines += ["", *speed_table(runs)]
    link = lambda stem, ext: os.path.relpath(f"{stem}.{ext}", where)     # relative to the markdown file
    stem = Path(folder) / "accuracy"
    save(accuracy_figure(runs, title(first, Path(folder).name), paper), stem)
    lines += ["", f"![test accuracy against round]({link(stem, 'svg')})", "",
              "Test accuracy (%) against round: each seed's accuracy is its mean over the test domains; line: "
              "the mean over seeds, band: ± the std over seeds" + ("; dashed: the published number" if paper else "")
              + f"; identical curves are drawn once, named together ([PNG]({link(stem, 'png')}))."]
    if first["dataset"] in ("rcmnist", "rcfmnist"):             # PerInvFL's p_test table as a figure
        paths = [f for f in sorted(Path(folder).glob("*.json")) if f.name not in skipped]
        p_test, table, source = ptest_table(folder, paths)
        if table:
            stem, rc = Path(folder) / "ptest", first["dataset"] == "rcmnist"
            head = title(first, Path(folder).name).replace(f", p_test {a['p_test']}", "")   # every p_test here
            save(ptest_figure(table, head, p_test, paper=rc), stem)
            lines += ["", f"![test accuracy against p_test]({link(stem, 'svg')})", "",
                      f"The same runs scored on the test contexts of every p_test (from {source}): line: the mean "
                      "over seeds, band: ± the std over seeds" + ("; dashed: PerInvFL's Table 2" if rc else "")
                      + f"; rows equal in every cell are drawn once, named together ([PNG]({link(stem, 'png')}))."]
    for md in sorted(Path(folder).glob("*.md")):               # tables written beside the runs (rcmnist_ptest.py)
        lines += ["", f"More from these runs: [{md.name}]({os.path.relpath(md, where)})."]
    if skipped:
        lines += ["", f"Left out (incomplete or unreadable): {', '.join(skipped)}."]
    return lines + [""]


def speed_report(path, where="."):
    """The table and bar chart of a speed.py --json file (the chart beside it)."""
    try:
        speed = json.loads(Path(path).read_text())
        med = {k: float(np.median(v)) for k, v in speed["seconds"].items()}
        n, base = speed["images_per_round"], next(iter(med.values()))
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        sys.exit(f"report.py: error: {path} is not a speed.py --json file ({e.__class__.__name__}: {e})")
    stem = Path(path).with_suffix("")
    save(speed_figure(speed), stem)
    return ["## speed", "", f"`benchmark/speed.py`: {speed['setting']}.", "",
            f"| round | s / round | images / s | × {next(iter(med))} |", "|---|---|---|---|",
            *[f"| {k} | {v:.3f} | {n / v:,.0f} | {v / base:.2f} |" for k, v in med.items()], "",
            f"![seconds per round]({os.path.relpath(f'{stem}.svg', where)})", "",
            f"Bars: the median over the timed rounds; whiskers: the fastest and the slowest round "
            f"([PNG]({os.path.relpath(f'{stem}.png', where)})).", ""]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="*")
    p.add_argument("--speed", default=None, help="a benchmark/speed.py --json file: its table and bar chart")
    p.add_argument("--out", default=None, help="write the markdown here (default: print it)")
    a = p.parse_args(argv)
    if not a.folders and not a.speed:
        sys.exit("report.py: error: give a folder of results or --speed FILE")
    for f in a.folders:
        if not Path(f).is_dir():
            sys.exit(f"report.py: error: {f} is not a folder of results")
    matplotlib_figure()                                       # no matplotlib: say so before writing anything
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
