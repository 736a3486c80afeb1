"""The run harness's tests (harness/): the command line and its refusals, --help, the defaults a
run resolves, results files, checkpoints, --resume, signals, locks, provenance, progress lines.
Every method goes through it; a method's own refusals are in its section of test_methods.py."""

import argparse
import dataclasses
import importlib.util
import inspect
import io
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
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
import fedloe
import fedomg
import harness
import perinvfl
from harness import config, datasets, outputs, provenance, runner

from tests.helpers import (
    HERE, LOE_FULL, METHODS, MINI, QUICK, RC_ARGV, fails, fake_pacs, flag_blocks,
    interrupted_then_resumed, on_every_device, resolved_args, run, stopped_at_checkpoint,
    strip_times,
)
import fedloe_spawn


pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@on_every_device
@pytest.mark.parametrize("stop_at", [("style0", 2), ("style1", 4)])
def test_resume_gives_the_uninterrupted_numbers(tmp_path, monkeypatch, stop_at, device):
    argv = QUICK + ["--rounds", "6", "--clients", "4", "--sample", "2", "--device", device]
    full, _ = run(fedavg.main, argv, tmp_path, "full.json")
    out = str(tmp_path / "cut.json")
    resumed = interrupted_then_resumed(fedavg.main, argv, out, monkeypatch,
                                       lambda blob: (blob["domain"], blob["round"]) == stop_at)
    assert strip_times(resumed) == strip_times(full)
    assert json.load(open(out))["domains"].keys() == full["domains"].keys()
    again = fedavg.main(argv + ["--out", out, "--resume"])              # all done: nothing to train
    assert strip_times(again) == strip_times(full)


def signal_at(monkeypatch, signum, domain, t, times=1):
    """Sends this process `signum` (`times` times) while round t of `domain` runs (as a scheduler
    or Ctrl-C would)."""
    checked = runner.checked

    def round_then_signal(t_, losses, model, state, fed):          # (at the end of its round)
        if (fed.name, t_) == (domain, t):
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return checked(t_, losses, model, state, fed)
    monkeypatch.setattr(runner, "checked", round_then_signal)


@pytest.mark.parametrize("signum,domain,t", [(signal.SIGTERM, "style1", 3),
                                             (signal.SIGINT, "style0", 1)])
def test_a_signal_stops_after_its_round_and_resume_gives_the_uninterrupted_numbers(
        tmp_path, monkeypatch, capsys, signum, domain, t):
    """SIGTERM (a scheduler's time limit) in the middle of the second held-out domain, and Ctrl-C in
    round 1, before any evaluation: the round finishes, its checkpoint is written (the losses since
    the last evaluation in it), exactly one line on stderr says where it is and how to go on (at
    the signal, stdout said the run would stop after the round), exit 128 + the signal; --resume
    then ends with the uninterrupted numbers, the mean losses of the cut evaluation window
    included."""
    argv = QUICK + ["--rounds", "6", "--eval-every", "3", "--clients", "3", "--sample", "2"]
    full, _ = run(fedavg.main, argv, tmp_path, "full.json")
    capsys.readouterr()
    out = str(tmp_path / "cut.json")
    with monkeypatch.context() as m:
        signal_at(m, signum, domain, t)
        with pytest.raises(SystemExit) as e:
            fedavg.main(argv + ["--out", out])
    assert e.value.code == 128 + signum
    std = capsys.readouterr()
    assert std.err.splitlines() == [
        f"fedavg.py: stopped by {signal.Signals(signum).name} after round {t} (testing on "
        f"{domain}); its checkpoint: {tmp_path / 'cut.json.ckpt'}; continue with the same "
        "arguments and --resume"]
    said = f"{signal.Signals(signum).name}: stopping after this round and its checkpoint (again: "
    assert [line for line in std.out.splitlines() if line.startswith(said)] == [said + "at once)"]
    blob = torch.load(tmp_path / "cut.json.ckpt", weights_only=True)
    assert (blob["domain"], blob["round"], len(blob["losses"])) == (domain, t, t % 3)
    assert not os.path.exists(out + ".lock") and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    resumed = fedavg.main(argv + ["--out", out, "--resume"])
    assert strip_times(resumed) == strip_times(full)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_in_one_line(tmp_path, monkeypatch, capsys, signum):
    """Ctrl-C twice (or SIGTERM twice) in round 4, after round 3's evaluation and checkpoint: the
    run ends at once, exit 130, exactly one line on stderr naming the checkpoint that stays and
    how to go on (stdout said the first would stop after the round); --resume from it ends with
    the uninterrupted numbers. Twice in round 1, before any checkpoint: one line, nothing was
    saved."""
    argv = QUICK + ["--rounds", "6", "--eval-every", "3", "--clients", "3", "--sample", "2",
                    "--test-domain", "0"]
    full, _ = run(fedavg.main, argv, tmp_path, "full.json")
    capsys.readouterr()
    for t, out, how in ((4, tmp_path / "cut.json", f"its checkpoint: {tmp_path / 'cut.json.ckpt'}; "
                         "continue with the same arguments and --resume"),
                        (1, tmp_path / "early.json", "nothing was saved")):
        with monkeypatch.context() as m:
            signal_at(m, signum, "style0", t, times=2)
            with pytest.raises(SystemExit) as e:
                fedavg.main(argv + ["--out", str(out)])
        std = capsys.readouterr()
        assert e.value.code == 130
        assert std.err.splitlines() == [f"fedavg.py: interrupted; {how}"], std.err
        assert f"{signal.Signals(signum).name}: stopping after this round" in std.out
        assert not os.path.exists(f"{out}.lock") and signal.getsignal(signum) in (
            signal.SIG_DFL, signal.default_int_handler)
    assert torch.load(f"{tmp_path / 'cut.json'}.ckpt", weights_only=True)["round"] == 3
    resumed = fedavg.main(argv + ["--out", str(tmp_path / "cut.json"), "--resume"])
    assert strip_times(resumed) == strip_times(full)


@pytest.mark.parametrize("error", [RuntimeError("reentrant call inside <_io.BufferedWriter>"),
                                   BrokenPipeError(32, "Broken pipe")])
def test_the_first_signal_is_honoured_whatever_stdout_does(monkeypatch, error):
    """The first signal's notice goes to stdout, which may be mid-write (the signal then makes a
    reentrant call) or closed: the stop is still taken, and nothing is raised into the round (the
    stderr line says what happened); a second signal stops at once."""
    class Failing:
        def write(self, text):
            raise error
    monkeypatch.setattr(sys, "stdout", Failing())
    monkeypatch.setattr(runner.STOP, "signal", None)
    runner.stop_after_the_round(signal.SIGTERM, None)
    assert runner.STOP.signal == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        runner.stop_after_the_round(signal.SIGINT, None)


def test_a_checkpoint_every_few_minutes_between_evaluations(tmp_path, monkeypatch):
    """--checkpoint-minutes: between evaluations a checkpoint as soon as that long has passed (here
    at once, every round); a run cut right after one (no evaluation yet) resumes to the
    uninterrupted numbers."""
    argv = QUICK + ["--rounds", "5", "--eval-every", "5", "--clients", "3", "--sample", "2",
                    "--test-domain", "0"]
    full, _ = run(fedavg.main, argv, tmp_path, "full.json")
    rounds = []
    resumed = interrupted_then_resumed(fedavg.main, argv + ["--checkpoint-minutes", "1e-9"],
                                       str(tmp_path / "cut.json"), monkeypatch,
                                       lambda b: rounds.append(b["round"]) or b["round"] == 3)
    assert rounds[:3] == [1, 2, 3]                           # every round, no evaluation among them
    assert strip_times(resumed)["domains"] == strip_times(full)["domains"]


def test_a_second_run_never_replaces_the_first_unasked(tmp_path, monkeypatch, capsys):
    """The default --out names the dataset, the held-out domain, the seed and a digest of the other
    arguments: the same command twice is refused in one line and the first result and checkpoint
    stay as they were, while another held-out domain or other arguments are other files. An
    interrupted run is refused alike (--resume continues it); --overwrite replaces them once the new
    run completes."""
    monkeypatch.chdir(tmp_path)
    argv = QUICK + ["--rounds", "2", "--test-domain", "0"]
    first = fedavg.main(argv)
    out = Path(first["args"]["out"])
    ckpt = Path(f"{out}.ckpt")
    assert out.parent == Path("results") and out.name.startswith("fedavg-synthetic-0-seed0-")
    before = out.read_bytes(), ckpt.read_bytes()
    line = fails(fedavg.main, argv, capsys)
    assert line == (f"fedavg.py: error: {out} holds a complete result; give another --out, or "
                    "--overwrite to replace it (it stays until the new run completes)")
    assert (out.read_bytes(), ckpt.read_bytes()) == before
    other = fedavg.main(argv[:-1] + ["1"])["args"]["out"]                 # another held-out domain
    longer = fedavg.main(argv + ["--rounds", "3"])["args"]["out"]          # other arguments
    assert (len({str(out), other, longer}) == 3
            and Path(other).name.startswith("fedavg-synthetic-1-seed0-"))
    out.write_text(json.dumps(dict(first, complete=False)))          # as a run cut short leaves it
    line = fails(fedavg.main, argv, capsys)
    assert line == (f"fedavg.py: error: {out} holds an interrupted run ({ckpt}): continue it with "
                    "--resume, or start again with --overwrite (it replaces that run once "
                    "complete)")
    line = fails(fedavg.main, argv + ["--overwrite", "--resume"], capsys)
    assert line == ("fedavg.py: error: --overwrite --resume continues an interrupted replacement, "
                    f"and there is none at {out}.next.ckpt: --overwrite alone starts one")
    again = fedavg.main(argv + ["--overwrite"])
    assert json.loads(out.read_text())["complete"] and again["args"]["out"] == str(out)
    assert not Path(f"{out}.next.ckpt").exists() and not Path(f"{out}.lock").exists()
    line = fails(fedavg.main, QUICK + ["--test-domain", "90"], capsys)  # its own message,
                                                                        # not "complete"
    assert line.startswith("fedavg.py: error: unknown test domain '90' for synthetic")


def test_one_run_per_out_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    """A second run on an --out that a live run holds is refused at its start in one line; the first
    one's lock (pid@host) goes when it ends, however it ends (here SIGTERM: exit 143); a lock of
    another host, or one still being written, is never taken; one left by a dead process of this
    host is. Temporary files carry the writer's pid."""
    out = tmp_path / "r.json"
    argv = QUICK + ["--rounds", "500", "--eval-every", "250", "--test-domain", "0",
                    "--out", str(out)]
    p = subprocess.Popen([sys.executable, str(HERE / "fedavg.py")] + argv, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=HERE)
    lock = Path(f"{out}.lock")
    try:
        for _ in range(600):                                       # its lock: taken before any work
            if lock.exists() and lock.read_text():
                break
            time.sleep(0.1)
        host = platform.node()
        assert lock.read_text() == f"{p.pid}@{host}"
        line = fails(fedavg.main, argv, capsys)
        assert line == (f"fedavg.py: error: --out {out} is in use by another run (pid {p.pid} "
                        f"on {host}): wait for it to end, or give another --out (that run gone? "
                        f"delete {lock})")
        p.send_signal(signal.SIGTERM)
        err = p.stderr.read().splitlines()                     # one line: what, and how to go on
        assert p.wait(60) == 143 and len(err) == 1 and "stopped by SIGTERM" in err[0], err
    finally:
        p.kill()
    assert not lock.exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    for held in (f"{dead.pid}@elsewhere", ""):    # another host sharing the
                                                  # disk; a lock being written
        lock.write_text(held)
        assert ("is in use by another run" in fails(fedavg.main, argv, capsys) and lock.read_text()
                == held)
    lock.write_text(f"{dead.pid}@{platform.node()}")           # a run that died without cleaning up
    res = fedavg.main(argv[:-2] + ["--out", str(out), "--rounds", "1", "--eval-every", "1",
                                   "--overwrite"])
    assert res["complete"] and not lock.exists()
    assert (not list(tmp_path.glob("*.tmp")) and "{path}.{os.getpid()}.tmp"
            in inspect.getsource(outputs.write_atomically))


def test_resume_takes_the_same_file_however_it_is_spelled(tmp_path, monkeypatch, capsys):
    argv = QUICK + ["--rounds", "4", "--eval-every", "2", "--test-domain", "0"]
    full, _ = run(fedavg.main, argv, tmp_path, "full.json")
    (tmp_path / "a").mkdir()
    cut = str(tmp_path / "a" / ".." / "cut.json")
    stopped_at_checkpoint(fedavg.main, argv + ["--out", cut], monkeypatch)
    # the same file, spelt otherwise
    resumed = fedavg.main(argv + ["--out", str(tmp_path / "cut.json"), "--resume"])
    assert strip_times(resumed) == strip_times(full)
    assert "resuming from" in capsys.readouterr().out


FEDAVG_BAD_INPUT = [
    (["--dataset", "nope"], "unknown dataset 'nope'; choose from rmnist"),
    (["--test-domain", "90"], "unknown test domain '90' for rmnist; choose 'all', one of 0, 15"),
    (["--dataset", "pacs"], "pacs needs --data-root DIR"),
    (["--dataset", "pacs", "--data-root", "/nonexistent"],
     "/nonexistent/PACS not found; get it with: python -m harness.datasets --download pacs "
     "--data-root /nonexistent"),
    (["--dataset", "cifar10"], "cifar10 is not embedded: pass --data-root"),
    (["--clients", "3"], "--clients 3 is below the 5 training domains"),
    (["--clients", "10", "--sample", "11"],
     "--sample must be between 1 and --clients (10), got 11"),
    (["--rounds", "0"], "--rounds must be positive, got 0"),
    (["--lr", "-1"], "--lr must be positive, got -1.0"),
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--out", "/dev/null/r.json"], "--out /dev/null/r.json: /dev/null is not a folder"),
    (["--dataset", "mnist", "--test-domain", "0"], "--test-domain does not apply to mnist"),
    (["--amp", "--device", "cpu"], "--amp needs a CUDA device"),
    (["--seed", "99999999999999999999"], "--seed must be in [0, 2**31), got 99999999999999999999"),
    (["--seed", "-1"], "--seed must be in [0, 2**31), got -1"),
    (["--data-root", ""], "--data-root is empty"),
    (["--out", ""], "--out is empty"),
    (["--out", "somewhere/"], "--out somewhere/ is a folder; give a file name, e.g. "
     "somewhere/results.json"),
]


@pytest.mark.parametrize("argv,message", FEDAVG_BAD_INPUT)
def test_bad_input_is_one_line(argv, message, capsys):
    assert message in fails(fedavg.main, argv, capsys)


def full_results_folder(outs):
    """results/ as a user's after many runs: a complete result and its checkpoint at every path in
    outs."""
    done = {"method": "fedavg", "args": {}, "domains": {}, "mean_test_acc": 0.5, "complete": True}
    for out in outs:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(done))
        Path(f"{out}.ckpt").write_bytes(b"PK\x03\x04")


def test_bad_input_is_the_same_with_a_full_results_folder(capsys):
    """Whatever a user keeps in results/ (here: a complete result and checkpoint at the default
    --out of the README's quick look, of every held-out domain alone and of all of them), each bad
    input still gets its own message, and nothing there changes."""
    outs = []
    for argv in [[], ["--rounds", "20", "--test-domain", "0"],
                 *[["--test-domain", str(d)] for d in range(0, 90, 15)],
                 ["--dataset", "synthetic"], ["--test-domain", "2"]]:
        outs.append(harness.resolve(fedavg.METHOD, argv).out)
    full_results_folder(outs)
    assert len(set(outs)) == 10 and all(o.startswith("results/fedavg-") for o in outs)
    before = {p: p.read_bytes() for p in Path("results").iterdir()}
    for argv, message in FEDAVG_BAD_INPUT:
        assert message in fails(fedavg.main, argv, capsys)
    assert {p: p.read_bytes() for p in Path("results").iterdir()} == before


def method(name):
    return importlib.import_module(name)


def float_flags(name):
    p = config.parser(method(name).METHOD)
    return [a.option_strings[0] for a in p._actions
            if a.type in (float, config.finite, config.finite_or_auto)]


@pytest.mark.parametrize("name", METHODS)
def test_every_float_flag_refuses_nan_inf_and_words_before_any_work(name, capsys, monkeypatch):
    monkeypatch.setattr(data, "load", lambda *a, **k: pytest.fail("data loaded despite a bad flag"))
    flags = float_flags(name)
    assert {"--lr", "--momentum", "--weight-decay", "--global-lr", "--alpha",
            "--p-test"} <= set(flags)
    for flag in flags:
        for value, why in (("inf", "must be a finite number, got 'inf'"),
                           ("-inf", "must be a finite number"),
                           ("nan", "must be a finite number, got 'nan'"),
                           ("1e999", "must be a finite number"),
                           ("ten", "expects a number, got 'ten'")):
            line = fails(method(name).main, [f"{flag}={value}"], capsys)
            assert line == f"{name}.py: error: argument {flag}: {why}" or line.startswith(
                f"{name}.py: error: argument {flag}: {why}"), (flag, value, line)


@pytest.mark.parametrize("argv,message", [
    (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["--momentum", "-0.1"], "--momentum must be in [0, 1), got -0.1"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
])
def test_float_flags_out_of_range_are_one_line(argv, message, capsys):
    assert message in fails(fedavg.main, argv, capsys)


def break_the_server(monkeypatch, where):
    """Every round as the method computes it, then, after the server step of round 2, one entry of
    the global model (where="model") or of the method's state set to inf, as a diverging server
    would."""
    train_domain = runner.train_domain

    def patched(method, *rest, **kw):
        round_fn = method.round

        def round_then_break(t, model, fed, args, state, ctx):
            out = round_fn(t, model, fed, args, state, ctx)
            if t == 2 and where == "model":
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = math.inf
            elif t == 2:
                state["server_quantity"] = torch.tensor([1.0, math.nan])
            return out
        return train_domain(dataclasses.replace(method, round=round_then_break), *rest, **kw)
    monkeypatch.setattr(runner, "train_domain", patched)


TWO_ROUNDS = {"fedavg": [], "fediir": [], "fedomg": [], "perinvfl": [], "fedipg": [],
              "fedloe": ["--clients", "4", "--stage1-epochs", "2", "--stage1-comms", "2",
                         "--stage2-comms", "0"] + LOE_FULL}


@pytest.mark.parametrize("where", ["model", "state"])
@pytest.mark.parametrize("name", METHODS)
def test_a_non_finite_model_or_server_quantity_is_never_written_as_a_result(
        name, where, tmp_path, monkeypatch, capsys):
    break_the_server(monkeypatch, where)
    argv = ["--dataset", "synthetic", "--model", "cnn", "--test-domain", "0",
            "--out", str(tmp_path / "r.json")]
    argv += TWO_ROUNDS[name] + (["--rounds", "3", "--eval-every", "1"] if name != "fedloe" else [])
    line = fails(method(name).main, argv, capsys, code=1)
    assert f"non-finite {'model ' if where == 'model' else 'state'}" in line, line
    assert "after the server step of round 2" in line, line
    # round 1's checkpoint only
    assert "the last good checkpoint" in line and not (tmp_path / "r.json").exists()
    blob = torch.load(tmp_path / "r.json.ckpt", weights_only=True)
    assert blob["round"] == 1 and all(v.isfinite().all() for v in blob["model"].values()
                                      if v.is_floating_point())


def test_a_finished_domain_stays_when_a_later_one_goes_non_finite(tmp_path, monkeypatch, capsys):
    """Two held-out domains: the first finishes and is written, not marked complete; the second's
    non-finite model is not."""
    calls = []
    train_domain = runner.train_domain

    def patched(method, args, ds, fed, *rest, **kw):
        calls.append(fed.name)
        if len(calls) == 1:
            return train_domain(method, args, ds, fed, *rest, **kw)
        round_fn = method.round

        def broken(t, model, *a):
            out = round_fn(t, model, *a)
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = math.nan
            return out
        return train_domain(dataclasses.replace(method, round=broken), args, ds, fed, *rest, **kw)
    monkeypatch.setattr(runner, "train_domain", patched)
    argv = ["--dataset", "synthetic", "--model", "cnn", "--rounds", "2",
            "--out", str(tmp_path / "r.json")]
    fails(fedavg.main, argv, capsys, code=1)
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["complete"] is False and list(res["domains"]) == calls[:1]


def test_out_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data, "load", lambda *a,
                        **k: pytest.fail("data loaded despite a bad --out"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("")
    (tmp_path / "r.json.ckpt").mkdir()
    for out, message in ((tmp_path / "folder",
                          f"{tmp_path / 'folder'} is a folder; give a file name, e.g. "
                                                f"{tmp_path / 'folder' / 'results.json'}"),
                         (tmp_path / "afile" / "x.json", f"{tmp_path / 'afile'} is not a folder"),
                         (tmp_path / "afile" / "deeper" / "x.json",
                          f"{tmp_path / 'afile'} is not a folder"),
                         (tmp_path / "r.json", f"{tmp_path / 'r.json.ckpt'} is a folder")):
        line = fails(fedavg.main, ["--out", str(out)], capsys)
        assert line == f"fedavg.py: error: --out {out}: {message}" or message in line, line
    # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder", "r.json.ckpt"]


def test_provenance_records_a_commit_only_where_the_project_is_the_top_of_its_git_tree(tmp_path):
    """A copy of the project inside another repository records no commit (that repository's says
    nothing of the project); the project at the top of its own repository records its HEAD, and
    whether it is dirty: its tracked files differ, the run's own outputs (a committed result
    regenerated in place) aside."""
    git = lambda where, *a: subprocess.run(["git", "-C", str(where), "-c", "user.name=t", "-c",
                                            "user.email=t@t", *a], capture_output=True, text=True,
                                            check=True).stdout.strip()
    def commit_of(project, *own):                  # the copy's own provenance.py, loaded from it
        spec = importlib.util.spec_from_file_location(
            "copied_provenance", project / "harness" / "provenance.py")
        copied = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copied)
        assert copied.HERE == project.resolve()
        prov = copied.provenance("fedavg", [], torch.device("cpu"), [project / o for o in own])
        return prov["commit"], prov["dirty"]
    outer = tmp_path / "outer"
    for project in (outer / "project", tmp_path / "alone"):
        project.mkdir(parents=True)
        for name in ("common.py", "data.py"):
            shutil.copy(HERE / name, project / name)
        shutil.copytree(HERE / "harness", project / "harness",
                        ignore=shutil.ignore_patterns("__pycache__"))
    git(outer, "init", "-q")
    git(outer, "add", ".")
    git(outer, "commit", "-qm", "another project, the copy inside")
    assert commit_of(outer / "project") == (None, None)
    alone = tmp_path / "alone"
    git(alone, "init", "-q")
    git(alone, "add", ".")
    git(alone, "commit", "-qm", "the project alone")
    assert commit_of(alone) == (git(alone, "rev-parse", "HEAD"), False)
    (alone / "r.json").write_text("{}")                  # a committed result, rewritten by its run:
    git(alone, "add", "r.json")                               # the run's own output is not the code
    git(alone, "commit", "-qm", "a result")
    (alone / "r.json").unlink()                                     # (--overwrite removes it first)
    assert commit_of(alone, "r.json") == (git(alone, "rev-parse", "HEAD"), False)
    assert commit_of(alone)[1] is True
    (alone / "data.py").write_text((alone / "data.py").read_text() + "\n")
    assert commit_of(alone, "r.json") == (git(alone, "rev-parse", "HEAD"), True)


def test_results_say_where_they_came_from_and_the_last_line_where_the_checkpoint_is(
        tmp_path, capsys):
    argv = QUICK + ["--model", "cnn", "--test-domain", "0", "--rounds", "1", "--eval-every", "1"]
    res, out = run(fedavg.main, argv, tmp_path)
    prov = res["provenance"]
    assert prov["command"] == "python fedavg.py " + " ".join(argv + ["--out", out, "--overwrite"])
    assert prov["torch"] == torch.__version__ and prov["numpy"] == np.__version__
    assert (prov["device"] == provenance.device_name(torch.device(res["args"]["device"]))
            and prov["device"])
    assert (prov["python"] == sys.version.split()[0]
            and re.fullmatch(r"\d{4}-\d\d-\d\d", prov["date"]))
    if (HERE / ".git").exists():
        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout
        assert prov["commit"] == head.strip() and isinstance(prov["dirty"], bool)
    assert json.loads(Path(out).read_text())["provenance"] == prov
    last = capsys.readouterr().out.strip().splitlines()[-1]
    ckpt = out + ".ckpt"
    assert last == (f"checkpoint: {ckpt} ({runner.size(ckpt)}): the final model and the method's "
                    "state, the only copy of the trained model; deleting it loses the model, not "
                    "the results")
    assert runner.size(ckpt).endswith(" kB") or runner.size(ckpt).endswith(" MB")


def test_missing_pretrained_weights(monkeypatch, tmp_path, capsys):
    import urllib.error
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))

    def offline(*a, **k):
        raise urllib.error.URLError("offline")
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    datasets.make_fake_tree(tmp_path, per_class=1)
    line = fails(fedavg.main, ["--dataset", "pacs", "--data-root", str(tmp_path), "--rounds", "1",
                               "--out", str(tmp_path / "r.json")], capsys)
    assert "could not get the ImageNet weights of resnet18" in line and "--no-pretrained" in line


def test_resume_with_other_arguments_and_corrupt_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "r.json")
    fedavg.main(QUICK + ["--out", out, "--test-domain", "0"])
    line = fails(fedavg.main, QUICK + ["--out", out, "--test-domain", "0", "--lr", "0.01",
                                       "--resume"], capsys)
    assert "was made with other arguments (lr: 0.05 -> 0.01)" in line
    ckpt = Path(f"{out}.ckpt")
    ckpt.write_bytes(ckpt.read_bytes()[:200])                  # truncated: one way out, --overwrite
    line = fails(fedavg.main, QUICK + ["--out", out, "--test-domain", "0", "--resume"], capsys)
    assert line == (f"fedavg.py: error: {ckpt} cannot be read (RuntimeError: truncated, or not a "
                    "checkpoint): --overwrite starts the run again and replaces it once complete")
    fedavg.main(QUICK + ["--out", out, "--test-domain", "0", "--overwrite"])
    assert torch.load(ckpt, weights_only=True)["round"] == 4
    ckpt.write_bytes(b"garbage")                                   # not a checkpoint: never touched
    for flags in ([], ["--resume"], ["--overwrite"]):
        line = fails(fedavg.main, QUICK + ["--out", out, "--test-domain", "0", *flags], capsys)
        assert line == (f"fedavg.py: error: --out {out}: {ckpt} is not a checkpoint of this "
                        "project, which no run replaces; nothing was touched: move it away, or "
                        "give another --out")
    assert ckpt.read_bytes() == b"garbage"


@on_every_device
def test_non_finite_loss_stops_and_keeps_what_was_written(tmp_path, capsys, device):
    def poisoned(t, model, fed, args, state, ctx):
        losses = fedavg.fedavg_round(t, model, fed, args, state, ctx)
        if fed.name == "style1" and t == 3:
            c = next(iter(losses))
            losses[c] = torch.full_like(losses[c], float("nan"))           # on the run's device
        return losses
    out = str(tmp_path / "r.json")
    argv = QUICK + ["--out", out, "--device", device]
    line = fails(lambda a: harness.main(dataclasses.replace(fedavg.METHOD, round=poisoned), a),
                 argv, capsys, code=1)
    assert "non-finite loss in round 3, the mean over its 2 clients" in line     # (no client's own)
    assert "testing on style1" in line
    assert list(json.load(open(out))["domains"]) == ["style0"]        # the finished domain is kept
    blob = torch.load(Path(f"{out}.ckpt"), weights_only=True)
    assert (blob["domain"], blob["round"]) == ("style1", 2)            # the last good checkpoint


def test_scripts_fail_without_a_traceback(tmp_path):
    """What a user sees: real processes, one line, no traceback; a diverging run is caught."""
    for argv, code in ((["--dataset", "nope"], 2), (["--sample", "0"], 2),   # argparse's, ours
                       (QUICK + ["--lr", "1e30", "--test-domain", "0"], 1)):
        p = subprocess.run([sys.executable, str(HERE / "fedavg.py"), *argv,
                            "--out", str(tmp_path / "x.json")],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert p.returncode == code, p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "non-finite loss in round" in p.stderr


# Flags every method shares (data.py's and the harness's),
# through fedavg.py; each method's own refusals
# are in its section of test_methods.py.
@pytest.mark.parametrize("argv,message", [
    (["--dataset", "rmnist", "--no-rotation"],
     "--no-rotation applies to rcmnist and rcfmnist only, not rmnist"),
    (["--dataset", "rcmnist", "--p-test", "1.5"], "--p-test must be in [0, 1], got 1.5"),
    (["--dataset", "rcmnist", "--clients", "5"], "--clients 5 does not match the 4 clients"),
    (["--parallel-clients", "yes"], "argument --parallel-clients: invalid choice: 'yes'"),
])
def test_shared_flags_bad_input(argv, message, capsys):
    assert message in fails(fedavg.main, argv, capsys)


@pytest.mark.parametrize("argv, message", [
    (["--client-size", "0"], "--client-size must be positive, got 0"),
    (["--client-size", "-5"], "--client-size must be positive, got -5"),
    (["--client-size", "4501", "--clients", "1"],
     "--client-size 4501 x --clients 1 exceeds the 4,500 examples"),
    (["--client-size", "1000"],
     "--client-size 1000 x --clients 5 exceeds the 4,500 examples of the nine training "
                                "combinations (at most 900 per client)"),
    (["--clients", "0"], "--clients must be positive, got 0"),
    (["--clients", "3000"], "3000 clients leave 1 example(s) each: too few"),
    (["--clients", "4", "--sample", "5"], "--sample must be between 1 and --clients (4), got 5"),
])
def test_stained_client_size_bad_input(argv, message, tmp_path, capsys):
    out = ["--out", str(tmp_path / "r.json")]
    assert message in fails(fedavg.main, ["--dataset", "stained", "--rounds", "1"] + argv + out,
                            capsys)


def test_client_size_is_for_stained_only(tmp_path, capsys):
    out = ["--out", str(tmp_path / "r.json")]
    assert ("--client-size applies to stained only, not rmnist"
            in fails(fedavg.main, ["--client-size", "10"] + out, capsys))


def test_parallel_clients_auto_is_on_for_cuda_and_the_small_models_only():
    a = lambda **kw: type("A", (), dict(dict(parallel_clients="auto", device="cuda",
                                             dataset="mnist", model="cnn"), **kw))
    assert common.parallel(a()) and common.parallel(a(dataset="rmnist", model="convnet"))
    assert not common.parallel(a(device="cpu")) and not common.parallel(a(model="resnet18"))
    assert (not common.parallel(a(dataset="pacs", model="convnet"))
            and not common.parallel(a(parallel_clients="off")))
    assert common.parallel(a(device="cpu", parallel_clients="on"))
    for method, supported, expected in (("fedavg", True, "on"), ("perinvfl", False, "off")):
        args = a()
        spec = common.Method(method, "", None, parallel=supported)
        common.check_parallel(args, spec)                           # 'auto' resolved for the record
        assert args.parallel_clients == expected


@pytest.mark.parametrize("method,argv,message", [
    ("fedavg", ["--parallel-clients", "off"],
     "--compile compiles the step of the clients trained at once: add --parallel-clients on"),
    # auto is off here
    ("fedavg", ["--device", "cpu"], "add --parallel-clients on (the default on CUDA)"),
    ("perinvfl", ["--device", "cpu", "--parallel-clients", "auto"],
     "--compile: perinvfl trains its clients one after another unless --R 1"),
    ("fedipg", ["--local-step", "paper"],
     "--compile: fedipg trains with --local-step paper one client after another (sgd at once), "
     "and --compile compiles the step of clients")])
def test_compile_is_refused_in_one_line_where_no_step_compiles(method, argv, message, tmp_path,
                                                               capsys):
    line = fails(MAINS[method], ["--compile"] + argv + ["--out", str(tmp_path / "r.json")], capsys)
    assert line.startswith(f"{method}.py: error: ") and message in line
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.json.ckpt").exists()


# What a new user meets first: refusals that come at once and say why, --help, the first lines of a
# run, the progress line, data.py's download and fake tree.
MAINS = {"fedavg": fedavg.main, "fediir": fediir.main, "fedomg": fedomg.main, "fedloe": fedloe.main,
         "perinvfl": perinvfl.main, "fedipg": fedipg.main}

FEW = "leaves clients without a training and a validation example"

# Bad input a new user meets, refused in one line within a bound on the CPU time of the refusal
# (loading the data included: process time, so that a loaded machine does not fail the bound).
# argv may hold "{tree}": a fake PACS tree (make-fake),
# "{odd}": one with a stray class folder sketch/Dogs.
NEW_USER_BAD = [
    ("fediir", ["--clients", "5000", "--rounds", "1", "--test-domain", "0"],
     f"--clients 5000 {MINI} (--batch-size 64): testing on 0, the 5 training domains of rmnist "
     "hold 4,166 examples, enough for at most 55 clients", 1),
    ("fedavg", ["--clients", "5000", "--rounds", "1"], f"--clients 5000 {MINI}", 1),
    ("fedavg", ["--clients", "100000"], f"--clients 100000 {MINI}", 1),
    # the exact edge
    ("fedavg", ["--clients", "56", "--test-domain", "0"], "enough for at most 55 clients", 1),
    # a batch above every training domain asks for full-batch
    # steps: a client needs a training and a validation example
    # (that rule's edge)
    ("fedavg", ["--clients", "2082", "--test-domain", "0", "--batch-size", "1000"],
     f"{FEW}: testing on 0, the 5 training domains of rmnist hold 4,166 examples, enough for at "
     "most 2,081 clients", 1),
    ("fedipg", ["--clients", "5000"], f"--clients 5000 {MINI}", 1),
    ("fedloe", ["--clients", "5000"], f"--clients 5000 {MINI} (--batch-size 128)", 1),
    ("fedomg", ["--dataset", "synthetic", "--clients", "400"], "--clients 400 " + MINI, 1),
    ("fedavg", ["--dataset", "pacs", "--data-root", "{tree}", "--clients", "10", "--no-pretrained"],
     f"--clients 10 {FEW}: testing on art_painting, the 3 training domains of pacs hold 21 "
     "examples, enough for at most 9", 1),
    ("fedomg", ["--dataset", "mnist", "--clients", "100000"],
     "--clients 100000: 5,000 examples cannot give every client 3 (a training, a validation and a "
     "test example at least); use at most 1,666 clients", 1),
    ("fedomg", ["--dataset", "mnist", "--clients", "6000"], "use at most 1,666 clients", 1),
    ("perinvfl", ["--dataset", "mnist", "--clients", "100000"], "use at most 1,666 clients", 1),
    ("fedavg", ["--dataset", "mnist", "--clients", "-3"], "--clients must be positive, got -3", 1),
    ("fedavg", ["--clients", "0"], "--clients must be positive, got 0", 1),
    ("fedavg", ["--dataset", "mnist", "--alpha", "0.0001"],
     "no Dirichlet(0.0001) split of 5000 examples over 100 clients gives every client 3 examples",
     10),   # 1,000 draws
    ("fedavg", ["--dataset", "pacs", "--data-root", "{odd}", "--no-pretrained", "--rounds", "1",
                "--test-domain", "0"],
     "class folders named as none of pacs's classes (dog, elephant, giraffe, guitar, horse, house, "
     "person): ", 1),
]


@pytest.mark.parametrize("method,argv,message,cpu_seconds", NEW_USER_BAD, ids=[
    "fediir-5000", "fedavg-5000", "fedavg-100000", "fedavg-56-edge", "fedavg-2082-full-batch-edge",
    "fedipg-5000", "fedloe-5000", "synthetic-400",
    "pacs-fake-10", "mnist-100000", "mnist-6000", "perinvfl-mnist-100000", "mnist-negative", "zero",
    "mnist-alpha-tiny",
    "pacs-stray-class"])
def test_new_user_bad_input_is_one_line_at_once(method, argv, message, cpu_seconds, tmp_path,
                                                capsys):
    trees = {"{tree}": lambda: fake_pacs(tmp_path / "t"),
             "{odd}": lambda: fake_pacs(tmp_path / "o", odd="sketch/Dogs")}
    argv = [trees[a]() if a in trees else a for a in argv] + ["--out", str(tmp_path / "r.json")]
    capsys.readouterr()
    t = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # numpy's warnings would be
                                                           # a second line on stderr
        line = fails(MAINS[method], argv, capsys)
    assert time.process_time() - t < cpu_seconds
    assert message in line and line.startswith(f"{method}.py: error: ")
    assert not (tmp_path / "r.json.ckpt").exists()


@pytest.mark.parametrize("earlier", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.parametrize("poison_at,named,how", [
    (("style0", 1), (), "loss"),                              # before any checkpoint: none is named
    (("style0", 3), ("checkpoint",), "loss"),                   # after the round-2 checkpoint
    (("style1", 1), ("checkpoint", "results"), "loss"),         # style0 finished: both
    (("style0", 3), ("checkpoint",), "raise"),        # a method's own check (FedLOE's φ) in round 3
])
def test_non_finite_names_only_the_files_this_run_wrote(poison_at, named, how, earlier, tmp_path,
                                                        capsys):
    """A run stopped by a non-finite number names only what it wrote. Over an earlier, different
    result (--overwrite) it wrote no results and its checkpoint is <out>.next.ckpt: the earlier
    result and checkpoint stay as they were."""
    out = tmp_path / "r.json"
    if earlier:
        fedavg.main(QUICK + ["--rounds", "2", "--out", str(out)])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def poisoned(t, model, fed, args, state, ctx):
        if how == "raise" and (fed.name, t) == poison_at:
            raise harness.runner.NonFinite(f"non-finite server weights in round {t}")
        losses = fedavg.fedavg_round(t, model, fed, args, state, ctx)
        if (fed.name, t) == poison_at:
            c = next(iter(losses))
            losses[c] = torch.full_like(losses[c], float("nan"))
        return losses
    line = fails(lambda a: harness.main(dataclasses.replace(fedavg.METHOD, round=poisoned), a),
                 QUICK + ["--out", str(out)] + ["--overwrite"] * earlier, capsys, code=1)
    assert (f"non-finite {'loss' if how == 'loss' else 'server weights'} in round {poison_at[1]}"
            in line)
    ckpt = f"{out}.next.ckpt" if earlier else f"{out}.ckpt"
    assert (f"the last good checkpoint ({ckpt})" in line) == ("checkpoint" in named)
    assert (f"the results of the finished test domains ({out})" in line) == (
        "results" in named and not earlier)
    assert ("nothing of this run was saved" in line) == (not named)
    if earlier:
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before


def help_text(method, argv, capsys):
    with pytest.raises(SystemExit) as e, mock.patch.dict(os.environ, COLUMNS="2000"):  # no wrapping
        MAINS[method](argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("method,dataset", [("fedavg", "rmnist"), ("fediir", "pacs"),
                                            ("fedomg", "pacs"), ("fedomg", "mnist"),
                                            ("fedloe", "rmnist"), ("perinvfl", "rcmnist"),
                                            ("fedipg", "stained")])
def test_help_gives_each_default_once(method, dataset, capsys):
    text = help_text(method, ["--dataset", dataset], capsys)
    blocks = flag_blocks(text)
    assert "(default: None)" not in text and "(default: False)" not in text
    for flag, help_ in blocks.items():
        assert help_.lower().count("default") <= 1, help_
        assert flag == "-h" or len(help_) > len(flag) + 12, f"{flag} has no help"
    title = "".join(MAINS[method].__globals__["__doc__"].strip().split("\n\n")[0].split())
    assert "".join(text.split()).count(title) == 1                       # the whole first paragraph
    assert ("Defaults for --dataset rmnist; those of every dataset: docs/protocol.md"
            in " ".join(text.split()))
    assert text == help_text(method, [], capsys)          # no probe of the command line:
                                                          # --dataset changes nothing


def test_help_shows_rmnists_defaults_the_methods_own_first(capsys):
    rmnist = flag_blocks(help_text("fedomg", [], capsys))
    assert (rmnist["--lr"].endswith("(default for rmnist: 0.01)")
            and rmnist["--local-epochs"].endswith("(default for rmnist: 1)"))
    assert (rmnist["--seed"].startswith("--seed SEED seeds the data split")
            and rmnist["--seed"].endswith("(default: 0)"))
    assert rmnist["--device"].endswith("auto: cuda if one is visible, else cpu (default: auto)")
    assert "default results/<method>-<dataset>-<test domain>-seed<seed>-<digest" in rmnist["--out"]
    loe = flag_blocks(help_text("fedloe", [], capsys))
    assert loe["--rounds"].endswith("(default for rmnist: 12)")             # K1 + K2, by its derive
    assert loe["--sample"].endswith("(default for rmnist: all)")
    assert loe["--clients"].endswith("(default for rmnist: 20)")
    assert loe["--lr"].endswith("(default for rmnist: 0.001)")     # FedLOE's own, not rmnist's 0.01
    assert flag_blocks(help_text("fedavg", [], capsys))["--sample"].endswith(
        "(default: per dataset, see docs/protocol.md)")


def test_dataset_defaults_take_the_methods_row_then_its_star_row_then_the_datasets():
    omg = common.table(fedomg.METHOD, "pacs")
    # pacs': 100
    assert (omg["lr"], omg["local_epochs"], omg["global_lr"], omg["rounds"]) == (1e-3, 5, 0.5, 100)
    loe = common.table(fedloe.METHOD, "officehome")
    assert (loe["lr"], loe["clients"], loe["batch_size"], loe["rounds"]) == (3e-5, 20, 128, 100)
    assert common.table(fedavg.METHOD, "mnist") == common.PROTOCOL["mnist"]


@pytest.mark.parametrize("method", METHODS)
def test_help_shows_the_defaults_a_run_resolves(method, tmp_path, capsys):
    """Every value --help gives as a default is the one a run on rmnist (the default --dataset)
    takes: the flag's own, or the tables' after resolve and the method's check()."""
    dataset = "rmnist"
    blocks = flag_blocks(help_text(method, [], capsys))
    module = importlib.import_module(method)
    p = config.parser(module.METHOD)
    args = resolved_args(module, ["--dataset", dataset], tmp_path)
    shown = 0
    for act in p._actions:
        m = re.search(r"\(default(?: for (\w+))?: ([^()]*)\)$",
                      blocks.get(act.option_strings[-1], "") if act.option_strings else "")
        own = re.sub(r" \(default[^()]*\)$", "", act.help or "")     # the help before the default
        # the method's own words, or given here, or resolved from other flags / the machine
        if (not m or m.group(2).startswith(("set by", "per dataset", "none"))
                or "default" in own.lower()
                or act.dest in ("dataset", "device", "parallel_clients")):
            continue
        assert m.group(1) in (None, dataset)
        assert m.group(2) == str(getattr(args, act.dest)), (act.dest, m.group(2),
                                                            getattr(args, act.dest))
        shown += 1
    assert shown >= 10


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_line_every_round_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    argv = QUICK[:2] + ["--rounds", "5", "--eval-every", "5", "--test-domain", "0"]
    run(fedavg.main, argv, tmp_path, "plain.json")
    plain = capsys.readouterr().out
    assert "\r" not in plain and "\x1b" not in plain              # a log file gets the lines it had
    assert re.search(r"\nround    5/5 \| val [\d.]+ \| test [\d.]+ \| mean loss \(rounds 1-5\) "
                     r"[\d.]+ \| [\d.]+ s/round \| "
                     r"ETA 0m00s\n", plain)
    screen = Terminal()
    monkeypatch.setattr("sys.stdout", screen)
    run(fedavg.main, argv, tmp_path, "tty.json")
    text = screen.getvalue()
    for t in range(1, 5):                                 # rounds without evaluation: one line each
        assert re.search(rf"\r\x1b\[Kround    {t}/5 \| round loss [\d.]+ \| [\d.]+ s/round \| ETA "
                         r"\dm\d\ds", text)
    # the evaluation line erases it first
    assert re.search(r"ETA \dm\d\ds\r\x1b\[Kround    5/5 \| val", text)
    assert text.replace("\r\x1b[K", "").count("\n") == plain.count("\n")  # no other line added
    assert json.loads((tmp_path / "tty.json").read_text())["domains"]["style0"]["test_acc"] == \
        json.loads((tmp_path / "plain.json").read_text())["domains"]["style0"]["test_acc"]


def test_fixed_client_refusals_are_one_line(tmp_path, capsys):
    """What still refuses on fixed clients, each in one line: a --sample below P, a client too small
    for a train/tune split, and the spawn diagnostic (it needs a held-out domain)."""
    out = ["--out", str(tmp_path / "x.json")]
    assert "fedloe uses every client" in fails(fedloe.main, ["--dataset", "mnist", "--sample", "20"]
                                               + out, capsys)
    assert "too few for a train/tune split" in fails(fedloe.main, ["--dataset", "mnist"] + out,
                                                     capsys)
    assert ("leave-one-domain-out datasets only, not rcmnist"
            in fails(fedloe_spawn.main, RC_ARGV + out, capsys))


def fixed_resolved(module, name, defaults, tmp_path):
    return resolved_args(module, ["--dataset", name], tmp_path)


def test_fixed_client_defaults_follow_fedavgs_default_run(tmp_path):
    """The docstring's rule on every fixed-client dataset: E1 = 32·K1 (Table 5's 256 / 8 epochs
    between averages), K1 the whole number nearest to 1/32 of the local epochs a client trains in
    FedAvg's default run (rounds × local epochs × sample / clients); model, batch, weight decay and
    clients as FedAvg's."""
    for name in data.FL + data.FIXED:
        fa, loe = (fixed_resolved(fedavg, name, None, tmp_path),
                   fixed_resolved(fedloe, name, fedloe.DEFAULTS, tmp_path))
        per_client = fa.rounds * fa.local_epochs * fa.sample / fa.clients
        assert (loe.stage1_comms == round(per_client / 32) and loe.stage1_epochs == 32
                * loe.stage1_comms), name
        assert [getattr(loe, k) for k in ("model", "batch_size", "weight_decay", "clients")] == \
            [getattr(fa, k) for k in ("model", "batch_size", "weight_decay", "clients")], name
        assert loe.sample == "all" and loe.local_epochs == 32             # every client, each round


def print_config(main, argv, capsys, note=False):
    """{flag: its line} of --print-config's table, which must exit 0 (note: and the line before the
    table that says the data was loaded, or None)."""
    with pytest.raises(SystemExit) as e:
        main(argv + ["--print-config"])
    assert e.value.code == 0
    out = capsys.readouterr().out.splitlines()        # (after a note the data prints as it loads)
    head = [k for k, line in enumerate(out) if line.endswith(": every value of the run, and where "
                                                             "it comes from")]
    said = out[head[0] + 1] if out[head[0] + 1].startswith("(loaded the data") else None
    table = out[head[0] + 1 + bool(said):]
    assert len(head) == 1 and all(line.startswith("  --") for line in table), out
    rows = {line.split()[0]: line for line in table}
    return (rows, said) if note else rows


def test_print_config_gives_every_value_and_where_it_comes_from(tmp_path, capsys, monkeypatch):
    """--print-config: every argument a run resolves, its value and its source (the command line or
    its default, the method's table for the dataset or for every dataset, the shared table, a rule,
    or the data), and nothing written (the data loaded only where it settles a count: below)."""
    monkeypatch.chdir(tmp_path)
    rows = print_config(fedomg.main, ["--lr", "0.02"], capsys)
    args = harness.resolve(fedomg.METHOD, ["--lr", "0.02", "--out", str(tmp_path / "r.json")])
    assert set(rows) == {f"--{k.replace('_', '-')}" for k in vars(args)
                         if k not in ("alpha", "p_test", "no_rotation", "stain", "client_size")}
    assert rows["--lr"].split()[1:] == ["0.02", "command", "line"]
    assert rows["--global-lr"].split()[1] == "auto" and rows["--global-lr"].endswith(
        "fedomg's table, every dataset; auto: U (1 + κ²), U the clients sampled in the round "
        "(eta_g)")
    assert rows["--kappa"].endswith("fedomg's table, every dataset")
    assert rows["--batch-size"].endswith("shared table, rmnist")
    assert rows["--seed"].endswith("the command line's default")
    assert "rule: auto" in rows["--device"] and "rule: auto" in rows["--parallel-clients"]
    assert rows["--clients"].endswith("rule: the data, one client per training domain "
                                      "(docs/protocol.md: Federation)")
    rows = print_config(fedomg.main, ["--dataset", "pacs", "--data-root",
                                      fake_pacs(tmp_path / "d")], capsys)
    assert rows["--global-lr"].split()[1] == "0.5" and rows["--global-lr"].endswith(
        "fedomg's table, pacs")
    rows = print_config(fediir.main, [], capsys)
    assert rows["--lr"].split()[1:] == ["0.01", "shared", "table,", "rmnist"]    # FedIIR's Table 3
    rows = print_config(fedloe.main, [], capsys)
    assert rows["--rounds"].endswith("rule: fedloe's derive (rounds from other flags)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and not Path("results").exists()


def test_print_config_settles_the_counts_from_the_data(tmp_path, capsys, monkeypatch):
    """Where neither the command line nor a table settles --clients, --sample (and stained's
    --client-size), --print-config loads the data as a run does, says so before the table, and
    shows the counts the run would use; where they are settled it loads nothing. A dataset it
    cannot load, or counts the data refuses: one line, exit 2, nothing printed."""
    out = ["--out", str(tmp_path / "r.json")]
    for method, argv, settled in ((fediir, [], "--clients and --sample"),
                                  (fedavg, ["--dataset", "stained", "--client-size", "300"],
                                   "--clients and --sample"),
                                  (fedavg, ["--dataset", "stained", "--stain", "both"],
                                   "--clients, --sample and --client-size"),
                                  (fedloe, ["--dataset", "rmnist", "--clients", "10"], "--sample")):
        rows, note = print_config(method.main, argv, capsys, note=True)
        assert note.startswith(f"(loaded the data to settle {settled}: "), note
        args = harness.resolve(method.METHOD, argv + out)
        common.after_load(args, common.load_data(args))                      # as the run does
        for k in ("clients", "sample", "client_size"):
            if args.dataset == "stained" or k != "client_size":
                assert rows[f"--{k.replace('_', '-')}"].split()[1] == str(getattr(args, k)), k
    rows = print_config(fediir.main, [], capsys)
    assert [rows[f].split()[1:3] for f in ("--clients", "--sample")] == [["5", "rule:"]] * 2
    assert rows["--clients"].endswith("rule: the data, one client per training domain "
                                      "(docs/protocol.md: Federation)")
    assert rows["--sample"].endswith("rule: the data, min(--clients, training domains) "
                                     "(docs/protocol.md: Federation)")
    rows = print_config(fedavg.main, ["--dataset", "stained", "--stain", "bg"], capsys)
    assert rows["--clients"].split()[1] == "5" and rows["--clients"].endswith(
        "rule: Section VI-C's for --stain bg (data.STAINED) (docs/protocol.md: Federation)")
    assert rows["--sample"].endswith("shared table, stained; all: every client")
    monkeypatch.setattr(data, "load", lambda *a, **k: pytest.fail("--print-config loaded data"))
    for method, argv in ((fediir, ["--clients", "10", "--sample", "3"]),
                         (fedomg, ["--dataset", "mnist"]), (fedavg, ["--dataset", "rcmnist"]),
                         (fedavg, ["--dataset", "stained", "--clients", "4", "--sample", "2",
                                   "--client-size", "100"])):
        rows, note = print_config(method.main, argv, capsys, note=True)
        assert note is None and rows["--clients"].split()[2:] in (["command", "line"],
                                                                  ["shared", "table,", "mnist"],
                                                                  ["shared", "table,", "rcmnist"])
    monkeypatch.undo()
    for main, argv, line in (
            (fedavg.main, ["--dataset", "pacs"], "pacs needs --data-root DIR holding "
             "PACS/<domain>/<class>/<images>; get it with: python -m harness.datasets --download "
             "pacs --data-root DIR"),
            (fedavg.main, ["--dataset", "pacs", "--data-root", str(tmp_path)],
             f"{tmp_path}/PACS not found; get it with: python -m harness.datasets --download pacs "
             f"--data-root {tmp_path} (or lay out any copy as PACS/<domain>/<class>/<images>)"),
            (fedloe.main, ["--dataset", "synthetic"], "--clients 20 leaves clients fewer "
             "training examples than one minibatch (--batch-size 128)")):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--print-config"])
        std = capsys.readouterr()
        err = std.err.splitlines()
        assert e.value.code == 2 and std.out == "" and len(err) == 1 and line in err[0], std.err


@pytest.mark.parametrize("dataset,own", [
    ("rmnist", []), ("synthetic", []), ("mnist", ["--alpha"]), ("cifar10", ["--alpha"]),
    ("rcmnist", ["--p-test", "--no-rotation"]), ("rcfmnist", ["--p-test", "--no-rotation"]),
    ("waterbird", ["--p-test"]), ("stained", ["--client-size", "--stain"])])
def test_print_config_leaves_out_the_flags_of_other_datasets(dataset, own, capsys):
    """A flag of the dataset's own (data.load's, check_data_args's) is shown only where it applies:
    --alpha for the label-skew datasets, --p-test for rcmnist, rcfmnist and waterbird,
    --no-rotation for the first two, --stain and --client-size for stained."""
    args = harness.resolve(fedavg.METHOD, ["--dataset", dataset])      # (no data loaded)
    config.print_config(fedavg.METHOD, args, {})              # the table that --print-config prints
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("  --")}
    theirs = ["--alpha", "--p-test", "--no-rotation", "--stain", "--client-size"]
    assert sorted(f for f in theirs if f in rows) == sorted(own)
    assert {"--dataset", "--clients", "--sample", "--lr", "--uniform-avg"} <= set(rows)


def test_auto_is_a_value_only_where_the_method_has_its_rule(tmp_path, capsys):
    """FedOMG's η_g takes "auto" (its rule: eta_g) in its table and on the command line; a method
    without a rule for it refuses the word in one line, as any non-number."""
    out = ["--out", str(tmp_path / "r.json")]
    assert harness.resolve(fedomg.METHOD, ["--global-lr", "auto"] + out).global_lr == "auto"
    assert harness.resolve(fedomg.METHOD, ["--global-lr", "0.3"] + out).global_lr == 0.3
    assert fails(fedavg.main, ["--global-lr", "auto"], capsys) == (
        "fedavg.py: error: argument --global-lr: expects a number, got 'auto'")
    assert fomg_eta(4, "auto") == 4 * 1.25 and fomg_eta(4, 0.7) == 0.7


def fomg_eta(U, global_lr):
    return fedomg.eta_g(argparse.Namespace(global_lr=global_lr, kappa=0.5), U)


def test_a_test_domain_is_checked_before_any_data_loads(tmp_path, capsys, monkeypatch):
    """--test-domain against the dataset's domains before the data loads (nothing is claimed or
    written): by their names (rmnist, synthetic, stained), a photo dataset's by its folders."""
    fake_pacs(tmp_path / "d")
    monkeypatch.setattr(data, "load", lambda *a, **k: pytest.fail("the data loaded"))
    out = ["--out", str(tmp_path / "o" / "r.json")]
    for argv, names in ((["--test-domain", "99"], "0, 15, 30, 45, 60, 75 or an index 0..5"),
                        (["--dataset", "synthetic", "--test-domain", "style9"],
                         "style0, style1, style2 or an index 0..2"),
                        (["--dataset", "stained", "--test-domain", "10"],
                         "c8, c9 or an index 0..9"),
                        (["--dataset", "pacs", "--data-root", str(tmp_path / "d"), "--test-domain",
                          "painting"], "art_painting, cartoon, photo, sketch or an index 0..3")):
        line = fails(fedavg.main, argv + out, capsys)
        assert line.startswith("fedavg.py: error: unknown test domain") and line.endswith(names)
    assert not (tmp_path / "o").exists()
