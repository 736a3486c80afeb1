"""benchmark/'s tools: the runner (run.py), the reports and the pages they write, the
leaderboard, the GPU session and checks, the operation counts, the speed table, the official
FedIIR wrapper, FedIPG's aberrant-client setup; and their refusals, one line and exit 2."""

import collections
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import common
import data
import fedavg
import fediir
import fedipg
import harness

from tests.helpers import (
    both_ways, fails, HERE, interrupted_then_resumed, IPG, ipg_args, max_abs, method_args,
    on_every_device, QUICK, run, SGD, strip_times, tiny_ctx, tiny_federation, tiny_model,
)
import aten_count
import fedipg_aberrant
import fedloe_spawn
import fedloe_stage2
import gpu_check
import gpu_session
import irm_central
import leaderboard
import mcmahan_fig1
import official_fediir as official
import rcmnist_ptest
import report
import report as bench_report
import run as bench_run
import sensitivity
import speed


pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def test_benchmark_run_and_report(tmp_path, capsys):
    argv = ["--dataset", "synthetic", "--methods", "fedavg", "fediir", "--seeds", "0", "1",
            "--rounds", "2", "--out-dir", str(tmp_path), "--jobs", "2",
            "--", "--eval-every", "1", "--test-domain", "0"]
    folder = bench_run.main(argv)
    files = sorted(p.name for p in folder.glob("*.json"))
    assert files == ["fedavg-seed0.json", "fedavg-seed1.json", "fediir-seed0.json",
                     "fediir-seed1.json"]
    stamp = {p: p.stat().st_mtime_ns for p in folder.glob("*.json")}
    partial = json.loads((folder / "fediir-seed1.json").read_text())
    # as if cut short
    (folder / "fediir-seed1.json").write_text(json.dumps(dict(partial, complete=False)))
    capsys.readouterr()
    bench_run.main(argv)
    out = capsys.readouterr().out
    assert out.count("skip ") == 3 and "fediir.py --dataset synthetic" in out and "--resume" in out
    assert all(p.stat().st_mtime_ns == t for p, t in stamp.items() if p.name != "fediir-seed1.json")
    text = bench_report.main([str(folder), "--out", str(tmp_path / "report.md")])
    runs = {k: [r["domains"]["style0"]["test_acc"] for r in v]
            for k, v in bench_report.load(folder)[0].items()}
    m = 100 * sum(runs["fedavg"]) / 2
    s = 100 * abs(runs["fedavg"][0] - runs["fedavg"][1]) / math.sqrt(2)
    assert f"{m:.1f} ± {s:.1f}" in text and "| fediir |" in text and "s / round" in text
    assert "2 per round, 2 rounds, 1 local epoch(s); data:" in text
    best = max(("fedavg", "fediir"), key=lambda k: sum(runs[k]))
    assert f"| {best} | **" in text                                       # the best mean is bold
    png = (folder / "accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 500
    (tmp_path / "report.md").write_text("# Intro\nhow these were made\n\n## stale section\nold "
                                        "table\n")
    # the introduction is kept
    again = bench_report.main([str(folder), "--out", str(tmp_path / "report.md")])
    assert again == "# Intro\nhow these were made\n\n" + text and "old table" not in again
    longer = tmp_path / "longer"                # runs of other lengths (FedLOE's K1): each is named
    longer.mkdir()
    for p in folder.glob("*.json"):
        r = json.loads(p.read_text())
        if r["method"] == "fediir":
            r["args"].update(rounds=4, local_epochs=3)
        r["args"]["device"] = "cpu"                     # (named: the runs took auto's choice)
        if r["method"] == "fedavg" and r["seed"] == 1:
            r["args"]["device"] = "cuda"       # a folder with runs from two devices: a row for each
            r["domains"]["style0"]["history"][-1]["seconds"] *= 0.1
        (longer / p.name).write_text(json.dumps(r))
    text = bench_report.main([str(longer)])
    assert "2 per round, rounds × local epochs fedavg 2 × 1, fediir 4 × 3; data:" in text
    lines = text.splitlines()
    top = lines.index("| method | s / round | images / s | × FedAvg |") + 2
    speed = {c[0]: c[1:] for c in ([x.strip() for x in line.strip("|").split("|")]
                                   for line in lines[top:top + 3])}
    assert list(speed) == ["fedavg (cpu)", "fedavg (cuda)", "fediir (cpu)"] and lines[top + 3] == ""
    # each against its own device
    assert speed["fedavg (cpu)"][2] == speed["fedavg (cuda)"][2] == "1.00"
    per_round = {}                        # the ratio from the runs' seconds, not the rounded column
    for p in longer.glob("*.json"):
        r = json.loads(p.read_text())
        last = r["domains"]["style0"]["history"][-1]
        per_round.setdefault((r["method"], r["args"]["device"]), []).append(
            last["seconds"] / last["round"])
    want = np.mean(per_round[("fediir", "cpu")]) / np.mean(per_round[("fedavg", "cpu")])
    # printed with 2 decimals
    assert float(speed["fediir (cpu)"][2]) == pytest.approx(want, abs=0.006)
    assert "report.py: error: " in fails(bench_report.main, [str(tmp_path / "nope")], capsys)
    assert "unknown method 'fedfoo'" in fails(bench_run.main,
                                              ["--dataset", "synthetic", "--methods", "fedfoo"],
                                              capsys)


def fake_results(folder, dataset, protocol, labels, seeds=(0, 1), domains=("0", "15"),
                 rounds=(1, 2, 3)):
    """Tiny results files as the method scripts write them (the fields report.py reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, lab in enumerate(labels):
        for seed in seeds:
            acc = lambda t, d: 0.1 + 0.05 * k + 0.1 * t + 0.02 * seed + 0.01 * d
            doms = {d: {"test_acc": acc(rounds[-1], i), "train_examples": 100, "history": [
                {"round": t, "test_acc": acc(t, i), "seconds": 0.5 * t,
                 **({"global_test_acc": acc(t, i) - 0.01} if lab == "perinvfl"
                    else {})} for t in rounds]}
                for i, d in enumerate(domains)}
            if lab == "perinvfl":
                for d in doms.values():
                    d["global_test_acc"] = d["history"][-1]["global_test_acc"]
            res = {"method": lab, "dataset": dataset, "seed": seed, "protocol": protocol,
                   "complete": True,
                   "source": f"fake {dataset}; made by the test",
                   "mean_test_acc": acc(rounds[-1], 0), "domains": doms,
                   "args": {"clients": 50, "sample": 5, "rounds": rounds[-1], "local_epochs": 1,
                            "p_test": 0.1}}
            (folder / f"{lab}-seed{seed}.json").write_text(json.dumps(res))


def test_report_prints_published_numbers_only_for_the_matching_setting(tmp_path):
    """FedIIR's Table 8 holds 0° and 75° alone, Table 2 the mean over all six; FedOMG's Table 1 is
    α = 0.1 and 0.5: a folder gets the numbers of its own held-out domain and α, or none."""
    cases = [("rmnist", "lodo", ("0",), {}, "fedavg 77.90 (FedIIR Tab. 8, 0°)"),
             ("rmnist", "lodo", ("75",), {}, "fediir 84.50 (FedIIR Tab. 8, 75°)"),
             ("rmnist", "lodo", ("0", "15"), {}, "fedavg 90.80 (FedIIR Tab. 2)"),
             ("rmnist", "lodo", ("30",), {}, None),
             ("mnist", "clients", ("clients",), {"alpha": 0.1},
              "fedomg 98.75 (FedOMG Tab. 1, α 0.1)"),
             ("mnist", "clients", ("clients",), {"alpha": 0.5},
              "fedavg 91.47 (FedOMG Tab. 1, α 0.5)"),
             ("mnist", "clients", ("clients",), {"alpha": 0.3}, None)]
    for k, (dataset, protocol, domains, extra, expected) in enumerate(cases):
        folder = tmp_path / str(k)
        fake_results(folder, dataset, protocol, ["fedavg", "fediir", "fedomg"], domains=domains)
        for f in folder.glob("*.json"):
            r = json.loads(f.read_text())
            r["args"].update(extra)
            f.write_text(json.dumps(r))
        text = "\n".join(bench_report.report(folder, tmp_path))
        assert (expected in text) if expected else "Published" not in text, (k, text)


def test_report_exit_table_for_aberrant_client_runs(tmp_path):
    folder = tmp_path / "exit"
    fake_results(folder, "rmnist", "lodo", ["kept", "exit-auto"], domains=("75",))
    for f in folder.glob("*.json"):
        r = json.loads(f.read_text())
        seed, auto = r["seed"], f.name.startswith("exit-auto")
        r["domains"]["75"].update(regular_acc=0.9 + 0.01 * seed, aberrant_acc=0.3 if auto else 0.6,
                                  exited=[0, 1] if auto and seed else ([0] if auto else []))
        f.write_text(json.dumps(r))
    lines = bench_report.exit_table(bench_report.load(folder)[0])
    assert ("| exit-auto | 0; 0, 1 | 90.0, 91.0 (mean 90.5) | 30.0, 30.0 (mean 30.0) |"
            in "\n".join(lines))
    assert ("| kept | none; none | 90.0, 91.0 (mean 90.5) | 60.0, 60.0 (mean 60.0) |"
            in "\n".join(lines))
    fake_results(tmp_path / "plain", "rmnist", "lodo", ["fedavg"])
    # only with an aberrant client
    assert bench_report.exit_table(bench_report.load(tmp_path / "plain")[0]) == []


def legend_texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]


def test_report_draws_every_figure(tmp_path, monkeypatch, capsys):
    """From small fake results: accuracy against round per table, accuracy against p_test on rcmnist
    (from ptest.md, or from the checkpoints through rcmnist_ptest when they are there) and
    speed.py's bars; PNG and SVG; every method named in the legend, the published numbers dashed."""
    rot, rc = tmp_path / "rot", tmp_path / "rc"
    fake_results(rot, "rmnist", "lodo", ["fedavg", "fediir", "fedomg"])
    fake_results(rc, "rcmnist", "clients", ["fedavg", "perinvfl"], seeds=(0, 1, 2),
                 domains=("clients",))
    (rc / "ptest.md").write_text(
        "| method | p_test 0.1 | p_test 0.2 | p_test 0.3 | p_test 0.4 | p_test 0.5 | mean | "
        "training contexts | seeds |\n|---|---|---|---|---|---|---|---|---|\n| fedavg | 11.5 ± 0.5 "
        "| 21.1 ± 1.1 | 29.3 ± 2.2 | 38.7 ± 1.9 | 48.1 ± 1.3 | 29.7 | 87.5 ± 0.7 | 3 |\n| perinvfl "
        "irm dual | 14.8 ± 1.9 | 23.8 ± 0.9 | 31.0 ± 1.3 | 39.8 ± 1.8 | 48.6 ± 1.8 | 31.6 | 88.6 ± "
        "0.9 | 3 |\n")
    speed = {"setting": "fake rmnist, 2 rounds", "images_per_round": 100,
             "seconds": {"FedAvg (harness)": [1.0, 1.2], "FedIIR": [1.5, 1.4],
                         "bare training loop": [0.9, 1.0]}}
    (tmp_path / "speed.json").write_text(json.dumps(speed))
    text = bench_report.main([str(rot), str(rc), "--speed", str(tmp_path / "speed.json"),
                              "--out", str(tmp_path / "report.md")])
    for stem in (rot / "accuracy", rc / "accuracy", rc / "ptest", tmp_path / "speed"):
        assert Path(f"{stem}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert "<svg" in Path(f"{stem}.svg").read_text()
        assert f"({stem.relative_to(tmp_path)}.svg)" in text                 # shown in the markdown
    assert "from ptest.md" in text and "| FedIIR | 1.450 | 69 | 1.32 |" in text

    runs = bench_report.load(rot)[0]
    paper = bench_report.PAPERS["rmnist", "large"]
    names = legend_texts(bench_report.accuracy_figure(runs, "t", paper))
    assert [n.split(" (")[0] for n in names[:3]] == ["fedavg", "fediir", "fedomg"]
    assert "fedavg: published, FedIIR Tab. 2" in names
    assert "fedipg: published, FedIPG Tab. II" not in names                      # no run
    fig = bench_report.accuracy_figure(runs, "t")
    line = fig.axes[0].get_lines()[0]                              # fedavg: the mean over its seeds
    per_seed = [[0.1 + 0.1 * t + 0.02 * s + 0.005 for t in (1, 2, 3)] for s in (0, 1)]
    assert torch.allclose(torch.tensor(line.get_ydata()), 100
                          * torch.tensor(per_seed).mean(0).double())
    names = legend_texts(bench_report.accuracy_figure(bench_report.load(rc)[0], "t"))
    assert (any(n.startswith("perinvfl (global)") for n in names)
            and any(n.startswith("fedavg") for n in names))
    p_test, table, source = bench_report.ptest_table(rc, sorted(rc.glob("*.json")))
    assert source == "ptest.md" and table["fedavg"][2] == 3 and p_test == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert torch.allclose(torch.tensor(table["perinvfl irm dual"][1]),
                          torch.tensor([1.9, 0.9, 1.3, 1.8, 1.8]).double())
    names = legend_texts(bench_report.ptest_figure(table, "t", p_test))
    assert (names[:2] == ["fedavg (3 seeds)", "perinvfl irm dual (3 seeds)"]
            and "IRM: published, PerInvFL Tab. 2" in names)
    names = legend_texts(bench_report.speed_figure(speed))
    assert names == list(speed["seconds"])

    # with a checkpoint beside every run, the p_test
    # figure is scored by rcmnist_ptest.py's functions (as report.py imports it)
    from diagnostics import rcmnist_ptest
    for f in rc.glob("*.json"):
        Path(f"{f}.ckpt").write_bytes(b"")
    scored = {"fedavg": [[0.2, 0.3, 0.4, 0.5, 0.6, 0.9], [0.4, 0.5, 0.6, 0.7, 0.8, 0.9]]}
    monkeypatch.setattr(rcmnist_ptest, "table", lambda paths: scored if len(paths) == 6 else {})
    p_test, table, source = bench_report.ptest_table(rc, sorted(rc.glob("*.json")))
    assert (source == "the runs' checkpoints" and list(table) == ["fedavg"] and table["fedavg"][2]
            == 2)
    assert torch.allclose(torch.tensor(table["fedavg"][0]),
                          torch.tensor([30., 40, 50, 60, 70]).double())
    assert torch.allclose(torch.tensor(table["fedavg"][1]), torch.full((5,), 200 ** 0.5).double())
    assert "from the runs' checkpoints" in bench_report.main([str(rc)])
    for f in rc.glob("*.ckpt"):
        f.unlink()
    (rc / "ptest.md").write_text("| method | p_test 0.1 | seeds |\n|---|---|---|\n| fedavg | n/a | "
                                 "3 |\n")
    capsys.readouterr()
    assert "is not rcmnist_ptest.py's table" in fails(bench_report.main, [str(rc)], capsys)
    (tmp_path / "bad.json").write_text("{}")
    assert "not a speed.py --json file" in fails(bench_report.main,
                                                 ["--speed", str(tmp_path / "bad.json")], capsys)


def test_report_ptest_from_real_checkpoints(tmp_path):
    """Two 1-round FedAvg runs on rcmnist: report.py scores their checkpoints at every p_test
    through rcmnist_ptest.py, and the p_test of the runs themselves gives their own number back."""
    for seed in (0, 1):
        fedavg.main(["--dataset", "rcmnist", "--rounds", "1", "--seed", str(seed), "--out",
                     str(tmp_path / f"fedavg-seed{seed}.json")])
    p_test, table, source = bench_report.ptest_table(tmp_path, sorted(tmp_path.glob("*.json")))
    assert (source == "the runs' checkpoints" and list(table) == ["fedavg"] and p_test
            == [0.1, 0.2, 0.3, 0.4, 0.5])
    m, s, n = table["fedavg"]
    own = [json.loads((tmp_path / f"fedavg-seed{seed}.json").read_text())["mean_test_acc"]
           for seed in (0, 1)]
    assert n == 2 and len(m) == 5 and abs(m[0] - 50 * sum(own)) < 1e-5 and (s >= 0).all()
    assert "from the runs' checkpoints" in bench_report.main([str(tmp_path)])
    assert (tmp_path / "ptest.png").is_file() and (tmp_path / "ptest.svg").is_file()


def test_benchmark_without_matplotlib_or_submitit_is_one_line(tmp_path):
    """matplotlib and submitit are optional: the method files import neither; without them report.py
    and run.py --launcher slurm say so in one line, no traceback, exit 2 (a problem of the
    environment, as common's UserError), before anything is made."""
    hide = "import sys; sys.modules['matplotlib'] = sys.modules['submitit'] = None; "
    p = subprocess.run([sys.executable, "-c", hide
                        + "import common, data, fedavg, fediir, fedomg, fedloe, perinvfl, "
                        "fedipg"], capture_output=True, text=True, cwd=HERE, timeout=120)
    assert p.returncode == 0, p.stderr
    for script, argv in (("report.py", [str(tmp_path)]),
                         ("run.py", ["--dataset", "synthetic", "--methods", "fedavg",
                                     "--seeds", "0",
                                     "--out-dir", str(tmp_path), "--launcher", "slurm"])):
        code = hide + (f"sys.argv = ['{script}'] + {argv!r}; import runpy; "
                       f"runpy.run_path('benchmark/{script}', run_name='__main__')")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                           timeout=120)
        assert (p.returncode == 2 and "Traceback" not in p.stderr
                and len(p.stderr.strip().splitlines()) == 1), p.stderr
        assert (("matplotlib" if script == "report.py" else "submitit") in p.stderr
                and "pip install" in p.stderr)
    assert not list(tmp_path.iterdir())                 # nothing ran, no folder made (run.py's was)


STUB = """import json, os, sys, time
a = sys.argv[1:]
out, seed = a[a.index("--out") + 1], int(a[a.index("--seed") + 1])
start = time.time()
time.sleep(1.0 if seed == 0 else 0.2)
fail = os.path.exists(out + ".fail")
json.dump({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time(),
           "argv": a, "complete": not fail, "method": "fedavg", "domains": {},
           "args": json.loads(os.environ["STUB_ARGS"])},
          open(out, "w"))
if fail:                                          # as a run cut short leaves it: its checkpoint
    open(out + ".ckpt", "wb").write(b"PK\x03\x04")
sys.exit(1 if fail else 0)
"""


def stub_args(monkeypatch, argv):
    """The arguments the stand-in records: those fedavg.py resolves from argv (run.py compares
    them)."""
    resolved, _ = bench_run.method_args("fedavg", argv)
    monkeypatch.setenv("STUB_ARGS", json.dumps(vars(resolved)))


def test_run_multi_gpu_one_run_per_gpu_and_resume(tmp_path, monkeypatch, capsys):
    """--launcher multi_gpu with a stand-in for the method scripts (no GPU needed): each run sees
    only its GPU, two runs never overlap on one GPU, the GPUs work in parallel (run 0 is long, so
    handing GPUs round-robin would put run 2 on its GPU); after a failed run, --dry-run lists and a
    second invocation runs only that one, with --resume."""
    (tmp_path / "stub.py").write_text(STUB)
    monkeypatch.setattr(bench_run, "command", lambda script,
                        args: [sys.executable, str(tmp_path / "stub.py"), *args])
    argv = ["--dataset", "synthetic", "--methods", "fedavg", "--seeds", *map(str, range(6)),
            "--out-dir",
            str(tmp_path), "--launcher", "multi_gpu", "--gpus", "3,5"]
    folder = tmp_path / "synthetic"
    folder.mkdir()
    stub_args(monkeypatch, ["--dataset", "synthetic", "--seed", "0"])
    (folder / "fedavg-seed4.json.fail").write_text("")               # this run fails the first time
    with pytest.raises(SystemExit) as e:
        bench_run.main(argv)
    assert e.value.code == 1 and "1 run(s) failed" in capsys.readouterr().err
    runs = [json.loads((folder / f"fedavg-seed{s}.json").read_text()) for s in range(6)]
    assert {r["gpu"] for r in runs} == {"3", "5"}
    overlap = [(r, q) for i, r in enumerate(runs) for q in runs[i + 1:] if r["start"] < q["end"]
               and q["start"] < r["end"]]
    assert overlap and all(r["gpu"] != q["gpu"] for r, q in overlap)
    (folder / "fedavg-seed4.json.fail").unlink()
    stamp = {p: p.stat().st_mtime_ns for p in folder.glob("*.json")}
    capsys.readouterr()
    bench_run.main(argv + ["--dry-run"])
    out = capsys.readouterr().out
    assert (out.count("would run") == 1 and "--seed 4 " in out and "--resume" in out
            and out.count("skip ") == 5)
    assert all(p.stat().st_mtime_ns == t for p, t in stamp.items())        # a dry run runs nothing
    bench_run.main(argv)
    assert ([p.name for p in folder.glob("*.json") if p.stat().st_mtime_ns != stamp[p]]
            == ["fedavg-seed4.json"])
    assert json.loads((folder / "fedavg-seed4.json").read_text())["complete"]
    line = fails(bench_run.main, argv + ["--rounds", "5"], capsys)      # complete, but with
                                                                        # other settings
    assert (f"{folder / 'fedavg-seed0.json'} is complete with other settings (--rounds 100 -> 5)"
            in line)
    for bad, msg in ((["--gpus", "0,a"], "distinct GPU ids"),
                     (["--gpus", "1,1"], "distinct GPU ids"),
                     (["--launcher", "local", "--gpus", "0"],
                      "--gpus is for --launcher multi_gpu")):
        assert msg in fails(bench_run.main, argv + bad, capsys)


def test_run_slurm_through_submitit_local(tmp_path, capsys):
    """--launcher slurm end to end through submitit's local executor: one job per run, the runs'
    .log and submitit's logs beside the results; a second invocation after a cut run submits only
    it."""
    argv = ["--dataset", "synthetic", "--methods", "fedavg", "--seeds", "0", "1", "--rounds", "1",
            "--out-dir", str(tmp_path), "--launcher", "slurm", "--cluster", "local",
            "--gpus-per-job", "0", "--time", "5", "--", "--test-domain", "0"]
    folder = bench_run.main(argv)
    assert capsys.readouterr().out.count("submitted ") == 2
    for s in (0, 1):
        assert json.loads((folder / f"fedavg-seed{s}.json").read_text())["complete"]
        assert "results: " in (folder / f"fedavg-seed{s}.log").read_text()
    assert len(list((folder / "slurm").glob("*_log.out"))) == 2
    res = json.loads((folder / "fedavg-seed1.json").read_text())
    # as if the job was cut
    (folder / "fedavg-seed1.json").write_text(json.dumps(dict(res, complete=False)))
    bench_run.main(argv)
    out = capsys.readouterr().out
    assert out.count("submitted ") == 1 and "--seed 1 " in out and "skip " in out
    assert json.loads((folder / "fedavg-seed1.json").read_text())["complete"]


def fake_gpu_results(loss=1.0, val=0.5, secs=3.0, out="a.json"):
    return {"method": "fedavg", "args": {"out": out, "seed": 0}, "mean_test_acc": 0.4,
            "domains": {"0": {"test_acc": 0.4, "history": [{"round": 1, "val_acc": 0.25,
                                                            "test_acc": 0.3, "loss": 2.0,
                                                            "seconds": 1.0},
                                                           {"round": 2, "val_acc": val,
                                                            "test_acc": 0.4, "loss": loss,
                                                            "seconds": secs}]}}}


def test_gpu_check_comparisons_targets_and_table(tmp_path):
    a = fake_gpu_results(loss=0.5)
    # timings and --out aside
    assert gpu_check.same_json(a, fake_gpu_results(loss=0.5, secs=9.5, out="b.json"))
    assert not gpu_check.same_json(a, fake_gpu_results(loss=0.5 + 1e-7))
    assert a["domains"]["0"]["history"][1]["seconds"] == 3.0               # the input is left alone
    d = gpu_check.differences(a, fake_gpu_results(loss=0.50015, val=0.52))  # relative: 1.5e-4 / 0.5
    assert (math.isclose(d["loss"], 3e-4, rel_tol=1e-6)
            and math.isclose(d["acc"], 0.02, rel_tol=1e-6))
    assert (gpu_check.within(d, gpu_check.TOL["fp32"])
            and not gpu_check.within(d, {"loss": 1e-4, "acc": 0.05}))
    assert not gpu_check.within(gpu_check.differences(a, fake_gpu_results(loss=0.50025)),
                                gpu_check.TOL["fp32"])
    assert not gpu_check.within(gpu_check.differences(a, fake_gpu_results(loss=0.5, val=0.6)),
                                gpu_check.TOL["fp32"])
    assert gpu_check.busy_seconds([(5, 6), (0, 2), (1, 3)]) == 4       # overlaps counted
                                                                       # once, gaps not at all
    assert (gpu_check.busy_seconds([(0, 10), (1, 2), (3, 4)]) == 10 and gpu_check.busy_seconds([])
            == 0)
    rows = [gpu_check.target_row("harness", "harness", 0.95),
            gpu_check.target_row("harness", "harness", 0.85),
            gpu_check.target_row("FedIPG", "fedipg", 2.1),
            gpu_check.target_row("FedIIR", "fediir", 1.25),
            gpu_check.target_row("exit", "exit", None)]
    assert [r["ok"] for r in rows] == [True, False, False, True, None]
    assert rows[0]["target"] == ">= 0.9" and rows[2]["target"] == "<= 2"
    text = gpu_check.format_table(rows + [{"check": "runs: x", "measured": "ok", "target": "",
                                           "ok": True}])
    assert text.splitlines()[:2] == ["| check | measured | target | ok |", "|---|---|---|---|"]
    assert "| harness | 0.850 | >= 0.9 | **NO** |" in text and "| exit | — | <= 1.5 | — |" in text
    gpu_check.write_report(tmp_path / "r" / "g.json", rows, {"device": "test"})
    back = json.loads((tmp_path / "r" / "g.json").read_text())
    assert back["device"] == "test" and back["rows"] == rows and back["all_ok"] is False
    gpu_check.write_report(tmp_path / "g.json", [rows[0], rows[4]], {})
    # not measured is no failure
    assert json.loads((tmp_path / "g.json").read_text())["all_ok"] is True
    state = {"w": torch.zeros(3), "opt": [{"step": torch.tensor(1.0, device="meta"),
                                           "m": torch.zeros(2, device="meta")}]}
    # a scalar step count may stay
    assert gpu_check.misplaced(state, "cpu") == ["state['opt'][0]['m'] (meta)"]
    assert gpu_check.misplaced(state, "meta") == ["state['w'] (cpu)"]


def test_gpu_check_without_cuda_is_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")                    # hides a GPU if there is one
    p = subprocess.run([sys.executable, str(HERE / "benchmark" / "gpu_check.py")],
                       capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["gpu_check.py: no CUDA device is visible; the CPU "
                                             "path is checked by pytest"]


def test_gpu_check_measures_on_the_cpu(tmp_path, monkeypatch):
    """The measuring code itself, on tiny settings on the CPU (its numbers mean nothing here)."""
    syn = ["--dataset", "synthetic", "--test-domain", "0", "--clients", "4", "--sample", "2"]
    step = common.local_train
    rows = list(gpu_check.check_runs([("fedipg", "fedipg", syn + gpu_check.TWO_ROUNDS["fedipg"])],
                                     "cpu", tmp_path))
    assert [(r["check"], r["ok"]) for r in rows] == [("runs: fedipg", True),
                                                     ("repeat: fedipg", True)]
    assert common.local_train is step                                        # the guards are lifted
    with gpu_check.loaded_once() as load:                   # the runs read and build a dataset once
        assert (load("synthetic", None, 0) is load("synthetic", None, 0)
                and gpu_check.loader() is load)
    assert gpu_check.loader() is data.load
    rm = {label: argv for label, _, argv in gpu_check.cases(tmp_path) if " rmnist " in label}
    assert all(("--sample" in argv) == (not label.startswith("fedloe"))
               for label, argv in rm.items())
    own = fediir.init_state
    stray = lambda *a: {**own(*a), "stray": torch.zeros(2, device="meta")}
    monkeypatch.setattr(fediir, "METHOD", dataclasses.replace(fediir.METHOD, init_state=stray))
    rows = list(gpu_check.check_runs([("fediir", "fediir", syn
                                       + ["--rounds", "1", "--gamma", "0"])], "cpu", tmp_path))
    assert (rows[0]["ok"] is False and rows[0]["measured"]
            == "RuntimeError: off the cpu: checkpoint['state']['stray'] (meta)")
    setup = gpu_check.setting(fedavg, "fedavg", syn, "cpu", tmp_path)
    ips = gpu_check.harness_vs_bare(*setup, rounds=1)
    assert set(ips) == {"harness", "bare"} and all(v > 0 for v in ips.values())
    assert (gpu_check.determinism_cost(*setup, rounds=1) > 0
            and torch.are_deterministic_algorithms_enabled())
    ratios, busy, med = gpu_check.round_ratios(setup, 1, "cpu", tmp_path)
    assert set(ratios) == {"fediir", "fedipg", "fedomg"} and all(v > 0 for v in ratios.values())
    chunks, calls = fedipg.in_chunks, []
    monkeypatch.setattr(fedipg, "in_chunks", lambda site, train=False: calls.append(site)
                        or chunks(site, train))
    paper = gpu_check.setting(fedipg, "fedipg", syn + ["--local-step", "paper"], "cpu", tmp_path)
    # the large chunks: 2 rounds
    assert gpu_check.chunk_cost(paper, rounds=1) > 0 and len(calls) == 2 * 2
    assert fedipg.in_chunks is not chunks and fedipg.in_chunks.__name__ == "<lambda>"   # put back
    assert (busy == dict.fromkeys(["fedavg", "fediir", "fedipg", "fedomg"])
            and all(v > 0 for v in med.values()))
    from torch._dynamo.utils import counters
    torch._dynamo.reset()             # graphs compiled by tests before this
                                      # one in the worker: not counted here
    counters.clear()
    # (shared graphs)
    cnn = syn[:4] + ["--clients", "5", "--sample", "4", "--model", "cnn", "--batch-size", "16"]
    setup = gpu_check.setting(fedavg, "fedavg", cnn, "cpu", tmp_path)
    ratio, busy, first, same = gpu_check.compile_cost(setup, rounds=1)
    assert (ratio > 0 and busy is None and first > 0 and same is True
            and counters["stats"]["unique_graphs"] >= 1)
    assert not setup[0].compile and setup[0].parallel_clients == "off"  # the setting itself
                                                                        # unchanged (CPU)
    # FedIPG's step compiles too
    ratio, first = gpu_check.compiled_ratio(cnn, "cpu", tmp_path, rounds=1)
    assert ratio > 0 and first > 0 and counters["stats"]["unique_graphs"] >= 2


def test_gpu_check_stops_when_a_method_script_stops_at_a_signal(tmp_path, monkeypatch, capsys):
    """A method script stopped by SIGINT / SIGTERM (exit 130 / 143, after its round) stops gpu_check
    too, with the rows measured before it written; a script's own error (exit 2) is a row's reason
    instead. main() is run with CUDA faked: the sections are stand-ins."""
    def stops(code):
        def main(argv):
            print("fedavg.py: its own line", file=sys.stderr)
            raise SystemExit(code)
        return main
    syn = [("fedavg", "fedavg", ["--dataset", "synthetic"])]
    monkeypatch.setattr(harness, "main", lambda method, argv, **hooks: stops(2)(argv))
    rows = list(gpu_check.check_runs(syn, "cpu", tmp_path))
    assert rows[0]["ok"] is False and rows[0]["measured"] == "fedavg.py: its own line"
    for code in (130, 143):
        monkeypatch.setattr(harness, "main", lambda method, argv, **hooks: stops(code)(argv))
        with pytest.raises(SystemExit) as e:
            list(gpu_check.check_runs(syn, "cpu", tmp_path))
        assert e.value.code == code

    def section(tmp, methods=None):
        yield {"check": "cpu vs gpu: fedavg fp32", "measured": "loss 0", "target": "", "ok": True}
        raise SystemExit(143)
    monkeypatch.setattr(gpu_check, "check_cpu_gpu", section)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a stand-in")
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--checks", "cpu", "--out", str(tmp_path / "g.json")])
    assert e.value.code == 143
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"gpu_check.py: stopped by SIGTERM; the 1 rows measured before it: {tmp_path / 'g.json'}"
    assert ([r["check"] for r in json.loads((tmp_path / "g.json").read_text())["rows"]]
            == ["cpu vs gpu: fedavg fp32"])


def test_aten_count_counts_the_convnet_as_a_cuda_run_holds_it(tmp_path, monkeypatch):
    """The counts stand for a GPU's launches: the ConvNet counted NCHW, as on CUDA, not in the CPU's
    channels-last (common.global_model), whose layout copies only the CPU makes; the method scripts'
    own CPU runs keep channels-last, and common.global_model is put back after the count."""
    from harness import runner
    seen, real, made = [], runner.checked, common.global_model

    @functools.wraps(real)                                      # its signature, which count() binds
    def spy(t, losses, model, *a, **k):
        conv = [p for p in model.parameters() if p.dim() == 4][-1]      # (the first: one
                                                                        # channel, both at once)
        seen.append((conv.is_contiguous(), conv.is_contiguous(memory_format=torch.channels_last)))
        return real(t, losses, model, *a, **k)
    monkeypatch.setattr(runner, "checked", spy)
    aten_count.count("fedavg", R=1)
    assert seen == [(True, False)] and common.global_model is made
    seen.clear()
    run(fedavg.main, ["--dataset", "rmnist", "--clients", "50", "--sample", "1", "--rounds", "1",
                      "--eval-every", "1",
                      "--test-domain", "0", "--device", "cpu"], tmp_path)
    assert seen == [(False, True)]                                # the CPU's own run: channels-last


def test_aten_count_counts_one_round_with_its_backward_pass(tmp_path, monkeypatch, capsys):
    """benchmark/aten_count.py on the embedded digits, round 1 (the cheapest): totals, ratios and
    the table; the backward pass counted (a threshold_backward per ReLU of a step, by both
    counters); twice the local epochs, twice the steps; bad input and a script's own error: one
    line, exit 2, nothing run."""
    out = tmp_path / "counts.json"
    aten_count.main(["--methods", "fedavg", "fediir", "--round", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    avg, iir = d["runs"]["fedavg"], d["runs"]["fediir"]
    assert (list(d["runs"]) == ["fedavg", "fediir"] and d["counter"] == "profiler" and d["round"]
            == 1)
    assert (avg["total"] == sum(avg["ops"].values()) and avg["compute"]
            == sum(avg["compute_ops"].values()))
    assert (avg["total_x_fedavg"] == 1.0 and iir["total_x_fedavg"]
            == round(iir["total"] / avg["total"], 3))
    assert (iir["total"] > 1.2 * avg["total"] and iir["compute"] > avg["compute"] > 0
            and avg["check"] > 0)
    relu = avg["ops"]["aten::clamp_min"]                 # a ReLU's forward; 4 a step in the ConvNet
    assert relu > 0 and relu % 4 == 0 and avg["ops"]["aten::threshold_backward"] == relu
    assert (avg["args"]["sample"] == 5 and avg["args"]["clients"] == 50 and "data_root" not
            in avg["args"])
    text = capsys.readouterr().out
    assert "| method | run | total ops | × FedAvg |" in text
    assert f"| fediir | {iir['run']} | {iir['total']:,} | {iir['total_x_fedavg']:.2f} |" in text
    twice = aten_count.count("fedavg", R=1, extra=["--local-epochs", "2"])["ops"]
    assert twice["aten::threshold_backward"] == 2 * relu         # the same clients, twice the steps
    assert 1.7 < twice.total() / avg["total"] < 2               # less the round's fixed part (1.79)
    net, x = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU()), torch.randn(1, 1, 5, 5)
    # a ReLU, as each sees it
    for counter, relu_op in [("profiler", "aten::clamp_min"), ("dispatch", "aten::relu")]:
        parts = {k: collections.Counter() for k in ("round", "compute", "check")}
        with aten_count.counting(counter, parts) as round_part:
            net(x)                                                  # outside the round: the check's
            with round_part():
                net(x).sum().backward()
        assert (parts["round"]["aten::threshold_backward"] == parts["check"][relu_op]
                == 1), (counter, parts)
        assert ("aten::threshold_backward" not in parts["check"] and parts["round"].total()
                > parts["check"].total())
    assert (parts["round"]["aten::convolution_backward"] == parts["compute"]["aten::convolution"]
            == 1)
    counted = []
    monkeypatch.setattr(aten_count, "count", lambda *a, **k: counted.append(a))
    for argv, message in [(["--methods", "fedavg", "nope"], "unknown run 'nope'"),
                          (["--round", "0"], "--round must be at least 1, got 0"),
                          (["--data-root", str(tmp_path / "none")], "no such folder"),
                          (["--json", str(tmp_path)], "give a file name")]:
        with pytest.raises(SystemExit) as e:
            aten_count.main(argv)
        o, err = capsys.readouterr()
        assert (e.value.code == 2 and o == "" and len(err.strip().splitlines()) == 1 and message
                in err), err
    assert counted == []                                                       # before any work
    monkeypatch.undo()
    fedavg_run = aten_count.RUNS["fedavg"]
    monkeypatch.setitem(aten_count.RUNS, "fedavg", (fedavg_run[0], lambda R: aten_count.rounds_of(R)
                                                    + ["--lr", "-1"],
                                                    fedavg_run[2]))
    with pytest.raises(SystemExit) as e:
        aten_count.main(["--methods", "fedavg"])
    assert e.value.code == 2 and capsys.readouterr().err == \
        "aten_count.py: error: fedavg: --lr must be positive, got -1.0\n"


def test_aten_count_counts_the_clients_at_once_as_cuda_runs_them(tmp_path, monkeypatch, capsys):
    """--parallel-clients on: the sampled clients' steps as one vmap each (common.at_once, entered
    once a round), fewer ops than one client after another; a run that trains one client after
    another only is named, not counted, and not fatal; the JSON says which way."""
    stacked, at_once = [], common.at_once
    monkeypatch.setattr(common, "at_once", lambda site, *a, **k: stacked.append(len(site.client)) or
                        at_once(site, *a, **k))
    out = tmp_path / "counts.json"
    runs = aten_count.main(["--methods", "fedavg", "fedipg-paper", "--round", "1",
                            "--parallel-clients", "on",
                            "--json", str(out)])
    d = json.loads(out.read_text())
    assert stacked == [5] and list(runs) == ["fedavg"] and d["parallel_clients"] == "on"
    assert ("one client after another" in d["not_counted"]["fedipg-paper"] and "clients at once"
            in d["what"])
    assert ("aten_count.py: fedipg-paper not counted: --parallel-clients on"
            in capsys.readouterr().err)
    one_by_one = aten_count.count("fedavg", R=1)
    assert stacked == [5] and runs["fedavg"]["args"]["parallel_clients"] == "on"
    assert (one_by_one["args"]["parallel_clients"] == "off" and runs["fedavg"]["total"]
            < one_by_one["ops"].total())


def recording_local_train(log):
    """Stands in for common.local_train: records the model each client starts from, moves it by a
    client-specific amount."""
    def fake(site, theta, *a, **kw):
        log.append((site.client.id, theta.clone()))
        return theta + (site.client.id + 1) * 0.01, torch.zeros(())
    return fake


def aberrant_round(monkeypatch):
    """benchmark/fedipg_aberrant.py's round: fedipg.fedipg_round with its arrivals (`arrive`)."""
    return functools.partial(fedipg.fedipg_round, arrive=fedipg_aberrant.arrivals)


def test_fedipg_aberrant_slow_client_trains_from_the_model_it_last_received(monkeypatch):
    fed, model = tiny_federation((6, 10, 8)), tiny_model()
    args = ipg_args(sample=3, aberrant=["slow", 3], aberrant_client=1)
    state, ctx, log, w = (fedipg_aberrant.init_state(model, fed, args, None),
                          tiny_ctx(args, fed, model), [], {})
    round_fn = aberrant_round(monkeypatch)
    monkeypatch.setattr(common, "local_train", recording_local_train(log))
    for t in range(1, 8):
        w[t] = common.get_flat(model)
        log.clear()
        round_fn(t, model, fed, args, state, ctx)
        starts = dict(log)
        assert torch.equal(starts[0], w[t]) and torch.equal(starts[2], w[t])       # regular: fresh
        assert (1 in starts) == (t in (3, 6))                       # slow:3 arrives every 3rd round
        if t in (3, 6):
            assert torch.equal(starts[1], w[t - 2])                   # computed from w^{t−2}: τ = 2
            n = {0: 6, 1: 10, 2: 8}
            step = sum(n[i] * (i + 1) * 0.01 for i in n) / 24           # Eq. 3 on the current model
            assert torch.allclose(common.get_flat(model), w[t] + step, atol=1e-6)


def test_fedipg_aberrant_unreliable_client_uploads_from_its_last_download(monkeypatch):
    fed, model = tiny_federation((6, 10)), tiny_model()
    args = ipg_args(sample=2, aberrant=["unreliable", 0.5], aberrant_client=0)
    state, ctx, log, w = (fedipg_aberrant.init_state(model, fed, args, None),
                          tiny_ctx(args, fed, model), [], {})
    round_fn = aberrant_round(monkeypatch)
    replay = torch.Generator().manual_seed(2)                           # the server's draws, redone
    monkeypatch.setattr(common, "local_train", recording_local_train(log))
    last, stale = 1, 0
    for t in range(1, 13):
        w[t] = common.get_flat(model)
        log.clear()
        round_fn(t, model, fed, args, state, ctx)
        torch.randperm(2, generator=replay)                                         # sample_clients
        down, up = (torch.rand(2, generator=replay) < 0.5).tolist()
        last = t if down else last
        starts = dict(log)
        assert (0 in starts) == up
        if up:
            assert torch.equal(starts[0], w[last])
            stale += last < t
    assert stale >= 1


@pytest.mark.parametrize("argv,message", [
    (["--aberrant", "fast:2"], "--aberrant takes slow:K, unreliable:P or rotate:DEG, got 'fast:2'"),
    (["--aberrant", "slow:0"], "--aberrant slow:0: K must be >= 1 and P in (0, 1]"),
    (["--aberrant", "unreliable:1.5"], "--aberrant unreliable:1.5: K must be >= 1 and P in (0, 1]"),
    (QUICK + ["--clients", "4", "--sample", "2", "--aberrant", "slow:2"],
     "--aberrant slow needs every client in every round: --sample 4 (got 2)"),
    (QUICK + ["--aberrant", "rotate:90", "--aberrant-client", "9"],
     "client 9 does not exist: there are 2 clients"),
    (QUICK + ["--aberrant", "slow:2", "--local-step", "sgd", "--parallel-clients", "on"],
     "--aberrant slow: a stale client starts from an older model than the others"),
    (["--exit", "auto", "--warmup", "rounds", "--rounds", "4", "--exit-warmup", "5"],
     "--warmup rounds: --exit-warmup must be between 1 and --rounds (4), got 5"),
    (["--exit-clients", "a,b"], "--exit-clients takes client numbers like 3,7, got 'a,b'"),
    (QUICK + ["--exit-clients", "9"], "client 9 does not exist: there are 2 clients"),
    (QUICK + ["--exit-clients", "0,1"], "--exit-clients names every client"),
])
def test_fedipg_aberrant_bad_input(argv, message, capsys):
    assert message in fails(fedipg_aberrant.main, argv, capsys)


@on_every_device
def test_fedipg_aberrant_end_to_end_with_exits_resumes(tmp_path, monkeypatch, device):
    argv = QUICK + ["--rounds", "4", "--clients", "6", "--sample", "6", "--test-domain", "2",
                    "--exit", "auto",
                    "--exit-warmup", "2", "--aberrant", "rotate:180", "--exit-clients", "5",
                    "--device", device,
                    "--local-step", "sgd"]      # (the warm-up: a pre-training phase before round 1)
    full, _ = run(fedipg_aberrant.main, argv, tmp_path, "full.json")
    d = full["domains"]["style2"]
    assert d["test_acc"] > 0.6 and d["id_acc"] > 0.6                        # 4 classes: chance 0.25
    assert 5 in d["exited"] and d["ood_acc"] is not None
    assert set(d["history"][0]) >= {"id_acc", "ood_acc", "aberrant_acc", "regular_acc", "exited"}
    resumed = interrupted_then_resumed(fedipg_aberrant.main, argv, str(tmp_path / "cut.json"),
                                       monkeypatch,
                                       lambda blob: blob["round"] == 2)
    assert strip_times(resumed) == strip_times(full)


def test_fedipg_aberrant_pretraining_gives_the_slow_client_w1_again(monkeypatch):
    """After the pre-training phase every client receives w^1 (line 4): a slow client's unfinished
    update from the phase is dropped, and its first update of the T rounds is computed from w^1."""
    fed, model = tiny_federation((8, 8, 8)), tiny_model()
    for c in fed.clients:                                            # alike: every contribution > 0
        c.x, c.y = fed.clients[0].x, fed.clients[0].y
    w1 = common.get_flat(model)
    args = ipg_args(sample=3, aberrant=["slow", 2], aberrant_client=1, exit="auto", exit_warmup=3,
                    local_step="paper", warmup="pretraining", lr=0.1)
    state, starts = fedipg_aberrant.init_state(model, fed, args, None), []
    round_fn = aberrant_round(monkeypatch)
    step = fedipg.client_update

    @functools.wraps(step)                                      # (its declarations: a sum)
    def record(site, sent):
        starts.append((site.client.id, sent["w"].clone()))
        return step(site, sent)
    monkeypatch.setattr(fedipg, "client_update", record)
    ctx = tiny_ctx(args, fed, model)
    round_fn(1, model, fed, args, state, ctx)                 # pre-training s = 1, 2, 3, then t = 1
    assert [i for i, _ in starts].count(1) == 1                       # slow:2 arrives in s = 2 only
    assert 1 not in state["exited"]
    assert state["since"] == 1 and torch.equal(state["received"], w1)  # it holds w^1, since round 1
    starts.clear()
    round_fn(2, model, fed, args, state, ctx)
    mine = [w for i, w in starts if i == 1]
    assert len(mine) == 1 and torch.equal(mine[0], w1)                    # τ = 1: computed from w^1


BOARD_TINY = ["--rounds", "2", "--eval-every", "1", "--clients", "2"]


@pytest.fixture
def tiny_board(monkeypatch, tmp_path):
    """The leaderboard on two synthetic benchmarks and three rows: one reused from a committed-style
    folder, one refused, one run."""
    monkeypatch.setattr(leaderboard, "BENCHMARKS", {
        "syn-0": ("Synthetic, domain 0", "synthetic", BOARD_TINY + ["--test-domain", "0"], "cpu"),
        "syn-1": ("Synthetic, domain 1", "synthetic", BOARD_TINY + ["--test-domain", "1"], "gpu")})
    monkeypatch.setattr(leaderboard, "ROWS", {"fedavg": ("fedavg", []),
                                              "fediir": ("fediir", ["--gamma", "0.1"])})
    reused = tmp_path / "results"
    (reused / "old").mkdir(parents=True)
    for s, acc in ((0, 0.5), (1, 0.7)):
        (reused / "old" / f"fedavg-seed{s}.json").write_text(json.dumps(
            {"complete": True, "domains": {"d0": {"test_acc": acc}}}))
    monkeypatch.setattr(leaderboard, "RESULTS", reused)
    monkeypatch.setattr(leaderboard, "REUSE", {("syn-0", "fedavg"): "old/fedavg"})
    monkeypatch.setattr(leaderboard, "REFUSED", {("syn-1", "fediir"): "a reason"})
    monkeypatch.setattr(leaderboard, "CENTRAL", {})
    monkeypatch.setattr(leaderboard, "PAPER", {("syn-0", "fedavg"): (12.5, "Tab. 0")})
    return ["--out-dir", str(tmp_path / "board"), "--seeds", "0", "1", "--jobs", "2", "--no-figure"]


def test_leaderboard_runs_the_missing_cells_once_then_writes_the_table(
        tiny_board, tmp_path, capsys):
    todo = leaderboard.main(tiny_board + ["--dry-run"])
    assert todo == {"syn-0": ["fediir"], "syn-1": ["fedavg"]}           # reused / refused: none
    out = capsys.readouterr().out
    assert "2 missing cell(s) in 2 benchmark(s)" in out
    assert ("'fediir=fediir --rounds 2 --eval-every 1 --clients 2 --test-domain 0 --gamma 0.1'"
            in out)
    assert leaderboard.main(tiny_board + ["--dry-run", "--only", "syn-1"]) == {"syn-1": ["fedavg"]}
    assert list(leaderboard.main(tiny_board + ["--dry-run", "--where", "gpu"])) == ["syn-1"]
    text = leaderboard.main(tiny_board)
    board = tmp_path / "board"
    assert (sorted(p.name for p in (board / "syn-0").glob("*.json"))
            == ["fediir-seed0.json", "fediir-seed1.json"])
    assert json.loads((board / "syn-0" / "fediir-seed1.json").read_text())["args"]["gamma"] == 0.1
    assert not (board / "syn-0" / "fedavg-seed0.json").exists()          # reused, not rerun
    assert leaderboard.main(tiny_board + ["--dry-run"]) == {}            # resumable: nothing left
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert "60.0 ± 14.1 (2) [paper 12.5]" in rows["fedavg"]             # the reused runs: 50 and 70
    assert "refused" in rows["fediir"].split(" | ")[2]
    readme = (board / "README.md").read_text()
    assert ("refused — a reason" in readme
            and "reused from `benchmark/results/old/fedavg-seed*.json`" in readme)
    acc = [100 * json.loads((board / "syn-0" / f"fediir-seed{s}.json").read_text())["mean_test_acc"]
           for s in (0, 1)]
    assert f"{sum(acc) / 2:.1f} ±" in rows["fediir"].split(" | ")[1]
    assert readme.endswith("## Still to run\n\nEvery cell has its seeds.\n")
    for only in (["--only", "syn-1"], ["--where", "cpu"]):           # they choose the runs,
                                                                     # never the columns
        assert leaderboard.main(tiny_board + only).splitlines()[0] == text.splitlines()[0]
        assert (board / "README.md").read_text() == readme


def test_leaderboard_sources_of_a_benchmark_without_arguments_have_no_stray_space(
        monkeypatch, tmp_path):
    monkeypatch.setattr(leaderboard, "BENCHMARKS", {"b": ("B", "synthetic", [], "cpu")})
    monkeypatch.setattr(leaderboard, "ROWS", {"fedavg": ("fedavg", [])})
    monkeypatch.setattr(leaderboard, "REUSE", {})
    text = leaderboard.sources(["b"], tmp_path, [0])
    assert "(`b`): `--dataset synthetic` and" in text
    assert "`python fedavg.py --dataset synthetic --data-root DIR --seed S` →" in text


def test_leaderboard_lists_what_is_still_to_run_with_its_command(tiny_board, tmp_path):
    leaderboard.main(tiny_board + ["--table-only"])
    still = (tmp_path / "board" / "README.md").read_text().split("## Still to run\n\n")[1]
    assert ("- **Synthetic, domain 0** (`syn-0`, cpu): fediir — `python benchmark/leaderboard.py "
            "--data-root DIR --only syn-0 --jobs 2`") in still
    assert ("(`syn-1`, gpu): fedavg — `python benchmark/leaderboard.py --data-root DIR --only "
            "syn-1`" in still)
    assert "`python benchmark/gpu_session.py --data-root DIR --out-dir DIR2`." in still


def test_leaderboard_never_marks_a_centralised_reference_row_best(monkeypatch, tmp_path):
    f = tmp_path / "central.json"
    f.write_text(json.dumps({"runs": [{"method": "irm", "test_acc": a}
                                      for a in (0.9, 0.91, 0.92)]}))
    monkeypatch.setattr(leaderboard, "RESULTS", tmp_path)
    monkeypatch.setattr(leaderboard, "BENCHMARKS", {"b": ("B", "synthetic", [], "cpu")})
    (tmp_path / "old").mkdir()
    for s, acc in ((0, 0.1), (1, 0.11)):
        (tmp_path / "old" / f"fedavg-seed{s}.json").write_text(
            json.dumps({"complete": True, "domains": {"d": {"test_acc": acc}}}))
    monkeypatch.setattr(leaderboard, "ROWS", {"fedavg": ("fedavg", [])})
    monkeypatch.setattr(leaderboard, "REUSE", {("b", "fedavg"): "old/fedavg"})
    monkeypatch.setattr(leaderboard, "CENTRAL", {"central IRM": ("irm", {"b": "central.json"})})
    text, c = leaderboard.table(["b"], tmp_path / "board", [0, 1])
    assert c[("b", "central IRM")] == [90.0, 91.0, 92.0] and c[("b", "fedavg")] == [10.0, 11.0]
    assert "**" not in text              # the reference row far ahead, but never the federated best


def test_leaderboard_marks_best_only_beyond_two_seed_stds():
    assert leaderboard.best({"a": [90, 91, 92], "b": [80, 81, 82]}) == "a"
    assert leaderboard.best({"a": [90, 91, 92], "b": [89, 90, 91]}) is None   # 1 apart, 2 · std = 2
    assert leaderboard.best({"a": [90, 91, 92], "b": [87, 88, 89]}) == "a"      # 3 > 2 · 1
    assert leaderboard.best({"a": [90, 95, 100], "b": [86, 87, 88]}) is None    # 8 < 2 · 5
    assert leaderboard.best({"a": [90], "b": [10, 11]}) is None               # one seed: no verdict
    assert leaderboard.best({"a": [90, 92], "b": [10, 11], "c": []}) == "a"


def test_leaderboard_leaves_the_round_count_to_methods_with_their_own_schedule():
    assert leaderboard.row_args("mnist-fl", "fedloe-fish") == ["--alpha", "0.1", "--dg", "fish"]
    assert leaderboard.row_args("mnist-fl", "fedomg") == ["--alpha", "0.1", "--rounds", "200",
                                                          "--eval-every", "20"]


def test_leaderboard_needs_full_mnist_to_run(capsys):
    assert "--data-root DIR" in fails(leaderboard.main, ["--only", "rcmnist-norot",
                                                         "--out-dir", "/nonexistent/board"],
                                      capsys)


def test_gpu_session_dry_run_lists_the_steps_their_caps_and_sources_within_nine_minutes(
        capsys, tmp_path):
    rows = gpu_session.main(["--data-root", "D", "--out-dir", str(tmp_path), "--dry-run"])
    names = ["tests", "gpu_check", "speed-rmnist", "speed-fl", "leaderboard"]
    # all run at the default 9
    assert [s.name for s, _ in rows] == names and all(cap for _, cap in rows)
    stop = sum(gpu_session.grace(s.name) + gpu_session.REAP for s, _ in rows)
    assert sum(cap for _, cap in rows) + stop + gpu_session.PACK <= 9 * 60
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()[0] in names}
    assert list(lines) == names and all("runs" in x and "source: " in x for x in lines.values())
    assert "108 s" in lines["tests"] and "H100" in lines["tests"]       # each cap's own measurement
    assert ("190 s cap" in lines["gpu_check"] and "56 s" in lines["speed-fl"] and "31 s"
            in lines["speed-rmnist"])
    assert "tf32" not in out.lower() and "--where gpu" in out and "--rounds 1 --json" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert total.startswith("total        9.00 min = caps 7.67 + stopping 1.00 + packing 0.33")


def test_gpu_session_dry_run_skips_a_step_that_does_not_fit(capsys, tmp_path):
    rows = gpu_session.main(["--data-root", "D", "--out-dir", str(tmp_path), "--minutes", "3.5",
                             "--dry-run"])
    assert {s.name: bool(cap) for s, cap in rows} == {"tests": True, "gpu_check": False,
                                                      "speed-rmnist": False,
                                                      "speed-fl": False, "leaderboard": True}
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "skipped: needs 3.20 min, 0.72 left" in lines["gpu_check"] and "runs" in lines["tests"]
    rows = gpu_session.main(["--data-root", "D", "--out-dir", str(tmp_path),
                             "--skip", "tests", "gpu_check",
                             "--dry-run"])
    assert [s.name for s, _ in rows] == ["speed-rmnist", "speed-fl", "leaderboard"]
    capsys.readouterr()
    rows = gpu_session.main(["--data-root", "D", "--out-dir", str(tmp_path), "--skip", "gpu_check",
                             "--minutes",
                             "3.55", "--dry-run"])    # 46 s left after the tests:
                                                      # speed-rmnist's cap (45 s), not its stop
    assert [bool(cap) for _, cap in rows] == [True, False, False, True]
    assert "speed-rmnist skipped: needs 0.87 min, 0.77 left" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--minutes", "0"], "--minutes must be above 0 and at most 10, got 0"),
    (["--minutes", "10.5"], "at most 10, got 10.5"),
    (["--minutes", "nan"], "must be a finite number"),
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--skip", "tf32-off"], "invalid choice: 'tf32-off'"),
    (["--bogus"], "unrecognized arguments: --bogus")])
def test_gpu_session_refuses_bad_input_in_one_line(capsys, tmp_path, argv, says):
    line = fails(gpu_session.main, ["--data-root", "D", "--out-dir", str(tmp_path / "o"),
                                    "--dry-run"] + argv, capsys)
    assert line.startswith("gpu_session.py: error: ") and says in line
    assert not (tmp_path / "o").exists()


def test_gpu_session_refuses_without_cuda_in_one_line(tmp_path):
    """No CUDA device visible (hidden from the child where the machine has one)."""
    r = subprocess.run([sys.executable, "benchmark/gpu_session.py", "--data-root", str(tmp_path),
                        "--out-dir",
                        str(tmp_path / "o")], cwd=HERE, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert (r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA device"
            in r.stderr)
    assert not (tmp_path / "o").exists()


def test_gpu_session_packs_one_archive_within_the_limit_logs_first_and_unpacks_it(
        tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    board = repo / "benchmark" / "results" / "leaderboard" / "b"
    board.mkdir(parents=True)
    monkeypatch.setattr(gpu_session, "ROOT", repo)
    monkeypatch.setattr(gpu_session, "LEADERBOARD", board.parent)
    monkeypatch.setattr(gpu_session, "LIMIT", 70_000)
    rng = np.random.default_rng(0)
    for k in range(3):
        (board / f"r-seed{k}.json").write_text(json.dumps({"acc": [k] * 500}))
        (board / f"r-seed{k}.log").write_text("round 1\n" * 2500)  # 20 kB, larger than a checkpoint
    for kb in (40, 5, 20, 30):                           # incompressible, smallest first: 5, 20 fit
        (board / f"r{kb}.ckpt").write_bytes(rng.bytes(kb * 1000))
    (board / "r-seed0.lock").write_text("123")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tests.log").write_text("5 passed\n" * 1500)                # 13.5 kB
    (out / "gpu_check.json").write_text("{}")
    for k in range(2):
        (out / f"gpu-session-{k}.tar.gz").write_bytes(b"an earlier version's part")
    import tarfile
    left = gpu_session.pack(out)
    archives = sorted(p.name for p in out.glob("*.tar.gz*"))
    assert (archives == ["gpu-session.tar.gz"] and (out / "gpu-session.tar.gz").stat().st_size
            <= 70_000)
    assert sorted(p.name for p in left) == ["r30.ckpt", "r40.ckpt"]
    printed = capsys.readouterr().out.splitlines()
    assert [x.split(": ")[1].split()[0] for x in printed] == [
        "benchmark/results/leaderboard/b/r30.ckpt", "benchmark/results/leaderboard/b/r40.ckpt"]
    with tarfile.open(out / "gpu-session.tar.gz") as t:
        names = t.getnames()
        said = t.extractfile("gpu-session/left-out.txt").read().decode()
    # the steps' files first,
    assert names[:2] == ["gpu-session/gpu_check.json", "gpu-session/tests.log"]
    assert set(names[2:8]) == {f"benchmark/results/leaderboard/b/r-seed{k}.{x}" for k in range(3)
                               for x in ("json", "log")}                         # then the board's,
    assert names[8:] == ["benchmark/results/leaderboard/b/r5.ckpt",
                         "benchmark/results/leaderboard/b/r20.ckpt",
                         "gpu-session/left-out.txt"]                              # checkpoints last
    assert "b/r30.ckpt" in said and "b/r40.ckpt" in said and "lock" not in said
    shutil.rmtree(board)
    gpu_session.unpack(out)
    assert sorted(p.name for p in board.iterdir()) == ["r-seed0.json", "r-seed0.log",
                                                       "r-seed1.json", "r-seed1.log",
                                                       "r-seed2.json", "r-seed2.log", "r20.ckpt",
                                                       "r5.ckpt"]
    assert (repo / "gpu-session" / "tests.log").read_text() == "5 passed\n" * 1500


def test_gpu_session_unpacks_an_earlier_versions_parts_then_its_archive(tmp_path, monkeypatch):
    import tarfile
    monkeypatch.setattr(gpu_session, "ROOT", tmp_path / "repo")
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("gpu-session-0.tar.gz", "part 0"), ("gpu-session-1.tar.gz", "part 1"),
                       ("gpu-session.tar.gz", "new")):
        src = tmp_path / name.replace(".tar.gz", "")
        src.write_text(text)
        with tarfile.open(out / name, "w:gz") as t:
            t.add(src, arcname="benchmark/x.json")            # the same path in each: the last wins
            t.add(src, arcname=f"benchmark/{name}.json")
    gpu_session.unpack(out)
    got = {p.name: p.read_text() for p in (tmp_path / "repo" / "benchmark").iterdir()}
    assert got == {"x.json": "new", "gpu-session-0.tar.gz.json": "part 0",
                   "gpu-session-1.tar.gz.json": "part 1",
                   "gpu-session.tar.gz.json": "new"}


def test_gpu_session_interrupts_a_step_at_its_cap(tmp_path):
    """Also where this process ignores SIGINT, as a background job of a non-interactive shell does
    (and passes on to its children): the step gets SIGINT's default action back (default_sigint)."""
    sleeper = ["sleep", "60"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        t0 = time.monotonic()
        rc, how = gpu_session.run_step("s", sleeper, tmp_path, cap=1, grace_s=20)
    finally:
        signal.signal(signal.SIGINT, before)
    assert (time.monotonic() - t0 < 6 and rc == -signal.SIGINT and how
            == "SIGINT at its cap (0.02 min)")
    deaf = ["sh", "-c", "trap '' INT; echo deaf; sleep 60"]                # SIGKILL after the grace
    t0 = time.monotonic()
    rc, how = gpu_session.run_step("d", deaf, tmp_path, cap=3, grace_s=1)
    assert time.monotonic() - t0 < 9 and rc == -signal.SIGKILL and ", SIGKILL 1 s later" in how
    assert (tmp_path / "d.log").read_text() == "deaf\n"
    rc, how = gpu_session.run_step("q", [sys.executable, "-c", "print(1)"], tmp_path, cap=30)
    assert (rc, how) == (0, "")


GPU_SESSION_DRIVER = """
import os, sys, torch
from benchmark import gpu_session as g
from pathlib import Path
torch.cuda.is_available = lambda: True                       # the steps are sleepers: no GPU used
g.LEADERBOARD, g.PACK, g.GRACE, g.LEADERBOARD_GRACE, g.MIN_CAP = Path(sys.argv[1]), 2, 1, 2, 1
deaf = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        if os.environ.get("DEAF") else "")
sleep = ["-c", deaf + "import time; print('started', flush=True); time.sleep(60)"]
g.STEPS = [g.Step("a", float(os.environ["CAP_A"]), "", sleep), g.Step("b", 20, "", sleep),
           g.Step("leaderboard", None, "", sleep)]
g.main(sys.argv[2:])
"""


def gpu_session_driver(tmp_path, minutes, **env):
    return [sys.executable, "-c", GPU_SESSION_DRIVER, str(tmp_path / "board"),
            "--data-root", str(tmp_path),
            "--out-dir", str(tmp_path / "o"), "--minutes", minutes], dict(os.environ, **env)


def test_gpu_session_ends_within_its_minutes_when_every_step_runs_to_its_kill(tmp_path):
    import tarfile
    cmd, env = gpu_session_driver(tmp_path, "0.3", CAP_A="3", DEAF="1")    # the steps ignore SIGINT
    r = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    said = {x.split(":")[0]: x for x in r.stdout.splitlines()
            if x.startswith(("a: exit", "b: ", "leaderboard: exit"))}
    assert said["a"].startswith("a: exit -9 after 0.07 min, SIGINT at its cap (0.05 min), SIGKILL "
                                "1 s later")
    assert said["b"].startswith("b: skipped, it does not fit: it needs 0.38 min")    # 20 + 1 + 2 s
    assert (said["leaderboard"].startswith("leaderboard: exit -9") and ", SIGKILL 2 s later"
            in said["leaderboard"])
    took, budget = re.search(r"after ([0-9.]+) s of (\d+)", r.stdout).groups()
    assert budget == "18" and float(took) <= 18, r.stdout      # the whole command, packing included
    with tarfile.open(tmp_path / "o" / "gpu-session.tar.gz") as t:
        assert {"gpu-session/a.log", "gpu-session/leaderboard.log",
                "gpu-session/gpu_session.log"} <= set(t.getnames())


def test_gpu_session_stops_its_step_packs_and_exits_143_on_sigterm(tmp_path):
    import tarfile
    cmd, env = gpu_session_driver(tmp_path, "1", CAP_A="30")
    proc = subprocess.Popen(cmd, env=env, cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().startswith("a: ")                      # step a started
    deadline, log = time.monotonic() + 30, tmp_path / "o" / "a.log"
    # (on a busy
    while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)                                  # machine the log may come after the line)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143 and time.monotonic() - t0 < 10, out     # not at a's cap (30 s)
    assert "a: exit -2 after 0.0" in out and "SIGINT (SIGTERM to gpu_session.py)" in out
    assert "b: not started (SIGTERM)" in out and "leaderboard: not started (SIGTERM)" in out
    with tarfile.open(tmp_path / "o" / "gpu-session.tar.gz") as t:
        assert "gpu-session/a.log" in t.getnames()


# one row per evaluation (epochs 0, 10, ..., 90, 99):
# validation peaks first at epoch 30 (test 0.61),
# ties at epoch 50 (0.65); the best test (0.95), and
# the last (0.77), are elsewhere; domain i adds 0.01 i
VAL = [0.30, 0.50, 0.60, 0.90, 0.70, 0.90, 0.80, 0.85, 0.60, 0.70, 0.88]

TEST = [0.20, 0.40, 0.50, 0.61, 0.95, 0.65, 0.70, 0.72, 0.73, 0.74, 0.77]

FAKE_MAIN = textwrap.dedent('''
    import argparse, csv, json, os, sys, time
    from domainbed import datasets
    VAL, TEST = %r, %r
    p = argparse.ArgumentParser()
    for name in ("--device_name", "--hparams", "--train_index", "--output_dir", "--data_dir",
                 "--dataset", "--algorithm"):
        p.add_argument(name, type=str, default=None)
    for name in ("--hparams_seed", "--trial_seed", "--seed", "--checkpoint_freq", "--num_clients",
                 "--sample_num", "--global_rounds", "--local_epochs"):
        p.add_argument(name, type=int, default=0)
    p.add_argument("--holdout_fraction", type=float, default=0.1)
    p.add_argument("--skip_model_save", action="store_true")
    args = p.parse_args()
    where = os.path.join(args.output_dir, args.dataset, args.algorithm)
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(args.output_dir, "call.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "argv0": sys.argv[0], "cwd": os.getcwd(),
                   "pid": os.getpid(), "workers": datasets.MultipleDomainDataset.N_WORKERS}, f)
    if os.environ.get("FAKE_CRASH"):
        sys.exit(3)
    out = open(os.path.join(where, args.train_index + "_stdout"), "w")
    hp = json.loads(args.hparams)
    names = ["0", "15", "30", "45", "60", "75"]
    for i, name in enumerate(names):
        if i >= 2:
            time.sleep(10)                        # the domains after the one under test are slow
        out.write("Args:\\n\\tdevice: " + (args.device_name or "cuda:0")
                  + "\\n\\tseed: %%d\\n" %% args.seed)
        keys = (["epoch", "mem_gb", "epoch_time", "loss"]
                + ["penalty"] * (args.algorithm == "FedIIR") + ["train_acc", name])
        out.write("  ".join(k.ljust(12)[:12] for k in keys) + "\\n")
        best_val, best_test, k = 0, 0, 0
        for epoch in range(args.global_rounds):
            if epoch %% args.checkpoint_freq and epoch != args.global_rounds - 1:
                continue
            val, test = VAL[k], TEST[k] + 0.01 * i
            values = ([epoch, 0.0, 0.1 * (k + 1), 2.0 - val]
                      + [0.5 * val] * (args.algorithm == "FedIIR") + [val, test])
            out.write("  ".join(("%%.10f" %% v if isinstance(v, float) else str(v)).ljust(12)[:12]
                                for v in values) + " \\n")
            if val > best_val:
                best_val, best_test = val, test
            k += 1
        if os.environ.get("FAKE_LIE"):
            best_test = max(TEST) + 0.01 * i
        out.write("best_train_acc: %%.10f\\nbest_test_acc: %%.10f\\n" %% (best_val, best_test))
        out.flush()
        path = os.path.join(where, args.dataset + "_" + args.algorithm + "_results.csv")
        row = {"Dataset": args.dataset, "Algorithm": args.algorithm,
               "Num_clients": args.num_clients, "Trial_seed": args.trial_seed, "Seed": args.seed,
               **hp,
               "Test_env": name, "Train_acc": best_val, "Test_acc": best_test}
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if f.tell() == 0:
                w.writeheader()
            w.writerow(row)
''') % (VAL, TEST)


@pytest.fixture
def fake(tmp_path):
    """A fake clone, a data root whose MNIST label headers say 60,000 + 10,000, and the results
    path."""
    clone = tmp_path / "FedIIR"
    (clone / "domainbed").mkdir(parents=True)
    (clone / "domainbed" / "__init__.py").write_text("")
    (clone / "domainbed" / "datasets.py").write_text("class MultipleDomainDataset:\n    N_WORKERS "
                                                     "= 8\n")
    (clone / "main.py").write_text(FAKE_MAIN)
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, n in (("train", 60000), ("t10k", 10000)):
        (raw / f"{name}-labels-idx1-ubyte").write_bytes((2049).to_bytes(4, "big")
                                                        + n.to_bytes(4, "big"))
        (raw / f"{name}-images-idx3-ubyte").write_bytes(b"")
    out = tmp_path / "res" / "fediir-seed1.json"
    return ["--clone", str(clone), "--data-root", str(tmp_path / "data"), "--device", "cpu",
            "--out", str(out)], tmp_path


def call_of(tmp_path, name="fediir-seed1"):
    return json.loads((tmp_path / "res" / f"{name}.official" / "call.json").read_text())


def test_official_fediir_runs_main_py_with_the_protocol_arguments(fake, capsys):
    argv, tmp = fake
    official.main(argv + ["--algorithm", "FedIIR", "--test-domain", "0", "--seed", "1"])
    call = call_of(tmp)
    assert (call["cwd"] == str(tmp / "FedIIR") and call["argv0"] == "main.py" and call["workers"]
            == 8)
    assert call["argv"] == [
        "--dataset", "RotatedMNIST", "--algorithm", "FedIIR", "--data_dir", str(tmp / "data"),
        "--output_dir", str(tmp / "res" / "fediir-seed1.official"), "--train_index", "seed1",
        "--num_clients", "50", "--sample_num", "5", "--global_rounds", "100", "--local_epochs", "1",
        "--checkpoint_freq", "10", "--holdout_fraction", "0.1", "--seed", "1", "--trial_seed", "1",
        "--hparams_seed", "0",
        "--hparams", '{"lr": 0.01, "batch_size": 64, "penalty": 0.01, "ema": 0.95}',
        "--skip_model_save", "--device_name", "cpu"]
    assert ("--dataset RotatedMNIST"
            in (tmp / "res" / "fediir-seed1.log").read_text().splitlines()[0])
    out = argv[-1].replace("fediir-seed1", "fedavg-seed1")
    official.main(argv[:-1] + [out, "--algorithm", "FedAvg", "--seed", "1", "--trial-seed", "4",
                               "--loader-workers", "0", "--rounds", "20"])
    call = call_of(tmp, "fedavg-seed1")
    assert call["workers"] == 0 and call["cwd"] == str(tmp / "FedIIR")
    assert call["argv"][call["argv"].index("--hparams") + 1] == '{"lr": 0.01, "batch_size": 64}'
    assert call["argv"][call["argv"].index("--trial_seed") + 1] == "4"
    assert call["argv"][call["argv"].index("--global_rounds") + 1] == "20"


def test_official_fediir_converts_its_output_selecting_by_validation(fake, tmp_path):
    argv, tmp = fake
    start = time.monotonic()
    res = official.main(argv + ["--algorithm", "FedIIR", "--test-domain", "15", "--seed", "1"])
    assert time.monotonic() - start < 8               # stopped after 15°, not after all six domains
    with pytest.raises(ProcessLookupError):
        os.kill(call_of(tmp)["pid"], 0)                     # and the official process is gone
    csv_rows = (tmp / "res" / "fediir-seed1.official" / "RotatedMNIST" / "FedIIR" /
                "RotatedMNIST_FedIIR_results.csv").read_text().splitlines()
    assert [r.split(",")[-3] for r in csv_rows[1:]] == ["0", "15"]
    assert json.loads((tmp / "res" / "fediir-seed1.json").read_text()) == res
    assert (res["method"] == "official-fediir" and res["dataset"] == "rmnist" and res["protocol"]
            == "lodo")
    assert res["complete"] is True and list(res["domains"]) == ["15"]
    d = res["domains"]["15"]
    # the first best val
    assert d["test_acc"] == pytest.approx(0.62) and res["mean_test_acc"] == d["test_acc"]
    assert d["val_acc"] == pytest.approx(0.90) and d["best_round"] == 31
    assert d["last_test_acc"] == pytest.approx(0.78)
    # 0°, 30°, 45° hold 11,667 digits
    assert d["train_examples"] == 3 * (11667 - 1166) + 2 * (11666 - 1166)
    h = d["history"]
    assert [r["round"] for r in h] == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    assert [r["test_acc"] for r in h] == pytest.approx([t + 0.01 for t in TEST])
    assert [r["val_acc"] for r in h] == pytest.approx(VAL)
    assert (h[0]["seconds"] == pytest.approx(0.1) and h[1]["seconds"]
            == pytest.approx(0.1 + 0.2 * 10))
    assert h[-1]["seconds"] == pytest.approx(0.1 + sum(0.1 * k * 10 for k in range(2, 11)) + 1.1
                                             * 9)
    assert h[3]["loss"] == pytest.approx(1.1) and h[3]["penalty"] == pytest.approx(0.45)
    a = res["args"]
    assert (a["clients"], a["sample"], a["rounds"], a["lr"], a["batch_size"], a["gamma"],
            a["device"]) == \
        (50, 5, 100, 0.01, 64, 0.01, "cpu")
    assert a["repository"] == "https://github.com/YamingGuo98/FedIIR" and a["commit"] is None
    runs, skipped = report.load(tmp / "res")        # benchmark/report.py and leaderboard.py read it
    assert not skipped and "| fediir | 62.0 ± 0.0 | 1 |" in report.accuracy_table(runs)
    assert leaderboard.accuracy(tmp / "res" / "fediir-seed1.json") == pytest.approx(62.0)


def test_official_fediir_refuses_bad_input_in_one_line(fake, capsys):
    argv, tmp = fake
    err = fails(official.main, argv[:1] + [str(tmp / "nowhere")] + argv[2:]
                + ["--algorithm", "FedAvg"], capsys)
    assert ("no clone" in err and f"git clone {official.REPOSITORY}" in err and official.COMMIT
            in err)
    assert "invalid choice" in fails(official.main, argv + ["--algorithm", "fedavg"], capsys)
    assert "unknown --test-domain '90'" in fails(
        official.main, argv + ["--algorithm", "FedAvg", "--test-domain", "90"], capsys)
    assert "FedIIR only" in fails(official.main, argv + ["--algorithm", "FedAvg", "--gamma", "0.1"],
                                  capsys)
    assert "at least 5" in fails(official.main, argv + ["--algorithm", "FedAvg", "--clients", "4"],
                                 capsys)
    os.remove(tmp / "data" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte")
    assert "lacks t10k-labels-idx1-ubyte" in fails(official.main, argv + ["--algorithm", "FedAvg"],
                                                   capsys)
    assert not (tmp / "res").exists() or not list((tmp / "res").iterdir())   # nothing ran


def test_official_fediir_fails_in_one_line_when_the_official_run_does(fake, capsys, monkeypatch):
    argv, tmp = fake
    # no warning: the error alone
    monkeypatch.setattr(official, "commit_of", lambda clone: official.COMMIT)
    monkeypatch.setenv("FAKE_CRASH", "1")
    err = fails(official.main, argv + ["--algorithm", "FedAvg"], capsys, code=1)
    assert "exited with 3 before test domain 0" in err and "fediir-seed1.log" in err
    monkeypatch.delenv("FAKE_CRASH")
    monkeypatch.setenv("FAKE_LIE", "1")                 # its CSV names another round than its table
    assert "disagrees with itself" in fails(official.main, argv + ["--algorithm", "FedAvg"], capsys,
                                            code=1)
    assert not (tmp / "res" / "fediir-seed1.json").exists()


def test_official_fediir_warns_once_when_the_clone_is_not_at_the_pinned_commit(
        fake, capsys, monkeypatch):
    argv, tmp = fake
    git = ["git", "-C", str(tmp / "FedIIR"), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "fake"]):
        subprocess.run(git + cmd, check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    official.main(argv + ["--algorithm", "FedAvg"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and head in err[0] and f"not the pinned {official.COMMIT}" in err[0]
    monkeypatch.setattr(official, "COMMIT", head)
    res = official.main(argv + ["--algorithm", "FedAvg"])
    assert capsys.readouterr().err == "" and res["args"]["commit"] == head


ONE_RUN = ["--dataset", "synthetic", "--methods", "fedavg", "--seeds", "0"]

BAD_INPUT = [   # (script, its main, argv (run in an empty folder), words of the one line)
    ("run", bench_run.main, [], "the following arguments are required: --dataset"),
    ("run", bench_run.main, ["--dataset", "rmnistt"], "unknown dataset 'rmnistt'"),
    ("run", bench_run.main, ["--dataset", "synthetic", "--methods", "fedsgd"],
     "unknown method 'fedsgd'"),
    ("run", bench_run.main, ONE_RUN + ["--jobs", "0"], "--jobs must be at least 1"),
    ("run", bench_run.main, ONE_RUN + ["--seeds", "x"], "argument --seeds: invalid int value: 'x'"),
    ("run", bench_run.main, ONE_RUN + ["--seeds", "0", "0"], "a seed twice"),
    ("run", bench_run.main, ONE_RUN + ["--seeds", "-1"], "out of the methods' range"),
    ("run", bench_run.main, ONE_RUN + ["--launcher", "slurmm"], "invalid choice: 'slurmm'"),
    ("run", bench_run.main, ONE_RUN + ["--gpus", "0"], "--gpus is for --launcher multi_gpu"),
    ("run", bench_run.main, ONE_RUN + ["--tag", "a/b"], "--tag 'a/b' names one folder"),
    ("run", bench_run.main, ["--dataset", "synthetic", "--methods", "fedipg --sample 2"],
     "give a variant its label"),
    ("run", bench_run.main, ["--dataset", "synthetic", "--methods", "a=fedavg", "a=fediir"],
     "label 'a' given twice"),
    ("run", bench_run.main, ["--dataset", "synthetic", "--methods",
                             "c=benchmark/diagnostics/irm_central"],
     "irm_central.py is not a method script"),
    ("run", bench_run.main, ONE_RUN + ["--", "--bogus"],
     "fedavg (fedavg.py): unrecognized arguments: --bogus"),
    ("run", bench_run.main, ["--dataset", "synthetic", "--methods", "fedavg", "fedloe",
                             "--rounds", "2"],
     "fedloe (fedloe.py): fedloe sets the rounds"),
    ("run", bench_run.main, ONE_RUN + ["--", "--test-domain", "7"],
     "unknown test domain '7' for synthetic"),
    ("run", bench_run.main, ONE_RUN + ["--sample", "5"],
     "--sample must be between 1 and --clients (2), got 5"),
    ("leaderboard", leaderboard.main, ["--only", "foo"], "argument --only: invalid choice: 'foo'"),
    ("leaderboard", leaderboard.main, ["--only", "rcmnist", "--jobs", "0"],
     "--jobs must be at least 1"),
    ("leaderboard", leaderboard.main, ["--only", "rcmnist", "--seeds", "-1"],
     "out of the methods' range"),
    ("leaderboard", leaderboard.main, ["--only", "rcmnist", "--out-dir", "b",
                                       "--data-root", "nowhere"],
     "--data-root nowhere is not a folder"),
    ("report", bench_report.main, ["--bogus"], "unrecognized arguments: --bogus"),
    ("report", bench_report.main, ["nofolder"], "nofolder is not a folder of results"),
    ("report", bench_report.main, ["--out", "r.md"], "--out needs a folder of results"),
    ("irm_central", irm_central.main, ["--steps", "x"], "argument --steps: invalid int value"),
    ("irm_central", irm_central.main, ["--data", "foo"], "argument --data: invalid choice: 'foo'"),
    ("irm_central", irm_central.main, ["--steps", "1", "--seeds", "-1", "--out", "c.json"],
     "--seeds must be in"),
    ("irm_central", irm_central.main, ["--steps", "1", "--out", "."], "cannot write --out ."),
    ("mcmahan_fig1", mcmahan_fig1.main, ["--points", "x"], "argument --points: invalid int value"),
    ("mcmahan_fig1", mcmahan_fig1.main, ["--seeds", "-1", "--out", "f.json"], "--seeds must be in"),
    ("mcmahan_fig1", mcmahan_fig1.main, ["--points", "2", "--out", "."], "--out .: . is a folder"),
    ("rcmnist_ptest", rcmnist_ptest.main, [], "the following arguments are required: RESULTS.json"),
    ("rcmnist_ptest", rcmnist_ptest.main, ["none.json"],
     "none.json is not a method script's results file"),
    ("sensitivity", sensitivity.main, ["--scale", "x"],
     "argument --scale: expects a number, got 'x'"),
    ("sensitivity", sensitivity.main, ["--scale", "nan"],
     "argument --scale: must be a finite number"),
    ("official_fediir", official.main, [], "the following arguments are required: --clone"),
    ("official_fediir", official.main, ["--clone", "c", "--data-root", "d", "--algorithm", "FedIIR",
                                        "--seed", "-1"],
     "--seed must be in [0, 2**31)"),
    ("official_fediir", official.main, ["--clone", "c", "--data-root", "d", "--algorithm", "FedIIR",
                                        "--gamma", "nan"],
     "argument --gamma: must be a finite number"),
    ("fedloe_stage2", fedloe_stage2.main, [], "give the stage-1 results file first"),
    ("fedloe_stage2", fedloe_stage2.main, ["s1.txt", "--test-domain", "0"], "must end with .json"),
    ("fedloe_stage2", fedloe_stage2.main, ["s1.json", "--test-domain", "0", "--out", "x.json"],
     "--out is set here"),
    ("fedloe_stage2", fedloe_stage2.main, ["s1.json", "--dataset", "synthetic", "--clients", "2"],
     "give one --test-domain"),
    ("fedloe_stage2", fedloe_stage2.main, ["s1.json", "--dataset", "synthetic",
                                           "--test-domain", "0", "--bogus"],
     "fedloe.py refuses the flags for stage 1: unrecognized arguments: --bogus"),
    ("fedloe_stage2", fedloe_stage2.main, ["s1.json", "--dataset", "synthetic",
                                           "--test-domain", "0", "--clients", "2",
                                           "--sample", "1"],
                                           "fedloe.py refuses the flags for stage 1: fedloe uses "
                                           "every client"),
    ("fedloe_stage2", fedloe_stage2.main, ["s1.json", "--dataset", "synthetic",
                                           "--test-domain", "0", "--clients", "2",
                                           "--stage2-comms", "0"],
                                           "--stage2-comms 0 leaves no stage 2 to run"),
    ("fedloe_spawn", fedloe_spawn.main, ["--spawn", "x"],
     "argument --spawn: invalid int value: 'x'"),
    ("fedloe_spawn", fedloe_spawn.main, ["--dataset", "rmnistt"], "unknown dataset 'rmnistt'"),
    ("speed", speed.main, ["--rounds", "0"], "--rounds must be positive, got 0"),
    ("speed", speed.main, ["--setting", "xx"], "argument --setting: invalid choice: 'xx'"),
    ("speed", speed.main, ["--clients", "5000"],
     "--clients 5000 leaves clients fewer training examples than one "
                                                 "minibatch"),
    ("gpu_check", gpu_check.main, ["--rounds", "0"],
     "--rounds, --ratio-rounds and --ipg-rounds must be positive"),
    ("gpu_check", gpu_check.main, ["--ratio-rounds", "0"],
     "--rounds, --ratio-rounds and --ipg-rounds must be positive"),
    ("gpu_check", gpu_check.main, ["--checks", "all"], "argument --checks: invalid choice: 'all'"),
]


@pytest.mark.parametrize("script,main,argv,words", BAD_INPUT,
                         ids=[f"{s}-{k}" for k, (s, *_) in enumerate(BAD_INPUT)])
def test_benchmark_scripts_refuse_bad_input_in_one_line_before_any_work(
        script, main, argv, words, tmp_path, monkeypatch, capsys):
    """Each script's bad input: exactly one line `<script>.py: error: ...` on stderr, exit 2, and
    nothing made in the folder it runs in (its runs, folders and files go there by default or by the
    relative paths given)."""
    monkeypatch.chdir(tmp_path)
    line = fails(main, argv, capsys)
    assert line.startswith(f"{script}.py: error: ") and words in line, line
    assert "Traceback" not in line and not list(tmp_path.iterdir())


def test_run_local_without_flower_says_what_to_install(tmp_path, monkeypatch, capsys):
    """flower/run_local.py where Flower is not installed (an import of flwr fails): one line that
    names the requirements file, exit 2, no SuperLink started and nothing written."""
    spec = importlib.util.spec_from_file_location("run_local_bare",
                                                  HERE / "flower" / "run_local.py")
    run_local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_local)
    monkeypatch.setitem(sys.modules, "flwr", None)                # `import flwr` raises ImportError
    monkeypatch.chdir(tmp_path)
    started = mock.Mock(side_effect=AssertionError("a process was started"))
    monkeypatch.setattr(subprocess, "Popen", started)
    assert run_local.main(["--method", "fedavg", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["run_local.py: error: Flower is not installed here: pip install -r "
                   "flower/requirements.txt"]
    assert not started.called and not list(tmp_path.iterdir())


def test_speed_json_holds_every_timed_round_and_where_it_was_made(tmp_path, capsys):
    """speed.py --json: each variant's timed rounds and the provenance of a method script's results
    (the device, the versions, the commit, no machine path), so that report.py's tables say where
    their times come from; --help says what speed.py is, not what FedAvg is."""
    out = tmp_path / "speed.json"
    speed.main(["--rounds", "1", "--sample", "1", "--device", "cpu", "--clock", "cpu",
                "--json", str(out)])
    r = json.loads(out.read_text())
    assert {"FedAvg, one after another", "FedIIR", "FedOMG", "FedIPG",
            "bare training loop"} <= set(r["seconds"])
    assert all(len(v) == 1 and v[0] > 0 for v in r["seconds"].values())
    prov = r["provenance"]
    assert (prov["command"].startswith("python benchmark/speed.py --rounds 1") and prov["device"]
            and prov["torch"])
    assert bench_report.provenance(out) == [(torch.__version__, np.__version__, prov["device"],
                                             prov["date"], True)]
    with pytest.raises(SystemExit):
        speed.main(["--help"])
    assert "How much the harness costs" in capsys.readouterr().out


def test_benchmark_inputs_are_checked_before_any_figure_or_run(tmp_path, capsys):
    """The refusals that need something on disk: report.py refuses a bad --speed file before it
    draws the folders' figures; rcmnist_ptest.py a run of another dataset, or one without its
    checkpoint, before scoring any; run.py a --out-dir under a file."""
    folder = tmp_path / "rot"
    fake_results(folder, "rmnist", "lodo", ["fedavg"])
    (tmp_path / "bad.json").write_text("{}")
    before = sorted(tmp_path.rglob("*"))
    assert "bad.json is not a speed.py --json file" in fails(
        bench_report.main, [str(folder), "--speed", str(tmp_path / "bad.json")], capsys)
    assert "is a folder" not in fails(bench_report.main, [str(folder),
                                                          "--out", str(tmp_path / "no" / "r.md")],
                                                          capsys)
    run_file = tmp_path / "rot" / "fedavg-seed0.json"
    assert ("a rmnist run; the p_test table is for rcmnist"
            in fails(rcmnist_ptest.main, [str(run_file)], capsys))
    r = json.loads(run_file.read_text())
    rc = tmp_path / "rc.json"
    rc.write_text(json.dumps(dict(r, dataset="rcmnist")))
    assert ("no readable checkpoint rc.json.ckpt beside it"
            in fails(rcmnist_ptest.main, [str(rc)], capsys))
    rc.unlink()
    assert sorted(tmp_path.rglob("*")) == before                   # no figure drawn, nothing scored
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "is not a folder this user can write in" in fails(bench_run.main, ONE_RUN
                                                             + ["--out-dir", str(blocker)],
                                                             capsys)
    if Path("/proc/version").exists():                      # a folder no one can write in, root too
        line = fails(bench_run.main, ONE_RUN + ["--out-dir", "/proc/fedood"], capsys)
        assert line.startswith("run.py: error: --out-dir /proc/fedood: /proc is not a folder this "
                               "user can write in")


def test_run_records_its_label_and_report_names_rows_by_the_runs_own_label(tmp_path):
    """report.py's row of a run: the label run.py recorded in it (whatever the file is named now),
    else the file name before -seed<S> (S the run's own seed), else the method where the file has
    the method script's default name (<method>-<dataset>-seed<S>: no label was chosen), else the
    file name."""
    folder = tmp_path / "f"
    fake_results(folder, "rmnist", "lodo", ["fedavg", "fedipg", "erm"])
    for seed in (0, 1):
        # the default --out
        (folder / f"fedavg-seed{seed}.json").rename(folder / f"fedavg-rmnist-seed{seed}.json")
        # as run.py, for 'fedipg-s5=...'
        bench_run.record_label(folder / f"fedipg-seed{seed}.json", "fedipg-s5")
        # renamed later: the label stays
        (folder / f"fedipg-seed{seed}.json").rename(folder / f"copy{seed}.json")
    r = json.loads((folder / "erm-seed1.json").read_text())
    r["method"] = "fedavg"                                       # a variant named by hand: its name
    (folder / "erm-seed1.json").write_text(json.dumps(r))
    (folder / "odd.json").write_text(json.dumps(dict(r, seed=3)))      # no -seed<S> of its own seed
    runs = bench_report.load(folder)[0]
    assert {k: sorted(x["seed"] for x in v) for k, v in runs.items()} == \
        {"fedavg": [0, 1], "fedipg-s5": [0, 1], "erm": [0, 1], "odd": [3]}
    text = "\n".join(bench_report.report(folder, tmp_path, figures=False))
    assert "| fedavg | " in text and "| fedipg-s5 | " in text and "fedavg-rmnist" not in text
    assert [line.split(" | ")[-1] for line in text.splitlines()
            if line.startswith("| fedavg | ")][-1] == "1.00 |"
    # FedAvg's published number
    assert "fedavg 77.90" not in text and "fedavg 90.80 (FedIIR Tab. 2)" in text


STOP_STUB = """import os, signal, sys, time
a = sys.argv[1:]
out, seed = a[a.index("--out") + 1], int(a[a.index("--seed") + 1])
print("started", flush=True)                 # as a method script prints once inside its main
if seed == 0:
    # the signal reaches the launcher mid-run
    os.kill(os.getppid(), getattr(signal, os.environ["STUB_SIGNAL"]))
try:
    time.sleep(60)
except KeyboardInterrupt:                    # a method script: its last checkpoint kept, exit 130
    open(out + ".stopped", "w").write("SIGINT")
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_run_stops_its_runs_with_sigint_on_a_signal_and_waits_for_them(
        sig, tmp_path, monkeypatch, capsys):
    """A signal to run.py mid-sweep: the run going gets SIGINT (for SIGTERM too) and has stopped
    before run.py ends, the next run never starts, one line says so, exit 128 + the signal, and
    run.py's handlers are put back."""
    (tmp_path / "stub.py").write_text(STOP_STUB)
    monkeypatch.setattr(bench_run, "command", lambda script,
                        args: [sys.executable, str(tmp_path / "stub.py"), *args])
    monkeypatch.setenv("STUB_SIGNAL", sig)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    argv = ONE_RUN[:-1] + ["0", "1", "--out-dir", str(tmp_path)]
    line = fails(bench_run.main, argv, capsys, code=128 + getattr(signal, sig))
    assert (line.startswith(f"run.py: interrupted ({sig}): stopped 1 run(s) (fedavg-seed0)")
            and "1 not started" in line)
    assert "rerun the same command to continue" in line
    assert (tmp_path / "synthetic" / "fedavg-seed0.json.stopped").read_text() == "SIGINT"
    assert not (tmp_path / "synthetic" / "fedavg-seed1.log").exists()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_leaderboard_stops_its_runs_on_a_signal_in_one_line(sig, tiny_board, tmp_path, monkeypatch,
                                                            capsys):
    """The same through leaderboard.py: its runs stopped with SIGINT, the next benchmark not
    started, its one line names the benchmark, exit 128 + the signal."""
    (tmp_path / "stub.py").write_text(STOP_STUB)
    monkeypatch.setattr(bench_run, "command", lambda script,
                        args: [sys.executable, str(tmp_path / "stub.py"), *args])
    monkeypatch.setenv("STUB_SIGNAL", sig)
    line = fails(leaderboard.main, tiny_board, capsys, code=128 + getattr(signal, sig))
    assert (line.startswith(f"leaderboard.py: interrupted ({sig}): benchmark syn-0: stopped 2 "
                            "run(s)")), line
    assert "rerun the same command to continue" in line
    assert all((tmp_path / "board" / "syn-0" / f"fediir-seed{s}.json.stopped").is_file()
               for s in (0, 1))
    assert not (tmp_path / "board" / "syn-1").exists()


def test_ctrl_c_of_run_py_stops_the_method_script_at_its_checkpoint_and_the_same_command_resumes(
        tmp_path, capsys):
    """SIGINT to a run.py process with one real FedAvg run going (once its first checkpoint is
    written): exit 130, one line on stderr, no traceback there or in the run's log, the run's
    checkpoint on disk and its results not complete; the same command (here in this process) then
    resumes the run from that checkpoint and completes it, its label recorded."""
    argv = ONE_RUN + ["--rounds", "20", "--out-dir", str(tmp_path), "--", "--eval-every", "1",
                      "--test-domain", "0"]
    ckpt, out, log = (tmp_path / "synthetic" / f"fedavg-seed0.{x}"
                      for x in ("json.ckpt", "json", "log"))
    p = subprocess.Popen([sys.executable, "benchmark/run.py", *argv], cwd=HERE,
                         env=dict(os.environ, OMP_NUM_THREADS="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ckpt.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert (p.returncode == 130 and len(err.strip().splitlines()) == 1 and "Traceback" not
            in err), err
    assert err.startswith("run.py: interrupted (SIGINT): stopped 1 run(s) (fedavg-seed0), 1 with a "
                          "checkpoint"), err
    assert ckpt.is_file() and not (out.exists() and json.loads(out.read_text())["complete"])
    text = log.read_text()
    assert "Traceback" not in text and "fedavg.py: stopped by SIGINT after round" in text
    assert text.rstrip().endswith(f"its checkpoint: {ckpt}; continue with the same arguments and "
                                  "--resume")
    bench_run.main(argv)
    assert "all runs complete" in capsys.readouterr().out
    assert "resuming from" in log.read_text().split("continue with the same arguments")[1]
    r = json.loads(out.read_text())
    assert r["complete"] and r["label"] == "fedavg"
    assert [h["round"] for h in r["domains"]["style0"]["history"]] == list(range(1, 21))


def test_leaderboard_refuses_fedloe_where_the_benchmark_samples_clients(tmp_path, capsys):
    """fedloe.py refuses --sample (it uses every client at every communication): the RotatedMNIST-50
    columns list FedLOE's refusal and its reason instead of running it, and every cell the
    leaderboard does run passes its method's own checks (a dry run plans them all, as a real one
    does before its first run)."""
    sampled = [b for b, (_, _, args, _) in leaderboard.BENCHMARKS.items() if "--sample" in args]
    fedloe_rows = [r for r, (script, _) in leaderboard.ROWS.items() if script == "fedloe"]
    assert sampled == ["rmnist50-0", "rmnist50-75"] and len(fedloe_rows) == 3
    assert set(leaderboard.REFUSED) == {(b, r) for b in sampled for r in fedloe_rows}
    todo = leaderboard.main(["--dry-run", "--out-dir", str(tmp_path / "board")])
    assert (all(r not in todo[b] for b in sampled for r in fedloe_rows) and "fedloe-fish"
            in todo["mnist-fl"])
    sources = leaderboard.sources(sampled, tmp_path / "board", [0])
    assert sources.count("refused — fedloe.py refuses --sample: it uses every client at every "
                         "communication (Eq. 4, Eq. 11), and this benchmark samples 5 of 50 "
                         "clients a round") == 6


def test_fedipg_resumes_after_the_pretraining_phase(tmp_path, monkeypatch, capsys):
    """Killed right after round 1 (the phase and round 1 checkpointed), --resume goes on at round 2
    with the phase's exits and the unreliable client's last download, and does not run it again."""
    argv = QUICK + ["--rounds", "3", "--eval-every", "1", "--clients", "4", "--sample", "4",
                    "--test-domain", "1",
                    "--exit", "auto", "--exit-warmup", "2", "--aberrant", "unreliable:0.5",
                    "--exit-L", "1e-3"]
    full, _ = run(fedipg_aberrant.main, argv, tmp_path, "full.json")
    assert capsys.readouterr().out.count("exit strategy:") == 1
    seen = []
    resumed = interrupted_then_resumed(fedipg_aberrant.main, argv, str(tmp_path / "cut.json"),
                                       monkeypatch, lambda blob: blob["round"] == 1,
                                       check=lambda blob: seen.append(blob["state"]))
    out = capsys.readouterr().out
    assert out.count("exit strategy:") == 1 and "resuming from" in out  # the phase ran once,
                                                                        # before the cut
    assert all(len(v) == 2 for v in seen[0]["contrib"].values())
    assert strip_times(resumed) == strip_times(full)


def test_parallel_fedipg_warmup_estimates_match_sequential(tmp_path, monkeypatch, dtype):
    """--exit auto: the g_i of Eq. 13 are taken at w^t before the clients train at once. 2 rounds.
    float64: max |Δθ| 9.0e-17 (tolerance 1e-13). float32, measured at 1 / 2 threads: 2.9e-7 /
    2.7e-7, tolerance 5e-6 (17x). The contributions (warm-up round 1, at w^1 before any training)
    agreed exactly in both; held to 1e-6 relative."""
    args = method_args(fedipg_aberrant, "fedipg", SGD + IPG
                       + ["--sample", "5", "--exit", "auto", "--warmup", "rounds",
                                                                 "--exit-warmup", "1"], tmp_path)
    out = both_ways(fedipg_aberrant.fedipg_round, args, 2, fedipg_aberrant.init_state)
    f32 = dtype == torch.float32
    assert max_abs(out) < (5e-6 if f32 else 1e-13)
    seq, par = out["off"][2]["contrib"], out["on"][2]["contrib"]
    assert (sorted(seq) == sorted(par) == list(range(5)) and out["on"][2]["exited"]
            == out["off"][2]["exited"])
    for i in seq:
        assert torch.allclose(torch.tensor(par[i]), torch.tensor(seq[i]), rtol=1e-6, atol=0)


def test_report_names_every_method_of_the_one_list():
    """report.py's table of names and papers covers harness.METHODS, each once, and its Methods
    table has one row per method, in that order."""
    assert list(bench_report.TITLES) == list(harness.METHODS)
    table = bench_report.block_methods(bench_report.ROOT)
    rows = [line for line in table if line.startswith("| [`")]
    assert [r.split("`")[1] for r in rows] == [f"{m}.py" for m in harness.METHODS]
