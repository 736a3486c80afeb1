"""The tests of the six methods: pytest -q -n auto runs them with the core's (tests/), the
harness's, benchmark/'s and the docs' tests (no GPU, no network; under five minutes on 2 CPU cores).

First what every method shares (each copied alone with common.py and data.py; its clients at once
against one after another), then one section per method: its numerics against a hand computation
or the authors' code, its plain functions copied, its defaults, its refusals. Shared helpers:
tests/helpers.py.
"""

import argparse
import copy
import dataclasses
import functools
import inspect
import json
import math
import re
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import common
import data
import fedavg
import fediir
import fedipg
import fedloe
import fedomg
import perinvfl
import harness
from harness import config, datasets, outputs
import fedomg_readings as readings
import perinvfl_variants as pv

from tests.helpers import (
    ARGS, as_federation, as_floats, assert_same_to_tolerance, both_ways, ce, copied,
    copied_fediir_rounds, copied_perinvfl_rounds, F64, fails, final_theta, flat,
    full_batch_step, FUNCTIONS, grad_by_hand, HERE, history_losses, hold, IIR,
    interrupted_then_resumed, IPG, ipg_args, irm_derivative_by_hand, irm_penalty_by_hand, load,
    LOE, LOE_FUNCTIONS, loe_own_rounds, loe_split, max_abs, max_diff, method_args,
    method_rounds, METHODS, on_every_device, own_local_sgd, own_model, own_rounds,
    perinvfl_rounds, pinv_args, pinv_copied, pinv_flags, pinv_setup, PLAIN, QUICK, R, RC_ARGV,
    read, refused, rel, resolved_args, rows, run, SGD, SIZES, smallconv, split, streams,
    strip_times,
    thetas, three_clients, tiny, tiny_args, tiny_ctx, tiny_federation, tiny_model, TINY_TOL,
    with_solver,
)


# ==================================================================================================
# Every method
# ==================================================================================================

# A method copied into another codebase: its file, common.py and data.py in an empty folder, run by
# a fresh interpreter that sees nothing of this checkout (-E: no PYTHONPATH; the folder alone on
# the path). The run's settings come from one call, common.settings (the method's tables and the
# protocol's, as the command line resolves them); then one round through common.rounds. The
# harness is never imported.
COPY_RUN = """
import math, pathlib, sys
import torch
import {method} as m
import common, data

here = pathlib.Path(__file__).resolve().parent
assert {{pathlib.Path(mod.__file__).resolve().parent for mod in (m, common, data)}} == {{here}}
args = common.settings(m.METHOD, "synthetic", clients=2, sample=2, eval_every=1, device="cpu")
ds = data.load("synthetic")
fed = data.federate(ds, 0, args.clients, args.seed, "cpu")
model = common.global_model(args, ds, torch.device("cpu"))
before = common.get_flat(model)
t, losses, scores = next(common.rounds(m.METHOD, model, fed, args))
loss = torch.stack(list(losses.values())).mean().item()
assert t == 1 and math.isfinite(loss) and 0 <= scores[1] <= 1, (t, loss, scores)
assert not torch.equal(common.get_flat(model), before)
assert not [k for k in sys.modules if k == "harness" or k.startswith("harness.")]
print("round 1:", loss, scores[:2])
"""
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def copied_alone(folder, *names, assets=False):
    """The files `names` of the checkout copied into `folder` (assets/: the embedded digits)."""
    for name in names:
        shutil.copy(HERE / name, folder / name)
    if assets:
        shutil.copytree(HERE / "assets", folder / "assets")


def in_copy(folder, *argv):
    """python argv in `folder`, a fresh interpreter that sees nothing of the checkout."""
    return subprocess.run([sys.executable, "-E", "-s", *argv], cwd=folder, env=CLEAN,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_copied_alone_with_common_and_data(method, tmp_path):
    """The method file, common.py and data.py copied into an empty folder, one interpreter there:
    (1) the script of the method's page ("The whole round, in your own code"), as printed, runs
    the method's round on a model and clients of the user's own (tensors, not the project's
    datasets) with the method's and the protocol's defaults from common.settings, and trains (the
    last test accuracy above chance's 1/3 by a margin: 0.52-0.93 seen); (2) one round on synthetic
    data with common's model and common.rounds. Nothing of the harness is imported; nothing is
    written."""
    text = (HERE / "docs" / f"{method}.md").read_text()
    block = text.split("### The whole round, in your own code")[1].split("```python\n")[1]
    block = block.split("```")[0]
    assert f"common.settings({method}.METHOD, " in block and "common.rounds(" in block
    copied_alone(tmp_path, f"{method}.py", "common.py", "data.py")
    (tmp_path / "run_copy.py").write_text(block + COPY_RUN.format(method=method))
    p = in_copy(tmp_path, "run_copy.py")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    *own, last = p.stdout.splitlines()
    assert re.fullmatch(r"round \d+: validation 0\.\d{3}, test 0\.\d{3}", own[-1]), own
    assert float(own[-1].split()[-1]) > 0.45 and last.startswith("round 1:"), p.stdout
    listing = sorted(q.name for q in tmp_path.iterdir() if q.name != "__pycache__")
    assert listing == sorted([f"{method}.py", "common.py", "data.py", "run_copy.py"])


@pytest.mark.parametrize("method,argv", [
    ("perinvfl", ["--dataset", "rcmnist", "--rounds", "3", "--eval-every", "1"]),
    ("fedipg", ["--dataset", "rcmnist", "--rounds", "2", "--eval-every", "1", "--seed", "1"])])
def test_a_copied_method_runs_as_a_program_with_the_checkouts_numbers(method, argv, tmp_path):
    """Copied with common.py, data.py and assets/ alone, `python <method>.py` runs on the embedded
    digits with the paper's defaults (PerInvFL's and FedIPG's RC-MNIST) and prints, evaluation by
    evaluation, the accuracies the checkout's run writes at the same flags; it writes nothing."""
    copied_alone(tmp_path, f"{method}.py", "common.py", "data.py", assets=True)
    p = in_copy(tmp_path, f"{method}.py", *argv, "--device", "cpu")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    printed = [line for line in p.stdout.splitlines() if line.startswith("round ")]
    out = tmp_path / "checkout"
    out.mkdir()
    result, _ = run(globals()[method].main, argv + ["--device", "cpu"], out)
    history = result["domains"]["clients"]["history"]
    R = int(argv[argv.index("--rounds") + 1])
    assert printed == [f"round {h['round']:4d}/{R} | val {h['val_acc']:.4f} | test "
                       f"{h['test_acc']:.4f}" for h in history] and len(printed) == R
    assert f"{result['domains']['clients']['test_acc']:19.4f}" in p.stdout.splitlines()[-1]
    listing = sorted(q.name for q in tmp_path.iterdir()
                     if q.name not in ("__pycache__", "checkout"))
    assert listing == sorted([f"{method}.py", "common.py", "data.py", "assets"])


def test_a_copied_method_says_in_one_line_what_needs_the_harness(tmp_path):
    """In a copy, --help lists the method's flags and every setting with its default (nothing
    run); a flag of the harness's (a results file, --resume, ...) is one line and exit 2, before
    any work; --print-config prints the settings, the counts of clients from the data."""
    copied_alone(tmp_path, "fedomg.py", "common.py", "data.py", assets=True)
    p = in_copy(tmp_path, "fedomg.py", "--help")
    assert p.returncode == 0 and p.stderr == ""
    for said in ("--kappa", "searching radius κ (Table 4); default for rmnist: 0.5",
                 "--lr", "default for rmnist: 0.01", "--global-lr", "--sample", "from the data",
                 "--seed", "--no-pretrained", "no results file, checkpoint or --resume"):
        assert said in " ".join(p.stdout.split()), said
    p = in_copy(tmp_path, "fedomg.py", "--resume")                 # (the others: below)
    assert p.returncode == 2 and p.stdout == "" and p.stderr == (
        "fedomg.py: error: --resume needs the project's harness/ (results files, checkpoints, "
        "locks): this copy prints its numbers, writes none\n")
    p = in_copy(tmp_path, "fedomg.py", "--print-config", "--test-domain", "1")
    shown = dict(line.split(None, 1) for line in p.stdout.splitlines())
    assert p.returncode == 0 and (shown["--clients"], shown["--sample"]) == ("5", "5")
    assert (shown["--kappa"], shown["--global-lr"], shown["--lr"]) == ("0.5", "auto", "0.01")
    assert sorted(q.name for q in tmp_path.iterdir() if q.name != "__pycache__") == sorted(
        ["fedomg.py", "common.py", "data.py", "assets"])


@pytest.mark.parametrize("argv,line", [
    (["--lr", "abc"], "argument --lr: expects a number, got 'abc'"),
    (["--rounds", "2.5"], "argument --rounds: expects a whole number, got '2.5'"),
    (["--lr", "nan"], "argument --lr: expects a number, got 'nan'"),
    (["--sample", "most"], "argument --sample: expects a whole number or all, got 'most'"),
    (["--model", "vit"], "argument --model: invalid choice: 'vit'"),
    (["--lr", "-1"], "--lr must be positive, got -1.0"),
    (["--dataset", "cifar"], "unknown dataset 'cifar'"),
    (["--test-domain", "9"], "unknown test domain '9' for rmnist"),
    (["--kappa", "-1"], "--kappa must be >= 0, got -1.0"),
    (["--kappa", "inf"], "argument --kappa: expects a number, got 'inf'"),
    (["--clients", "2"], "--clients 2 is below the 5 training domains"),
    (["--nope"], "unrecognized arguments: --nope"),
    *[(flag.split(), f"{flag.split()[0]} needs the project's harness/ (results files, checkpoints, "
       f"locks): this copy prints its numbers, writes none") for flag in (
           "--resume", "--out r.json", "--overwrite", "--allow-code-change",
           "--checkpoint-minutes 1")]])
def test_a_copied_methods_program_refuses_bad_input_in_one_line(argv, line, capsys):
    """common.program, the program of a method file copied without the harness: bad input, and a
    flag of the harness's, is one line on stderr, exit 2, before any training (the data loads
    where it settles a count)."""
    with pytest.raises(SystemExit) as e:
        common.program(fedomg.METHOD, argv + ["--device", "cpu"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "round" not in out, err
    assert err.startswith(f"fedomg.py: error: {line}"), err


def test_a_copied_methods_program_stops_in_one_line(capsys):
    """common.program once training has begun: a Ctrl-C (KeyboardInterrupt), a non-finite loss or
    model after the server's step, and a method's refusal each end it in one line on stderr (exit
    130, 1, 1, 2), no traceback; a round that runs prints its evaluation."""
    def stopped(t, *a):
        raise KeyboardInterrupt

    def nan(t, model, *a):
        return {0: torch.tensor(float("nan"))}

    def nan_model(t, model, *a):
        common.set_flat(model, common.get_flat(model) * float("nan"))
        return {0: torch.tensor(1.0)}

    def refuses(t, *a):
        raise data.UserError("lower --exit-L")

    argv = ["--dataset", "synthetic", "--test-domain", "0", "--rounds", "1", "--device", "cpu"]
    nonfinite = "error: non-finite loss or model after round 1 (testing on style0)"
    for fn, code, line in ((stopped, 130, "interrupted; nothing was saved (a copy writes no "
                            "checkpoint)"), (nan, 1, nonfinite), (nan_model, 1, nonfinite),
                           (refuses, 2, "error: lower --exit-L")):
        with pytest.raises(SystemExit) as e:
            common.program(dataclasses.replace(fedavg.METHOD, round=fn), argv)
        out, err = capsys.readouterr()
        assert e.value.code == code and err == f"fedavg.py: {line}\n", err
    done = common.program(fedavg.METHOD, argv + ["--eval-every", "1"])
    assert "round    1/1 | val " in capsys.readouterr().out and list(done) == ["style0"]


def test_settings_in_one_call_are_the_command_lines():
    """common.settings(method, dataset, **given) gives what harness.resolve gives for the command
    line naming the same values (the harness's own flags aside), for every method on datasets of
    each protocol; a name no setting has is a TypeError, a bad value the command line's line."""
    cases = [("rmnist", {}), ("synthetic", {"rounds": 3, "lr": 0.5}), ("synthetic", {"lr": 0.5}),
             ("stained", {}), ("rcmnist", {"seed": 3}), ("mnist", {"alpha": 0.5}),
             ("pacs", {"model": "resnet18"}), ("rmnist", {"test_domain": 2, "sample": 3})]
    own = {"out", "resume", "overwrite", "allow_code_change", "checkpoint_minutes"}
    for module in (fedavg, fediir, fedomg, fedloe, perinvfl, fedipg):
        for dataset, given in cases:
            argv = ["--dataset", dataset, "--device", "cpu"]
            argv += [a for k, v in given.items() for a in (f"--{k.replace('_', '-')}", str(v))]
            try:                 # (FedLOE refuses --rounds and --sample: the same line, both)
                want = {k: v for k, v in vars(resolved_args(module, argv)).items()
                        if k not in own}
            except data.UserError as e:
                want = str(e)
            try:
                got = vars(common.settings(module.METHOD, dataset, device="cpu", **given))
            except data.UserError as e:
                got = str(e)
            assert got == want, (module.__name__, dataset)
            assert isinstance(want, dict) or module is fedloe, want
    with pytest.raises(TypeError, match="no setting named round"):
        common.settings(fedavg.METHOD, round=3)
    for given, line in (({"kappa": math.inf}, "--kappa must be a finite number, got inf"),
                        ({"parallel_clients": "yes"}, "--parallel-clients must be one of auto, "
                         "on, off, got 'yes'"),
                        ({"rounds": "20"}, "--rounds expects a number, got '20'"),
                        ({"sample": "most"}, "--sample expects a number, got 'most'"),
                        ({"select": "best"}, "--select must be one of val, last, got 'best'")):
        with pytest.raises(data.UserError) as e:
            common.settings(fedomg.METHOD, **given)
        assert str(e.value) == line
    with pytest.raises(data.UserError, match="--global-lr expects a number, got 'auto'"):
        common.settings(fedavg.METHOD, global_lr="auto")        # (FedOMG's rule: FedOMG's alone)
    with pytest.raises(data.UserError, match="--lr must be positive, got -1"):
        common.settings(fedavg.METHOD, lr=-1)
    with pytest.raises(data.UserError, match="--kappa must be >= 0"):
        common.settings(fedomg.METHOD, "pacs", kappa=-1)


def test_copied_reaches_for_nothing_of_the_project():
    """The harness itself: a function that names common fails when copied."""
    def leaky(theta):
        return common.get_flat(theta)
    mod = types.ModuleType("m")
    mod.leaky = leaky
    with pytest.raises(NameError):
        copied(mod, "leaky").leaky(torch.zeros(1))


# Through main(), 4 rounds (QUICK) at lr 0.01: max |Δθ_T| between --parallel-clients off and on,
# and the relative difference of the logged losses (float32 running sums, see `float64`), measured
# on a 2-core Intel Xeon at 1 and 2 threads (torch 2.14):
#                        float64       float32                float32 tolerance
#   FedIIR (γ 1, v 0.5)  1e-13 holds   θ 1.6e-6, loss 0       θ 2e-5 (12x), loss 1e-5
#   FedIPG (sgd, λ 5)    1e-13 holds   θ 1.5e-8, loss 1.3e-7  θ 2e-7 (13x), loss 2e-6 (15x)
# At the synthetic default lr 0.05 float32 training is chaotic: a ReLU or max-pool switch amplifies
# the rounding about 40x a round (FedIIR θ 1.5e-8 after round 1, 3.7e-6 after 3, 1.4e-4 after 4;
# FedIPG 4.3e-5), while float64 holds the two paths to 1e-13 whatever the lr. So the float32 check
# runs where it measures rounding, not a kink.
PARALLEL_RUN_TOL = {"fediir": {torch.float32: (2e-5, 1e-5), torch.float64: (1e-13, 1e-6)},
                    "fedipg": {torch.float32: (2e-7, 2e-6), torch.float64: (1e-13, 1e-6)}}


@pytest.mark.parametrize("main,extra", [(fediir.main, IIR), (fedipg.main, IPG)],
                         ids=["fediir", "fedipg"])
def test_parallel_run_matches_sequential_and_resumes_to_the_uninterrupted_numbers(
        main, extra, tmp_path, monkeypatch, dtype):
    argv = QUICK + ["--model", "cnn", "--clients", "4", "--sample", "3", "--test-domain", "0",
                    "--batch-size", "16",
                    "--lr", "0.01", "--device", "cpu"] + extra  # the tolerances:
                                                                # measured on the CPU
    seq, seq_out = run(main, argv + ["--parallel-clients", "off"], tmp_path, "seq.json")
    full, full_out = run(main, argv + ["--parallel-clients", "on"], tmp_path, "full.json")
    assert full["args"]["parallel_clients"] == "on"
    theta_tol, loss_tol = PARALLEL_RUN_TOL[main.__module__][dtype]
    assert (torch.load(full_out + ".ckpt", weights_only=True)["model"]["classifier.weight"].dtype
            == dtype)
    assert max_diff(final_theta(full_out), final_theta(seq_out)) < theta_tol      # θ after 4 rounds
    assert torch.allclose(history_losses(full), history_losses(seq), rtol=loss_tol, atol=0)
    if dtype == torch.float64:
        return                                           # resuming: bit for bit, checked in float32
    resumed = interrupted_then_resumed(main, argv + ["--parallel-clients", "on"],
                                       str(tmp_path / "cut.json"),
                                       monkeypatch, lambda blob: blob["round"] == 2)
    assert strip_times(resumed) == strip_times(full)
    assert torch.equal(final_theta(str(tmp_path / "cut.json")), final_theta(full_out))


# ==================================================================================================
# fedavg.py
# ==================================================================================================

# The round against the same steps written by hand: float64 (the `dtype` fixture, below) agrees to
# 2.8e-17 (tolerance 1e-12); float32 measured at most
# 1.5e-8 at 1 and 2 threads (AMD EPYC), tolerance
# atol 1e-6 (plus rtol 1e-5: 140x).
@pytest.mark.parametrize("uniform,global_lr", [(False, 1.0), (False, 0.3), (True, 1.0)])
def test_fedavg_round_is_weighted_mean_of_deltas(uniform, global_lr, dtype):
    fed, model = tiny_federation(), tiny_model()
    theta = common.get_flat(model)
    expected_deltas = [full_batch_step(model, c, 0.5) - theta for c in fed.clients]
    w = [1.0, 1.0] if uniform else [6.0, 10.0]
    expected = theta + global_lr * (w[0] * expected_deltas[0] + w[1] * expected_deltas[1]) / sum(w)
    args = tiny_args(global_lr=global_lr, uniform_avg=uniform)
    losses = fedavg.fedavg_round(1, model, fed, args, {}, tiny_ctx(args, fed, model))
    assert list(losses) == [(0, 1)] and expected.dtype == dtype
    assert torch.allclose(common.get_flat(model), expected, **TINY_TOL[dtype])


def test_one_client_one_step_is_plain_sgd(dtype):
    fed, model = tiny_federation((8,)), tiny_model()
    expected = full_batch_step(model, fed.clients[0], 0.5)
    args = tiny_args(sample=1)
    fedavg.fedavg_round(1, model, fed, args, {}, tiny_ctx(args, fed, model))
    assert expected.dtype == dtype and torch.allclose(common.get_flat(model), expected,
                                                      **TINY_TOL[dtype])


def test_fedavg_synthetic_learns_and_writes_the_results_json(tmp_path):
    res, out = run(fedavg.main, QUICK, tmp_path)
    on_disk = json.load(open(out))
    assert on_disk == json.loads(json.dumps(res))
    assert set(on_disk) >= {"method", "dataset", "seed", "args", "domains", "mean_test_acc"}
    assert (on_disk["method"] == "fedavg" and on_disk["dataset"] == "synthetic" and on_disk["seed"]
            == 0)
    assert (list(on_disk["domains"]) == ["style0", "style1", "style2"]
            and on_disk["complete"] is True)
    for d in on_disk["domains"].values():
        assert set(d) == {"test_acc", "val_acc", "best_round", "last_test_acc", "history",
                          "train_examples"}
        assert d["train_examples"] == 2 * 240 - 2 * int(0.1 * 240)     # two training domains,
                                                                       # 10% held out
        assert [r["round"] for r in d["history"]] == [2, 4]
        assert all(set(r) == {"round", "val_acc", "test_acc", "loss", "seconds"}
                   for r in d["history"])
        secs = [r["seconds"] for r in d["history"]]
        assert 0 < secs[0] < secs[1]                                   # cumulative wall-clock
        best = max(d["history"], key=lambda r: r["val_acc"])
        assert d["best_round"] == best["round"] and d["test_acc"] == best["test_acc"]
        assert d["last_test_acc"] == d["history"][-1]["test_acc"]
        assert all(0 <= r[k] <= 1 for r in d["history"] for k in ("val_acc", "test_acc"))
    mean = sum(d["test_acc"] for d in on_disk["domains"].values()) / 3
    assert math.isclose(on_disk["mean_test_acc"], mean)
    assert mean > 0.6                                                  # 4 classes: chance is 0.25


def test_embedded_rmnist_above_chance(tmp_path):
    res, _ = run(fedavg.main, ["--rounds", "2", "--sample", "2", "--test-domain", "30"],
                 tmp_path)                                    # (2 of the 5 clients a round: 0.21)
    assert res["source"].startswith("embedded MNIST subset")
    assert res["domains"]["30"]["test_acc"] > 0.15          # 10 classes: chance is 0.1 (CUDA: 0.19)


@pytest.mark.parametrize("uniform", [False, True])
def test_fedavg_copied(uniform):
    """fedavg.server_update copied into a loop of the test's own (the clients sampled as the
    server's generator draws them, each client's minibatches from its own stream): θ after two
    rounds is fedavg_round's."""
    m = copied(fedavg, "server_update")
    clients = three_clients()
    model, sampler, gen = own_model(), torch.Generator().manual_seed(2), streams("client_update")
    theta = flat(model)
    for t in range(1, 3):
        S = sorted(torch.randperm(3, generator=sampler).tolist())
        delta_sum = torch.zeros_like(theta)
        for c in S:
            load(model, theta)
            theta_c = own_local_sgd(model, *clients[c], gen(t, c), 0.1, 0.9, 4, 2, ce)
            delta_sum += (1.0 if uniform else float(len(clients[c][1]))) * (theta_c - theta)
        n = sum(1.0 if uniform else float(len(clients[c][1])) for c in S)
        theta = m.server_update(theta, delta_sum, n, 1.0)
    expected = method_rounds(fedavg.fedavg_round, clients, 2, uniform_avg=uniform)
    assert torch.allclose(theta, expected, atol=1e-6), (theta - expected).abs().max()
    assert (theta - flat(own_model())).abs().max() > 1e-2                        # they trained


# The server's plain functions refuse what they cannot mean, in a ValueError that names it. A
# method's server step of the clients' sum (what on_clients returns for a `reduced` client
# function): a sum of another shape than θ (a length-1 sum would broadcast), or weights that sum to
# no positive number (no client). The rest of every method's server functions in its section.
TH = torch.arange(4.0)


@pytest.mark.parametrize("fn, of", [(fedavg.server_update, "θ"), (fediir.server_update, "θ"),
                                    (fedloe.average, "θ"), (fedipg.aggregate, "w^t")])
def test_a_server_step_of_a_sum_refuses_what_it_cannot_mean(fn, of):
    name = fn.__name__
    assert refused(fn, TH, TH[:1], 2.0) == \
        f"{name}: a sum of shape (1,) and weights 2.0 for {of} of shape (4,)"
    assert refused(fn, TH, TH[None], 2.0) == \
        f"{name}: a sum of shape (1, 4) and weights 2.0 for {of} of shape (4,)"
    assert refused(fn, TH, TH, 0.0) == f"{name}: a sum of shape (4,) and weights 0.0 for {of} of " \
        "shape (4,)"
    assert refused(fn, TH, TH, float("nan")) == f"{name}: a sum of shape (4,) and weights nan " \
        f"for {of} of shape (4,)"
    assert torch.equal(fn(TH, TH + 2, 2.0), TH + (TH + 2) / 2)
    assert torch.equal(fn(TH, TH + 2, 2.0, 0.5), TH + 0.5 * (TH + 2) / 2)


# ==================================================================================================
# fediir.py
# ==================================================================================================

def tiny_net64():
    torch.manual_seed(1)
    return common.Net(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()),
                      torch.nn.Linear(3, 2)).double()


def iir_objective_by_hand(model, x, y, g_tilde, gamma):
    """R + γ ||∇_ω R − g̃||² with ∇_ω R written out for a linear head: (softmax − onehot)ᵀ z / n."""
    z = model.featurizer(x)
    logits = model.classifier(z)
    r = torch.softmax(logits, 1) - F.one_hot(y, 2).double()
    gW, gb = r.T @ z / len(y), r.mean(0)
    return F.cross_entropy(logits, y) + gamma * (((gW - g_tilde[0]) ** 2).sum()
                                                 + ((gb - g_tilde[1]) ** 2).sum())


def test_fediir_penalty_gradient_matches_finite_differences():
    model = tiny_net64()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randint(2, (7,), generator=g)
    g_tilde = [torch.randn(2, 3, generator=g, dtype=torch.float64),
               torch.randn(2, generator=g, dtype=torch.float64)]
    w = torch.full((7,), 1 / 7, dtype=torch.float64)
    flat_g = torch.cat([v.reshape(-1) for v in g_tilde])
    loss = fediir.iir_objective(model, dict(model.named_parameters()), {}, x, y, w, flat_g, 0.7)
    assert torch.allclose(loss, iir_objective_by_hand(model, x, y, g_tilde, 0.7), atol=1e-12)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    eps = 1e-6
    for p, gp in zip(model.parameters(), grads):          # featurizer and classifier, every entry
        fd = torch.zeros_like(p)
        for i in range(p.numel()):
            with torch.no_grad():
                p.view(-1)[i] += eps
                up = iir_objective_by_hand(model, x, y, g_tilde, 0.7)
                p.view(-1)[i] -= 2 * eps
                down = iir_objective_by_hand(model, x, y, g_tilde, 0.7)
                p.view(-1)[i] += eps
            fd.view(-1)[i] = (up - down) / (2 * eps)
        assert torch.allclose(gp, fd, atol=1e-7), (gp, fd)
    assert grads[0].abs().sum() > 0                        # the penalty's gradient reaches φ


@on_every_device
def test_fediir_with_gamma_zero_is_fedavg_bit_for_bit(tmp_path, device):
    argv = QUICK + ["--clients", "4", "--sample", "2", "--test-domain", "1", "--device", device]
    import fediir_readings
    for avg, main, iir in (([], fediir_readings.main, ["--size-avg"]),
                           (["--uniform-avg"], fediir.main, [])):
        # as FedIIR's
        a, _ = run(fedavg.main, argv + avg + ["--parallel-clients", "off"], tmp_path, "avg.json")
        b, _ = run(main, argv + iir + ["--gamma", "0", "--parallel-clients", "off"], tmp_path,
                   "iir.json")   # 1/C
        assert strip_times(a)["domains"] == strip_times(b)["domains"]
    c, _ = run(fediir.main, argv + ["--gamma", "0.5"], tmp_path, "iir.json")
    assert strip_times(a)["domains"] != strip_times(c)["domains"]   # and the penalty does act


def test_fediir_averages_the_sampled_clients_uniformly_by_default(dtype):
    """Algorithm 1 and the code: θ^t = θ^{t-1} + (1/C) Σ_c Δ_c, whatever the clients' sizes (6 and
    10 here); the readings' --size-avg weights by size. γ = 0 and one full-batch step each: Δ_c is
    one SGD step. Tolerances as test_fedavg_round_is_weighted_mean_of_deltas's (float32 measured
    1.5e-8)."""
    import fediir_readings
    for size_avg, w in ((False, [0.5, 0.5]), (True, [6 / 16, 10 / 16])):
        model, fed = tiny_model(), tiny_federation()
        theta = common.get_flat(model)
        want = theta + sum(wc * (full_batch_step(model, c, 0.5) - theta)
                           for wc, c in zip(w, fed.clients))
        args = tiny_args(gamma=0.0, size_avg=size_avg, ema=0.95, half=False, gbar="batches",
                         gbar_inputs="augmented")
        round_fn = fediir_readings.readings_round if size_avg else fediir.fediir_round
        round_fn(1, model, fed, args, fediir.init_state(model, fed, args, None),
                 tiny_ctx(args, fed, model))
        assert want.dtype == dtype and torch.allclose(common.get_flat(model), want,
                                                      **TINY_TOL[dtype])


@pytest.mark.parametrize("mode", ["batches", "clients"])
def test_fediir_global_gradient_is_the_mean_classifier_gradient(mode):
    """Step 2: each client's summed minibatch gradients of the classifier and their number (the
    readings' --gbar clients: one full-batch gradient each), divided on the server, are the mean
    over every minibatch (over the clients) of ordinary backward passes."""
    import fediir_readings
    ds = data.synthetic()
    fed = data.federate(ds, 0, 3, seed=0, device="cpu")
    args = tiny_args(model="smallconv", head="mlp", batch_size=50, gbar=mode,
                     gbar_inputs="augmented")
    torch.manual_seed(0)
    model = common.build_model(args, ds)
    S, per, ctx = [0, 2], [], tiny_ctx(args, fed, model)
    for c in S:                                           # independently: ordinary backward passes
        cl = fed.clients[c]
        chunks = ([(cl.x[i:i + 50], cl.y[i:i + 50]) for i in range(0, cl.n, 50)] if mode
                  == "batches" else [(cl.x, cl.y)])
        for xb, yb in chunks:
            model.zero_grad()
            F.cross_entropy(model(xb.float() / 255), yb).backward()
            per.append(torch.cat([p.grad.reshape(-1) for p in model.classifier.parameters()]))
    client_fn = (fediir.classifier_gradient if mode == "batches"
                 else fediir_readings.readings_gradient)
    up = common.on_clients(client_fn, S, {"theta": common.get_flat(model)}, 1, ctx)   # their sums
    got = up["grad"] / up["count"]
    assert torch.allclose(got, torch.stack(per).mean(0), atol=1e-6)
    assert up["count"] == len(per) == (sum(math.ceil(fed.clients[c].n / 50)
                                                           for c in S)
                                                         if mode == "batches" else 2)


def test_fediir_ema_recursion(monkeypatch):
    """Appendix C: g̃^t = 0.95 g̃^{t-1} + 0.05 g_bar from g̃^0 = 0, g_bar the mean of what the
    clients send."""
    fed, model = tiny_federation(), tiny_model()
    args = tiny_args(gamma=0.1, ema=0.95, half=False)
    g1 = torch.cat([torch.full((48,), 1.0), torch.full((3,), 2.0)])
    g2 = torch.cat([torch.full((48,), -3.0), torch.full((3,), 5.0)])
    feed = iter([g1, g1, 2 * g2, 0 * g2])                 # two clients a round, one minibatch each
    summed = common.replies(None, grad="sum", count="sum")            # as classifier_gradient's
    monkeypatch.setattr(fediir, "classifier_gradient",
                        summed(lambda site, sent: {"grad": next(feed), "count": 1}))
    state = fediir.init_state(model, fed, args, None)
    ctx = tiny_ctx(args, fed, model)
    fediir.fediir_round(1, model, fed, args, state, ctx)
    assert torch.allclose(state["g_tilde"], 0.05 * g1)                            # 0.95·0 + 0.05·g1
    fediir.fediir_round(2, model, fed, args, state, ctx)
    assert torch.allclose(state["g_tilde"], 0.95 * 0.05 * g1 + 0.05 * g2)


@on_every_device
def test_fediir_learns_and_resumes(tmp_path, monkeypatch, device):
    argv = QUICK + ["--rounds", "4", "--clients", "4", "--sample", "2", "--gamma", "0.01",
                    "--test-domain", "2", "--device", device]
    full, _ = run(fediir.main, argv, tmp_path, "full.json")
    assert full["domains"]["style2"]["test_acc"] > 0.6
    resumed = interrupted_then_resumed(fediir.main, argv, str(tmp_path / "cut.json"), monkeypatch,
                                       lambda blob: blob["round"] == 2)
    assert strip_times(resumed) == strip_times(full)                     # g̃ restored


def test_fediir_defaults_follow_table_3(tmp_path):
    res, _ = run(fediir.main, QUICK + ["--rounds", "1", "--test-domain", "0"], tmp_path)
    assert res["args"]["gamma"] == 1e-2 and res["args"]["ema"] == 0.95 and "gbar" not in res["args"]
    gamma = {d: common.table(fediir.METHOD, d)["gamma"]
             for d in ("rmnist", "vlcs", "pacs", "officehome")}
    assert gamma == {"rmnist": 1e-2, "vlcs": 5e-3, "pacs": 1e-3, "officehome": 5e-4}       # Table 3


def photo_setup(tmp_path):
    datasets.make_fake_tree(tmp_path, per_class=2)
    ds = data.load("pacs", str(tmp_path), size=32)
    fed = data.federate(ds, 3, 3, seed=0, device="cpu")
    torch.manual_seed(0)
    args = tiny_args(model="smallconv", head="linear", dataset="pacs", batch_size=4, gbar="batches")
    model = common.build_model(args, ds)
    ctx = dataclasses.replace(tiny_ctx(args, fed, model), prep=data.make_prep("pacs", "cpu"))
    return fed, model, ctx


def mean_batch_gradient(model, inputs, S, fed, batch_size):
    """The code's mean_grad, written out: ∇_ω CE of every minibatch, averaged over all of them."""
    per = []
    for c, x in zip(S, inputs):
        y = fed.clients[c].y
        for i in range(0, len(y), batch_size):
            loss = F.cross_entropy(model(x[i:i + batch_size]), y[i:i + batch_size])
            g = torch.autograd.grad(loss, list(model.classifier.parameters()))
            per.append(torch.cat([gi.reshape(-1) for gi in g]))
    return torch.stack(per).mean(0)


def test_fediir_gbar_sees_augmented_inputs_on_photos_by_default(tmp_path):
    """A PACS-like tree: by default g_bar is taken on the inputs the training loaders give
    (augmented, from each client's own stream), as the official code's mean_grad; the readings'
    --gbar-inputs plain on the images."""
    import fediir_readings
    assert config.parser(fediir_readings.METHOD).parse_args([]).gbar_inputs == "augmented"
    fed, model, ctx = photo_setup(tmp_path)
    S, prep = [0, 2], data.make_prep("pacs", "cpu")
    # the clients' draws
    replay = [common.stream(0, fed.name, 1, c, "classifier_gradient", "cpu") for c in S]
    augmented = [prep(fed.clients[c].x, train=True, gen=g) for c, g in zip(S, replay)]
    plain = [prep(fed.clients[c].x) for c in S]
    assert not torch.allclose(augmented[0], plain[0], atol=1e-2)
    got = {}
    for how in ("augmented", "plain"):
        ctx.args.gbar_inputs = how
        fn = fediir.classifier_gradient if how == "augmented" else fediir_readings.readings_gradient
        up = common.on_clients(fn, S, {"theta": common.get_flat(model)}, 1, ctx,
                               phase="classifier_gradient")
        got[how] = up["grad"] / up["count"]
    assert torch.allclose(got["augmented"], mean_batch_gradient(model, augmented, S, fed, 4),
                          atol=1e-6)
    assert torch.allclose(got["plain"], mean_batch_gradient(model, plain, S, fed, 4), atol=1e-6)
    assert (got["augmented"] - got["plain"]).abs().max() > 1e-4


def test_fediir_gbar_pass_keeps_the_minibatches_of_a_batchnorm(tmp_path):
    """With BatchNorm in the featurizer the g_bar pass runs it on the code's minibatches (their
    statistics, train mode, as mean_grad); on larger chunks, as it does without BatchNorm, the
    features would differ."""
    fed, model, ctx = photo_setup(tmp_path)
    torch.manual_seed(0)
    d = model.classifier.in_features
    nn = torch.nn
    model.featurizer = nn.Sequential(nn.Conv2d(3, d, 3), nn.BatchNorm2d(d), nn.ReLU(),
                                     common.GlobalMean(), nn.Flatten())
    ctx = dataclasses.replace(tiny_ctx(ctx.args, fed, model), prep=data.make_prep("pacs", "cpu"))
    S, prep = [0, 2], data.make_prep("pacs", "cpu")
    assert all(fed.clients[c].n > ctx.args.batch_size for c in S)         # several minibatches each
    b, replay = ctx.args.batch_size, [common.stream(0, fed.name, 1, c, "classifier_gradient", "cpu")
                                      for c in S]
    # (drawn a
    augmented = [torch.cat([prep(x[i:i + b], train=True, gen=g) for i in range(0, len(x), b)])
                 # minibatch at a time)
                 for x, g in ((fed.clients[c].x, g) for c, g in zip(S, replay))]
    up = common.on_clients(fediir.classifier_gradient, S, {"theta": common.get_flat(model)}, 1, ctx)
    got = up["grad"] / up["count"]
    model.train()
    assert torch.allclose(got, mean_batch_gradient(model, augmented, S, fed, b), atol=1e-6)


@pytest.mark.parametrize("gbar,size_avg,half", [("batches", False, False), ("clients", True, True)])
def test_fediir_copied(gbar, size_avg, half):
    """Two rounds, γ = 0.5 (γ/2 with --half), v = 0.95, batch 4 over clients of 7, 12 and 9 (partial
    batches): θ^2 and g̃^2 of the copied loop are those of fediir_round (the paper's readings: of
    benchmark/diagnostics/fediir_readings.py's round), bit for bit."""
    import fediir_readings
    m = copied(fediir, *PLAIN)
    clients = three_clients()
    theta, g_tilde = copied_fediir_rounds(m, clients, 2, 0.25 if half else 0.5, 0.95, 4, gbar
                                          == "clients", size_avg)
    state = {"g_tilde": torch.zeros(51)}                                  # fediir.init_state's g̃^0
    round_fn = fediir_readings.readings_round if half else fediir.fediir_round
    expected = method_rounds(round_fn, clients, 2, state, gamma=0.5, ema=0.95, half=half, gbar=gbar,
                             gbar_inputs="augmented", size_avg=size_avg)
    assert torch.equal(theta, expected), (theta - expected).abs().max()
    assert torch.equal(g_tilde, state["g_tilde"])
    assert g_tilde.abs().max() > 1e-3                        # the penalty had something to align to
    fedavg_like, _ = copied_fediir_rounds(m, clients, 2, 0.0, 0.95, 4, gbar == "clients", size_avg)
    assert (fedavg_like - theta).abs().max() > 1e-4               # and it acted: γ = 0 is elsewhere


# FedIIR's and FedIPG's clients at once (--parallel-clients on, common.at_once with the methods'
# torch.func objectives) against one after another,
# on the CPU with ragged synthetic clients (partial
# batches, different step counts) and the small CNN (its max pools exercise FedIPG's tangent), in
# float64 and float32 (the `dtype` fixture above). Without the penalty in the parallel objective the
# same float32 comparisons differ by 2.6e-2 (FedIIR) and 1.1e-2 (FedIPG). ReLU kinks and max pools
# make the float32 runs sensitive beyond rounding once a pre-activation sits within rounding of zero
# (a sequential FedIPG round from θ^1 + 1e-8 noise
# moves a client by up to 1.3e-5 at λ = 0.5), and the
# more so the more rounds and the more threads: 4 rounds through main() differ by 1.2e-5 here and by
# 1.0e-4 on a 2-core Intel Xeon. So the mathematics is checked in float64 (agreement ~1e-16) and
# float32 is held to 10x what was measured here, at 1 and 2 threads.






def test_parallel_fediir_with_penalty_and_ema_matches_sequential(tmp_path, monkeypatch, dtype):
    """2 rounds. float64: θ 3.5e-17, update 9.3e-16, g̃ 4.6e-16 (relative), max |Δθ| 2.8e-17, losses
    0; tolerances 1e-12 and 1e-13 (1000x). float32, measured at 1 / 2 threads: θ 1.9e-8 / 1.8e-8,
    update 4.8e-7 / 4.6e-7, g̃ 1.0e-7 / 9.8e-8, max |Δθ| 1.5e-8 / 1.5e-8, losses 0 / 8.0e-8;
    tolerances 1e-6 (53x), 1e-5 (21x), 2e-6 (20x), 2e-7 (13x), 1e-5 (125x)."""
    args = method_args(fediir, "fediir", SGD + IIR, tmp_path)
    out = both_ways(fediir.fediir_round, args, 2, fediir.init_state)
    f32 = dtype == torch.float32
    assert_same_to_tolerance(out, **(dict(params=1e-6, update=1e-5) if f32 else F64))
    assert max_abs(out) < (2e-7 if f32 else 1e-13)
    seq, par = out["off"][2]["g_tilde"], out["on"][2]["g_tilde"]     # g̃^2: the EMA at
                                                                     # θ^1 of either run
    assert rel(par, seq) < (2e-6 if f32 else 1e-12) and seq.norm() > 0


def test_parallel_fediir_at_gamma_0_is_fedavgs_parallel_run_bit_for_bit(tmp_path):
    """As one after another (fediir.py's docstring), so at once: γ = 0 is FedAvg with 1/C."""
    argv = QUICK + ["--model", "cnn", "--clients", "4", "--sample", "3", "--test-domain", "0",
                    "--rounds", "2", "--parallel-clients", "on"]
    iir, iir_out = run(fediir.main, argv + ["--gamma", "0"], tmp_path, "iir.json")
    avg, avg_out = run(fedavg.main, argv + ["--uniform-avg"], tmp_path, "avg.json")
    assert torch.equal(final_theta(iir_out), final_theta(avg_out))
    assert (iir["domains"]["style0"]["history"][-1]["loss"]
            == avg["domains"]["style0"]["history"][-1]["loss"])


def test_fediir_names_the_papers_authors():
    """fediir.py's docstring and --help name the paper's five authors."""
    first = " ".join(fediir.__doc__.strip().split("\n\n")[0].split())
    assert "Yaming Guo, Kai Guo, Xiaofeng Cao, Tieru Wu, Yi Chang; ICML 2023" in first


@pytest.mark.parametrize("argv,message", [
    (["--gamma", "-1"], "--gamma must be >= 0, got -1.0"),
    (["--gamma", "nan"], "argument --gamma: must be a finite number, got 'nan'"),
    (["--ema", "1"], "--ema must be in [0, 1), got 1.0"),
    (["--ema", "-0.1"], "--ema must be in [0, 1), got -0.1"),
    (["--gbar", "clients"], "unrecognized arguments: --gbar clients"),
])
def test_fediir_flags_bad_input(argv, message, capsys):
    assert message in fails(fediir.main, argv, capsys)


def test_fediir_server_functions_refuse_what_they_cannot_mean():
    """gbar_update's g_bar of g̃'s shape (a length-1 g_bar would broadcast); server_update: with
    FedAvg's (above)."""
    assert refused(fediir.gbar_update, TH, TH[:1], 0.95) == \
        "gbar_update: g_bar of shape (1,) for g̃ of shape (4,)"
    assert refused(fediir.gbar_update, TH, TH[:, None], 0.95) == \
        "gbar_update: g_bar of shape (4, 1) for g̃ of shape (4,)"
    assert torch.equal(fediir.gbar_update(TH, TH + 2, 0.5), TH + 1)


def test_fediir_gbar_inputs_change_nothing_on_the_digits(tmp_path):
    import fediir_readings
    argv = QUICK + ["--rounds", "2", "--clients", "3", "--test-domain", "1"]
    a, _ = run(fediir.main, argv, tmp_path, "a.json")
    b, _ = run(fediir_readings.main, argv + ["--gbar-inputs", "plain"], tmp_path, "b.json")
    assert strip_times(a)["domains"] == strip_times(b)["domains"]


def test_fediir_half_is_the_papers_gamma_over_2(tmp_path):
    """The readings' --half: the local objective R + (γ/2)||∇_ω R − g̃||² (FedIIR's Eq.), i.e. a run
    with --gamma γ --half is fediir.py's run with --gamma γ/2, bit for bit, and not the run with
    γ."""
    import fediir_readings
    argv = QUICK + ["--rounds", "2", "--eval-every", "1", "--clients", "3", "--test-domain", "1"]
    half, _ = run(fediir_readings.main, argv + ["--gamma", "2", "--half"], tmp_path, "half.json")
    over2, _ = run(fediir.main, argv + ["--gamma", "1"], tmp_path, "over2.json")
    full, _ = run(fediir.main, argv + ["--gamma", "2"], tmp_path, "full.json")
    assert strip_times(half)["domains"] == strip_times(over2)["domains"]
    assert strip_times(half)["domains"] != strip_times(full)["domains"]


# ==================================================================================================
# fedomg.py
# ==================================================================================================

@pytest.mark.parametrize("solver", ["sgd", "exact"])
def test_fedomg_steps_with_identical_updates(solver, monkeypatch):
    with_solver(monkeypatch, solver)
    d = torch.randn(300, dtype=torch.float64)
    G, p = d.repeat(4, 1), torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    kappa = 0.5
    # Γ𝐠 = d
    assert torch.allclose(readings.paper_step(G, d.clone(), p, kappa), (1 + kappa) * d, atol=1e-9)
    k = d.norm() ** 2 / (d.norm() ** 2 + 1e-4)           # K / s² = k 11ᵀ when every ĝ_u = d (w = 1)
    lam = kappa * (k + 1e-4).sqrt() / ((k + 1e-4).sqrt() + 1e-4)
    code = fedomg.code_step(G, torch.ones(4, dtype=torch.float64), kappa)
    assert torch.allclose(code, (1 + lam) / (1 + kappa ** 2) * d, atol=1e-9)


def test_fedomg_code_step_at_kappa_zero_is_fedavg_over_u():
    """κ = 0: the DG code's step is Σ_u p_u g_u / U = g_FL / U; the FL code's the plain mean."""
    g = torch.Generator().manual_seed(5)
    G = torch.randn(4, 100, generator=g, dtype=torch.float64)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    assert torch.allclose(fedomg.code_step(G, p, 0.0), p @ G / 4, atol=1e-12)
    assert torch.allclose(fedomg.code_step(G, torch.ones(4, dtype=torch.float64), 0.0), G.mean(0),
                          atol=1e-12)
    assert torch.equal(readings.paper_step(G, p @ G, p, 0.0), p @ G)


@pytest.mark.parametrize("solver", ["sgd", "exact"])
def test_fedomg_steps_are_invariant_to_client_order(solver, monkeypatch):
    with_solver(monkeypatch, solver)
    g = torch.Generator().manual_seed(3)
    G = (torch.randn(1, 200, generator=g, dtype=torch.float64)
         + torch.randn(5, 200, generator=g, dtype=torch.float64))
    p = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.25], dtype=torch.float64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    a = readings.paper_step(G, p @ G, p, 0.5)
    b = readings.paper_step(G[perm], p[perm] @ G[perm], p[perm], 0.5)
    assert torch.allclose(a, b, atol=1e-7)
    assert not torch.allclose(a, 1.5 * (p @ G), atol=1e-3)             # κ does change the direction
    c, d = fedomg.code_step(G, p, 0.5), fedomg.code_step(G[perm], p[perm], 0.5)
    assert torch.allclose(c, d, atol=1e-7)


def test_fedomg_gram_is_float64_from_float32_updates():
    g = torch.Generator().manual_seed(6)
    G = torch.randn(3, 10_000, generator=g)
    K = fedomg.gram(G, cols=4096)                                            # several column blocks
    assert K.dtype == torch.float64
    assert torch.allclose(K, G.double() @ G.double().T, rtol=1e-13, atol=0)


# One full round against the server rules computed by hand from their formulas: the official code's
# (fed_merge.py OMG: autograd through a softmax, torch's SGD, 21 evaluations, best kept; or Γ* by a
# brute-force grid for --solver exact) and Eq. 15–16
# as printed (Γ* the same two ways, g_IGD from the
# update vectors themselves).
def omg_simplex_argmin(f, steps=200, zooms=5):
    """argmin over the 3-simplex of f (candidates [n, 3] -> values [n]) by brute force: a grid over
    the whole simplex, then grids zoomed to ±4 cells around the best point so far."""
    centre, width = torch.full((3,), 1 / 3, dtype=torch.float64), 1.0
    t = torch.linspace(-1, 1, steps + 1, dtype=torch.float64)
    a, b = (x.reshape(-1) for x in torch.meshgrid(t, t, indexing="ij"))
    for _ in range(zooms):
        cands = torch.stack([centre[0] + width * a, centre[1] + width * b, centre[2] - width
                             * (a + b)], 1)
        cands = cands[(cands >= 0).all(1)]
        centre, width = cands[f(cands).argmin()], width * 8 / steps
    return centre


def omg_softmax_sgd(f, U, evaluations=21):
    """The code's solver, as its code reads: logits v = 0, torch SGD (lr 25, momentum 0.5) on
    f(softmax(v)) by autograd, the best of `evaluations` objective values."""
    v = torch.zeros(U, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([v], lr=25, momentum=0.5)
    best, v_best = float("inf"), None
    for i in range(evaluations):
        opt.zero_grad()
        obj = f(torch.softmax(v, 0)[None])[0]
        if obj.item() < best:
            best, v_best = obj.item(), v.detach().clone()
        if i < evaluations - 1:
            obj.backward()
            opt.step()
    return torch.softmax(v_best, 0)


def omg_official_step(D, w, kappa, solver, eps=1e-4):
    """fed_merge.py's FedOMG/OMG by hand: rows ĝ_u = w_u g_u, GG = ĝĝᵀ / s², s = mean sqrt(diag +
    ε), anchor = row means, c = κ sqrt(mean(GG) + ε), λ = c / (sqrt(ΓᵀGGΓ + ε) + ε), step = Σ_u (1/U
    + λ γ_u) ĝ_u / (1 + κ²)."""
    U, Gh = len(w), w[:, None] * D
    GG = Gh @ Gh.T
    GG = GG / (GG.diagonal() + eps).sqrt().mean() ** 2
    Gg, c = GG.mean(1), kappa * (GG.mean() + eps).sqrt()
    f = lambda X: X @ Gg + c * (torch.einsum("ni,ij,nj->n", X, GG, X) + eps).sqrt()
    Gam = omg_softmax_sgd(f, U) if solver == "sgd" else omg_simplex_argmin(f)
    lam = c / ((Gam @ GG @ Gam + eps).sqrt() + eps)
    return ((1 / U + lam * Gam)[:, None] * Gh).sum(0) / (1 + kappa ** 2)


def omg_paper_step(D, p, kappa, solver):
    """Eq. 15–16 by hand: g_FL = Σ p_u g_u; Γ* minimises Γ𝐠·g_FL + κ||g_FL|| ||Γ𝐠|| (the sgd solver
    on inner products divided by s² = (mean_u ||g_u||)², as the code's solver runs); g_IGD from
    vectors."""
    g_FL = p @ D
    K = D @ D.T / D.norm(dim=1).mean() ** 2
    f = (lambda X: X @ K @ p + kappa * (p @ K @ p).sqrt()
         * torch.einsum("ni,ij,nj->n", X, K, X).sqrt())
    Gam = omg_softmax_sgd(f, len(p)) if solver == "sgd" else omg_simplex_argmin(f)
    g_Gamma = Gam @ D
    return g_FL + kappa * g_FL.norm() / g_Gamma.norm() * g_Gamma


def omg_one_round(argv, tmp_path, monkeypatch, dataset="synthetic", sizes=(20, 45, 70)):
    """One fedomg_round (the readings script's flags in argv) on 3 clients of uneven size, all
    sampled, η_g = 0.7; returns θ before, the clients' θ_u and sizes N_u (in the order trained), the
    server's step, and the resolved args."""
    args = method_args(readings, "fedomg", ["--dataset", dataset, "--clients", "3", "--sample", "3",
                                            "--alpha", "1",
                                          "--batch-size", "16", "--local-epochs", "1",
                                          "--global-lr", "0.7"] + argv,
                       tmp_path)
    ds = data.load(dataset, clients=3, alpha=1.0)
    fed = (data.federate_fixed(ds, 0, "cpu") if dataset in data.FL
           else data.federate(ds, 0, 3, 0, "cpu"))
    for c, n in zip(fed.clients, sizes):
        c.x, c.y = c.x[:n], c.y[:n]
    torch.manual_seed(0)
    model = common.build_model(args, ds)
    theta = common.get_flat(model)
    seen, real = [], common.local_train

    def spy(site, *a, **k):
        out = real(site, *a, **k)
        seen.append((site.client.n, out[0].clone()))
        return out
    steps = []

    def kept(fn):
        return lambda *a, **k: steps.append(fn(*a, **k)) or steps[-1]
    monkeypatch.setattr(common, "local_train", spy)
    # their result, as returned
    for module, name in ((readings, "code_step"), (readings, "paper_step")):
        monkeypatch.setattr(module, name, kept(getattr(module, name)))
    readings.readings_round(1, model, fed, args, {}, tiny_ctx(args, fed, model))
    N = torch.tensor([n for n, _ in seen], dtype=torch.float64)
    assert sorted(N.tolist()) == sorted(sizes) and len(steps) == 1
    assert torch.equal(common.get_flat(model), theta + 0.7 * steps[0])  # Eq. 17: θ ← θ + η_g · step
    return theta, torch.stack([th for _, th in seen]), N, steps[0], args


@pytest.mark.parametrize("rule,solver,dataset", [("code", "sgd", "synthetic"),
                                                 ("code", "exact", "synthetic"),
                                                 ("paper", "sgd", "synthetic"),
                                                 ("paper", "exact", "synthetic"),
                                                 ("code", "sgd", "mnist")])
def test_fedomg_round_matches_the_rule_by_hand(rule, solver, dataset, tmp_path, monkeypatch, dtype):
    """The server's step against Eq. 15-16 / the code's rule by hand from the clients' θ_u (in
    float64), relative. float64 run, sgd solver (the same iterations by hand): 5.7e-14 (tolerance
    1e-12: 17x); exact solver: 2.9e-8, the two exact minimisers' accuracy, not rounding (tolerance
    1e-6: 34x). float32, measured at 1 / 2 threads: 6.8e-8 (tolerance 1e-6: 15x)."""
    theta, thetas, N, step, args = omg_one_round(["--server-rule", rule, "--solver", solver,
                                                  "--kappa", "0.5"], tmp_path, monkeypatch, dataset)
    D, p = (thetas - theta).double(), N / N.sum()
    # the FL code does not weight
    w = torch.ones(3, dtype=torch.float64) if dataset == "mnist" else p
    by_hand = {"code": omg_official_step(D, w, 0.5, solver),
               "paper": omg_paper_step(D, p, 0.5, solver)}
    assert step.dtype == dtype
    step = step.double()
    assert rel(step, by_hand[rule]) < (1e-6 if dtype == torch.float32 or solver == "exact"
                                       else 1e-12)
    other = "paper" if rule == "code" else "code"
    assert rel(step, by_hand[other]) > 0.3                             # the two rules are far apart
    if dataset == "synthetic" and rule == "code":                    # and so are the two weightings
        assert rel(step, omg_official_step(D, torch.ones(3, dtype=torch.float64), 0.5,
                                           solver)) > 0.3


@on_every_device
def test_fedomg_keeps_client_momentum_and_resumes(tmp_path, monkeypatch, device):
    argv = QUICK + ["--clients", "3", "--sample", "2", "--test-domain", "0", "--rounds", "4",
                    "--device", device]
    full, _ = run(fedomg.main, argv, tmp_path, "full.json")
    assert full["domains"]["style0"]["test_acc"] > 0.6
    fresh, _ = run(readings.main, argv + ["--fresh-opt"], tmp_path, "fresh.json")
    assert strip_times(full)["domains"] != strip_times(fresh)["domains"]    # the kept momentum acts

    def momentum_saved(blob):                                           # each client's own momentum
        assert sum("momentum" in kept for kept in blob["state"]["clients"].values()) >= 2
    resumed = interrupted_then_resumed(fedomg.main, argv, str(tmp_path / "cut.json"), monkeypatch,
                                       lambda blob: blob["round"] == 2, momentum_saved)
    assert strip_times(resumed) == strip_times(full)


def test_fedomg_fl_setting_on_embedded_mnist(tmp_path):
    res, _ = run(fedomg.main, ["--dataset", "mnist", "--rounds", "6", "--eval-every", "3",
                               "--local-epochs", "2", "--lr", "0.05", "--alpha", "1"], tmp_path)
    assert (res["args"]["global_lr"] == 1.0 and res["args"]["clients"] == 100
            and res["args"]["sample"] == 20)
    assert res["domains"]["clients"]["test_acc"] > 0.25


def test_fedomg_headline_command_on_a_fake_pacs_tree(tmp_path):
    """`python fedomg.py --dataset pacs` end to end: ResNet-18, momentum kept, 11M-parameter
    updates."""
    datasets.make_fake_tree(tmp_path, per_class=2)
    res, _ = run(fedomg.main, ["--dataset", "pacs", "--data-root", str(tmp_path), "--no-pretrained",
                               "--rounds", "2", "--local-epochs", "1", "--test-domain", "photo",
                               "--batch-size", "8"], tmp_path)
    assert (res["args"]["model"], res["args"]["head"], res["args"]["global_lr"]) == (
        "resnet18", "linear", 0.5)
    assert list(res["domains"]) == ["photo"] and 0 <= res["domains"]["photo"]["test_acc"] <= 1


def test_fedomg_dg_defaults_follow_the_paper_and_the_dg_scripts(tmp_path):
    a = resolved_args(fedomg, ["--dataset", "pacs"], tmp_path)
    assert (a.model, a.head, a.lr, a.batch_size, a.local_epochs, a.momentum, a.weight_decay,
            a.global_lr) == \
        ("resnet18", "linear", 1e-3, 16, 5, 0.9, 5e-4, 0.5)  # η_g: train_pacs_OMG.py
                                                             # (Table 4: 5e-2)
    assert a.kappa == 0.5
    # the FL code: no momentum
    for name, fl in (("mnist", True), ("cifar10", True), ("rmnist", False)):
        a = resolved_args(fedomg, ["--dataset", name], tmp_path)
        assert a.momentum == (0.0 if fl else 0.9)


def test_parallel_fedomg_keeps_each_clients_momentum(tmp_path, monkeypatch, dtype):
    """3 rounds, relative differences. float64: θ 1.7e-17, update 2.6e-15, momentum 7.1e-16, losses
    0 (tolerance 1e-12: 380x). float32, measured at 1 / 2 threads: θ 7.2e-9 / 7.1e-9, update 1.6e-6
    / 1.5e-6, momentum 3.1e-7 / 3.1e-7, losses 8.6e-8 / 0; tolerances 1e-7 (14x), 2e-5 (12x), 1e-5
    (32x), 1e-5 (116x)."""
    args = method_args(readings, "fedomg", ["--clients", "5", "--sample", "3", "--batch-size", "16",
                                            "--rounds", "3",
                                            "--weight-decay", "1e-2", "--lr-step", "0.5"], tmp_path)
    out = both_ways(readings.readings_round, args, 3)
    f32 = dtype == torch.float32
    assert_same_to_tolerance(out, **(dict(params=1e-7, update=2e-5) if f32 else F64))
    seq, par = out["off"][2]["clients"], out["on"][2]["clients"]    # each client's own state
    assert sorted(par) == sorted(seq) and len(seq) >= 4  # clients sampled in some round, kept since
    for c in seq:
        assert rel(par[c]["momentum"], seq[c]["momentum"]) < (1e-5 if f32 else 1e-12)


# FedOMG: the server step size η_g (the DG scripts' default, the per-round
# rule where no code gives one, --global-lr by hand), the bit-for-bit usage line, the DG code's lr
# step, the solver's keep-the-best rule and its measured accuracy.
def resolved(argv, tmp_path, by_hand):
    """fedomg's resolved arguments (by_hand: whether argv gives --global-lr, as the assertions
    say)."""
    return resolved_args(fedomg, argv, tmp_path)


def test_fedomg_eta_g_defaults_by_setting(tmp_path):
    """DG: the official scripts' 0.5 (train_pacs_OMG.py, train_vlcs_GA.py: --global_model_lr), not
    Table 4's 5e-2; FL: the FL code's 1 (--omg_meta_lr); elsewhere the rule, "auto": η_g is set
    per round (also by hand: --global-lr auto); every value from fedomg's table."""
    for name in ("pacs", "vlcs", "officehome"):
        assert resolved(["--dataset", name], tmp_path, False).global_lr == 0.5
    for name in data.FL:
        assert resolved(["--dataset", name], tmp_path, False).global_lr == 1.0
    for name in ("rmnist", "synthetic", "stained", "rcmnist", "rcfmnist", "waterbird"):
        assert resolved(["--dataset", name], tmp_path, False).global_lr == "auto"
        assert resolved(["--dataset", name, "--global-lr", "0.3"], tmp_path, True).global_lr == 0.3
    assert resolved(["--dataset", "pacs", "--global-lr", "5e-2"], tmp_path, True).global_lr == 5e-2
    assert resolved(["--dataset", "pacs", "--global-lr", "auto"], tmp_path, 1).global_lr == "auto"
    for name in (*data.NAMES, "*"):                        # no None, and not the shared table's
        own = {**fedomg.DEFAULTS["*"], **fedomg.DEFAULTS.get(name, {})}
        assert own["global_lr"] in (0.5, 1.0, "auto"), name


def test_fedomg_eta_g_rule_restores_fedavgs_scale():
    """Unset η_g: U (1 + κ²) under the code's rule, so that its anchor term is g_FL itself (κ = 0:
    FedAvg's step; κ > 0: g_FL plus a term of length κ||g_FL||, Eq. 16's form); 1 under Eq. 16."""
    g = torch.Generator().manual_seed(11)
    G = (torch.randn(1, 400, generator=g, dtype=torch.float64) + 0.8
         * torch.randn(4, 400, generator=g, dtype=torch.float64))
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    g_FL = p @ G
    for kappa in (0.0, 0.5, 1.0):
        args = types.SimpleNamespace(global_lr="auto", kappa=kappa)
        assert fedomg.eta_g(args, 4) == 4 * (1 + kappa ** 2)
        step = fedomg.eta_g(args, 4) * fedomg.code_step(G, p, kappa)
        if kappa == 0:
            assert rel(step, g_FL) < 1e-12
        else:
            # κ||g_FL||, up to the ε's
            assert abs((step - g_FL).norm() / g_FL.norm() - kappa) < 1e-3
            assert rel(step, g_FL) > 0.1                                           # κ does act
    paper = types.SimpleNamespace(global_lr="auto", kappa=0.5, server_rule="paper", solver="sgd",
                                  solver_evals=21, lr_step=None)
    assert readings.swaps(paper)["eta_g"](paper, 4) == 1.0                      # Eq. 16's own scale
    assert fedomg.eta_g(types.SimpleNamespace(global_lr=0.3, kappa=0.5), 4) == 0.3


def test_fedomg_round_at_kappa_zero_steps_as_fedavg(tmp_path, dtype):
    """One round on 3 clients of uneven size with the default code rule and the η_g rule, κ = 0: θ
    moves by FedAvg's data-weighted step (fedavg_round from the same θ and minibatches) to float
    rounding; with η_g = 1 it would move 1/U of it. Relative differences (of θ^1 − θ^0, so with θ's
    cancellation); float64: 5.4e-16 and 1.3e-14 (tolerance 1e-12: 77x). float32, measured at 1 / 2
    threads: 2.5e-7 / 2.6e-7 and 7.3e-6 / 7.3e-6; tolerances 3e-6 (11x) and 1e-4 (14x)."""
    # round 1: no kept momentum
    argv = ["--clients", "3", "--sample", "3", "--batch-size", "16", "--kappa", "0"]
    args = method_args(fedomg, "fedomg", argv, tmp_path)
    assert args.global_lr == "auto"
    ds = data.load("synthetic")
    moved = {}
    for name, module, a in (("avg", fedavg, method_args(fedavg, "fedavg", argv[:6], tmp_path)),
                            ("omg", fedomg, args),
                            ("omg, η_g = 1", fedomg,
                             types.SimpleNamespace(**{**vars(args), "global_lr": 1.0}))):
        fed = data.federate(ds, 0, 3, 0, "cpu")
        for c, n in zip(fed.clients, (20, 45, 70)):
            c.x, c.y = c.x[:n], c.y[:n]
        torch.manual_seed(0)
        model = common.build_model(a, ds)
        theta = common.get_flat(model)
        round_fn = fedavg.fedavg_round if module is fedavg else fedomg.fedomg_round
        round_fn(1, model, fed, a, {}, tiny_ctx(a, fed, model))
        moved[name] = common.get_flat(model) - theta
    assert moved["avg"].norm() > 0 and moved["avg"].dtype == dtype
    f32 = dtype == torch.float32
    assert rel(moved["omg"], moved["avg"]) < (3e-6 if f32 else 1e-12)
    assert rel(3 * moved["omg, η_g = 1"], moved["avg"]) < (1e-4 if f32 else 1e-12)


def test_fedomg_global_lr_by_hand_in_every_argparse_form(tmp_path):
    for argv in (["--global-lr", "0.3"], ["--global-lr=0.3"], ["--global", "0.3"],
                 ["--global-l=0.3"]):
        assert resolved_args(fedomg, argv, tmp_path).global_lr == 0.3        # given: kept
    for argv in ([], ["--kappa", "0.3"], ["--lr", "0.3"]):
        assert resolved_args(fedomg, argv, tmp_path).global_lr == "auto"    # not given: per round
    small = QUICK + ["--rounds", "1", "--eval-every", "1", "--clients", "3", "--sample", "2",
                     "--test-domain", "0"]
    by_hand, _ = run(fedomg.main, small + ["--global=0.3"], tmp_path, "hand.json")
    rule, _ = run(fedomg.main, small, tmp_path, "rule.json")
    assert by_hand["args"]["global_lr"] == 0.3 and rule["args"]["global_lr"] == "auto"
    assert strip_times(by_hand)["domains"] != strip_times(rule)["domains"]


def fedomg_rounds(clients, **kw):
    """fedomg_round R times (test_copy's harness, with args.rounds = R for the lr step); with
    fresh_opt=True the readings script's round (a fresh client SGD every round)."""
    fresh = kw.pop("fresh_opt", False)

    def round_fn(t, model, fed, args, state, ctx):
        args = types.SimpleNamespace(**vars(args), rounds=R, server_rule="code", solver="sgd",
                                     solver_evals=21, fresh_opt=fresh, lr_step=None)
        return ((readings.readings_round if fresh else fedomg.fedomg_round)(
            t, model, fed, args, state, ctx))
    args = dict(kappa=0.5, dataset="synthetic", global_lr="auto", weight_decay=1e-2)
    return method_rounds(round_fn, clients, R, **{**args, **kw})


@pytest.mark.parametrize("kappa,fl,keep", [(0.5, False, True),     # the defaults: η_g = U (1 + κ²)
                                           (0.0, False, False),    # κ = 0: FedAvg's step, fresh SGD
                                           (0.5, True, True)])     # the FL code: w_u = 1, η_g = 1
def test_fedomg_copied(kappa, fl, keep):
    m = copied(fedomg, *FUNCTIONS)
    clients = three_clients()
    eta_g = (lambda U: 1.0) if fl else (lambda U: U * (1 + kappa ** 2))
    theta = own_rounds(m, clients, kappa, not fl, eta_g, keep, lr_step=1.0 if fl else 0.8)
    expected = fedomg_rounds(clients, kappa=kappa, fresh_opt=not keep,
                             **(dict(dataset="mnist", global_lr=1.0) if fl else {}))
    # the rounds moved θ
    assert (theta - flat(own_model())).norm() > 1e-2 * flat(own_model()).norm()
    assert torch.equal(theta, expected), (theta - expected).abs().max()


def test_fedomg_copied_step_scale_is_in_the_signature():
    """server_update's η_g has no default (the copier chooses it), and at κ = 0 the code rule with
    η_g = U moves θ by FedAvg's data-weighted step, with η_g = 1 by 1/U of it."""
    m = copied(fedomg, *FUNCTIONS)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(50, generator=g, dtype=torch.float64)
    thetas = [theta + torch.randn(50, generator=g, dtype=torch.float64) for _ in range(3)]
    N = [7, 12, 9]
    g_FL = sum(n * (t - theta) for n, t in zip(N, thetas)) / sum(N)
    with pytest.raises(TypeError):
        m.server_update(theta, thetas, N)
    assert torch.allclose(m.server_update(theta, thetas, N, 3.0, 0.0) - theta, g_FL, atol=1e-12)
    assert torch.allclose(m.server_update(theta, thetas, N, 1.0, 0.0) - theta, g_FL / 3, atol=1e-12)
    # Eq. 16 as printed
    assert torch.equal(readings.paper_update(theta, thetas, N, 1.0, 0.0), theta + g_FL)


class Seen(Exception):
    pass


def local_lr(args, t, tmp_path, monkeypatch):
    """The lr of the client optimiser fedomg_round builds in round t (the round stops there)."""
    def spy(site, theta, objective=None, make_opt=None, **k):
        raise Seen(make_opt([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"])
    monkeypatch.setattr(common, "local_train", spy)
    ds = data.load("synthetic")
    fed = data.federate(ds, 0, 3, 0, "cpu")
    model = common.build_model(args, ds)
    with pytest.raises(Seen) as e:
        fedomg.fedomg_round(t, model, fed, args, {}, tiny_ctx(args, fed, model))
    return e.value.args[0]


@pytest.mark.parametrize("E,R", [(5, 100), (1, 10), (3, 20)])
def test_fedomg_lr_step_is_the_dg_codes_steplr(E, R, tmp_path, monkeypatch):
    """trainval_func.py: StepLR(step_size=int(0.8 E R), gamma=0.1), stepped after every local epoch;
    the lr of round t (1-based) is the scheduler's at its first epoch, (t − 1) E."""
    args = method_args(fedomg, "fedomg", ["--clients", "3", "--sample", "3",
                                          "--local-epochs", str(E), "--rounds", str(R)],
                       tmp_path)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=int(0.8 * E * R), gamma=0.1)
    code = []
    for epoch in range(E * R):
        code.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    for t in sorted({1, int(0.8 * R), int(0.8 * R) + 1, R}):
        assert len(set(code[(t - 1) * E:t * E])) == 1                   # one lr within the round
        assert (local_lr(args, t, tmp_path, monkeypatch)
                == pytest.approx(code[(t - 1) * E], rel=1e-12))
    assert local_lr(args, R, tmp_path, monkeypatch) == pytest.approx(0.1 * args.lr, rel=1e-12)
    args.dataset = "mnist"                                               # the FL code: never
    assert local_lr(args, R, tmp_path, monkeypatch) == args.lr


def test_fedomg_copied_with_its_defaults_steps_as_its_round():
    """solve and objective default to the ε that code_step passes them (the code's 1e-4): a copy
    that keeps their signatures' defaults finds the Γ* of fedomg's own step (not one ~5e-6 off)."""
    eps = {f.__name__: inspect.signature(f).parameters["eps"].default
           for f in (fedomg.code_step, fedomg.solve, fedomg.objective)}
    assert set(eps.values()) == {1e-4}, eps
    g = torch.Generator().manual_seed(7)
    G = torch.randn(4, 30, generator=g, dtype=torch.float64)
    K = G @ G.T / (G @ G.T).diagonal().sqrt().mean() ** 2
    a = torch.full((4,), 0.25, dtype=torch.float64)
    assert torch.equal(fedomg.solve(K, a, 0.5), fedomg.solve(K, a, 0.5, 1e-4))
    assert not torch.equal(fedomg.solve(K, a, 0.5), fedomg.solve(K, a, 0.5, 0.0))


def test_fedomg_sgd_solver_keeps_the_best_iterate():
    """Four updates in three dimensions (a singular Gram matrix): Table 4's lr 25 makes the iterates
    oscillate, the last is far above the best, and the solver returns the best of the first n
    evaluations for every n (the code's obj_best / w_best)."""
    g = torch.Generator().manual_seed(3)
    G = torch.randn(4, 3, generator=g, dtype=torch.float64)
    K = G @ G.T
    K = K / K.diagonal().sqrt().mean() ** 2
    a = torch.full((4,), 0.25, dtype=torch.float64)
    v = torch.zeros(4, dtype=torch.float64, requires_grad=True)          # the iterates, by autograd
    opt, values = torch.optim.SGD([v], lr=25, momentum=0.5), []
    for i in range(21):
        opt.zero_grad()
        f = fedomg.objective(torch.softmax(v, 0), K, a, 0.5, 0.0)       # (ε 0: it oscillates)
        values.append(f.item())
        if i < 20:
            f.backward()
            opt.step()
    assert values[-1] - min(values) > 0.1                                 # the last is not the best
    for n in range(1, 22):
        got = fedomg.objective(fedomg.solve(K, a, 0.5, 0.0, evaluations=n), K, a, 0.5, 0.0).item()
        assert got == pytest.approx(min(values[:n]), abs=1e-9)


@pytest.mark.parametrize("argv,message", [
    (["--kappa", "-0.5"], "--kappa must be >= 0, got -0.5"),
    (["--server-rule", "paper"], "unrecognized arguments: --server-rule paper"),
    (["--no-rescale"], "unrecognized arguments: --no-rescale"),
    (["--dataset", "pacs", "--parallel-clients", "on"], "--parallel-clients on: not for pacs"),
])
def test_fedomg_flags_bad_input(argv, message, capsys):
    assert message in fails(fedomg.main, argv, capsys)


def test_fedomg_server_functions_refuse_what_they_cannot_mean():
    """As FedAvg's: server_update's updates (read by `updates` into G) one per size N_u, of θ's
    shape; code_step's G one row per weight. The issue's case first: fewer θ_u than sizes left
    rows of an unfilled G (5.57 in every entry), now refused."""
    seen = []
    assert refused(fedomg.server_update, TH, iter([TH + 1]), [5, 6, 7], 1.0, 0.5) == \
        "updates: 1 update(s) θ_u for U = 3"
    assert refused(fedomg.server_update, TH, read([TH] * 5, seen), [5, 6, 7], 1.0) == \
        "updates: update 4 of shape (4,) for U = 3 and θ of shape (4,)"
    assert len(seen) == 4
    assert refused(fedomg.server_update, TH, [], [], 1.0) == "updates: 0 update(s) θ_u for U = 0"
    assert refused(fedomg.server_update, TH, [TH, TH[:1]], [5, 6], 1.0) == \
        "updates: update 2 of shape (1,) for U = 2 and θ of shape (4,)"
    assert refused(fedomg.updates, TH, [TH[None]], 1) == \
        "updates: update 1 of shape (1, 4) for U = 1 and θ of shape (4,)"
    G = torch.stack([TH, TH + 1, TH + 2])
    for G_, w in ((G, torch.ones(2)), (G[:2], torch.ones(3)), (G[:0], torch.ones(0)),
                  (TH, torch.ones(4)), (G, torch.ones(3, 1))):
        assert refused(fedomg.code_step, G_, w, 0.5) == (
            f"code_step: G of shape {tuple(G_.shape)} for w of shape {tuple(w.shape)} "
            "(G: U × |θ|, w: U, U ≥ 1)")
    assert torch.equal(fedomg.server_update(TH, iter([TH + 1, TH + 3]), [4, 4], 2.0, 0.0), TH + 2)


# ==================================================================================================
# fedloe.py
# ==================================================================================================

LODO = ("pacs", "vlcs", "officehome", "rmnist", "synthetic")


# fixed clients, with waterbird
RC, FL = ("rcmnist", "rcfmnist"), ("mnist", "emnist", "cifar10", "cifar100")


DATASETS = LODO + RC + FL + ("waterbird",)


def loe_value(cell):
    for kind in (int, float):
        try:
            return kind(cell)
        except ValueError:
            pass
    return cell


def loe_defaults_table():
    """docs/fedloe.md's table of defaults: (flag, value per dataset, source) per row. A cell holds
    one value for its datasets, or `name value, name value, ...`."""
    page = (HERE / "docs" / "fedloe.md").read_text()
    lines = (page.split("<!-- defaults -->")[1].split("<!-- /defaults -->")[0].strip().splitlines()[
        2:])
    rows = []
    for line in lines:
        flag, *cells, source = [c.strip() for c in line.strip().strip("|").split("|")]
        value = {}
        for names, cell in zip((LODO, RC, FL, ("waterbird",)), cells):
            pairs = (dict(p.split() for p in cell.split(", ")) if " " in cell
                     else dict.fromkeys(names, cell))
            assert set(pairs) == set(names), (flag, cell)
            value.update({k: loe_value(v) for k, v in pairs.items()})
        rows.append((flag.strip("`")[2:].replace("-", "_"), value, source))
    return rows


DEFAULTS = loe_defaults_table()


@pytest.fixture(scope="module")
def loe_resolved(tmp_path_factory):
    """The arguments fedloe.main would run with, per dataset, nothing given but the dataset."""
    out = {}
    for name in DATASETS:
        args = resolved_args(fedloe, ["--dataset", name], tmp_path_factory.mktemp(name))
        # as after_load reads it
        args.sample = args.clients if args.sample == "all" else args.sample
        out[name] = args
    return out


@pytest.mark.parametrize("flag,value,source", DEFAULTS, ids=[row[0] for row in DEFAULTS])
def test_every_default_follows_its_source(loe_resolved, flag, value, source):
    for name in DATASETS:
        want = value[name] if isinstance(value, dict) else value
        assert getattr(loe_resolved[name], flag) == want, \
            f"--{flag.replace('_', '-')} on {name}: source {source}"





def test_fedloe_ensemble_of_linear_heads_is_a_linear_head():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    Ws, bs, phi, z = r(5, 3, 7), r(5, 3), r(5), r(11, 7)
    W, b = fedloe.ensemble(phi, Ws, bs)
    by_heads = sum(phi[c] * (z @ Ws[c].T + bs[c]) for c in range(5))     # Σ_c φ_c h_c(z)
    assert torch.allclose(F.linear(z, W, b), by_heads, atol=1e-12)  # = h_{Σ φ_c ψ_c}(z):


def tiny_predictions():
    """Two clients (environments) with 2 and 3 tuning examples, two heads, two classes."""
    Y = torch.tensor([[[1.0, -1.0], [0.5, 0.0]], [[0.0, 2.0], [1.0, 1.0]],        # client 0
                      [[2.0, 0.0], [-1.0, 0.5]], [[0.3, 0.1], [0.0, -2.0]],
                      [[1.0, 1.0], [2.0, 0.0]]],                                     # client 1
                     dtype=torch.float64)
    return fedloe.Tuning(Y, torch.tensor([0, 1, 0, 1, 1]), [2, 3])


LOE_ENV = [0, 0, 1, 1, 1]   # the client of each row of tiny_predictions


def by_hand(phi, Y, y, env):
    """Per client: risk R_c and ∇_φ R_c, in plain floats."""
    R, gphi, n = [0.0, 0.0], [[0.0, 0.0], [0.0, 0.0]], [0, 0]
    for i in range(len(y)):
        s = [sum(phi[k] * Y[i][k][j] for k in range(2)) for j in range(2)]
        e = [math.exp(v) for v in s]
        p = [v / sum(e) for v in e]
        c, yi = env[i], y[i]
        R[c] += -math.log(p[yi])
        for k in range(2):
            gphi[c][k] += sum(p[j] * Y[i][k][j] for j in range(2)) - Y[i][k][yi]
        n[c] += 1
    return [R[c] / n[c] for c in range(2)], [[g / n[c] for g in gphi[c]] for c in range(2)]


def test_fedloe_risks_and_fish_match_hand_computed_values():
    T = tiny_predictions()
    phi = torch.tensor([0.3, 0.7], dtype=torch.float64)
    R, _ = by_hand(phi.tolist(), T.Y.tolist(), T.y.tolist(), LOE_ENV)
    assert torch.allclose(fedloe.risks(phi, T)[0], torch.tensor(R, dtype=torch.float64), atol=1e-12)
    # Fish (DomainBed's), from uniform: per meta step an
    # Adam step on client 0's risk, one on client 1's at the
    # moved point, the meta step; three meta steps, the inner Adam's state kept
    lr, wd, meta = 0.4, 0.01, 0.3
    got = fedloe.fit_phi(T, "fish", lr=lr, weight_decay=wd, steps=3, meta_lr=meta)
    assert torch.allclose(got, torch.tensor(fish_by_hand(T, [1, 1], lr, wd, meta, 3),
                                            dtype=torch.float64), atol=1e-12)


def domainbed_irm_penalty(logits, y):
    """DomainBed's IRM._irm_penalty (algorithms.py), as written there: the derivatives of the even
    and the odd rows' losses in a dummy scale, multiplied."""
    scale = torch.tensor(1.0, dtype=logits.dtype).requires_grad_()
    loss_1 = F.cross_entropy(logits[::2] * scale, y[::2])
    loss_2 = F.cross_entropy(logits[1::2] * scale, y[1::2])
    grad_1 = torch.autograd.grad(loss_1, [scale], create_graph=True)[0]
    grad_2 = torch.autograd.grad(loss_2, [scale], create_graph=True)[0]
    return torch.sum(grad_1 * grad_2)


def test_fedloe_irm_penalty_is_domainbeds_two_halves():
    """IRMv1 as the base code computes it: DomainBed's formula on each client's logits Σφŷ (its even
    and odd tuning rows), the mean over the clients; made-up logits in float64, three clients of 5,
    6 and 7 rows. The square of the derivative over a client's whole split (another reading) is 1e-3
    or more away."""
    g = torch.Generator().manual_seed(0)
    sizes = [5, 6, 7]
    Y = 3 * torch.randn(sum(sizes), 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(4, (sum(sizes),), generator=g)
    T, phi = fedloe.Tuning(Y, y, sizes), torch.tensor([0.5, -0.2, 0.9], dtype=torch.float64)
    logits, start, want, squared = torch.einsum("nkm,k->nm", Y, phi), 0, [], []
    for n in sizes:
        s, t = logits[start:start + n], y[start:start + n]
        want.append(domainbed_irm_penalty(s, t).item())
        w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        squared.append(torch.autograd.grad(F.cross_entropy(w * s, t), w)[0].item() ** 2)
        start += n
    got = fedloe.irm_penalty(phi, T).item()
    assert math.isclose(got, sum(want) / 3, rel_tol=1e-12, abs_tol=1e-15)
    assert abs(got - sum(squared) / 3) > 1e-3
    one = fedloe.Tuning(Y[:7], y[:7], [6, 1])         # a single-row client: no odd half, its term 0
    assert math.isclose(fedloe.irm_penalty(phi, one).item(),
                        domainbed_irm_penalty(logits[:6], y[:6]).item() / 2,
                        rel_tol=1e-12)


@pytest.mark.parametrize("dg", ["irm", "rex"])
def test_fedloe_server_lowers_the_eq_11_objective(dg):
    T = tiny_predictions()
    args = type("A", (), dict(dg=dg, dg_lambda=1.0, stage2_lr=0.05, stage2_wd=0.0, server_steps=50,
                              meta_lr=0.05))

    def objective(phi):
        pen = fedloe.irm_penalty(phi, T) if dg == "irm" else fedloe.rex_penalty(phi, T)
        return (fedloe.risks(phi, T)[0].mean() + pen).item()
    phi = fit_phi_of(T, args)
    assert objective(phi) < objective(torch.full((2,), 0.5, dtype=torch.float64)) - 1e-3


def test_fedloe_stage1_with_one_communication_is_one_shot_averaging(dtype):
    """3 full-batch Adam steps per client, averaged by size. float64: 1.1e-16 (tolerance 1e-12);
    float32, measured at 1 / 2 threads: 6.0e-8 (tolerance atol 1e-6 + rtol 1e-5: 38x)."""
    fed, model = tiny_federation((6, 10)), tiny_model()
    args = tiny_args(lr=0.05, weight_decay=0.0, local_epochs=3)
    expected, weights = 0, 0
    for c in fed.clients:                        # independently: 3 full-batch Adam steps per client
        m = copy.deepcopy(model)
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(m(c.x.to(dtype) / 255), c.y).backward()
            opt.step()
        expected = expected + c.n * common.get_flat(m)
        weights += c.n
    fedloe.fedloe_round(1, model, fed, tiny_args(**vars(args), stage1_comms=1), {},
                        tiny_ctx(args, fed, model))
    assert expected.dtype == dtype and torch.allclose(common.get_flat(model), expected / weights,
                                                      **TINY_TOL[dtype])


def test_fedloe_stage2_with_uniform_phi_and_no_server_steps_is_the_plain_average():
    fed, model = tiny_federation((12, 20)), tiny_model()
    loe_split(fed)
    args = tiny_args(stage1_comms=2, stage2_lr=0.5, stage2_wd=5e-4, stage2_epochs=3, stage2_comms=1,
                     server_steps=0, dg="irm", dg_lambda=100.0, meta_lr=0.05)
    heads = []
    for c in fed.clients:                        # independently: 3 full-batch SGD steps on the head
        W, b = model.classifier.weight.detach().clone(), model.classifier.bias.detach().clone()
        for _ in range(3):
            W.requires_grad_(), b.requires_grad_()
            gW, gb = (torch.autograd.grad(
                F.cross_entropy(F.linear(c.x.float().flatten(1) / 255, W, b), c.y), [W, b]))
            W, b = (W - 0.5 * (gW + 5e-4 * W)).detach(), (b - 0.5 * (gb + 5e-4 * b)).detach()
        heads.append((W, b))
    state = {}
    fedloe.fedloe_round(3, model, fed, args, state, tiny_ctx(args, fed, model))
    assert torch.equal(state["phi"], torch.full((2,), 0.5))
    assert torch.allclose(model.classifier.weight, (heads[0][0] + heads[1][0]) / 2, atol=1e-6)
    assert torch.allclose(model.classifier.bias, (heads[0][1] + heads[1][1]) / 2, atol=1e-6)


def test_fedloe_split_follows_appendix_d2():
    ds = data.synthetic()
    fed = data.federate(ds, 0, 4, seed=0, device="cpu")
    before = [(rows(c.x), rows(c.val_x), c.n + len(c.val_y)) for c in fed.clients]
    loe_split(fed)
    for c, (train, held, total) in zip(fed.clients, before):
        # 90 / 10
        assert len(c.tune_y) == int(0.1 * len(train)) and rows(c.x) | rows(c.tune_x) == train
        assert not rows(c.x) & rows(c.tune_x)
        assert rows(c.val_x) | rows(c.id_x) == held and not rows(c.val_x) & rows(c.id_x)
        # 5% + 5%
        assert abs(len(c.val_y) - 0.05 * total) <= 1 and abs(len(c.id_y) - 0.05 * total) <= 1
    assert len(fed.pooled("val")[1]) == sum(len(c.val_y) for c in fed.clients)
    assert not hasattr(fed, "id_x")          # each client keeps its own: scored there (evaluate)


@on_every_device
def test_fedloe_end_to_end_frozen_featurizer_and_resume(tmp_path, monkeypatch, device):
    blobs, save, argv = {}, outputs.save_checkpoint, LOE + ["--device", device]

    def keep(path, blob):
        blobs[blob["round"]] = copy.deepcopy(blob)
        save(path, blob)
    monkeypatch.setattr(outputs, "save_checkpoint", keep)
    full, _ = run(fedloe.main, argv, tmp_path, "full.json")
    monkeypatch.setattr(outputs, "save_checkpoint", save)
    d = full["domains"]["style1"]
    # chance 0.25; CUDA 0.59
    assert [r["round"] for r in d["history"]] == [1, 2, 3, 4] and d["last_test_acc"] > 0.5
    # the end of stage 2, never stage 1
    assert d["best_round"] == 4 and d["test_acc"] == d["last_test_acc"]
    assert all(0 <= r["in_domain_acc"] <= 1 for r in d["history"])
    part = lambda t, name: [v for k, v in blobs[t]["model"].items() if k.startswith(name)]
    for t in (3, 4):                                     # stage 2 leaves θ̂ bit for bit and moves ψ
        assert all(torch.equal(a, b) for a, b in zip(part(t, "featurizer"), part(2, "featurizer")))
        assert not torch.equal(part(t, "classifier")[0], part(t - 1, "classifier")[0])
    # stage 1 trains θ
    assert not all(torch.equal(a, b) for a, b in zip(part(2, "featurizer"), part(1, "featurizer")))
    # --stage2-comms 0 ("our FedAvg") is the first K1 rounds of the full run
    only1, _ = run(fedloe.main, argv + ["--stage2-comms", "0"], tmp_path, "s1.json")
    assert (strip_times(only1)["domains"]["style1"]["history"]
            == strip_times(full)["domains"]["style1"]["history"][:2])
    resumed = interrupted_then_resumed(fedloe.main, argv, str(tmp_path / "cut.json"), monkeypatch,
                                       lambda blob: blob["round"] == 3)
    assert strip_times(resumed) == strip_times(full)


def test_parallel_fedloe_stage1_with_adam(tmp_path, monkeypatch, dtype):
    """2 communications of 4 Adam epochs, relative differences. float64: θ 2.3e-14, update 7.3e-14,
    losses 0 (tolerance 1e-12: 14x). float32, measured at 1 / 2 threads: θ 1.9e-6 / 1.3e-6, update
    5.9e-6 / 4.0e-6, losses 9.3e-8 / 9.3e-8; tolerances 3e-5 (16x), 1e-4 (17x), 1e-5 (108x)."""
    args = method_args(fedloe, "fedloe", ["--clients", "5", "--batch-size", "16",
                                          "--stage1-epochs", "4",
                                          "--stage1-comms", "2", "--weight-decay", "1e-3",
                                          "--lr", "1e-3"], tmp_path)
    tol = dict(params=3e-5, update=1e-4) if dtype == torch.float32 else F64
    # stage 1 (K1 = 2)
    assert_same_to_tolerance(both_ways(fedloe.fedloe_round, args, 2), **tol)


# FedLOE against its sources: the terms of Eq. 11 in the base code's form (V-REx, IRMv1),
# Fish's inner optimiser kept across server steps, every default against the table or code it comes
# from, and stage 2 over several communications. Each
# computed value is checked against a computation
# written here independently of fedloe.py (plain floats, or per-client torch loops).
def sample_losses_by_hand(phi, Y, y):
    """ℓ(Σ_k φ_k ŷ_k, y) of every row, in plain floats (two heads, two classes)."""
    out = []
    for i in range(len(y)):
        s = [sum(phi[k] * Y[i][k][j] for k in range(2)) for j in range(2)]
        out.append(math.log(sum(math.exp(v) for v in s)) - s[y[i]])
    return out


def rex_by_hand(phi, T):
    """Per client c: R_c and V_c, the population variance of its per-example losses; plain
    floats."""
    ell = sample_losses_by_hand(phi, T.Y.tolist(), T.y.tolist())
    R, V = [], []
    for c in (0, 1):
        mine = [v for v, e in zip(ell, LOE_ENV) if e == c]
        R.append(sum(mine) / len(mine))
        V.append(sum((v - R[-1]) ** 2 for v in mine) / len(mine))
    return R, V


def test_rex_penalty_is_the_base_codes_within_client_variance():
    """V-REx: the FedDG benchmark's VREx.irm_penalty (per-example loss variance within each client,
    mean over the clients) against the hand computation; not DomainBed's variance of the clients'
    risks."""
    T = tiny_predictions()
    phi = torch.tensor([0.3, 0.7], dtype=torch.float64)
    R, V = rex_by_hand(phi.tolist(), T)
    assert math.isclose(fedloe.rex_penalty(phi, T).item(), (V[0] + V[1]) / 2, abs_tol=1e-12)
    assert abs((V[0] + V[1]) / 2 - ((R[0] - R[1]) / 2) ** 2) > 1e-3


def irm_halves_by_hand(phi, T):
    """Per client, IRMv1's derivative at w = 1 on its logits Σφŷ over its even rows times over its
    odd rows."""
    out = []
    for c in (0, 1):
        rows = [i for i, e in enumerate(LOE_ENV) if e == c]
        s, y = torch.einsum("nkm,k->nm", T.Y[rows], torch.tensor(phi, dtype=T.Y.dtype)), T.y[rows]
        out.append((irm_derivative_by_hand(s[0::2], y[0::2])
                    * irm_derivative_by_hand(s[1::2], y[1::2])).item())
    return out


def server_args(**kw):
    a = dict(dg="irm", dg_lambda=100.0, stage2_lr=0.05, stage2_wd=5e-4, server_steps=5,
             meta_lr=0.05)
    a.update(kw)
    return argparse.Namespace(**a)


def fit_phi_of(T, a):
    """Eq. 11's fit_phi with the flags fedloe_round passes it."""
    return fedloe.fit_phi(T, a.dg, a.dg_lambda, a.stage2_lr, a.stage2_wd, a.server_steps, a.meta_lr)


def eq11_by_hand(phi, T, dg, lam):
    """Eq. 11's objective written per client with torch (differentiable), independently of fedloe:
    the mean of the risks plus λ times the mean of the clients' IRMv1 (DomainBed's, on their rows)
    or V-REx terms."""
    P, R, pen = len(T.rows), [], []
    for c in range(P):
        rows = [i for i, e in enumerate(LOE_ENV) if e == c]
        s = torch.einsum("nkm,k->nm", T.Y[rows], phi)
        ell = F.cross_entropy(s, T.y[rows], reduction="none")
        R.append(ell.mean())
        pen.append(domainbed_irm_penalty(s, T.y[rows]) if dg == "irm"
                   else ((ell - ell.mean()) ** 2).mean())
    return torch.stack(R).mean() + lam * torch.stack(pen).mean()


def adam_on(objective, P, lr, wd, steps, dtype=torch.float64):
    phi = torch.full((P,), 1.0 / P, dtype=dtype, requires_grad=True)
    opt = torch.optim.Adam([phi], lr=lr, weight_decay=wd)
    for _ in range(steps):
        opt.zero_grad()
        objective(phi).backward()
        opt.step()
    return phi.detach()


def test_irm_penalty_is_averaged_over_the_clients():
    """IRMv1 as the base code reduces it (penalty /= n_groups): the mean over the clients of the
    halves' product; and the server's fit is Eq. 11 with that mean and the clients' risks averaged
    (the code's avg_loss), against Adam on the objective written per client, for IRM and V-REx."""
    T = tiny_predictions()
    phi = torch.tensor([0.3, 0.7], dtype=torch.float64)
    d = irm_halves_by_hand(phi.tolist(), T)
    assert math.isclose(fedloe.irm_penalty(phi, T).item(), (d[0] + d[1]) / 2, abs_tol=1e-12)
    for dg in ("irm", "rex"):
        want = adam_on(lambda f: eq11_by_hand(f, T, dg, 100.0), 2, 0.05, 5e-4, 5)
        assert torch.allclose(fit_phi_of(T, server_args(dg=dg)), want, atol=1e-12), dg


def fish_by_hand(T, weights, lr, wd, meta, steps, keep=True, betas=(0.9, 0.999), eps=1e-8):
    """Fish from uniform φ in plain floats: per meta step, φ̃ = φ, an Adam step on weights[c]·R_c
    (+ wd·φ̃) for client 0 then client 1, then φ += meta (φ̃ − φ). keep: the Adam's moments and step
    count go on across meta steps (DomainBed's create_clone); else a fresh Adam every meta step."""
    (b1, b2), phi = betas, [0.5, 0.5]
    m, v, t = [0.0, 0.0], [0.0, 0.0], 0
    for _ in range(steps):
        if not keep:
            m, v, t = [0.0, 0.0], [0.0, 0.0], 0
        tilde = list(phi)
        for c in (0, 1):
            t += 1
            # ∇_φ̃ of client c's mean loss
            g = by_hand(tilde, T.Y.tolist(), T.y.tolist(), LOE_ENV)[1][c]
            g = [weights[c] * g[k] + wd * tilde[k] for k in range(2)]
            m = [b1 * m[k] + (1 - b1) * g[k] for k in range(2)]
            v = [b2 * v[k] + (1 - b2) * g[k] ** 2 for k in range(2)]
            tilde = [tilde[k] - lr * m[k] / (1 - b1 ** t) / (math.sqrt(v[k] / (1 - b2 ** t)) + eps)
                     for k in range(2)]
        phi = [phi[k] + meta * (tilde[k] - phi[k]) for k in range(2)]
    return phi


def test_fish_keeps_the_inner_adam_state_across_server_steps():
    """fit_phi's Fish against the hand-written loop with the inner Adam's state carried over the
    meta steps; an Adam restarted every meta step ends elsewhere."""
    T, weights = tiny_predictions(), [1.0, 1.0]
    lr, wd, meta, steps = 0.1, 0.01, 0.5, 6
    got = fit_phi_of(T, server_args(dg="fish", stage2_lr=lr, stage2_wd=wd, meta_lr=meta,
                                    server_steps=steps))
    kept = fish_by_hand(T, weights, lr, wd, meta, steps)
    restarted = fish_by_hand(T, weights, lr, wd, meta, steps, keep=False)
    assert torch.allclose(got, torch.tensor(kept, dtype=torch.float64), atol=1e-12)
    assert max(abs(a - b) for a, b in zip(kept, restarted)) > 1e-2


def test_the_defaults_table_covers_every_fedloe_flag():
    p = argparse.ArgumentParser()
    fedloe.add_args(p)
    flags = {a.dest for a in p._actions if a.dest != "help"} | {k for t in fedloe.DEFAULTS.values()
                                                                for k in t}
    assert flags <= {row[0] for row in DEFAULTS}, flags - {row[0] for row in DEFAULTS}
    assert len(DEFAULTS) == len({row[0] for row in DEFAULTS}) and "docs/fedloe.md" in fedloe.__doc__


def test_stage2_over_several_communications_by_hand():
    """K2 = 3 communications of E2 = 6 epochs: every client trains its head E2/K2 = 2 full-batch SGD
    epochs (weight decay) from the broadcast ψ, the server fits φ from uniform by Adam with the
    stage-2 weight decay on Eq. 11 (V-REx, the default form), and ψ = Σ φ_c ψ̂_c goes down; all by
    hand, round by round."""
    fed, model = tiny_federation((40, 60)), tiny_model()
    loe_split(fed)
    lr, wd, lam, steps = 0.5, 0.05, 1.0, 4
    args = tiny_args(batch_size=100, stage1_comms=2, stage2_lr=lr, stage2_wd=wd, stage2_epochs=6,
                     stage2_comms=3, server_steps=steps, dg="rex", dg_lambda=lam, meta_lr=0.05)
    assert all(c.n < args.batch_size for c in fed.clients) and fed.clients[0].n != fed.clients[1].n
    state = {}
    W, b = model.classifier.weight.detach().clone(), model.classifier.bias.detach().clone()
    prep, ctx = (lambda x: x.float().flatten(1) / 255), tiny_ctx(args, fed, model)
    for t in range(3):
        fedloe.fedloe_round(3 + t, model, fed, args, state, ctx)
        heads = []
        for c in fed.clients:                # 2.1: E2/K2 = 2 full-batch epochs from the broadcast ψ
            Wc, bc = W.clone(), b.clone()
            for _ in range(2):
                Wc.requires_grad_(), bc.requires_grad_()
                gW, gb = torch.autograd.grad(F.cross_entropy(F.linear(prep(c.x), Wc, bc), c.y),
                                             [Wc, bc])
                Wc, bc = (Wc - lr * (gW + wd * Wc)).detach(), (bc - lr * (gb + wd * bc)).detach()
            heads.append((Wc, bc))
        groups = []                                 # 2.2: every head on every client's tuning split
        for c in fed.clients:
            # [n_c, P, m]
            Y = torch.stack([F.linear(prep(c.tune_x), Wk, bk) for Wk, bk in heads], 1)
            groups.append((Y, c.tune_y))

        def objective(phi):                            # (1/P) Σ_c R_c + λ (1/P) Σ_c V_c, per client
            R, V = [], []
            for Y, y in groups:
                ell = F.cross_entropy(torch.einsum("nkm,k->nm", Y, phi), y, reduction="none")
                R.append(ell.mean())
                V.append(((ell - ell.mean()) ** 2).mean())
            return torch.stack(R).mean() + lam * torch.stack(V).mean()
        phi = adam_on(objective, 2, lr, wd, steps, dtype=torch.float32)
        W, b = (phi[0] * heads[0][0] + phi[1] * heads[1][0], phi[0] * heads[0][1] + phi[1]
                * heads[1][1])
        assert torch.allclose(state["phi"], phi, atol=1e-5), t
        assert torch.allclose(model.classifier.weight, W, atol=1e-5), t
        assert torch.allclose(model.classifier.bias, b, atol=1e-5), t
    assert not torch.allclose(phi, torch.full((2,), 0.5), atol=1e-3)        # the server did move φ


TINY = ["--stage1-epochs", "2", "--stage1-comms", "1", "--stage2-epochs", "2",
        "--stage2-comms", "2",
        "--server-steps", "3"]


def keep_checkpoints(monkeypatch):
    blobs, save = {}, outputs.save_checkpoint

    def keep(path, blob):
        blobs[blob["round"]] = copy.deepcopy({k: v for k, v in blob.items() if k
                                              in ("model", "state")})
        save(path, blob)
    monkeypatch.setattr(outputs, "save_checkpoint", keep)
    return blobs


def scored_by_hand(ds, model_kind, state_dict):
    """The final model's accuracy on each client's own test set and on the whole validation hold-out
    of data.federate_fixed (seed 0), computed here."""
    model = common.build_model(types.SimpleNamespace(model=model_kind, head="linear",
                                                     no_pretrained=True), ds)
    model.load_state_dict(state_dict)
    model.eval()
    prep = data.make_prep(ds.name, "cpu")
    with torch.no_grad():
        per = {d.name: (model(prep(d.x_test)).argmax(1) == d.y_test).float().mean().item()
               for d in ds.domains}
        fed = data.federate_fixed(ds, 0, "cpu")
        val_x, val_y, _ = fed.pooled("val")
        val = (model(prep(val_x)).argmax(1) == val_y).float().mean().item()
    return per, val


def test_fedloe_stage1_on_fixed_clients_is_fedavg_with_adam(tmp_path, monkeypatch):
    """--stage2-comms 0, one local epoch per communication: FedAvg with every client in every round
    (in their order), a fresh Adam per client and round, on the same 90% of each client's training
    split, gives the same history, per-client test accuracies and model, bit for bit."""
    argv = RC_ARGV + ["--batch-size", "512", "--parallel-clients", "off"]
    blobs = keep_checkpoints(monkeypatch)
    loe, _ = run(fedloe.main, argv + ["--stage1-epochs", "3", "--stage1-comms", "3",
                                      "--stage2-comms", "0"],
                 tmp_path, "loe.json")
    theta_loe = blobs[3]["model"]
    blobs.clear()
    federate_fixed, local_train, stream = data.federate_fixed, common.local_train, common.stream

    def split(ds, seed, device, **kw):                    # FedAvg trains on FedLOE's training split
        fed = federate_fixed(ds, seed, device, **kw)
        loe_split(fed, seed, "rcmnist")
        return fed

    def with_adam(site, theta, objective=common.cross_entropy, make_opt=None, **kw):
        args = site.args
        adam = lambda params: torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay,
                                               foreach=True)
        return local_train(site, theta, objective, adam, **kw)
    monkeypatch.setattr(data, "federate_fixed", split)
    monkeypatch.setattr(common, "local_train", with_adam)
    monkeypatch.setattr(common, "sample_clients", lambda ctx, P, C: list(range(C)))
    # FedLOE's clients' streams
    monkeypatch.setattr(common, "stream", lambda seed, domain, t, c, phase, device:
                        stream(seed, domain, t, c, "stage1_update", device))
    avg, _ = run(fedavg.main, argv + ["--rounds", "3", "--local-epochs", "1", "--sample", "4",
                                      "--lr", "1e-3",
                                      "--weight-decay", "2.2e-3"], tmp_path, "avg.json")
    assert list(loe["domains"]) == list(avg["domains"]) == ["clients"]  # (FedAvg's exchange
                                                                        # drew as FedLOE's)
    a, b = strip_times(loe)["domains"]["clients"], strip_times(avg)["domains"]["clients"]
    assert a.keys() == b.keys() and a == b                 # history, per_client_test_acc, ... equal
    assert (len(a["per_client_test_acc"]) == 4 and a["history"][0]["loss"]
            != a["history"][-1]["loss"])
    assert all(torch.equal(theta_loe[k], blobs[3]["model"][k]) for k in theta_loe)


def test_fedloe_both_stages_on_rcmnist_scored_on_the_clients_test_sets(tmp_path, monkeypatch):
    """Stage 1 and stage 2 (Fish) with the 4 clients as the environments: stage 2 moves the head and
    leaves the featurizer; the last round's scores are the final model's on each client's own test
    set and on the whole validation hold-out (not halved: no held-out domain), computed here."""
    blobs = keep_checkpoints(monkeypatch)
    r, _ = run(fedloe.main, RC_ARGV + TINY + ["--dg", "fish"], tmp_path)
    assert list(r["domains"]) == ["clients"] and r["protocol"] == "clients"
    d = r["domains"]["clients"]
    assert [h["round"] for h in d["history"]] == [1, 2, 3] and d["best_round"] == 3
    # no in-domain
    assert all(set(h) == {"round", "val_acc", "test_acc", "loss", "seconds"} for h in d["history"])
    part = lambda t, name: [v for k, v in blobs[t]["model"].items() if k.startswith(name)]
    assert all(torch.equal(x, y) for x, y in zip(part(3, "featurizer"), part(1, "featurizer")))
    assert not torch.equal(part(3, "classifier")[0], part(2, "classifier")[0])
    assert blobs[3]["state"]["phi"].shape == (4,)              # one weight per client (environment)
    ds = data.load("rcmnist", None, 0, p_test=0.1)
    per, val = scored_by_hand(ds, "mlp", blobs[3]["model"])
    assert d["per_client_test_acc"] == per
    assert abs(d["val_acc"] - val) < 1e-6
    assert abs(d["test_acc"] - sum(per.values()) / 4) < 1e-6  # the 4 test sets are of equal size


def test_fedloe_on_mnist_label_skew(tmp_path):
    """The label-skew split (3 clients here): both stages run (IRM), every client takes part, and
    the per-client test accuracies are the final model's on each client's own test set."""
    argv = ["--dataset", "mnist", "--clients", "3", "--batch-size", "256", "--stage1-epochs", "1",
            "--stage1-comms",
            "1", "--stage2-epochs", "1", "--stage2-comms", "1", "--server-steps", "3"]
    r, out = run(fedloe.main, argv, tmp_path)
    d = r["domains"]["clients"]
    assert r["args"]["sample"] == 3 and r["args"]["rounds"] == 2 and r["args"]["lr"] == 1e-3
    assert len(d["history"]) == 2 and d["last_test_acc"] == d["test_acc"]
    blob = torch.load(str(tmp_path / "r.json.ckpt"), map_location="cpu", weights_only=True)
    per, val = scored_by_hand(data.load("mnist", None, 0, clients=3, alpha=0.1), "cnn",
                              blob["model"])
    assert d["per_client_test_acc"] == per and abs(d["val_acc"] - val) < 1e-6


def fedloe_rounds(clients, K1, E1, K2, E2, B, lr, wd, lr2, wd2, r, lam, steps, meta_lr):
    """fedloe_round K1 + K2 times on the same clients (train and tuning splits), model and minibatch
    stream."""
    fed = as_federation([(x, y) for x, y, _, _ in clients])
    for c, (_, _, xt, yt) in zip(fed.clients, clients):
        c.tune_x, c.tune_y = xt, yt
    args = tiny_args(sample=3, batch_size=B, local_epochs=E1 // K1, lr=lr, momentum=0.0,
                     weight_decay=wd,
                     global_lr=1.0, parallel_clients="off", stage1_comms=K1, stage2_comms=K2,
                     stage2_epochs=E2, stage2_lr=lr2, stage2_wd=wd2, dg=r, dg_lambda=lam,
                     meta_lr=meta_lr, server_steps=steps, rounds=K1 + K2)
    model, state = tiny(), {}
    ctx = tiny_ctx(args, fed, model)
    for t in range(1, K1 + K2 + 1):
        fedloe.fedloe_round(t, model, fed, args, state, ctx)
    return flat(model), state["phi"]


@pytest.mark.parametrize("K1,K2,r", [(1, 1, "irm"), (1, 1, "rex"), (1, 1, "fish"), (2, 2, "fish"),
                                     (2, 2, "irm")])
def test_fedloe_copied(K1, K2, r):
    """Two rounds (one communication of each stage; and two of each), every term of Eq. 11:
    the copied functions in the test's loop give fedloe_round's model and φ bit for bit."""
    m = copied(fedloe, *LOE_FUNCTIONS)
    clients = split(three_clients(sizes=SIZES))
    hp = dict(K1=K1, E1=2 * K1, K2=K2, E2=2 * K2, B=8, lr=0.01, wd=1e-3, lr2=0.3, wd2=5e-3, r=r,
              lam=2.0, steps=5, meta_lr=0.5)
    theta, phi = loe_own_rounds(m, as_floats(clients), **hp)
    expected, expected_phi = fedloe_rounds(clients, **hp)
    start = flat(tiny())
    assert (theta - start).norm() > 1e-2 * start.norm()                         # the rounds moved θ
    assert not torch.allclose(phi, torch.full((3,), 1 / 3), atol=1e-3)      # and the server moved φ
    assert torch.equal(theta, expected), (theta - expected).abs().max()
    assert torch.equal(phi, expected_phi), (phi - expected_phi).abs().max()


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "5"], "fedloe sets the rounds and local epochs from --stage1-epochs"),
    (["--local-epochs", "2"], "drop --rounds / --local-epochs"),
    (["--stage1-epochs", "10", "--stage1-comms", "4"],
     "--stage1-epochs (10) must be a positive multiple of --stage1-comms (4)"),
    (["--stage1-comms", "0"], "must be a positive multiple of --stage1-comms (0) >= 1"),
    (["--stage2-epochs", "3"],
     "--stage2-epochs (3) must be a multiple of --stage2-comms (4), both >= 0"),
    (["--stage2-comms", "-1"], "--stage2-comms (-1), both >= 0"),
    (["--head", "mlp"], "fedloe ensembles linear heads (Eq. 12 is exact only for them)"),
    (["--sample", "5"], "fedloe uses every client at every communication"),
    (["--dataset", "mnist"],
     "has 1 training example(s), too few for a train/tune split; use fewer --clients"),
    (["--dataset", "rcmnist", "--sample", "3"], "fedloe uses every client at every communication"),
    (["--select", "val"], "fedloe reports the end of stage 2 (Table 5 stops at a fixed iteration)"),
    (["--dg", "coral"], "argument --dg: invalid choice: 'coral'"),
    (["--dg-lambda", "-1"], "--dg-lambda must be >= 0, got -1.0"),
    (["--meta-lr", "0"], "--meta-lr must be positive, got 0.0"),
    (["--stage2-lr", "nan"], "argument --stage2-lr: must be a finite number, got 'nan'"),
    (["--stage2-lr", "-1"], "--stage2-lr must be positive, got -1.0"),
    (["--server-steps", "-1"], "--server-steps must be >= 0, got -1"),
    (["--clients", "2000", "--batch-size", "1000"],   # full-batch steps: clients
                                                      # of 2 pass data.py's check
     "too few for a train/tune split; use fewer --clients"),
])
def test_fedloe_flags_bad_input(argv, message, capsys):
    assert message in fails(fedloe.main, argv, capsys)


def test_fedloe_server_functions_refuse_what_they_cannot_mean():
    """Tuning's N predictions, labels and tuning sizes (summing to N, one client at least);
    ensemble's φ [P], Ws [P, m, d], bs [P, m] (P ≥ 1: no head is no ensemble); average: with
    FedAvg's."""
    Y, y = torch.zeros(5, 2, 3), torch.zeros(5, dtype=torch.long)
    for Y_, y_, n_tune in ((Y, y, [2, 2]), (Y, y[:4], [2, 3]), (Y[:4], y, [2, 3]),
                           (Y[:0], y[:0], []), (Y[:, 0], y, [2, 3])):
        assert refused(fedloe.Tuning, Y_, y_, n_tune) == \
            f"Tuning: Y {list(Y_.shape)} and y {list(y_.shape)} for n_tune {n_tune}"
    assert fedloe.Tuning(Y, y, [2, 3]).P == 2
    phi, Ws, bs = torch.ones(2), torch.ones(2, 3, 4), torch.ones(2, 3)
    for phi_, Ws_, bs_ in ((phi[:1], Ws, bs), (torch.ones(3), Ws, bs), (phi, Ws[:1], bs),
                           (phi, Ws, bs[:1]), (phi, Ws, bs[:, :2]), (phi[:0], Ws[:0], bs[:0]),
                           (phi, Ws[..., 0], bs)):
        assert refused(fedloe.ensemble, phi_, Ws_, bs_) == \
            f"ensemble: φ {list(phi_.shape)}, Ws {list(Ws_.shape)}, bs {list(bs_.shape)}"
    W, b = fedloe.ensemble(torch.tensor([0.25, 0.75]), torch.stack([Ws[0], 5 * Ws[1]]), bs)
    assert torch.equal(W, 4 * Ws[0]) and torch.equal(b, bs[0])


# ==================================================================================================
# perinvfl.py
# ==================================================================================================

def test_irm_penalty_and_its_gradient_match_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(7, 4, generator=g, dtype=torch.float64)).requires_grad_()
    y = torch.randint(4, (7,), generator=g)
    p = perinvfl.irm_penalty(z, y)
    q = irm_penalty_by_hand(z, y)
    assert p.item() > 1e-4 and torch.allclose(p, q, rtol=1e-12)
    gp, = torch.autograd.grad(p, z)
    gq, = torch.autograd.grad(irm_penalty_by_hand(z, y), z)
    assert torch.allclose(gp, gq, rtol=1e-10)
    e, zz = 1e-6, z.detach().clone()                      # and one entry by central differences
    zz[2, 1] += e
    up = irm_penalty_by_hand(zz, y)
    zz[2, 1] -= 2 * e
    assert abs((up - irm_penalty_by_hand(zz, y)).item() / (2 * e) - gp[2, 1].item()) < 1e-7


def test_perinvfl_beta_zero_is_local_irm_and_a_large_beta_pins_theta_to_nu():
    model, fed, ctx, args, state = pinv_setup(beta=0.0, S=3, R=2)
    nu = common.get_flat(model)
    perinvfl.perinvfl_round(1, model, fed, args, state, ctx)
    for i, c in enumerate(fed.clients):               # β = 0: R·S steps of local IRM from θ_i^0 = ν
        theta = nu.clone()
        for _ in range(6):
            theta = theta - args.lr * grad_by_hand(theta, c, args.lam, args.weight_decay)
        assert torch.allclose(thetas(state)[i], theta, atol=1e-5)
    # 2βη = 1: line 8 becomes θ ← ν_{i,r} − η∇L_INV(θ): θ_i never strays more than one gradient step
    model, fed, ctx, args, state = pinv_setup(beta=1 / (2 * 0.05), S=4, lam=1.0, theta="kept")
    far = [common.get_flat(model) + 5.0, common.get_flat(model) - 5.0]
    hold(ctx, far)
    nu = common.get_flat(model)
    pv.variant_round(1, model, fed, args, state, ctx)
    for i, c in enumerate(fed.clients):
        assert (thetas(state)[i] - nu).norm() < 0.05 * (far[i] - nu).norm()


def test_perinvfl_nu_is_centralised_irm_step_for_step():
    """--opt adam, R = S = 1: ν follows full-batch IRM on the clients as environments, written out
    as IRM's code does it (mean over environments of risk + λ·penalty, L2 on every parameter, the
    whole loss divided by λ once λ > 1, one Adam), round for step, across the switch to the large λ.
    Adam moments kept per client with the models averaged would not (averaged sign steps)."""
    model, fed, ctx, args, state = pinv_setup(opt="adam", lr=0.01, lam=50.0, anneal=2)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for t in range(1, 7):
        perinvfl.perinvfl_round(t, model, fed, args, state, ctx)
        lam = 50.0 if t > 2 else 1.0
        risks = []
        for c in fed.clients:
            z = ref(c.x.float() / 255)
            risks.append(F.cross_entropy(z, c.y) + lam * irm_penalty_by_hand(z, c.y))
        loss = (torch.stack(risks).mean() + args.weight_decay / 2
                * sum(p.pow(2).sum() for p in ref.parameters()))
        loss = loss / lam if lam > 1 else loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.allclose(common.get_flat(model), common.get_flat(ref), rtol=1e-5, atol=1e-6), t


def spurious_colour_federation(n=1000, p_train=(0.9, 0.8), p_test=0.1, seed=0):
    """ColoredMNIST in miniature: a 3x3 'digit' (one of two fixed patterns, each pixel flipped with
    probability 0.1), label = digit flipped with probability 0.25 (the shape predicts 75%), colour =
    label kept with probability p_e (90% / 80% in training, 10% at test: reversed); the image sits
    in its colour's channel, as data.colored."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.tensor([[1, 0, 1, 0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 0, 1, 0, 1, 0]],
                           dtype=torch.bool)

    def context(p):
        d = torch.randint(2, (n,), generator=g)
        shape = pattern[d] ^ (torch.rand(n, 9, generator=g) < 0.1)
        y = d ^ (torch.rand(n, generator=g) < 0.25).long()
        colour = y ^ (torch.rand(n, generator=g) >= p).long()
        img = torch.zeros(n, 2, 9, dtype=torch.uint8)
        img[torch.arange(n), colour] = shape.to(torch.uint8) * 255
        return img.view(n, 2, 3, 3), y
    clients = []
    for i, p in enumerate(p_train):
        (x, y), (xt, yt) = context(p), context(p_test)
        clients.append(data.Client(i, f"p{p}", x, y, x[:1], y[:1], xt, yt))
    return data.Federation("clients", clients, [], [c.domain for c in clients])


def spurious_colour_model():
    torch.manual_seed(0)
    net = common.Net(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(18, 64),
                                         torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU()),
                     torch.nn.Linear(64, 2))
    for m in net.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            torch.nn.init.zeros_(m.bias)
    return net


def reversed_test_accuracy(lam=1e4, fedavg_lr=None, **kw):
    """Test accuracy (colour reversed) after 300 full-batch rounds of federated IRM (ν of PerInvFL,
    λ = 1 for 50 rounds, then `lam`) or, with fedavg_lr, of FedAvg."""
    fed, net = spurious_colour_federation(), spurious_colour_model()
    if fedavg_lr:
        args = tiny_args(batch_size=10 ** 6, lr=fedavg_lr)
        ctx = tiny_ctx(args, fed, net)
        for t in range(1, 301):
            fedavg.fedavg_round(t, net, fed, args, {}, ctx)
    else:
        args = pinv_args(batch_size=10 ** 6, opt="adam", lr=1e-2, weight_decay=1e-3, lam=lam,
                         anneal=50, beta=1.0, **kw)
        ctx = tiny_ctx(args, fed, net)
        state = perinvfl.init_state(net, fed, args, ctx)
        for t in range(1, 301):
            perinvfl.perinvfl_round(t, net, fed, args, state, ctx)
    return torch.cat([common.correct(net, c.test_x, c.test_y, ctx)
                      for c in fed.clients]).float().mean().item()


def test_federated_irm_ignores_a_planted_spurious_colour_that_fedavg_follows():
    """The invariance machinery end to end: FedAvg follows the colour (about 12% when it reverses);
    federated IRM learns the shape (about 65%, at most 75%). Without the penalty (λ = 0) or with a
    penalty too weak to bind (λ = 100), ν follows the colour as FedAvg does."""
    fedavg_acc, irm_acc = reversed_test_accuracy(fedavg_lr=0.5), reversed_test_accuracy()
    assert (fedavg_acc < 0.25 and irm_acc > 0.55 and irm_acc - fedavg_acc
            > 0.35), (fedavg_acc, irm_acc)
    assert reversed_test_accuracy(lam=0.0) < 0.25 and reversed_test_accuracy(lam=100.0) < 0.4


@on_every_device
def test_perinvfl_end_to_end_and_resume(tmp_path, monkeypatch, device):
    argv = ["--dataset", "rcmnist", "--p-test", "0.9", "--rounds", "12", "--eval-every", "4",
            "--anneal", "6", "--lam", "100", "--lr", "2e-3", "--device", device]
    res, out = run(perinvfl.main, argv, tmp_path)
    r = res["domains"]["clients"]
    before = r["history"][1]                                         # round 8, before λ = 100 bites
    # colour agrees at p_test 0.9
    assert before["test_acc"] > 0.8 and before["global_test_acc"] > 0.8
    assert (r["best_round"] == 12 and len(r["per_client_test_acc"]) == 4
            and len(r["global_per_test"]) == 4)
    assert abs(sum(r["per_client_test_acc"].values()) / 4 - r["test_acc"]) < 1e-6  # equal test sets
    out2 = str(tmp_path / "resumed.json")
    argv[argv.index("--rounds") + 1] = "8"                         # cut at round 4, λ = 100 from 7
    # (GroupDRO's q resumes too)
    for main, more in ((perinvfl.main, []), (pv.main, ["--inv", "groupdro"])):
        resumed = interrupted_then_resumed(main, argv + more, out2, monkeypatch,
                                           lambda b: b["round"] == 4)
        straight, _ = run(main, argv + more, tmp_path, "straight.json")
        assert strip_times(resumed) == strip_times(straight)


def test_one_environments_irmv1_penalty_is_its_head_gradient_against_the_head():
    """With a linear head (W, b), d/dw R(w·f)|_{w=1} = ⟨∇_(W,b) R, (W,b)⟩, so the IRMv1 penalty of
    one environment is zero wherever its risk is stationary in the head (the docstring's reason why
    Eq. 4 with one context per client has no invariance content of its own)."""
    torch.manual_seed(0)
    net = common.Net(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8),
                                         torch.nn.ReLU()),
                     torch.nn.Linear(8, 3)).double()
    x, y = torch.randn(20, 1, 4, 4, dtype=torch.float64), torch.randint(3, (20,))
    W, b = net.classifier.weight, net.classifier.bias
    gW, gb = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x), y), [W, b])
    inner = (gW * W).sum() + (gb * b).sum()
    assert inner.abs() > 1e-3 and torch.allclose(perinvfl.irm_penalty(net(x), y), inner.pow(2),
                                                 rtol=1e-10)


# PerInvFL on leave-one-domain-out datasets: the held-out domain has no client,
# so the global invariant model ν is scored there and
# is the run's test accuracy (`test_model` "nu"),
# selected on ν's pooled validation accuracy; the personalised θ_i are scored on their own clients'
# validation splits; the defaults there; the refusal that remains is one line. And the row label of
# benchmark/diagnostics/rcmnist_ptest.py, which names line 8's reading.
PINV_LODO = ["--dataset", "synthetic", "--test-domain", "1", "--rounds", "3", "--eval-every", "1"]


def accuracy(model, x, y):
    """Independently of the method file: argmax of the model on pixels / 255, in eval mode."""
    model.eval()
    with torch.no_grad():
        return (model(x.float() / 255).argmax(1) == y).float()


def test_perinvfl_lodo_scores_nu_on_the_held_out_domain(tmp_path):
    """Synthetic, style1 held out, 2 clients (one per training domain), 3 rounds. From the final
    checkpoint, independently: ν's accuracy on the held-out domain is the last row's test_acc (and
    its global_test_acc), ν's accuracy on the clients' pooled validation split its val_acc, and
    θ_i's on client i's own validation split its personal_per_val (personal_val_acc: pooled). The
    reported test_acc is that of the round with ν's best validation accuracy (the first of
    equals)."""
    res, out = run(perinvfl.main, PINV_LODO, tmp_path)
    r = res["domains"]["style1"]
    assert res["protocol"] == "lodo" and r["test_model"] == "nu"
    hist = r["history"]
    assert [h["round"] for h in hist] == [1, 2, 3]

    args = types.SimpleNamespace(**res["args"])
    ds = data.load("synthetic", None, args.seed)
    fed = data.federate(ds, 1, args.clients, args.seed, "cpu")
    blob = torch.load(out + ".ckpt", map_location="cpu", weights_only=True)
    assert blob["round"] == 3
    model = common.build_model(args, ds)
    model.load_state_dict(blob["model"])                                       # ν^T
    nu = common.get_flat(model)
    held_out = ds.domains[1]
    nu_test = accuracy(model, held_out.x, held_out.y).mean().item()
    nu_val = accuracy(model, *fed.pooled("val")[:2]).mean().item()
    last = hist[-1]
    assert abs(last["test_acc"] - nu_test) < 1e-6 and abs(last["global_test_acc"] - nu_test) < 1e-6
    assert abs(last["val_acc"] - nu_val) < 1e-6 and last["test_model"] == "nu"

    hits = []
    for c, theta_i in zip(fed.clients, thetas(blob["state"]), strict=True):
        common.set_flat(model, theta_i)
        hits.append(accuracy(model, c.val_x, c.val_y))
    assert len(last["personal_per_val"]) == len(fed.clients) == 2
    assert all(abs(a - h.mean().item()) < 1e-6 for a, h in zip(last["personal_per_val"], hits))
    assert abs(last["personal_val_acc"] - torch.cat(hits).mean().item()) < 1e-6
    assert min((th - nu).abs().max() for th in thetas(blob["state"])) > 1e-6   # the θ_i are not ν

    best = max(hist, key=lambda h: h["val_acc"])                               # the first of equals
    assert (r["best_round"] == best["round"] and r["test_acc"] == best["test_acc"]
            == best["global_test_acc"])
    assert (r["personal_val_acc"] == best["personal_val_acc"] and res["mean_test_acc"]
            == r["test_acc"])


def test_perinvfl_lodo_defaults_and_one_epoch_of_line_9(monkeypatch):
    """On a leave-one-domain-out dataset the defaults are the dataset's common ones (rmnist:
    ConvNet, FedIIR's Table 3 lr 1e-2 and batch 64, best validation), Algorithm 1's plain steps
    (momentum 0, λ = 1 throughout, R = one local epoch); rcmnist keeps IRM's recipe with R = 1. With
    `--R epoch` client i takes E·⌈n_i/B⌉ steps of line 9, each after S steps of line 8 (batches
    drawn counted)."""
    a = resolved_args(perinvfl, ["--dataset", "rmnist"])
    assert (a.model, a.lr, a.batch_size, a.select, a.rounds, a.local_epochs) == (
        "convnet", 1e-2, 64, "val", 100, 1)
    assert (a.R, a.S, a.opt, a.momentum, a.lam, a.anneal, a.beta) == (
        "epoch", 1, "sgd", 0.0, 1.0, 0, 1.0)
    rc = resolved_args(perinvfl, ["--dataset", "rcmnist"])
    assert (rc.R, rc.opt, rc.lam, rc.anneal, rc.eta) == (1, "adam", 91257.186, 190, 0.1)

    model, fed = tiny_model(), tiny_federation()
    args = pinv_args(R="epoch", S=2, batch_size=4, local_epochs=2)
    ctx = tiny_ctx(args, fed, model)
    state = perinvfl.init_state(model, fed, args, ctx)
    drawn, batches = [], common.batches

    def counted(n, *a, **k):                           # every minibatch a client draws, by its size
        for idx in batches(n, *a, **k):
            drawn.append(n)
            yield idx
    monkeypatch.setattr(common, "batches", counted)
    perinvfl.perinvfl_round(1, model, fed, args, state, ctx)
    for c in fed.clients:
        assert drawn.count(c.n) == (2 + 1) * 2 * math.ceil(c.n / 4), (c.n, drawn.count(c.n))


def test_perinvfl_refusal_on_lodo_is_one_line(capsys):
    """On leave-one-domain-out, --parallel-clients on (PerInvFL trains its clients one after another
    there) is refused in one line with its reason."""
    line = fails(perinvfl.main, PINV_LODO + ["--parallel-clients", "on"], capsys)
    assert "--parallel-clients on: perinvfl trains its clients one after another" in line
    assert "fixed-clients dataset" not in line


CASES = {   # the loop's arguments, and the same as perinvfl.py's flags
    # IRM, θ_i reset, R = S = 2, minibatches, line 8 with
    # momentum, the server's Adam, λ = 50 from round 2
    "irm-reset-adam": (dict(lam=50.0, anneal=1, beta=0.5, wd=0.01, gamma=0.1, eta=0.05, alpha=1.0,
                            momentum=0.0, R=2, S=2, B=4),
                       dict(inv="irm", personalize="dual", theta="reset", opt="adam", R=2, S=2)),
    # GroupDRO, θ_i kept (perinvfl_variants.py), R = one epoch's steps, the plain average at α 0.5
    "groupdro-kept-epoch": (dict(lam=3.0, anneal=0, beta=0.7, wd=0.01, gamma=0.1, eta=0.05,
                                 alpha=0.5, momentum=0.0,
                                 R="epoch", S=1, B=4, reading="kept", adam=False, groupdro=True),
                            dict(inv="groupdro", personalize="dual", theta="kept", opt="sgd",
                                 R="epoch", S=1)),
    # IRM-L2 on line 8, IRM's rescaling at λ = 3 from round 1, full batch
    "l2-full-batch": (dict(lam=3.0, anneal=0, beta=0.7, wd=0.01, gamma=0.1, eta=0.05, alpha=1.0,
                           momentum=0.0, R=1, S=1, B=10 ** 6, personalize="l2"),
                      dict(inv="irm", personalize="l2", theta="reset", opt="adam", R=1, S=1)),
}


@pytest.mark.parametrize("case", CASES)
def test_perinvfl_copied(case):
    """Two rounds: ν^2, every θ_i and q of the copied loop are those of perinvfl_round, bit for
    bit."""
    m = pinv_copied()
    clients = three_clients()
    loop, extra = CASES[case]
    nu, theta, q = copied_perinvfl_rounds(m, clients, 2, **loop)
    expected, state = perinvfl_rounds(clients, 2, pinv_flags(loop, extra))
    assert torch.equal(nu, expected), (nu - expected).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(theta, thetas(state), strict=True))
    assert torch.equal(q, state["q"])
    assert min((th - nu).abs().max() for th in theta) > 1e-4          # the θ_i are not ν
    if loop.get("groupdro"):
        assert (q - 1 / 3).abs().max() > 1e-4                          # and q moved
    else:
        other, _, _ = copied_perinvfl_rounds(m, clients, 2, **dict(loop, lam=0.0, anneal=0))
        assert (other - nu).abs().max() > 1e-4                         # the IRMv1 term acted


# Lines 8 and 9 of every sampled client at once (--R
# 1): perinvfl.client_update on a stacked site, its two
# common.local_train calls through common.at_once with
# the sequential objectives (J_i; L_INV with IRMv1's
# dummy-scale derivative a nested torch.func.grad). Measured
# on the CPU (torch float32): the tolerances below.
PINV_PAR = ["--R", "1", "--batch-size", "100000", "--lam", "50", "--anneal", "1", "--beta", "0.5",
            "--S", "2", "--weight-decay", "1e-3"]


def test_parallel_perinvfl_line_9_matches_sequential_across_the_lambda_switch(
        tmp_path, monkeypatch, dtype):
    """3 rounds with λ = 1 in round 1 and λ = 50 (loss divided by 50) after: ν, every θ_i and the
    uploaded risks agree with the sequential run; the at-once step is not the penalty-free one.
    Relative differences; float64: ν 5.8e-17, update 6.1e-14, θ_i 3.1e-18, risks 0 (tolerances
    1e-12, 1e-11 (160x), 1e-12, 1e-6). float32, measured at 1 / 2 threads: ν 3.2e-8 / 3.2e-8, update
    ν_T − ν_0 4.1e-5 / 4.1e-5 (a small update, 8e-4 of ν), θ_i 1.5e-9 / 1.7e-9, risks 8.6e-8 / 0;
    tolerances 1e-6 (31x), 1e-3 (24x), 1e-7 (59x), 1e-5 (116x)."""
    args = method_args(perinvfl, "perinvfl", PINV_PAR, tmp_path)
    out = both_ways(perinvfl.perinvfl_round, args, 3, perinvfl.init_state)
    (seq, nu0, s_state, s_loss), (par, _, p_state, p_loss) = out["off"], out["on"]
    f32 = dtype == torch.float32
    nu_tol, update_tol, theta_tol, risk_tol = (1e-6, 1e-3, 1e-7, 1e-5) if f32 else (
        1e-12, 1e-11, 1e-12, 1e-6)
    assert seq.dtype == torch.get_default_dtype()
    assert (rel(seq, nu0) > 1e-4 and rel(par, seq) < nu_tol and rel(par - nu0, seq - nu0)
            < update_tol)
    assert all(rel(p, s) < theta_tol for p, s in zip(thetas(p_state), thetas(s_state), strict=True))
    assert sorted(p_loss) == sorted(s_loss)
    assert torch.allclose(torch.stack([p_loss[i] for i in s_loss]),
                          torch.stack(list(s_loss.values())),
                          rtol=risk_tol, atol=0)
    args.lam = 0.0                                            # the same rounds without IRMv1's term
    free = both_ways(perinvfl.perinvfl_round, args, 3, perinvfl.init_state)["off"][0]
    assert rel(free - nu0, seq - nu0) > 100 * rel(par - nu0, seq - nu0)


def test_parallel_perinvfl_run_matches_sequential_and_resumes(tmp_path, monkeypatch, dtype):
    """4 rounds through main(). float64: max |Δν| 4.4e-16, logged risks 0 (tolerances 1e-13, 1e-6).
    float32, measured at 1 / 2 threads: max |Δν| 5.0e-6 / 5.0e-6, risks 6.0e-7 / 6.0e-7 (relative);
    tolerances 1e-4 (20x), 1e-5 (17x)."""
    argv = QUICK + ["--clients", "3", "--test-domain", "0", "--R", "1", "--batch-size", "100000",
                    "--lam", "20", "--anneal", "2", "--device", "cpu"]  # the tolerances:
                                                                        # measured on the CPU
    seq, seq_out = run(perinvfl.main, argv + ["--parallel-clients", "off"], tmp_path, "seq.json")
    full, full_out = run(perinvfl.main, argv + ["--parallel-clients", "on"], tmp_path, "full.json")
    assert full["args"]["parallel_clients"] == "on"
    f32 = dtype == torch.float32
    # ν after 4 rounds
    assert max_diff(final_theta(full_out), final_theta(seq_out)) < (1e-4 if f32 else 1e-13)
    assert torch.allclose(history_losses(full), history_losses(seq), rtol=1e-5 if f32 else 1e-6,
                          atol=0)   # risks
    if not f32:
        return                                           # resuming: bit for bit, checked in float32
    resumed = interrupted_then_resumed(perinvfl.main, argv + ["--parallel-clients", "on"],
                                       str(tmp_path / "cut.json"),
                                       monkeypatch, lambda blob: blob["round"] == 2)
    assert strip_times(resumed) == strip_times(full)
    assert torch.equal(final_theta(str(tmp_path / "cut.json")), final_theta(full_out))


def test_parallel_perinvfl_refuses_with_its_reason(tmp_path, capsys):
    """--R other than 1: line 8 reads each client's own ν_{i,r}, so the clients cannot share the
    steps; --R 1 in minibatches runs at once (each client's fresh draws from its own stream)."""
    line = fails(perinvfl.main, QUICK + ["--parallel-clients", "on"], capsys)
    assert line.startswith("perinvfl.py: error: --parallel-clients on: ") and "unless --R 1" in line
    assert line.endswith("; use off")
    res, _ = run(perinvfl.main, QUICK + ["--R", "1", "--batch-size", "8", "--rounds", "1",
                                         "--test-domain", "0",
                                         "--parallel-clients", "on"], tmp_path)
    assert res["args"]["parallel_clients"] == "on"


@pytest.mark.parametrize("argv,message", [
    (["--dataset", "rmnist", "--R", "0"], "--R must be at least 1 or 'epoch', got 0"),
    (["--dataset", "rcmnist", "--beta", "nan"],
     "argument --beta: must be a finite number, got 'nan'"),
    (["--dataset", "rcmnist", "--lam", "-1"], "--lam must be >= 0, got -1.0"),
    (["--dataset", "rcmnist", "--S", "0"], "--S must be at least 1, got 0"),
    (["--dataset", "rcmnist", "--eta", "0"], "--eta must be positive, got 0.0"),
    (["--dataset", "rcmnist", "--momentum", "0.9"], "--momentum must be 0, got 0.9"),
])
def test_perinvfl_flags_bad_input(argv, message, capsys):
    assert message in fails(perinvfl.main, argv, capsys)


def test_perinvfl_server_functions_refuse_what_they_cannot_mean():
    """Line 10's two forms take the clients' mean Δ_i (on_clients' reduction): one of another
    shape than ν is refused (a length-1 mean would broadcast)."""
    for name, fn in (("server_update", lambda nu, d: perinvfl.server_update(nu, d, 1.0)),
                     ("server_adam", lambda nu, d: perinvfl.server_adam(nu, d, 1.0, 0.1))):
        assert refused(fn, TH, TH[:1]) == f"{name}: mean Δ_i of shape (1,) for ν of shape (4,)"
        assert refused(fn, TH, TH[None]) == f"{name}: mean Δ_i of shape (1, 4) for ν of shape (4,)"
    assert torch.equal(perinvfl.server_update(TH, TH + 1, 0.5), 1.5 * TH + 0.5)
    nu, _ = perinvfl.server_adam(TH, TH + 1, 1.0, 0.1)
    assert torch.allclose(nu, TH + 0.1)                      # Adam's first step: lr · sign


# ==================================================================================================
# fedipg.py
# ==================================================================================================

def test_fedipg_lam_is_1e_4_for_every_resnet_and_1e_3_otherwise(tmp_path):
    """--lam's help says 1e-4 for ResNets: WaterBird's ResNet-18 and a --model resnet18 on the
    digits too."""
    lam = lambda *argv: method_args(fedipg, "fedipg", ["--no-pretrained", *argv], tmp_path).lam
    # (the helper's default: cnn)
    assert lam("--dataset", "waterbird", "--model", "resnet18") == 1e-4
    assert lam("--dataset", "pacs", "--model", "resnet50") == lam("--model", "resnet18") == 1e-4
    assert (lam() == lam("--dataset", "rmnist", "--model", "convnet")
            == lam("--dataset", "stained", "--model", "mlp") == 1e-3)
    assert "1e-4 for the ResNets" in dict((a.dest, a.help) for a in fedipg_parser()._actions)["lam"]


def fedipg_parser():
    return config.parser(fedipg.METHOD)


def test_fedipg_refuses_momentum_and_epochs_its_papers_step_would_ignore(tmp_path, capsys):
    for argv, flags in ((["--momentum", "0.5"], "--momentum applies"),
                        (["--local-epochs", "2"], "--local-epochs applies"),
                        (["--momentum", "0", "--local-epochs", "1"],
                         "--momentum and --local-epochs apply")):
        line = fails(fedipg.main, QUICK + ["--local-step", "paper"] + argv, capsys)
        assert line == (f"fedipg.py: error: {flags} to --local-step sgd only: the paper's step "
                        "(Eq. 2) is one plain gradient step on the client's whole split")
    paper = method_args(fedipg, "fedipg", ["--local-step", "paper"], tmp_path)
    assert (paper.momentum, paper.local_epochs) == (0.0, 1)         # recorded as what the step does
    sgd = method_args(fedipg, "fedipg", [], tmp_path)
    # the default: the dataset's
    assert sgd.local_step == "sgd" and (sgd.momentum, sgd.local_epochs) == (0.9, 1)
    fl = method_args(fedipg, "fedipg", ["--local-step", "sgd", "--dataset", "mnist",
                                        "--clients", "100"], tmp_path)
    assert (fl.momentum, fl.local_epochs) == (0.0, 5)                            # FedOMG's FL table
    assert (method_args(fedipg, "fedipg", ["--local-step", "sgd", "--momentum", "0.5"],
                        tmp_path).momentum == 0.5)
    with pytest.raises(SystemExit):
        fedipg.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "local SGD momentum (default for rmnist: 0.9)" in text            # --local-step sgd's


def scaled_risk_derivative(model, x, y):
    """d/ds R(s·w) at s = 1, independently of fedipg: the model called with every parameter times
    s."""
    s = torch.ones((), dtype=torch.float64, requires_grad=True)
    params = {k: s * p for k, p in model.named_parameters()}
    risk = F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
    return torch.autograd.grad(risk, s, create_graph=True)[0]


def tiny_chain64():
    """Conv, ReLU, GroupNorm, max pool, a second block, average pool and an MLP head: every rule of
    fedipg.tangent, the ȧ = 0 and ȧ = a shortcuts and the general case."""
    torch.manual_seed(1)
    nn = torch.nn
    return common.Net(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.GroupNorm(2, 4),
                                    nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.ReLU(),
                                    nn.GroupNorm(2, 4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                    nn.Linear(4, 3), nn.ReLU()),
                      nn.Linear(3, 2)).double()


def ipg_loss(lam, mode="auto"):
    """f_i of Eq. 9 on a batch through fedipg.f_i with the model's own parameters and the batch mean
    (w_j = 1/n): d by `tangent` along the model's chain (auto, where it is one), or by
    torch.func.jvp (mode jvp)."""
    return lambda model, x, y: fedipg.f_i(model, dict(model.named_parameters()),
                                          dict(model.named_buffers()), x, y,
                                          torch.full((len(y),), 1 / len(y), dtype=x.dtype), lam,
                                          None if mode == "jvp" else fedipg.chain(model))


@pytest.mark.parametrize("mode,net", [("jvp", "mlp"), ("tangent", "chain"), ("jvp", "chain")])
def test_fedipg_penalty_and_its_gradient_match_finite_differences(mode, net):
    model = tiny_net64() if net == "mlp" else tiny_chain64()
    g = torch.Generator().manual_seed(0)
    shape = (7, 4) if net == "mlp" else (7, 1, 6, 6)
    x, y = (torch.randn(*shape, generator=g, dtype=torch.float64),
            torch.randint(2, (7,), generator=g))
    w = list(model.parameters())
    grad_R = torch.autograd.grad(F.cross_entropy(model(x), y), w)
    d = scaled_risk_derivative(model, x, y)
    # ⟨∇R, w⟩ = d/ds R(s·w)
    assert torch.allclose(sum((gi * wi).sum() for gi, wi in zip(grad_R, w)), d, atol=1e-12)
    with torch.no_grad():                                  # and d/ds by a central difference in s
        def risk_at(s):
            scaled = {k: s * p for k, p in model.named_parameters()}
            return F.cross_entropy(torch.func.functional_call(model, scaled, (x,)), y)
        fd_s = (risk_at(1.000001) - risk_at(0.999999)) / 2e-6
    assert abs(fd_s - d) < 1e-8 and abs(d) > 1e-3

    lam = 0.7
    # Eq. 9 by hand
    f = lambda: F.cross_entropy(model(x), y) + lam * scaled_risk_derivative(model, x, y) ** 2
    loss = ipg_loss(lam, mode)(model, x, y)
    assert torch.allclose(loss, f(), atol=1e-12)
    grads = torch.autograd.grad(loss, w)
    eps = 1e-6
    for p, gp in zip(w, grads):                            # every entry of every parameter
        fd = torch.zeros_like(p)
        for i in range(p.numel()):
            with torch.no_grad():
                p.view(-1)[i] += eps
            up = f().detach()
            with torch.no_grad():
                p.view(-1)[i] -= 2 * eps
            down = f().detach()
            with torch.no_grad():
                p.view(-1)[i] += eps
            fd.view(-1)[i] = (up - down) / (2 * eps)
        assert torch.allclose(gp, fd, atol=1e-7), (gp, fd)
    plain = torch.autograd.grad(F.cross_entropy(model(x), y), w)
    assert not torch.allclose(grads[0], plain[0], atol=1e-4)  # the penalty does change the step


@pytest.mark.parametrize("arch", ["convnet", "cnn", "mlp"])
def test_fedipg_tangent_penalty_equals_the_jvp_one(arch):
    """`tangent` (forward by hand) against torch.func.jvp on the models it serves, in float64: the
    loss and every gradient entry, and the model's chain picks it."""
    a = type("A", (), dict(model=arch, head="linear", no_pretrained=True))
    torch.manual_seed(0)
    model = common.build_model(a, data.synthetic()).double()
    assert fedipg.chain(model) is not None
    g = torch.Generator().manual_seed(1)
    x, y = (torch.rand(5, 3, 16, 16, generator=g, dtype=torch.float64),
            torch.randint(4, (5,), generator=g))
    w = list(model.parameters())
    lt, lp = ipg_loss(0.5, "tangent")(model, x, y), ipg_loss(0.5, "jvp")(model, x, y)
    assert torch.allclose(lt, lp, rtol=1e-12)
    gt, gp = torch.autograd.grad(lt, w), torch.autograd.grad(lp, w)
    assert all(torch.allclose(u, v, rtol=1e-9, atol=1e-12 * v.abs().max()) for u, v in zip(gt, gp))
    plain = torch.autograd.grad(F.cross_entropy(model(x), y), w)
    assert any(not torch.allclose(u, v, rtol=1e-6) for u, v in zip(gt, plain))


@pytest.mark.parametrize("arch", ["convnet", "resnet18"])
def test_fedipg_jvp_penalty_holds_for_groupnorm_and_batchnorm_models(arch):
    """⟨∇R, w⟩ by torch.func.jvp = from the parameter gradients (double backward), with GroupNorm,
    BatchNorm in eval mode and ResNet's in-place additions and ReLUs."""
    a = type("A", (), dict(model=arch, head="mlp" if arch == "resnet18" else "linear",
                           no_pretrained=True))
    torch.manual_seed(0)
    model = common.build_model(a, data.synthetic()).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(4, 3, 32, 32, generator=g), torch.randint(4, (4,), generator=g)
    w = [p for p in model.parameters()]
    ga = torch.autograd.grad(ipg_loss(0.5, "jvp")(model, x, y), w)
    risk = F.cross_entropy(model(x), y)                    # ⟨∇_w R, w⟩ by a double backward
    d = sum((g * p).sum() for g, p in zip(torch.autograd.grad(risk, w, create_graph=True), w))
    gb = torch.autograd.grad(risk + 0.5 * d * d, w)
    if arch == "resnet18":                                 # not a plain chain: jvp
        assert fedipg.chain(model) is None
        assert all(torch.equal(u, v)
                   for u, v in zip(ga, torch.autograd.grad(ipg_loss(0.5)(model, x, y), w)))
    scale = max(v.abs().max() for v in gb)
    assert all(torch.allclose(u, v, atol=1e-4 * scale) for u, v in zip(ga, gb))
    plain = torch.autograd.grad(F.cross_entropy(model(x), y), w)
    assert any(not torch.allclose(u, v, atol=1e-3 * scale) for u, v in zip(ga, plain))


@on_every_device
def test_fedipg_with_lambda_zero_is_fedavg_bit_for_bit(tmp_path, device):
    argv = QUICK + ["--clients", "4", "--sample", "2", "--test-domain", "1", "--global-lr", "0.7",
                    "--device", device]
    # both one client after
    a, _ = run(fedavg.main, argv + ["--parallel-clients", "off"], tmp_path, "avg.json")
    b, _ = run(fedipg.main, argv + ["--lam", "0", "--exit", "off", "--local-step", "sgd",
                                    "--parallel-clients", "off"],
               tmp_path, "ipg.json")                                     # another, on either device
    assert strip_times(a)["domains"] == strip_times(b)["domains"]
    c, _ = run(fedipg.main, argv + ["--lam", "0.01"], tmp_path, "ipg.json")
    assert strip_times(a)["domains"] != strip_times(c)["domains"]


def planted_federation():
    """Six synthetic clients; client 3's labels are permuted, so its gradient fights the others'."""
    fed = data.federate(data.synthetic(), 0, 6, seed=0, device="cpu")
    fed.clients[3].y = (fed.clients[3].y + 1) % 4
    return fed


def test_fedipg_contribution_is_eq_13():
    fed = tiny_federation((6, 10, 4, 8))
    g = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([-2.0, 1.0]),
         torch.tensor([0.5, 2.0])]
    state = {"contrib": {}}
    fedipg.exit_strategy(fed, ipg_args(lr=0.1, exit_L=0.5), state, [0, 1, 2, 3],
                         [6.0, 10.0, 4.0, 8.0], g, [True, True, False, True], False)
    n, fresh = (6, 10, 4, 8), (0, 1, 3)
    for i in range(4):
        others = [j for j in fresh if j != i]                              # fresh, and not i itself
        grad_R = sum(n[j] * g[j] for j in others) / sum(n[j] for j in others)
        expected = 0.1 * n[i] / 28 * (grad_R @ g[i] - 0.25 * g[i] @ g[i]) / (grad_R @ grad_R)
        assert math.isclose(state["contrib"][i][0], expected.item(), rel_tol=1e-6)  # a float32 Gram
    state = {"contrib": {}}                                               # 0: no other fresh client
    fedipg.exit_strategy(fed, ipg_args(lr=0.1, exit_L=0.5), state, [0, 2], [6.0, 4.0],
                         g[:1] + g[2:3], [True, False], False)
    assert list(state["contrib"]) == [2]


def test_fedipg_client_gradient_is_the_full_batch_gradient():
    fed, model = tiny_federation((7, 10)), tiny_model()
    client, args = fed.clients[1], ipg_args(batch_size=3)
    site = common.site(tiny_ctx(args, fed, model), 1, 1, "risk_gradient")
    m = copy.deepcopy(model)
    loss = F.cross_entropy(m(client.x.float() / 255), client.y)
    expected = torch.cat([v.reshape(-1) for v in torch.autograd.grad(loss, list(m.parameters()))])
    by_3 = [(site.prep(client.x[s:s + 3]), client.y[s:s + 3]) for s in range(0, 10, 3)]
    for parts in (by_3, fedipg.in_chunks(site)):        # four chunks, the last of 1; in_chunks: one
        g = fedipg.full_gradient(model, parts, client.n)[0]
        assert torch.allclose(g, expected, atol=1e-6) and g.abs().max() > 1e-3
    assert torch.equal(common.get_flat(model), common.get_flat(m))              # no step taken


# digits: 2^18 values
@pytest.mark.parametrize("shape,n,b,sizes", [((1, 28, 28), 700, 64, [334, 334, 32]),
                                             # a batch size above
                                             ((1, 28, 28), 700, 400, [400, 300]),
                                             # photos: the batch size
                                             ((3, 224, 224), 70, 32, [32, 32, 6]),
                                             ((1, 4, 4), 10, 3, [10])])
def test_fedipg_in_chunks_are_the_batch_size_or_2_18_input_values_if_more(shape, n, b, sizes):
    """The whole split once and in order (each example holds its index), in chunks of --batch-size
    or, where that is more, of 2^18 input values: fewer, larger chunks for small inputs."""
    x = torch.arange(n).view(n, 1, 1, 1).expand(n, *shape)
    client = types.SimpleNamespace(x=x, y=torch.arange(n), n=n)
    site = types.SimpleNamespace(client=client, args=types.SimpleNamespace(batch_size=b), gen=None,
                                 prep=lambda x, train=False, gen=None: x)
    got = list(fedipg.in_chunks(site, train=True))
    assert [len(y) for _, y in got] == sizes and [len(x) for x, _ in got] == sizes
    assert torch.equal(torch.cat([y for _, y in got]), torch.arange(n))
    assert torch.equal(torch.cat([x[:, 0, 0, 0] for x, _ in got]), torch.arange(n))


def ipg_warmup_round(**kw):
    fed = tiny_federation((6, 10, 8, 12))
    model = tiny_model()
    args = ipg_args(sample=4, exit="auto", exit_warmup=2, lr=0.3, **kw)
    state, ctx = fedipg.init_state(model, fed, args, None), tiny_ctx(args, fed, model)
    fedipg.fedipg_round(1, model, fed, args, state, ctx, warmup=True)
    return state["contrib"], common.get_flat(model)


def test_fedipg_contributions_do_not_depend_on_momentum_or_steps():
    base, w0 = ipg_warmup_round()
    # 3 to 18 steps, momentum
    heavy, w1 = ipg_warmup_round(momentum=0.9, batch_size=2, local_epochs=3)
    assert not torch.equal(w0, w1)                                           # the training differed
    assert base.keys() == heavy.keys() == {0, 1, 2, 3}
    # g_i = ∇R_i(w^1) in both
    assert all(math.isclose(base[i][0], heavy[i][0], rel_tol=1e-5) for i in base)


def test_fedipg_estimates_leave_training_unchanged():
    """The warm-up of --exit auto trains exactly as --exit off: the g_i pass draws nothing and takes
    no step (the exits come after the last warm-up round's aggregation)."""
    fed, outs = planted_federation(), []
    for how in ("off", "auto"):
        torch.manual_seed(0)
        model = common.build_model(type("A", (), dict(model="smallconv", head="linear")),
                                   data.synthetic())
        args = ipg_args(sample=6, exit=how, exit_warmup=3, lr=0.05, momentum=0.9, batch_size=32,
                        lam=1e-3)
        state, ctx = fedipg.init_state(model, fed, args, None), tiny_ctx(args, fed, model)
        for t in (1, 2, 3):
            fedipg.fedipg_round(t, model, fed, args, state, ctx, warmup=how == "auto")
        outs.append(common.get_flat(model))
    assert len(state["contrib"][0]) == 3 and torch.equal(*outs)


def test_fedipg_every_in_distribution_client_takes_part_by_default(tmp_path, capsys):
    argv = QUICK + ["--rounds", "1", "--eval-every", "1", "--clients", "5", "--test-domain", "1"]
    run(fedavg.main, argv, tmp_path, "avg.json")
    assert "5 clients, 2 per round" in capsys.readouterr().out              # FedAvg: one per domain
    res, _ = run(fedipg.main, argv, tmp_path, "ipg.json")
    # Eq. 3
    assert "5 clients, 5 per round" in capsys.readouterr().out and res["args"]["sample"] == 5
    res, _ = run(fedipg.main, argv + ["--sample", "3"], tmp_path, "ipg.json")
    assert res["args"]["sample"] == 3


def test_fedipg_id_and_ood_accuracies_pool_the_answers_of_their_own_clients():
    """fedipg.evaluate with client 1 exited (I_OOD): val_acc = id_acc pools the validation answers
    of clients 0 and 2, ood_acc client 1's, and the aberrant-client benchmark's aberrant_acc
    (client 0) and regular_acc (1 and 2) theirs, each equal in float32 to the mean of the pooled
    answers (the sites score once; the server sums by group, common.scores)."""
    import fedipg_aberrant
    args = harness.resolve(fedipg.METHOD, QUICK[:2] + ["--test-domain", "0", "--clients", "3",
                                                       "--exit", "auto", "--device", "cpu",
                                                       "--out", "r.json"])     # (both on the CPU)
    ds = data.load("synthetic", None, args.seed)
    fed = data.federate(ds, 0, args.clients, args.seed, "cpu")
    model = common.global_model(args, ds, torch.device("cpu"))
    ctx = common.make_context(args, fed, model)
    state = {"exited": [1], "contrib": {}}
    val, test, per, extra = fedipg.evaluate(1, model, fed, args, state, ctx)
    pooled = lambda ids: torch.cat([accuracy(model, fed.clients[i].val_x, fed.clients[i].val_y)
                                    for i in ids]).mean().item()
    assert val == extra["id_acc"] == pooled([0, 2]) and extra["ood_acc"] == pooled([1])
    assert pooled([0, 2]) != pooled([1]) and extra["exited"] == [1]
    held_out = ds.domains[0]
    assert test == per[0] == accuracy(model, held_out.x, held_out.y).mean().item()
    args.aberrant, args.aberrant_client = ("rotate", 180.0), 0
    *_, extra = fedipg_aberrant.evaluate(1, model, fed, args, state, ctx)
    assert extra["aberrant_acc"] == pooled([0]) and extra["regular_acc"] == pooled([1, 2])
    assert pooled([0]) != pooled([1, 2])


def test_fedipg_on_stained_mnist_learns_its_training_combinations(tmp_path):
    res, _ = run(fedipg.main, ["--dataset", "stained", "--stain", "fg", "--rounds", "10",
                               "--eval-every", "10", "--test-domain", "c4"], tmp_path)
    a = res["args"]
    assert (a["model"], a["clients"], a["sample"], a["client_size"], a["lam"], a["lr"]) == (
        "mlp", 5, 5, 600, 1e-3, 0.1)
    assert res["domains"]["c4"]["train_examples"] == 5 * 540
    assert res["domains"]["c4"]["val_acc"] > 0.2                            # 10 classes: chance 0.1


# FedIPG and FedIIR against their sources: FedIPG's local step as Eq. 2 (one gradient step
# on f_i of Eq. 9 over the client's whole split) and its warm-up as Algorithm 1's pre-training phase
# (before round 1, outside the T rounds, then w^1
# again); FedIIR's g_bar over augmented inputs on the
# photo datasets, as the official code's training loaders, and its --half. Each computed value is
# checked against a computation written here independently of the method files.
def paper_step_by_hand(model, client, lam, lr, wd):
    """w − η (∇f_i(w) + wd·w), f_i = R_i + λ (d/ds R_i(s·w) at s = 1)² on the client's whole
    training split at once (Eq. 1, 9), in float64, and f_i(w)."""
    m = copy.deepcopy(model).double()
    x, y = client.x.double() / 255, client.y
    f = F.cross_entropy(m(x), y) + lam * scaled_risk_derivative(m, x, y) ** 2
    g = torch.autograd.grad(f, list(m.parameters()))
    return torch.cat([(p - lr * (gp + wd * p)).reshape(-1)
                      for p, gp in zip(m.parameters(), g)]).detach(), f.item()


@pytest.mark.parametrize("penalty", ["tangent", "jvp"])
def test_fedipg_paper_step_is_one_gradient_step_on_eq_9(penalty, dtype, monkeypatch):
    """Eq. 2 with Eq. 9: one step, the whole split (taken in chunks of 3, 3, 3 and 1: the penalty is
    the square of the whole split's d, not a sum of the chunks' squares), and the step returns
    f_i(w). Against the float64 hand computation. float64: the step agrees to 4.7e-9 only, because
    fedipg.full_gradient accumulates d (and R) through .float(), rounding d to float32 before it
    scales the penalty's gradient (tolerance 1e-7: 21x), f_i to 4.7e-8 (tolerance 1e-6: 21x).
    float32, measured at 1 / 2 threads: the step 1.5e-8 (tolerance atol 2e-6 + rtol 1e-5: 260x), f_i
    2.3e-8 (1e-5: 430x)."""
    fed, model = tiny_federation((7, 10)), tiny_model()
    client = fed.clients[1]
    args = ipg_args(lam=5.0, lr=0.5, weight_decay=0.01, batch_size=3, local_step="paper")
    if penalty == "jvp":
        monkeypatch.setattr(fedipg, "chain", lambda model: None)
    want, f = paper_step_by_hand(model, client, 5.0, 0.5, 0.01)
    plain, _ = paper_step_by_hand(model, client, 0.0, 0.5, 0.01)
    w = common.get_flat(model)
    r = fedipg.client_update(common.site(tiny_ctx(args, fed, model), 1, 1, "client_update"),
                             {"w": w})
    got, loss = w + r["delta"] / client.n, r["loss"]                    # (the reply: n_i Δ_i)
    f32 = dtype == torch.float32
    assert got.dtype == dtype and torch.allclose(got.double(), want, rtol=1e-5 if f32 else 0,
                                                 atol=2e-6 if f32 else 1e-7)
    assert (want - plain).abs().max() > 1e-3             # the penalty's part of the step is visible
    assert max_diff(loss.double(), torch.tensor(f, dtype=torch.float64)) < (1e-5 if f32 else 1e-6)


def test_fedipg_round_with_the_paper_step_averages_one_step_per_client(dtype):
    """Eq. 2 then Eq. 3: w^{t+1} = Σ_i n_i (w − η ∇f_i(w)) / Σ_i n_i over the clients (7 and 10).
    float64: 2.8e-10 (d rounded to float32, see the test above; tolerance 1e-8: 36x); float32,
    measured at 1 / 2 threads: 1.1e-8 (tolerance atol 2e-6 + rtol 1e-5: 300x)."""
    fed, model = tiny_federation((7, 10)), tiny_model()
    w = common.get_flat(model).double()
    steps = [paper_step_by_hand(model, c, 0.3, 0.5, 0.0)[0] for c in fed.clients]
    want = (7 * steps[0] + 10 * steps[1]) / 17
    args = ipg_args(lam=0.3, lr=0.5, batch_size=4, local_step="paper")
    fedipg.fedipg_round(1, model, fed, args, fedipg.init_state(model, fed, args, None),
                        tiny_ctx(args, fed, model))
    got = common.get_flat(model)
    assert got.dtype == dtype
    assert torch.allclose(got.double(), want, **(dict(atol=2e-6) if dtype == torch.float32
                                                 else dict(rtol=0, atol=1e-8)))
    assert (want - w).abs().max() > 1e-2


def test_fedipg_defaults_to_the_verdicts_step_and_the_papers_step_is_fedsgd(tmp_path):
    """By default a client takes --local-epochs of minibatch SGD (the step every committed FedIPG
    result used): at λ = 0, fedavg.py's run. --local-step paper is one full-batch step per client:
    at λ = 0, what fedavg.py computes with one batch of the whole split and no momentum (FedSGD), to
    rounding, whatever --batch-size (here 32: only the chunks of the gradient pass)."""
    # (its 1e-5: the CPU's)
    argv = QUICK + ["--clients", "4", "--sample", "2", "--test-domain", "1", "--device", "cpu"]
    sgd, _ = run(fedipg.main, argv + ["--lam", "0", "--parallel-clients", "off"], tmp_path,
                 "sgd.json")
    avg, _ = run(fedavg.main, argv + ["--parallel-clients", "off"], tmp_path, "avg.json")
    # the warm-up: Algorithm 1's alone
    assert sgd["args"]["local_step"] == "sgd" and "warmup" not in sgd["args"]
    assert strip_times(sgd)["domains"] == strip_times(avg)["domains"]
    a, _ = run(fedavg.main, argv + ["--batch-size", "1000", "--momentum", "0",
                                    "--parallel-clients", "off"],
               tmp_path, "avg1.json")
    b, _ = run(fedipg.main, argv + ["--lam", "0", "--local-step", "paper"], tmp_path, "ipg.json")
    ha, hb = a["domains"]["style1"]["history"], b["domains"]["style1"]["history"]
    assert [r["val_acc"] for r in ha] == [r["val_acc"] for r in hb]
    assert all(abs(u["loss"] - v["loss"]) < 1e-5 for u, v in zip(ha, hb))
    # 14 steps of 32
    assert abs(sgd["domains"]["style1"]["history"][-1]["loss"] - hb[-1]["loss"]) > 1e-3


def test_fedipg_pretraining_runs_before_round_1_and_round_1_starts_from_w1(monkeypatch):
    """Algorithm 1: line 1 (pre-training: W rounds of every client, the exits after them), lines 2-4
    (t = 1, the initial w^1 to all): round 1 is one ordinary round from w^1 over I_ID; the W
    pre-training rounds are not among the T."""
    fed, W = planted_federation(), 3
    args = ipg_args(sample=6, lr=0.05, exit="auto", exit_warmup=W, lam=1e-3, local_step="paper",
                    warmup="pretraining")
    model = smallconv()
    w1 = common.get_flat(model)
    calls = []
    step = fedipg.client_update
    monkeypatch.setattr(fedipg, "client_update", functools.wraps(step)(
        lambda site, sent: calls.append(site.client.id) or step(site, sent)))
    state = fedipg.init_state(model, fed, args, None)
    fedipg.fedipg_round(1, model, fed, args, state, tiny_ctx(args, fed, model))
    assert state["exited"] == [3]                                          # the planted client
    assert all(len(state["contrib"][i]) == W for i in range(6))  # W estimates each,
                                                                 # all before round 1
    assert len(calls) == W * 6 + 5                             # W pre-training rounds, then round 1
    pretrained = smallconv()                                # what keeping the warm model would give
    keep = ipg_args(sample=6, lr=0.05, exit="auto", exit_warmup=W, lam=1e-3, local_step="paper")
    s_keep, ctx = fedipg.init_state(pretrained, fed, keep, None), tiny_ctx(keep, fed, pretrained)
    for t in range(1, W + 2):                                  # rounds 1..W the warm-up, model kept
        fedipg.fedipg_round(t, pretrained, fed, keep, s_keep, ctx, warmup=t <= W)
    monkeypatch.undo()
    ref = smallconv()                                          # one round from w^1 without client 3
    plain = ipg_args(sample=6, lr=0.05, exit="off", lam=1e-3, local_step="paper")
    fedipg.fedipg_round(1, ref, fed, plain, {"exited": [3], "contrib": {}},
                        tiny_ctx(plain, fed, ref))
    got, want = common.get_flat(model), common.get_flat(ref)
    assert torch.allclose(got, want, atol=1e-6)                      # (client order: rounding only)
    assert (got - common.get_flat(pretrained)).abs().max() > 1e-3          # not the warmed-up model
    assert s_keep["exited"] == [3] and not torch.equal(w1, got)
    for t in (2, 3):                                                  # no estimates after the phase
        fedipg.fedipg_round(t, model, fed, args, state, tiny_ctx(args, fed, model))
    assert all(len(v) == W for v in state["contrib"].values())


# Copy FedIPG, not the project: its plain functions, lifted by their source into a namespace
# that holds torch alone, driven by the loop of
# docs/fedipg.md ("Copy it") written here — the pre-training
# phase with g_i, Eq. 13 and the exit rule, then rounds of Eq. 2 on f_i (Eq. 9) and Eq. 3 — against
# fedipg.py's own round on the same three clients.
IPG_FUNCTIONS = ("tangent", "risk_and_d", "f_i", "Beside", "full_gradient", "aggregate",
                 "client_contributions")


W, T, LAM = 2, 2, 0.5


def chunks(x, y, b):
    """The client's whole split, in order, in chunks of b or, if more, of 2^18 input values (as
    fedipg.in_chunks), pixels / 255."""
    b = max(b, 2 ** 18 // x[0].numel())
    return [(x[s:s + b].float() / 255, y[s:s + b]) for s in range(0, len(y), b)]


def copied_loop(m, clients, local_step, penalty, L):
    """The docs' loop: W pre-training rounds (t ≤ 0) with every client, each sending g_i; Eq. 13;
    the exit rule; w^1 again; then T rounds over I_ID. The clients come in the order of their ids,
    as the method's replies; each draws from its own stream (the method's pre-training round s draws
    as round −s)."""
    model, sampler, gen = own_model(), torch.Generator().manual_seed(2), streams("client_update")
    # else torch.func.jvp
    layers = [model.featurizer, model.classifier] if penalty == "tangent" else None
    lr, b = ARGS["lr"], ARGS["batch_size"]
    n = [float(len(y)) for _, y in clients]
    w1, I_ID, C = flat(model), [0, 1, 2], {}
    for t in range(1 - W, T + 1):
        w, g = flat(model), []
        S = sorted(I_ID[k] for k in torch.randperm(len(I_ID), generator=sampler).tolist())

        def f(mod, xb, yb):                                                     # f_i on a minibatch
            weights = torch.full((len(yb),), 1 / len(yb))
            return m.f_i(mod, dict(mod.named_parameters()), dict(mod.named_buffers()), xb, yb,
                         weights, LAM, layers)

        def deltas():
            for i in S:
                x, y = clients[i]
                load(model, w)
                if t <= 0:
                    # g_i, for Eq. 13
                    g.append(m.full_gradient(model, chunks(x, y, b), n[i])[0].float())
                if local_step == "paper":
                    # ∇f_i (Eq. 9)
                    grad, _ = m.full_gradient(model, chunks(x, y, b), n[i], LAM, layers)
                    yield -lr * (grad + ARGS["weight_decay"] * w)                       # Eq. 2: Δ_i
                else:
                    own_local_sgd(model, x, y, gen(t if t > 0 else -(t + W), i), lr,
                                  ARGS["momentum"], b, ARGS["local_epochs"], f)
                    yield flat(model) - w                                               # Δ_i
        total = sum(n[i] * d for i, d in zip(S, deltas()))                        # Σ_i n_i Δ_i
        load(model, m.aggregate(w, total, sum(n[i] for i in S)))                        # Eq. 3
        if t <= 0:
            for i, c in zip(S, m.client_contributions(g, [n[i] for i in S], [True] * len(S), sum(n),
                                                      lr, L)):
                C.setdefault(i, []).append(c)                                           # Eq. 13
        if t == 0:                                                              # Section IV's exits
            mean = {i: sum(v) / len(v) for i, v in C.items()}
            out = [i for i in I_ID if mean.get(i, 0.0) <= 0]
            I_ID = [i for i in I_ID if i not in out]
            load(model, w1)                                                             # w^1 to all
    return flat(model), I_ID, C


@pytest.mark.parametrize("local_step,penalty,L", [("paper", "tangent", 0.2), ("paper", "jvp", 0.2),
                                                  ("sgd", "tangent", 0.4), ("sgd", "jvp", 0.4)])
def test_fedipg_copied(local_step, penalty, L, monkeypatch):
    """The copied functions in the test's loop give fedipg.py's w after W pre-training rounds and T
    rounds, its contributions and its exits (L: some of the three clients leave, not all): bit for
    bit, in w and in every C_i (the same operations in the same order)."""
    m = copied(fedipg, *IPG_FUNCTIONS)
    clients = three_clients()
    w, I_ID, C = copied_loop(m, clients, local_step, penalty, L)
    state = {"exited": [], "contrib": {}}
    if penalty == "jvp":
        monkeypatch.setattr(fedipg, "chain", lambda model: None)
    expected = method_rounds(fedipg.fedipg_round, clients, T, state, lam=LAM, exit="auto",
                             exit_warmup=W, exit_L=L, local_step=local_step)
    assert 0 < len(I_ID) < 3 and state["exited"] == [i for i in range(3) if i not in I_ID]
    assert C == state["contrib"] and all(len(c) == W for c in C.values())
    assert torch.equal(w, expected), (w - expected).abs().max()
    assert (w - flat(own_model())).abs().max() > 1e-3                                   # it trained


def test_compiled_fedipg_step_is_one_graph_and_matches_the_clients_one_after_another(
        tmp_path, monkeypatch, dtype):
    """--compile with FedIPG's sgd step (Eq. 9 through the tangent; f_i's Beside module, whose
    forward is fixed on the class, lets torch.compile trace it as one graph), 2 rounds on the CPU,
    with the bounds of test_parallel_fedipg_penalty_matches_sequential. Measured at 1 / 2 threads,
    relative θ, update, max |Δθ|: float64 1.2e-16, 2.3e-15, 1.7e-16 (eager at once: 1.0e-16,
    1.8e-15, 9.4e-17); float32 2.8e-8 / 3.2e-8, 8.8e-7 / 9.9e-7, 2.2e-8, losses 1.2e-7: far inside
    the coarse float32 bounds, which a ReLU or max-pool kink within rounding of zero needs (eager at
    once reached 5.5e-5 at 2 threads)."""
    from torch._dynamo.utils import counters
    args = method_args(fedipg, "fedipg", SGD + IPG + ["--compile"], tmp_path)
    torch._dynamo.reset()
    counters.clear()
    out = both_ways(fedipg.fedipg_round, args, 2, fedipg.init_state)
    assert counters["stats"]["unique_graphs"] == 1
    f32 = dtype == torch.float32
    assert_same_to_tolerance(out, **(dict(params=1e-3, update=5e-2, losses=2e-4) if f32 else F64))
    assert max_abs(out) < (1e-3 if f32 else 1e-13)


@pytest.mark.parametrize("form", ["tangent", "jvp"])
def test_parallel_fedipg_penalty_matches_sequential(tmp_path, monkeypatch, dtype, form):
    """2 rounds. Eq. 9's small CNN has ReLU and max-pool kinks: a pre-activation within rounding of
    zero turns a 1e-8 difference into 1e-5, and with two threads the paths' float32 sums split
    differently. Relative differences; float64: θ 1.0e-16, update 1.8e-15, losses 0, max |Δθ|
    9.4e-17 (tolerances 1e-12, 1e-13: 1000x). float32, measured at 1 / 2 threads: θ 1.6e-7 / 5.5e-5,
    update 7.6e-6 / 2.7e-3, losses 1.7e-7 / 9.8e-6, max |Δθ| 2.0e-7 / 7.9e-5; tolerances 1e-3 (18x),
    5e-2 (18x), 2e-4 (20x), 1e-3 (13x): coarse, set by the two-thread run; the float64 run is the
    check of the paths (with the penalty dropped from the parallel objective float32 differs by
    1e-2)."""
    args = method_args(fedipg, "fedipg", SGD + IPG, tmp_path)
    if form == "jvp":                           # d by torch.func.jvp (the ResNets' form), both ways
        monkeypatch.setattr(fedipg, "chain", lambda model: None)
    out = both_ways(fedipg.fedipg_round, args, 2, fedipg.init_state)
    f32 = dtype == torch.float32
    assert_same_to_tolerance(out, **(dict(params=1e-3, update=5e-2, losses=2e-4) if f32 else F64))
    assert max_abs(out) < (1e-3 if f32 else 1e-13)


@pytest.mark.parametrize("argv,reason", [
    (["--local-step", "paper"], "fedipg trains with --local-step paper one client after another"),
])
def test_parallel_fedipg_refuses_with_its_reason(argv, reason, capsys):
    line = fails(fedipg.main, QUICK + argv + ["--parallel-clients", "on"], capsys)
    assert line.startswith("fedipg.py: error: --parallel-clients on: ") and reason in line
    assert line.endswith("; use off")


def test_parallel_auto_follows_fedipgs_local_step(tmp_path):
    args = method_args(fedipg, "fedipg", [], tmp_path)
    for step, expected in (("paper", "off"), ("sgd", "on")):
        # auto: on for CUDA
        args.local_step, args.parallel_clients, args.device = step, "auto", "cuda"
        common.check_parallel(args, fedipg.METHOD)
        assert args.parallel_clients == expected


def test_fedipg_exit_ranks_a_planted_aberrant_client_worst_and_removes_it(capsys):
    fed = planted_federation()
    args = type("A", (), dict(model="smallconv", head="linear"))
    torch.manual_seed(0)
    model = common.build_model(args, data.synthetic())
    args = ipg_args(sample=2, lr=0.05, momentum=0.9, batch_size=32, exit="auto", exit_warmup=3,
                    lam=1e-3)
    state, ctx = fedipg.init_state(model, fed, args, None), tiny_ctx(args, fed, model)
    for t in range(1, 5):                                               # rounds 1-3: the warm-up
        losses = fedipg.fedipg_round(t, model, fed, args, state, ctx, warmup=t <= 3)
        assert len(next(iter(losses))) == (6 if t <= 3 else 2)      # warm-up: every client trains
    mean = {i: sum(v) / len(v) for i, v in state["contrib"].items()}
    assert len(state["contrib"][0]) == 3 and min(mean, key=mean.get) == 3
    assert state["exited"] == [3] and "exiting: [3]" in capsys.readouterr().out
    for t in range(5, 9):
        # never aggregated again
        assert 3 not in fedipg.fedipg_round(t, model, fed, args, state, ctx, warmup=False)


@pytest.mark.parametrize("argv,message", [
    (["--lam", "-1"], "--lam must be >= 0, got -1.0"),
    (["--exit", "auto", "--exit-warmup", "0"], "--exit-warmup must be at least 1, got 0"),
    (["--exit-L", "0"], "--exit-L must be positive, got 0.0"),
    (["--exit", "sometimes"], "argument --exit: invalid choice: 'sometimes'"),
    (["--dataset", "stained", "--stain", "all"], "argument --stain: invalid choice: 'all'"),
    (QUICK + ["--local-step", "paper", "--parallel-clients", "on"],
     "--parallel-clients on: fedipg trains with --local-step paper one client after another"),
])
def test_fedipg_flags_bad_input(argv, message, capsys):
    assert message in fails(fedipg.main, argv, capsys)


def test_fedipg_server_functions_refuse_what_they_cannot_mean():
    """client_contributions's g_i, sizes and fresh flags one per client, the g_i of one shape, one
    client at least; aggregate: with FedAvg's."""
    g = [TH, TH + 1]
    for g_, n, fresh in ((g, [1.0], [True, True]), (g, [1.0, 2.0], [True]), ([], [], []),
                         (g[:1], [1.0, 2.0], [True, True]), ([TH, TH[:2]], [1.0, 2.0], [True] * 2)):
        assert refused(fedipg.client_contributions, g_, n, fresh, 3.0, 0.1, 0.5) == \
            f"client_contributions: g_i {[x.shape for x in g_]}, n {n}, fresh {fresh}"
    assert fedipg.client_contributions(g, [1.0, 2.0], [True, False], 3.0, 0.1, 0.5)[1] is not None
