"""Six methods, one table: every method on every MNIST-family benchmark at full scale, side by side.

Rows are methods, columns benchmarks; a cell is the test accuracy (%) as mean ± std over seeds
(3 by default), each run at its method's paper settings for that dataset where the paper gives
them, otherwise at its file's defaults, never tuned on a test domain. The benchmarks (BENCHMARKS):

    rcmnist-norot   federated ColoredMNIST: rcmnist --no-rotation, 4 clients, 500 rounds, p_test 0.1
    rcmnist         RC-MNIST as PerInvFL builds it (client i rotated by 90·i degrees)
    rmnist5-0/-75   RotatedMNIST, one client per training domain, test domain 0° / 75°
    rmnist50-0/-75  RotatedMNIST, 50 clients, 5 sampled, test domain 0° / 75°
    mnist-fl        label-skew MNIST, Dirichlet α = 0.1, 100 clients, 20 sampled, 200 rounds

A committed run of the same protocol and code is reused, not rerun (REUSE names its folder); the
other cells run through benchmark/run.py (resumable: a complete run is skipped, an interrupted one
continued) into benchmark/results/leaderboard/<benchmark>/. A method that refuses a protocol gets
no cell, and the reason is listed under the table. PerInvFL gives two rows from one run: its
personalised models and its global invariant model ν ("federated IRM"). The centralised ERM and IRM
of benchmark/diagnostics/irm_central.py are reference rows on the two RC-MNIST columns.

A cell is marked best (bold) only where its mean beats every other federated row's mean in that
column by more than two seed standard deviations (2 · the larger of the two stds), with at least 2
seeds each (the centralised reference rows are not candidates).

    python benchmark/leaderboard.py --data-root DIR      # run what is missing, then the table
    python benchmark/leaderboard.py --data-root DIR --only rcmnist-norot --jobs 2
    python benchmark/leaderboard.py --data-root DIR --launcher multi_gpu --gpus 0,1
    python benchmark/leaderboard.py --dry-run            # the missing cells and their commands
    python benchmark/leaderboard.py --table-only         # the table from what exists

Writes benchmark/results/leaderboard/README.md (the table, where each cell comes from, every cell's
settings, the refusals) and leaderboard.{png,svg} (matplotlib, benchmark/ only).

Bad input ends with one line on stderr and exit code 2 before any run starts: every benchmark's
run.py command is planned (its methods' own checks included) before the first runs, and an --out-dir
the table could not be written in (a file, a path under a file, a folder not writable) is refused.
The runs go through run.py in this process; Ctrl-C (SIGINT) or SIGTERM stops them as run.py does
(each run gets SIGINT and keeps its last checkpoint), and leaderboard.py says in one line what it
stopped and exits 130 (143 for SIGTERM); the same command continues.
"""
import json
import shlex
import signal
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
import run as bench_run  # noqa: E402
from data import UserError  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402
RESULTS = ROOT / "benchmark" / "results"
SEEDS = [0, 1, 2]

# name -> (title, dataset, arguments of every run, where it fits: "cpu" (hours on 2 cores) or "gpu")
BENCHMARKS = {
    "rcmnist-norot": ("Federated ColoredMNIST", "rcmnist", ["--no-rotation"], "cpu"),
    "rcmnist": ("RC-MNIST (rotated)", "rcmnist", [], "cpu"),
    "rmnist5-0": ("RotatedMNIST-5, 0°", "rmnist", ["--test-domain", "0"], "gpu"),
    "rmnist5-75": ("RotatedMNIST-5, 75°", "rmnist", ["--test-domain", "75"], "gpu"),
    "rmnist50-0": ("RotatedMNIST-50, 0°", "rmnist",
                   ["--clients", "50", "--sample", "5", "--test-domain", "0"], "gpu"),
    "rmnist50-75": ("RotatedMNIST-50, 75°", "rmnist",
                    ["--clients", "50", "--sample", "5", "--test-domain", "75"], "gpu"),
    "mnist-fl": ("MNIST label skew α 0.1", "mnist",
                 ["--alpha", "0.1", "--rounds", "200", "--eval-every", "20"], "gpu"),
}
# row label -> (script, its own arguments)
ROWS = {
    "fedavg": ("fedavg", []),
    "fediir": ("fediir", []),
    "fedomg": ("fedomg", []),
    "fedloe-fish": ("fedloe", ["--dg", "fish"]),
    "fedloe-irm": ("fedloe", ["--dg", "irm"]),
    "fedloe-rex": ("fedloe", ["--dg", "rex"]),
    "perinvfl": ("perinvfl", []),
    # the default, the form of every FedIPG verdict
    "fedipg-sgd": ("fedipg", ["--local-step", "sgd"]),
    # Eq. 2 read as one step (the default before 2026-11-26)
    "fedipg-paper": ("fedipg", ["--local-step", "paper"]),
}
# scripts that set their own rounds from their own flags (fedloe.py: --stage1-comms, --stage2-comms)
# and refuse --rounds / --eval-every: a benchmark's round count does not apply to them
OWN_SCHEDULE = {"fedloe"}
# (benchmark, row) -> committed folder/label of the same protocol and code, reused as it is
REUSE = {
    ("rcmnist-norot", "fedavg"): "rcmnist-full-norot/fedavg",
    ("rcmnist", "fedavg"): "rcmnist-full/fedavg",
    ("rmnist50-0", "fedavg"): "rmnist50-full-0/fedavg",
    ("rmnist50-0", "fediir"): "rmnist50-full-0/fediir",
    ("rmnist50-75", "fedavg"): "rmnist50-full-75/fedavg",
    ("rmnist50-75", "fediir"): "rmnist50-full-75/fediir",
    # FedIPG's Table II verdict runs (minibatch SGD)
    ("rmnist50-0", "fedipg-sgd"): "rmnist50-full-0/fedipg",
    ("rmnist50-75", "fedipg-sgd"): "rmnist50-full-75/fedipg",
    ("mnist-fl", "fedavg"): "mnist-fl-full-alpha0.1/fedavg",
    ("mnist-fl", "fedomg"): "mnist-fl-full-alpha0.1/fedomg",            # the FL η_g and server rule
    # θ_i reset to ν (perinvfl.py's default)
    ("rcmnist-norot", "perinvfl"): "rcmnist-full-norot-reset/perinvfl",
    ("rcmnist", "perinvfl"): "rcmnist-full-reset/perinvfl",
}
# (benchmark, row) -> why the method does not run there (listed under the table). FedLOE on the
# benchmarks that sample clients (RotatedMNIST-50: --sample 5, FedIIR's Table 8): fedloe.py refuses
# --sample, since its Eq. 4 and Eq. 11 use every client at every communication. Its own protocol
# (all 50 clients every communication) was the other choice, not taken: these columns are defined by
# 5 of 50 clients a round, and a FedLOE cell that saw every client would sit in them as if
# comparable; a refusal with its reason says what the column cannot hold. (mnist-fl passes no
# --sample: there each method runs its own default participation, FedLOE every client, as its
# sources line says, "each method's defaults".)
REFUSED = {(b, row): "fedloe.py refuses --sample: it uses every client at every communication "
                     "(Eq. 4, Eq. 11), and this benchmark samples "
                     f"{args[args.index('--sample') + 1]} of "
                     f"{args[args.index('--clients') + 1]} clients a round"
           for b, (_, _, args, _) in BENCHMARKS.items() if "--sample" in args
           for row, (script, _) in ROWS.items() if script == "fedloe"}
# reference rows: label -> {benchmark: irm_central.py results file, its key}
CENTRAL = {"central ERM": ("erm", {"rcmnist-norot": "irm-central/rc-norot.json",
                                   "rcmnist": "irm-central/rc.json"}),
           "central IRM": ("irm", {"rcmnist-norot": "irm-central/rc-norot.json",
                                   "rcmnist": "irm-central/rc.json"})}
# the papers' numbers for a column, where one exists: (benchmark, row) -> (value, source)
PAPER = {
    ("rcmnist", "fedavg"): (20.77, "PerInvFL Tab. 2"),
    ("rcmnist", "perinvfl"): (53.46, "PerInvFL Tab. 2"),
    ("rcmnist", "perinvfl (ν)"): (51.48, "PerInvFL Tab. 2, IRM"),
    ("rmnist50-0", "fedavg"): (77.9, "FedIIR Tab. 8"),
    ("rmnist50-0", "fediir"): (84.0, "FedIIR Tab. 8"),
    ("rmnist50-75", "fedavg"): (81.2, "FedIIR Tab. 8"),
    ("rmnist50-75", "fediir"): (84.5, "FedIIR Tab. 8"),
    ("mnist-fl", "fedavg"): (93.77, "FedOMG Tab. 1"),
    ("mnist-fl", "fedomg"): (98.75, "FedOMG Tab. 1"),
}


def row_args(bench, row):
    """A cell's arguments: the benchmark's, then the row's own (a round count dropped where the
    method sets its own schedule)."""
    args, (script, extra) = list(BENCHMARKS[bench][2]), ROWS[row]
    if script in OWN_SCHEDULE:
        for flag in ("--rounds", "--eval-every"):
            if flag in args:
                i = args.index(flag)
                del args[i:i + 2]
    return args + extra


def folder(bench, out_dir):
    return Path(out_dir) / bench


def runs_of(bench, row, out_dir, seeds):
    """[(seed, results path)] of a cell: the reused committed runs, or the leaderboard's own."""
    if (bench, row) in REUSE:
        f, label = REUSE[(bench, row)].split("/")
        return [(s, RESULTS / f / f"{label}-seed{s}.json") for s in seeds]
    return [(s, folder(bench, out_dir) / f"{row}-seed{s}.json") for s in seeds]


def complete(path):
    try:
        return json.loads(Path(path).read_text()).get("complete", False)
    except (OSError, ValueError):
        return False


def accuracy(path, which="test_acc"):
    """A run's test accuracy (%): the mean over its test domains (one here), or ν's for PerInvFL."""
    r = json.loads(Path(path).read_text())
    return 100 * float(np.mean([d[which] for d in r["domains"].values()]))


def cells(benches, out_dir, seeds):
    """{(bench, row): [accuracies of the complete seeds]}, PerInvFL's ν as row 'perinvfl (ν)'."""
    out = {}
    for b in benches:
        for row in ROWS:
            if (b, row) in REFUSED:
                continue
            done = [p for _, p in runs_of(b, row, out_dir, seeds) if complete(p)]
            out[(b, row)] = [accuracy(p) for p in done]
            if row == "perinvfl":
                out[(b, "perinvfl (ν)")] = [accuracy(p, "global_test_acc") for p in done]
        for label, (key, files) in CENTRAL.items():
            f = RESULTS / files[b] if b in files else None
            if f is not None and f.is_file():
                out[(b, label)] = [100 * r["test_acc"] for r in json.loads(f.read_text())["runs"]
                                   if r["method"] == key]
    return out


def best(col):
    """The row of a column that beats every other row beyond two seed stds, or None."""
    stats = {r: (np.mean(v), np.std(v, ddof=1)) for r, v in col.items() if len(v) >= 2}
    if len(stats) < 2:
        return None
    top = max(stats, key=lambda r: stats[r][0])
    m, s = stats[top]
    ok = all(m - m2 > 2 * max(s, s2) for r, (m2, s2) in stats.items() if r != top)
    return top if ok else None


def fmt(v):
    if not v:
        return "—"
    return f"{np.mean(v):.1f} ± {np.std(v, ddof=1) if len(v) > 1 else 0.0:.1f} ({len(v)})"


def table(benches, out_dir, seeds):
    """The markdown table: rows methods, columns benchmarks, mean ± std (seeds), paper's number,
    best in bold."""
    c = cells(benches, out_dir, seeds)
    rows = list(dict.fromkeys(r for (_, r) in c))
    tops = {b: best({r: v for (bb, r), v in c.items() if bb == b and r not in CENTRAL})
            for b in benches}
    lines = ["| method | " + " | ".join(BENCHMARKS[b][0] for b in benches) + " |",
             "|---|" + "---|" * len(benches)]
    for r in rows:
        out = []
        for b in benches:
            v = c.get((b, r))
            s = fmt(v) if v is not None else "refused" if (b, r) in REFUSED else ""
            s = f"**{s}**" if tops[b] == r else s
            if (b, r) in PAPER:
                s += f" [paper {PAPER[(b, r)][0]}]"
            out.append(s)
        lines.append(f"| {r} | " + " | ".join(out) + " |")
    return "\n".join(lines), c


def sources(benches, out_dir, seeds):
    out = []
    for b in benches:
        _, dataset, args, _ = BENCHMARKS[b]
        shown = folder(b, out_dir).relative_to(ROOT) if folder(b, out_dir).is_relative_to(ROOT) \
            else folder(b, out_dir)
        out.append(f"- **{BENCHMARKS[b][0]}** (`{b}`): "
                   f"`{shlex.join(['--dataset', dataset, *args])}` and each method's "
                   f"defaults for {dataset}.")
        for row, (script, extra) in ROWS.items():
            if (b, row) in REFUSED:
                out.append(f"  - {row}: refused — {REFUSED[(b, row)]}")
            elif (b, row) in REUSE:
                out.append(f"  - {row}: reused from "
                           f"`benchmark/results/{REUSE[(b, row)]}-seed*.json`")
            else:
                cmd = shlex.join([f"{script}.py", "--dataset", dataset, *row_args(b, row),
                                  "--data-root", "DIR", "--seed", "S"])
                out.append(f"  - {row}: `python {cmd}` → `{shown}/{row}-seedS.json`")
    return "\n".join(out)


def missing(benches, out_dir, seeds):
    """{bench: [row labels with a seed not complete]} (reused and refused cells excluded)."""
    todo = {}
    for b in benches:
        for row in ROWS:
            if (b, row) in REUSE or (b, row) in REFUSED:
                continue
            if not all(complete(p) for _, p in runs_of(b, row, out_dir, seeds)):
                todo.setdefault(b, []).append(row)
    return todo


def run_command(b, rows, a):
    """benchmark/run.py's command for the missing rows of one benchmark."""
    dataset = BENCHMARKS[b][1]
    methods = [f"{r}={ROWS[r][0]} {shlex.join(row_args(b, r))}" for r in rows]
    cmd = [sys.executable, str(ROOT / "benchmark" / "run.py"), "--dataset", dataset,
           "--seeds", *map(str, a.seeds),
           "--out-dir", str(a.out_dir), "--tag", b, "--launcher", a.launcher, "--jobs", str(a.jobs),
           "--methods", *methods]
    if a.gpus:
        cmd += ["--gpus", a.gpus]
    return cmd + ["--"] + (["--data-root", a.data_root] if a.data_root else [])


def figure(c, benches, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("leaderboard.py: no figure (matplotlib is not installed: pip install matplotlib)")
        return
    rows = list(dict.fromkeys(r for (_, r) in c))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(benches)), 4))
    w = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        m = [np.mean(c[(b, r)]) if c.get((b, r)) else np.nan for b in benches]
        s = [np.std(c[(b, r)], ddof=1) if len(c.get((b, r)) or []) > 1 else 0 for b in benches]
        ax.bar(np.arange(len(benches)) + i * w, m, w, yerr=s, label=r)
    ax.set_xticks(np.arange(len(benches)) + 0.4 - w / 2, [BENCHMARKS[b][0] for b in benches],
                  fontsize=7)
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(Path(out_dir) / f"leaderboard.{ext}", dpi=120)
    plt.close(fig)


def still_to_run(benches, out_dir, seeds):
    """The cells with a seed missing, by benchmark, and the one command that runs them (the GPU
    ones: gpu_session.py, which runs every missing GPU cell within a borrowed GPU's time)."""
    todo = missing(benches, out_dir, seeds)
    if not todo:
        return "Every cell has its seeds.\n"
    out = []
    for b, rows in todo.items():
        where = BENCHMARKS[b][3]
        cmd = f"python benchmark/leaderboard.py --data-root DIR --only {b}" \
            + (" --jobs 2" if where == "cpu" else "")
        out.append(f"- **{BENCHMARKS[b][0]}** (`{b}`, {where}): {', '.join(rows)} — `{cmd}`")
    if any(BENCHMARKS[b][3] == "gpu" for b in todo):
        out.append("\nOn a borrowed GPU (one command of 9 minutes, the suite and the GPU checks "
                   "first; the cells get what is left and resume from their checkpoints in the "
                   "next session): "
                   "`python benchmark/gpu_session.py --data-root DIR --out-dir DIR2`.")
    return "\n".join(out) + "\n"


def writable(out_dir, figures):
    """Refuse, before any run, an --out-dir the table could not be written in: a file, a path
    under a file, a folder this user cannot write in, or README.md (or a figure's name) taken by
    something other than a file. Nothing is made: the folder is probed where it is, or else
    where it would be made."""
    out = Path(out_dir)
    above = next(q for q in [out, *out.parents] if q.exists())
    outputs.writable_folder(above, "--out-dir", out)   # it exists: probed by a file made and gone
    for name in ["README.md"] + (["leaderboard.png", "leaderboard.svg"] if figures else []):
        f = out / name
        if f.exists() and not f.is_file():
            raise UserError(f"--out-dir {out_dir}: {f} is not a file the table can be written to; "
                            f"move it away")


def write(benches, a):
    text, c = table(benches, a.out_dir, a.seeds)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(
        "# Leaderboard\n\nTest accuracy (%), mean ± std over seeds (number of seeds), "
        "the paper's number in brackets where one exists; bold: beats every other row beyond two "
        "seed stds. Written by `python benchmark/leaderboard.py --table-only`.\n\n"
        + text + "\n\n![leaderboard](leaderboard.svg)\n\n"
        "## Where each cell comes from\n\n" + sources(benches, a.out_dir, a.seeds) + "\n\n"
        "## Still to run\n\n" + still_to_run(benches, a.out_dir, a.seeds))
    if not a.no_figure:
        figure(c, benches, out)
    print(text)
    return text


def main(argv=None):
    """The command line: bad input -> one line, exit 2, before any run; a failed run -> exit 1; a
    signal -> the runs stopped, one line, exit 128 + signum."""
    p = Parser(prog="leaderboard.py", description=help_text(__doc__))
    p.add_argument("--data-root", default=None,
                   help="full MNIST (python -m harness.datasets --download mnist --data-root DIR)")
    p.add_argument("--launcher", default="local", choices=["local", "multi_gpu", "slurm"],
                   help="benchmark/run.py's")
    p.add_argument("--jobs", type=int, default=1, help="local launcher: runs at once")
    p.add_argument("--gpus", default=None, help="multi_gpu launcher: GPU ids")
    p.add_argument("--only", nargs="+", default=None, choices=list(BENCHMARKS),
                   help="run these benchmarks' missing cells only "
                        "(the table keeps every benchmark)")
    p.add_argument("--where", default=None, choices=["cpu", "gpu"],
                   help="run the missing cells of the benchmarks that fit this kind only "
                        "(the table keeps all)")
    p.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    p.add_argument("--out-dir", default=str(RESULTS / "leaderboard"))
    p.add_argument("--dry-run", action="store_true",
                   help="list the missing cells and their commands, run nothing")
    p.add_argument("--table-only", action="store_true",
                   help="write the table from the runs that exist")
    p.add_argument("--no-figure", action="store_true")
    a = p.parse_args(argv)
    a.out_dir = str(Path(a.out_dir).resolve())
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, got {a.jobs}")
    bad = [s for s in a.seeds if not 0 <= s < bench_run.SEED_LIMIT]
    if bad or len(set(a.seeds)) < len(a.seeds):
        p.error(f"--seed {bad[0]} is out of the methods' range [0, 2**31)" if bad else
                f"--seeds {' '.join(map(str, a.seeds))}: a seed twice "
                f"(its runs would write one file)")
    if not a.dry_run:                            # where the table goes, before any run
        try:
            writable(a.out_dir, not a.no_figure)
        except UserError as e:
            p.error(str(e))
    benches = [b for b in (a.only or BENCHMARKS) if a.where is None or BENCHMARKS[b][3] == a.where]
    todo = {} if a.table_only else missing(benches, a.out_dir, a.seeds)
    if todo and not a.dry_run and a.data_root is None \
            and any(BENCHMARKS[b][1] != "synthetic" for b in todo):
        p.error("the leaderboard is at full scale: give --data-root DIR with full MNIST "
                "(python -m harness.datasets --download mnist --data-root DIR)")
    # the runs start in ROOT
    if todo and a.data_root is not None and not (ROOT / a.data_root).is_dir():
        p.error(f"--data-root {a.data_root} is not a folder")
    current = None
    try:
        plans = {}
        for b, rows in todo.items():            # every command planned (and refused) before any run
            current = b
            plans[b] = bench_run.plan(run_command(b, rows, a)[2:])
        with bench_run.stopping():        # a signal between two benchmarks: the next does not start
            for b, rows in todo.items():
                current = b
                if bench_run.STOP:
                    raise bench_run.Interrupted(bench_run.STOP[0], "not started")
                cmd = run_command(b, rows, a)
                print(("would run " if a.dry_run else "run ") + shlex.join(cmd[1:]), flush=True)
                if not a.dry_run:
                    bench_run.execute(*plans[b])
    except UserError as e:
        p.error(f"benchmark {current}: {e}")
    except bench_run.Failed as e:
        print(f"leaderboard.py: error: benchmark {current}: {e}", file=sys.stderr)
        sys.exit(1)
    except bench_run.Interrupted as e:
        print(f"leaderboard.py: interrupted ({signal.Signals(e.signum).name}): benchmark "
              f"{current}: {e.what}; rerun the same command to continue "
              f"(complete runs are skipped, the others resume from their checkpoints)",
              file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:                        # between runs: planning, or the table
        print("leaderboard.py: interrupted, no run going; rerun the same command to continue",
              file=sys.stderr)
        sys.exit(130)
    if a.dry_run:
        print(f"{sum(map(len, todo.values()))} missing cell(s) in {len(todo)} benchmark(s)")
        return todo
    return write(list(BENCHMARKS), a)             # the whole table: --only, --where choose the runs


if __name__ == "__main__":
    main()
