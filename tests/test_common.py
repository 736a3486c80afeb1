"""The core's tests (common.py): its models, a round's clients and their engines (one after
another, all at once, compiled), its streams and determinism, through the methods' runs where a
round needs one. No benchmark code: the core stands without it.
"""

import argparse
import dataclasses
import importlib
import math
import os
import subprocess
import sys

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
import harness
from harness import datasets

from tests.helpers import (
    assert_same_to_tolerance, both_ways, F64, HERE, interrupted_then_resumed, LOE, method_args,
    on_every_device, QUICK, ragged_federation, rel, run, strip_times, tiny_ctx,
)


def test_sampling_is_without_replacement():
    ctx = tiny_ctx()
    for _ in range(20):
        s = common.sample_clients(ctx, 50, 5)
        # in the order of ids
        assert len(set(s)) == 5 and all(0 <= c < 50 for c in s) and s == sorted(s)


def test_each_client_stream_depends_on_its_five_values_alone():
    """common.stream: the same (seed, domain, round, client, exchange) give the same draws on every
    call; a change in any one of them gives other draws, also where seed + round + id would collide;
    its seed is BLAKE2b's, as docs/protocol.md states it."""
    import hashlib
    draw = lambda *key: torch.randperm(1000, generator=common.stream(*key, "cpu"))
    base = (0, "style0", 3, 7, "client_update")
    assert torch.equal(draw(*base), draw(*base))
    others = [(1, "style0", 3, 7, "client_update"), (0, "style1", 3, 7, "client_update"),
              (0, "style0", 4, 7, "client_update"), (0, "style0", 3, 8, "client_update"),
              (0, "style0", 3, 7, "classifier_gradient"), (0, "style0", 7, 3, "client_update"),
              (1, "style0", 2, 7, "client_update"), (0, "style0", -3, 7, "client_update")]
    assert all(not torch.equal(draw(*base), draw(*key)) for key in others)
    want = int.from_bytes(hashlib.blake2b(b"0/style0/3/7/client_update", digest_size=8).digest(),
                          "little")
    assert common.stream(*base, "cpu").initial_seed() == want


CLIENT_ORDER_ARGV = {   # 2 rounds on 3 clients (2 sampled where the
                        # method samples): every exchange of a round
    "fedavg": QUICK[:2] + ["--rounds", "2", "--clients", "3", "--sample", "2",
                           "--test-domain", "0"],
    "fediir": QUICK[:2] + ["--rounds", "2", "--clients", "3", "--sample", "2",
                           "--test-domain", "0"],
    "fedomg": QUICK[:2] + ["--rounds", "2", "--clients", "3", "--sample", "2",
                           "--test-domain", "0"],
    "fedloe": QUICK[:2] + ["--clients", "3", "--test-domain", "0", "--stage1-epochs", "1",
                           "--stage1-comms", "1",
                           "--stage2-epochs", "1", "--stage2-comms", "1", "--batch-size", "64"],
    "perinvfl": QUICK[:2] + ["--rounds", "2", "--clients", "3", "--test-domain", "0", "--R", "2",
                             "--S", "2", "--batch-size", "32"],
    "fedipg": QUICK[:2] + ["--rounds", "2", "--clients", "3", "--test-domain", "0",
                           "--exit", "auto", "--exit-warmup", "1"],
}


@pytest.mark.parametrize("method", list(CLIENT_ORDER_ARGV))
def test_clients_taken_in_reverse_order_make_the_same_updates(method, tmp_path, monkeypatch):
    """Every exchange of every round run with the sampled clients taken in reverse order: each
    client's reply (its update, its loss, what it uploads) is the same, bit for bit, and so is the
    run (the server reads the replies in the order of the ids either way). A client's work depends
    on no other's. And the functions the rounds ran on the clients are those the method's record
    declares, each of them (what a Flower node may run: harness.client_functions)."""
    one_by_one, seen, ran = common.one_by_one, {}, set()
    for order in ("forward", "reverse"):
        def engine(fn, S, sents, t, phase, ctx):
            ran.add(harness.methods.qualified(fn))
            if order == "reverse":
                out = one_by_one(fn, S[::-1], sents[::-1], t, phase, ctx)[::-1]
            else:
                out = one_by_one(fn, S, sents, t, phase, ctx)
            seen.setdefault(order, []).append((t, phase, list(S), out))
            return out
        monkeypatch.setattr(common, "one_by_one", engine)
        run(importlib.import_module(method).main, CLIENT_ORDER_ARGV[method]
            + ["--parallel-clients", "off"], tmp_path,
            f"{order}.json")
    forward, reverse = seen["forward"], seen["reverse"]
    assert len(forward) == len(reverse) >= 2 and any(len(S) > 1 for _, _, S, _ in forward)
    for (t, phase, S, a), (t2, phase2, S2, b) in zip(forward, reverse):
        assert (t, phase, S) == (t2, phase2, S2)
        for ra, rb in zip(a, b):
            assert ra.keys() == rb.keys()
            for k in ra:
                same = torch.equal(ra[k], rb[k]) if torch.is_tensor(ra[k]) else ra[k] == rb[k]
                assert same, (method, t, phase, k)
    ckpt = [torch.load(tmp_path / f"{o}.json.ckpt", weights_only=True)["model"]
            for o in ("forward", "reverse")]
    assert all(torch.equal(v, ckpt[1][k]) for k, v in ckpt[0].items())
    record = harness.method(method)
    args = harness.resolve(record, CLIENT_ORDER_ARGV[method] + ["--out", str(tmp_path / "a.json")])
    declared = harness.methods.run_clients(record, args) + record.evaluations
    assert ran == {harness.methods.qualified(f) for f in declared} and len(ran) >= 2
    setup = {f"{method}:init_state"} if record.init_state else set()
    assert harness.client_functions(method, args=args) == ran | setup


def test_what_a_node_may_run_is_each_methods_declaration():
    """harness.client_functions: the record's client functions, its evaluations and its init_state
    by full name, for a method's name or a record (a variant declares its own); an evaluation-only
    node's, the evaluations and the setup alone; nothing for an unknown name."""
    assert harness.client_functions("fediir") == {"fediir:classifier_gradient", "common:score",
                                                  "fediir:client_update", "fediir:init_state"}
    assert harness.client_functions("fediir", evaluate_only=True) == {"common:score",
                                                                      "fediir:init_state"}
    assert harness.client_functions("fedavg") == {"fedavg:client_update", "common:score"}
    assert harness.client_functions("perinvfl", True) == {"perinvfl:score", "perinvfl:init_state"}
    variant = dataclasses.replace(fedavg.METHOD, clients=(fedavg.client_update, common.features))
    assert harness.client_functions(variant) == {"fedavg:client_update", "common:features",
                                                 "common:score"}
    # FedIPG's clients follow from --exit: risk_gradient (Eq. 13's g_i) with exits alone; without
    # the run's arguments, a record whose clients follow from them has none
    for exit, step0 in (("off", set()), ("auto", {"fedipg:risk_gradient"})):
        assert harness.client_functions("fedipg", args=argparse.Namespace(exit=exit)) == {
            "fedipg:client_update", "common:score", "fedipg:init_state"} | step0
    assert harness.client_functions("fedipg") == {"common:score", "fedipg:init_state"}
    # FedLOE's on --stage2-comms: its heads and tuning predictions only with a stage 2
    stage1 = {"fedloe:stage1_update", "common:score", "fedloe:init_state"}
    assert harness.client_functions("fedloe", args=argparse.Namespace(stage2_comms=0)) == stage1
    assert harness.client_functions("fedloe", args=argparse.Namespace(stage2_comms=2)) == stage1 | {
        "fedloe:head_update", "fedloe:tuning_predictions"}
    with pytest.raises(ValueError, match="unknown method 'fedx'"):
        harness.client_functions("fedx")
    assert all(harness.method(m).name == m for m in harness.METHODS)


def test_the_server_sums_the_sites_scores_in_groups_to_the_pooled_accuracies():
    """common.score on each site, common.scores' sums, common.accuracies: the accuracies are those
    of the pooled answers in float32 (torch.equal with .mean()), on the CPU; an empty test set's
    is 0; a subset restricts the validation accuracy to its sites (-1: the sites in none). What
    reaches the server is the sums by group alone: each site's reply is one-hot in its group's
    row; a test set's sum is its sites' together."""
    g = torch.Generator().manual_seed(0)
    sizes = [(7, 13), (11, 3), (5, 17), (0, 9)]        # (validation, test) of fixed clients
    answers = [(torch.rand(v, generator=g) < 0.6, torch.rand(t, generator=g) < 0.3)
               for v, t in sizes]

    def part(right):                 # two-pixel images whose argmax is right where `right` says
        y = torch.randint(2, (len(right),), generator=g)
        return F.one_hot(torch.where(right, y, 1 - y), 2).to(torch.uint8), y
    sites = [data.Client(i, f"c{i}", *part(torch.ones(1, dtype=torch.bool)), *part(a), *part(b))
             for i, (a, b) in enumerate(answers)]
    sites[3].domain = "c2"                              # two sites of one test set
    fed = data.Federation("clients", sites, [], ["c0", "c1", "c2", "nobody"])
    model = torch.nn.Linear(2, 2)                       # the logits are the pixels
    common.set_flat(model, torch.cat([torch.eye(2).reshape(-1), torch.zeros(2)]))
    ctx = common.Context(torch.device("cpu"), torch.Generator(), lambda x, **_: x.float(),
                         args=argparse.Namespace(seed=0), fed=fed, model=model, clients={})
    replies = []
    ctx.engine = lambda *a: replies.extend(common.one_by_one(*a)) or replies
    sums = common.scores(1, model, fed, ctx, subsets=[[0, 2]])
    assert sums.keys() == {"val", "test"} and sums["val"].shape == (4, 2, 2)
    for c, r in enumerate(replies):                     # a site's counts in its group's row alone
        row = min(c, 2) * 2 + (0 if c in (0, 2) else 1)
        assert all(r[k].count_nonzero(1).nonzero().flatten().tolist() in ([], [row]) for k in r)
        assert r["test"][row].tolist() == [answers[c][1].sum().item(), sizes[c][1]]
    assert sums["test"][2].sum(0).tolist() == [(answers[2][1].sum() + answers[3][1].sum()).item(),
                                               26]
    val, test, per = common.accuracies(sums)
    pooled = lambda k, idx: torch.cat([answers[i][k] for i in idx]).float().mean().item()
    assert val == pooled(0, [0, 1, 2, 3]) and test == pooled(1, [0, 1, 2, 3])
    assert per == [pooled(1, [0]), pooled(1, [1]), pooled(1, [2, 3]), 0.0]
    assert common.accuracies(sums, 0)[0] == pooled(0, [0, 2])
    assert common.accuracies(sums, -1)[0] == pooled(0, [1, 3])
    assert common.accuracies(sums, [0, 1])[0] == val


@on_every_device
def test_determinism(tmp_path, device):
    argv = QUICK + ["--clients", "5", "--sample", "3", "--device", device]
    a, _ = run(fedavg.main, argv, tmp_path, "a.json")
    b, _ = run(fedavg.main, argv, tmp_path, "b.json")
    c, _ = run(fedavg.main, argv + ["--seed", "1"], tmp_path, "c.json")
    assert strip_times(a) == strip_times(b)
    assert strip_times(a)["domains"] != strip_times(c)["domains"]


@pytest.mark.parametrize("module", ["fedipg", "fedloe"])
def test_nondeterministic_changes_no_cpu_number(tmp_path, module):
    """Deterministic mode is on by default and --nondeterministic turns it off; on the CPU, whose
    kernels are deterministic either way, the numbers stay the same."""
    main = {"fedipg": lambda a: fedipg.main(QUICK + ["--clients", "4", "--sample", "2"] + a),
            "fedloe": lambda a: fedloe.main(LOE + a)}[module]
    argv = ["--test-domain", "1", "--device", "cpu"]
    a, _ = run(main, argv, tmp_path, "a.json")
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"]
    b, _ = run(main, argv + ["--nondeterministic"], tmp_path, "b.json")
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    common.deterministic(True)
    assert strip_times(a)["domains"] == strip_times(b)["domains"]


def test_deterministic_mode_costs_no_compiler_import():
    """common.deterministic turns torch's flag on without torch.use_deterministic_algorithms, which
    imports torch._inductor (2 s of every Flower node's setup per message, flower/node_cost.py):
    in a fresh process the flag is on and the compiler never loaded."""
    code = ("import sys, torch\nfrom common import deterministic\n"
            "deterministic(True)\nprint(torch.are_deterministic_algorithms_enabled(), "
            "'torch._inductor' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                       env=dict(os.environ, PYTHONPATH=str(HERE)))
    assert r.stdout.split() == ["True", "False"], r.stderr[-500:]


def test_label_skew_fl_path_on_embedded_mnist(tmp_path):
    # alpha 1 and a larger lr: at the default alpha 0.1 FedAvg needs far more than a test's rounds
    res, _ = run(fedavg.main, ["--dataset", "mnist", "--rounds", "6", "--eval-every", "3",
                               "--local-epochs", "2", "--lr", "0.05", "--alpha", "1"], tmp_path)
    d = res["domains"]["clients"]
    assert (res["protocol"] == "clients" and res["args"]["clients"] == 100 and res["args"]["sample"]
            == 20)
    assert len(d["per_client_test_acc"]) == 100
    assert d["test_acc"] > 0.25                                        # 10 classes: chance is 0.1


def test_fedavg_on_a_fake_pacs_tree_with_resnet(tmp_path):
    datasets.make_fake_tree(tmp_path, per_class=2)
    res, _ = run(fedavg.main, ["--dataset", "pacs", "--data-root", str(tmp_path), "--no-pretrained",
                               "--rounds", "1", "--test-domain", "sketch",
                               "--batch-size", "8"], tmp_path)
    assert res["args"]["model"] == "resnet18" and res["args"]["head"] == "mlp"
    assert 0 <= res["domains"]["sketch"]["test_acc"] <= 1


def test_resnet_batchnorm_stays_in_eval_mode():
    a = type("A", (), dict(model="resnet18", no_pretrained=True, head="mlp"))
    model = common.build_model(a, data.synthetic()).train()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and not any(m.training for m in bns) and model.classifier.training
    before = [m.running_mean.clone() for m in bns]
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    assert all(torch.equal(b, m.running_mean) for b, m in zip(before, bns))


def test_global_pooling_is_a_plain_mean_in_every_model():
    """AdaptiveAvgPool2d's CUDA backward kernel is not deterministic: no model may hold one."""
    x = torch.randn(3, 8, 5, 7)
    assert torch.equal(common.GlobalMean()(x), torch.nn.AdaptiveAvgPool2d(1)(x))  # the same numbers
    for model in ("convnet", "smallconv", "resnet18"):
        a = type("A", (), dict(model=model, no_pretrained=True, head="linear"))
        net = common.build_model(a, data.synthetic())
        assert any(isinstance(m, common.GlobalMean) for m in net.modules()), model
        assert not any(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in net.modules()), model


def test_heads_start_as_the_fedIIR_code():
    for model, head in (("convnet", "linear"), ("convnet", "mlp")):
        args = type("Args", (), dict(model=model, head=head, no_pretrained=True))
        torch.manual_seed(0)
        ws = [m.weight for m in common.build_model(args, data.synthetic()).classifier.modules()
              if isinstance(m, torch.nn.Linear)]
        for w in ws:                             # Kaiming-normal: std sqrt(2 / fan_in), not uniform
            std = math.sqrt(2 / w.shape[1])
            assert abs(w.std().item() - std) < 0.1 * std and w.abs().max() > 2.2 * std


def test_mlp_has_irms_initialisation():
    args = type("Args", (), dict(model="mlp", head="linear", no_pretrained=True))
    net = common.build_model(args, data.load("rcmnist"))
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3
    for m in linears:                             # Xavier-uniform weights, zero biases (IRM's code)
        bound = math.sqrt(6 / (m.in_features + m.out_features))
        assert torch.all(m.bias == 0) and 0.98 * bound < m.weight.abs().max() <= bound
        assert abs(m.weight.std().item() - bound / math.sqrt(3)) < 0.03 * bound


def test_parallel_minibatches_are_the_sequential_ones(tmp_path, monkeypatch):
    """Both ways every client draws its minibatches from its own stream (common.batches), the same
    index tensors; at once they are the rows of the plan that at_once trains on (padding -1
    aside)."""
    args = method_args(fedavg, "fedavg", ["--clients", "5", "--sample", "5", "--batch-size", "16",
                                          "--local-epochs", "3"], tmp_path)
    drawn, batches = {}, common.batches

    def logged(n, batch_size, gen, device, epochs=None, steps=None):
        out = list(batches(n, batch_size, gen, device, epochs, steps))
        drawn.setdefault(mode, {})[(n, gen.initial_seed())] = out
        return iter(out)
    monkeypatch.setattr(common, "batches", logged)
    for mode in ("off", "on"):
        both_ways(fedavg.fedavg_round, args, 1)
    assert drawn["off"].keys() == drawn["on"].keys() and len(drawn["on"]) == 5
    assert sorted(n for n, _ in drawn["on"]) == [20, 33, 45, 70, 108]           # the ragged clients
    for key, seq in drawn["off"].items():
        assert len(seq) == 3 * -(-key[0] // 16) and all(torch.equal(a, b)
                                                        for a, b in zip(seq, drawn["on"][key]))
    assert len({s for _, s in drawn["on"]}) == 5                         # five streams, none shared


def test_parallel_fedavg_matches_sequential_with_ragged_clients_momentum_and_weight_decay(
        tmp_path, monkeypatch, dtype):
    """2 rounds, relative differences. float64: θ 6e-17, update 5e-16, losses 0 (tolerance 1e-12).
    float32 at lr 0.02, measured at 1 / 2 threads (Intel Xeon): θ 2.0e-8 / 2.0e-8, update 5.3e-7 /
    5.2e-7; tolerances 1e-6 (50x), 1e-5 (19x). At the synthetic default lr 0.05 float32 training is
    chaotic here (a max-pool or ReLU switch amplifies the rounding: θ 3.7e-4 apart after 2 rounds at
    one thread, 4e-3 after 4; float64 6e-17)."""
    args = method_args(fedavg, "fedavg", ["--clients", "5", "--sample", "4", "--batch-size", "16",
                                          "--local-epochs", "2",
                                          "--momentum", "0.9", "--weight-decay", "1e-2",
                                          "--lr", "0.02"], tmp_path)
    tol = dict(params=1e-6, update=1e-5) if dtype == torch.float32 else F64
    assert_same_to_tolerance(both_ways(fedavg.fedavg_round, args, 2), **tol)


def test_parallel_client_with_fewer_steps_never_moves_after_its_last(tmp_path, dtype):
    """Client 0 (6 examples: 2 steps) beside client 1 (40: 10 steps), momentum and weight decay:
    were it not put back after its last step, its momentum would carry it on for 8 more. Relative
    differences; float64: θ, momentum and loss 0 (tolerances 1e-12, 1e-12, 1e-6). float32, measured
    at 1 / 2 threads: θ 3.5e-9 / 3.5e-9, momentum 6.7e-8 / 6.7e-8, loss 8.8e-8 / 8.8e-8; tolerances
    1e-7 (28x), 1e-6 (15x), 1e-6 (11x)."""
    fed = ragged_federation((6, 40))
    args = method_args(fedavg, "fedavg", ["--batch-size", "4", "--momentum", "0.9",
                                          "--weight-decay", "0.1",
                                          "--lr", "0.05", "--parallel-clients", "on"], tmp_path)
    torch.manual_seed(0)
    model = common.build_model(args, data.synthetic())
    theta = common.get_flat(model)
    ends = {}
    for ids in ([0, 1], [0]):                               # both, then client 0 alone: no put-back
        ctx = tiny_ctx(args, fed, model)
        site = common.site(ctx, ids, 1, "client_update")               # stacked, even alone
        thetas, losses = common.local_train(site, theta, keep_momentum=True)
        ends[len(ids)] = thetas[0], losses[0], ctx.clients[0]["momentum"]
    (both, loss_both, m_both), (alone, loss_alone, m_alone) = ends[2], ends[1]
    tol = (1e-7, 1e-6, 1e-6) if dtype == torch.float32 else (1e-12, 1e-12, 1e-6)
    assert both.dtype == torch.get_default_dtype()
    assert rel(both, alone) < tol[0] and rel(m_both, m_alone) < tol[1]
    assert torch.allclose(loss_both, loss_alone, rtol=tol[2], atol=0)
    assert rel(alone, theta) > 1e-3


def test_compiled_step_is_one_graph_matches_the_clients_one_after_another_and_repeats(
        tmp_path, monkeypatch, dtype):
    """--compile: at_once's stacked step through torch.compile (fullgraph), on all clients at every
    step (those done weigh 0 and are put back). FedAvg's 2 rounds of
    test_parallel_fedavg_matches_sequential_... against the clients one after another, both on the
    CPU: one graph for every step of both rounds, the same tolerances; a second compiled run equal
    bit for bit. Measured float32 (2 threads, Intel Xeon): θ 1.4e-8, update 6.1e-7 (the eager step
    at once: 1.4e-8); float64: below 1e-15."""
    from torch._dynamo.utils import counters
    args = method_args(fedavg, "fedavg", ["--clients", "5", "--sample", "4", "--batch-size", "16",
                                          "--local-epochs", "2",
                                          "--momentum", "0.9", "--weight-decay", "1e-2",
                                          "--lr", "0.02", "--compile"],
                       tmp_path)
    torch._dynamo.reset()
    counters.clear()
    out = both_ways(fedavg.fedavg_round, args, 2)
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 0
    tol = dict(params=1e-6, update=1e-5) if dtype == torch.float32 else F64
    assert_same_to_tolerance(out, **tol)
    assert torch.equal(both_ways(fedavg.fedavg_round, args, 2)["on"][0], out["on"][0])
    assert counters["stats"]["unique_graphs"] == 1                # the second run: no recompilation


@on_every_device
def test_compiled_run_repeats_and_resumes_to_the_uninterrupted_numbers(
        tmp_path, monkeypatch, device):
    """A --compile run (FedAvg, 4 of 5 clients at once; on CUDA the step replayed as a CUDA graph)
    twice: the same results bit for bit; cut after round 2 and resumed: the uninterrupted results.
    Its args say so."""
    argv = QUICK + ["--clients", "5", "--sample", "4", "--model", "cnn", "--batch-size", "16",
                    "--test-domain", "0",
                    # (the float32 test's graph)
                    "--device", device, "--parallel-clients", "on", "--compile"]
    full, _ = run(fedavg.main, argv, tmp_path, "full.json")
    assert full["args"]["compile"] is True and full["domains"]["style0"]["test_acc"] > 0.5
    again, _ = run(fedavg.main, argv, tmp_path, "again.json")
    assert strip_times(again) == strip_times(full)
    resumed = interrupted_then_resumed(fedavg.main, argv, str(tmp_path / "cut.json"), monkeypatch,
                                       lambda blob: blob["round"] == 2)
    assert strip_times(resumed) == strip_times(full)


@pytest.mark.parametrize("name,argv,rounds,tol", [
    ("fediir", ["--clients", "5", "--sample", "4", "--batch-size", "16", "--momentum", "0.9",
                "--weight-decay", "1e-2", "--gamma", "1", "--ema", "0.5"], 2, (1e-6, 1e-5)),
    ("fedomg", ["--clients", "5", "--sample", "3", "--batch-size", "16", "--weight-decay", "1e-2"],
     3, (2e-7, 2e-5)),
    ("fedloe", ["--clients", "5", "--batch-size", "16", "--stage1-epochs", "4",
                "--stage1-comms", "2",
                "--weight-decay", "1e-3", "--lr", "1e-3"], 2, (3e-5, 1e-4))])
def test_compiled_step_of_every_stacked_objective_is_one_graph_and_matches(
        name, argv, rounds, tol, tmp_path, monkeypatch, dtype):
    """--compile beyond FedAvg: FedIIR's nested-grad penalty, FedOMG's kept momentum, FedLOE's stage
    1 (Adam), each traced as one graph (fullgraph) and as close to the clients one after another as
    the eager step at once, on the CPU. Relative θ / update, the larger of 1 and 2 threads (Intel
    Xeon). float32: FedIIR 2.0e-8 / 3.6e-7, FedOMG 1.3e-8 / 7.6e-7, FedLOE 3.6e-7 / 1.1e-6 (eager at
    once, 2 threads: 1.9e-8 / 3.5e-7, 1.0e-8 / 9.0e-7, 6.1e-7 / 1.9e-6); tolerances those of their
    test_parallel_* tests, FedOMG's θ 2e-7 (16x). float64: at most 2.4e-15 / 7.7e-15 (tolerance
    1e-12)."""
    from torch._dynamo.utils import counters
    module = {"fediir": fediir, "fedomg": fedomg, "fedloe": fedloe}[name]
    args = method_args(module, name, argv + ["--compile"], tmp_path)
    torch._dynamo.reset()
    counters.clear()
    # (as their test_parallel_*)
    out = both_ways(getattr(module, f"{name}_round"), args, rounds,
                    fediir.init_state if name == "fediir" else lambda *a: {})
    assert counters["stats"]["unique_graphs"] == 1
    assert_same_to_tolerance(out, **(dict(params=tol[0], update=tol[1]) if dtype == torch.float32
                                     else F64))


@on_every_device
def test_parallel_resume_gives_the_uninterrupted_numbers(tmp_path, monkeypatch, device):
    argv = QUICK + ["--clients", "4", "--sample", "3", "--test-domain", "0", "--rounds", "4",
                    "--global-lr", "3",
                    "--device", device, "--parallel-clients", "on"]   # η_g = U: the code rule
                                                                      # steps g_FL / U at κ = 0
    full, _ = run(fedomg.main, argv, tmp_path, "full.json")
    assert full["args"]["parallel_clients"] == "on" and full["domains"]["style0"]["test_acc"] > 0.6
    resumed = interrupted_then_resumed(fedomg.main, argv, str(tmp_path / "cut.json"), monkeypatch,
                                       lambda blob: blob["round"] == 2)
    assert strip_times(resumed) == strip_times(full)
    auto, _ = run(fedomg.main, argv[:-2] + ["--rounds", "1", "--eval-every", "1"], tmp_path,
                  "auto.json")
    # what auto chose
    assert auto["args"]["parallel_clients"] == {"cpu": "off", "cuda": "on"}[device]
