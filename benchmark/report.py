"""Tables and plots from results JSON files (benchmark/run.py's folders, or any results of the
method scripts): test accuracy per held-out domain, mean ± std over seeds, the best mean in bold;
seconds per round and images per second with the ratio to FedAvg; accuracy against round as PNG.

    python benchmark/report.py results/benchmark/rmnist-50clients [more folders] [--out report.md]

Runs are grouped by folder, then by label (the file name before `-seed`). The std is over seeds
(n − 1 in the denominator; 0 with one seed). Images per second = training examples of the sampled
clients × local epochs × training rounds / seconds of the run (evaluation time included; a method's
extra passes, e.g. FedIIR's global-gradient pass, are not counted as images; FedLOE's training rounds
are its stage-1 communications). With --out, an existing file's text above its first "## " heading
(a hand-written introduction: how the results were made) is kept. The paper's numbers are printed beside a
table when the dataset and scenario match one of the papers (from ../shared/notes/PAPERS.md); they
used the full datasets, GPUs and their own round counts. The plot uses matplotlib if it is installed;
otherwise a plain PNG is drawn with numpy alone (axes and lines; the legend is in the markdown).
"""
import argparse
import json
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

PAPERS = {  # (dataset, scenario) -> [(label, mean test accuracy %, source)]
    ("rmnist", "small"): [("fedavg", 94.5, "FedIIR Tab. 1"), ("fediir", 95.0, "FedIIR Tab. 1"),
                          ("fedipg", 96.40, "FedIPG Tab. II")],
    ("rmnist", "large"): [("fedavg", 90.8, "FedIIR Tab. 2"), ("fediir", 93.0, "FedIIR Tab. 2"),
                          ("fedipg", 95.68, "FedIPG Tab. II")],
    ("pacs", "small"): [("fedavg", 83.1, "FedIIR Tab. 1"), ("fediir", 83.7, "FedIIR Tab. 1"),
                        ("fedomg", 88.4, "FedOMG Tab. 2"), ("fedloe-fish", 86.60, "FedLOE Tab. 2")],
    ("vlcs", "small"): [("fedavg", 76.3, "FedIIR Tab. 1"), ("fediir", 76.6, "FedIIR Tab. 1"),
                        ("fedomg", 82.0, "FedOMG Tab. 2")],
    ("mnist", "fl"): [("fedavg", 93.77, "FedOMG Tab. 1"), ("fedomg", 98.75, "FedOMG Tab. 1")],
    ("stained-fg", "large"): [("fedavg", 45.73, "FedIPG Tab. III"), ("fedipg", 63.99, "FedIPG Tab. III")],
    ("stained-bg", "large"): [("fedavg", 49.71, "FedIPG Tab. III"), ("fedipg", 62.77, "FedIPG Tab. III")],
    ("stained-both", "large"): [("fedavg", 52.78, "FedIPG Tab. III"), ("fedipg", 62.08, "FedIPG Tab. III")],
    ("rcmnist", "fl"): [("fedavg", 20.77, "PerInvFL Tab. 2, p_test 0.1"), ("perinvfl (global)", 51.48, "IRM row"),
                        ("perinvfl", 53.46, "PerInvFL Tab. 2")],
}
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127)]


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
    return "small" if a["clients"] == a["sample"] and a["clients"] <= 5 else "large"   # one client per domain


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


def speed_table(runs):
    lines = ["| method | s / round | images / s | × FedAvg |", "|---|---|---|---|"]
    rates = {}
    for lab, rs in sorted(runs.items()):
        if lab.endswith("(global)"):
            continue
        sec, ips = [], []
        for r in rs:
            a = r["args"]
            for d in r["domains"].values():
                last = d["history"][-1]
                s = last["seconds"] / last["round"]
                sec.append(s)
                if "train_examples" in d:                  # images through local training, whole run
                    trained = a.get("stage1_comms", last["round"])   # fedloe: stage 1 trains, stage 2 heads only
                    ips.append(d["train_examples"] * a["sample"] / a["clients"] * a["local_epochs"] * trained
                               / last["seconds"])
        rates[lab] = (np.mean(sec), np.mean(ips) if ips else float("nan"))
    base = rates.get("fedavg", (None,))[0]
    for lab, (s, i) in rates.items():
        ratio = f"{s / base:.2f}" if base else "–"
        lines.append(f"| {lab} | {s:.3f} | {i:,.0f} | {ratio} |")
    if any(r["method"] == "fedloe" for rs in runs.values() for r in rs):
        lines += ["", "fedloe: a round is one communication (stage 1: every client trains E1/K1 local epochs; "
                  "stage 2: heads only), so its s / round is not a FedAvg round's; its images / s counts the "
                  "stage-1 images over the whole run."]
    return lines


def curves(runs):
    """{label: (rounds, mean test accuracy over seeds and domains)} on the rounds all runs share."""
    out = {}
    for lab, rs in sorted(runs.items()):
        hist = [d["history"] for r in rs for d in r["domains"].values()]
        common = sorted(set.intersection(*[{row["round"] for row in h} for h in hist]))
        acc = [np.mean([next(row["test_acc"] for row in h if row["round"] == t) for h in hist]) for t in common]
        out[lab] = (np.array(common), 100 * np.array(acc))
    return out


def plot(cs, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return plain_png(cs, path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (lab, (x, y)) in enumerate(cs.items()):
        ax.plot(x, y, marker="o", ms=3, label=lab, color=np.array(COLOURS[k % len(COLOURS)]) / 255)
    ax.set(xlabel="round", ylabel="test accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def plain_png(cs, path, W=640, H=400, pad=40):
    """Lines on axes, y from 0 to 100 %, x from round 0 to the last round; no text."""
    img = np.full((H, W, 3), 255, np.uint8)
    img[H - pad, pad:W - pad // 2] = 0
    img[pad // 2:H - pad + 1, pad] = 0
    for q in range(0, 101, 10):                                        # y ticks every 10 %
        yy = int(H - pad - q / 100 * (H - 1.5 * pad))
        img[yy, pad - 5:pad] = 0
        img[yy, pad + 1:W - pad // 2:4] = 200
    xmax = max(max(x) for x, _ in cs.values())
    for k, (x, y) in enumerate(cs.values()):
        px = pad + x / xmax * (W - 1.5 * pad)
        py = H - pad - y / 100 * (H - 1.5 * pad)
        for i in range(len(px)):
            a = (px[i - 1], py[i - 1]) if i else (px[i], py[i])
            for t in np.linspace(0, 1, 200):
                u, v = int(a[0] + t * (px[i] - a[0])), int(a[1] + t * (py[i] - a[1]))
                img[max(v - 1, 0):v + 2, max(u - 1, 0):u + 2] = COLOURS[k % len(COLOURS)]
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(H))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    return "plain"


def report(folder, where="."):
    runs, skipped = load(folder)
    if not runs:
        return [f"## {folder}", "", "no complete results here", ""]
    first = next(iter(runs.values()))[0]
    a = first["args"]
    lines = [f"## {Path(folder).name}", "",
             f"`{first['dataset']}`, {a['clients']} clients, {a['sample']} per round, {a['rounds']} rounds, "
             f"{a['local_epochs']} local epoch(s); data: {first['source']}; test accuracy in % "
             f"({'last round' if a.get('select') == 'last' else 'at the best validation round'}), "
             f"mean ± std over seeds.", ""]
    lines += accuracy_table(runs)
    name = first["dataset"] + (f"-{a.get('stain')}" if first["dataset"] == "stained" else "")
    paper = PAPERS.get((name, scenario(first)))
    if paper:
        lines += ["", "Published (full data, GPUs, the papers' own round counts; not comparable in scale): "
                  + "; ".join(f"{lab} {m:.2f} ({src})" for lab, m, src in paper) + "."]
    lines += ["", *speed_table(runs)]
    png = Path(folder) / "accuracy.png"
    cs = curves(runs)
    how = plot(cs, png, Path(folder).name)
    legend = ", ".join(f"{lab} = rgb{COLOURS[k % len(COLOURS)]}" for k, lab in enumerate(cs))
    link = os.path.relpath(png, where)                       # relative to the markdown file
    lines += ["", f"![test accuracy against round]({link})", "",
              f"Test accuracy (%, mean over seeds and test domains) against round; "
              + ("" if how == "matplotlib" else "y axis 0–100 % (ticks every 10), x axis 0 to the last round; ")
              + f"colours: {legend}."]
    for md in sorted(Path(folder).glob("*.md")):               # tables written beside the runs (rcmnist_ptest.py)
        lines += ["", f"More from these runs: [{md.name}]({os.path.relpath(md, where)})."]
    if skipped:
        lines += ["", f"Left out (incomplete or unreadable): {', '.join(skipped)}."]
    return lines + [""]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--out", default=None, help="write the markdown here (default: print it)")
    a = p.parse_args(argv)
    for f in a.folders:
        if not Path(f).is_dir():
            sys.exit(f"report.py: error: {f} is not a folder of results")
    where = Path(a.out).parent if a.out else Path(a.folders[0])
    text = "\n".join(line for f in a.folders for line in report(f, where))
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
