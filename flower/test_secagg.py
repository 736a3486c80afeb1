"""The server sees only sums (flower/secagg.py, run config secagg): Flower's SecAgg+ gives the
ServerApp the sum of the nodes' vectors within its quantisation, and nothing it receives is any
node's vector or close to one; a method run under it equals its own run within that; what cannot
be a sum, a value outside the range and a lone client are refused in one line."""
import importlib
import json
import types

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr not installed: pip install -r flower/requirements.txt")

import torch  # noqa: E402
from flwr.app import Array, ConfigRecord, RecordDict  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common import bytes_to_ndarray, parameters_to_ndarrays  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402

import fake_grid  # noqa: E402
import fl_adapter  # noqa: E402
import secagg  # noqa: E402
import test_flower  # noqa: E402

C, L, CLIP = 3, 500, 64.0
STAGE1 = ["--dataset", "synthetic", "--test-domain", "0", "--clients", "3", "--stage1-epochs", "2",
          "--stage1-comms", "2", "--stage2-epochs", "0", "--stage2-comms", "0",
          "--batch-size", "64"]                # FedLOE's stage 1 alone: two communications
SPAN = {"_began": 0.0, "_ready": 0.0, "_ended": 0.0, "_round": 1, "_phase": "x"}


def numbers(content):
    """Every array of numbers in a RecordDict, as the server could read it: its arrays, and every
    bytes value that is an array in Flower's format (SecAgg+'s masked vectors and keys)."""
    out = []
    for record in content.array_records.values():
        out += [np.asarray(a.numpy(), dtype=np.float64).ravel() for a in record.values()
                if isinstance(a, Array)]
    for record in content.config_records.values():
        for v in record.values():
            for b in (v if isinstance(v, list) else [v]):
                try:
                    out.append(np.asarray(bytes_to_ndarray(b), dtype=np.float64).ravel())
                except Exception:          # (keys, shares, ciphertexts: not arrays)
                    pass
    return [x for x in out if x.size]


def vector_app(vectors):
    """A ClientApp whose nodes answer SecAgg+ (Flower's secaggplus_mod, replies signed when keyed)
    with their own vector: vectors[partition id]."""
    app = ClientApp()

    def own(msg, context):
        return secagg.fit_reply(msg, vectors[context.node_config["partition-id"]], SPAN)
    app.train(mods=[secagg.signed(fl_adapter.answer), secaggplus_mod])(own)
    return app


def test_secure_sum_is_the_sum_and_the_server_sees_no_nodes_vector(tmp_path):
    """Three nodes, vectors of 500 values up to ±60 (one with a spike at its first entry):
    everything the server receives in the four stages (check sees every reply) holds no node's
    vector, nor anything within 1 of it, read as it is or dequantised as the mod quantised it;
    the sum the server gets is the nodes' sum within C quantisation steps."""
    gen = np.random.default_rng(0)
    vectors = [gen.normal(0, 10 ** k, L).clip(-60, 60) for k in range(C)]
    vectors[1][0] = 59.0
    grid = fake_grid.FakeGrid(vector_app(vectors), [tmp_path] * C)
    nodes = sorted(grid.contexts, key=lambda n: grid.contexts[n].node_config["partition-id"])
    seen, sent = [], []

    def check(m, r, stage):
        assert not r.has_error(), r.error
        seen.append((stage, numbers(r.content)))
    head = lambda stage: RecordDict({"c": ConfigRecord({"round": 1, "phase": "x"})})
    heads = {n: head for n in nodes}
    total, _ = secagg.secure_sum(grid, nodes, heads, 1, check, sent.append, CLIP)
    exact = np.sum(vectors, 0)
    assert np.abs(total - exact).max() <= C * secagg.step(C, CLIP)
    assert np.abs(total - exact).max() > 0                  # (quantised: not the exact sum)
    assert {stage for stage, _ in seen} == {"setup", "share_keys", "collect_masked_vectors",
                                            "unmask"}
    Q = secagg.levels(C)
    masked = [x for stage, xs in seen for x in xs if stage == "collect_masked_vectors"]
    assert sum(x.size == L for x in masked) == C                 # each node's masked vector
    for _, xs in seen:
        for x in xs:
            for read in (x, x * 2 * CLIP / Q - CLIP):            # as it is; as the mod quantised
                for v in vectors:
                    for part in (read[:L], read[-L:]):
                        if part.size == L:
                            assert np.abs(part - v).max() > 1.0


def test_a_node_refuses_a_value_outside_the_range_and_nothing_is_clipped():
    """encode refuses a value outside ±clip (Flower's quantize would clip it) and a non-finite
    one, naming the site, the key and the value; within the range the vector is the reply's keys
    in key order, exact (float64)."""
    out = {"delta": torch.tensor([0.5, -2.0]), "loss": torch.tensor(1.5), "count": 1}
    how = {"delta": "sum", "loss": "mean", "count": "sum"}
    assert secagg.encode(out, how, 2.0, 4).tolist() == [1.0, 0.5, -2.0, 1.5]
    with pytest.raises(secagg.Refused, match=r"^site 4's delta reaches 2, outside secagg-clip "
                                              r"±1.9: nothing of it was sent"):
        secagg.encode(out, how, 1.9, 4)
    out["loss"] = torch.tensor(float("nan"))
    with pytest.raises(secagg.Refused, match=r"^site 4's loss reaches nan"):
        secagg.encode(out, how, 2.0, 4)


def test_the_levels_leave_the_sum_below_the_modulus():
    """levels(C): the quantised values of C clients and their C weight factors sum below 2^32 (no
    wrap), and one value fits Flower's int32; the most levels that allows (a power of two)."""
    for n in (2, 3, 4, 5, 50, 64, 65, 1000):
        Q = secagg.levels(n)
        assert n * Q + n * Q <= secagg.MODULUS and Q < 2 ** 31
        assert 2 * (n * 2 * Q) > secagg.MODULUS                            # twice as many: not
    assert secagg.step(5, 1024.0) == 2048 / 2 ** 28


def run_secure(method, argv, tmp_path, clip=secagg.CLIP):
    """The method file's own run and the run through the fake grid under secagg (nodes signing,
    the server checking): (own results, own checkpoint, flower results, flower checkpoint)."""
    importlib.import_module(method).main(argv + ["--out", str(tmp_path / "own.json")])
    grid = test_flower.grid_of(method, argv, tmp_path)
    keys = test_flower.signed(grid, tmp_path / "certs")
    fl_adapter.serve(grid, method, argv + ["--out", str(tmp_path / "flower.json")], keys=keys,
                     clip=clip)
    load = lambda name: (json.loads((tmp_path / f"{name}.json").read_text()),
                         torch.load(tmp_path / f"{name}.json.ckpt", weights_only=True))
    return (*load("own"), *load("flower"))


def largest(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_counts_are_whole_steps_and_too_many_for_the_levels_are_refused():
    """count_clip, an evaluation's range: the least power of two above the largest count, so that
    a quantisation step divides 1 (every count a whole number of steps: no rounding, the sum
    exact); a ValueError where the C clients' levels are too few for that."""
    assert [secagg.count_clip(m, 2) for m in (0, 1, 240, 255, 256)] == [1, 2, 256, 256, 512]
    for C in (2, 3, 5, 100):
        assert (1 / secagg.step(C, secagg.count_clip(10_000, C))).is_integer()
    assert secagg.count_clip(2 ** 28 - 1, 2) == 2 ** 28
    with pytest.raises(ValueError, match="counts up to 1073741824 over 2 clients cannot be summed"):
        secagg.count_clip(2 ** 30, 2)


def test_fedavg_under_secagg_is_its_own_run_within_quantisation(tmp_path):
    """FedAvg on the synthetic data, 2 rounds, 2 of 3 clients a round: the server gets Σ n_c Δ_c
    and Σ loss alone, and the model is the method file's own within 1e-3 (measured 1.2e-7, the
    rounding's draws seeded; unseeded, 1.2e-7 to 2.4e-5 were seen; float32 rounding alone, the
    same sums in another order, moves FedAvg on this data by 1.4e-3 in 3 rounds), every accuracy
    within one validation or test example of its own."""
    own, own_ckpt, flower, flower_ckpt = run_secure("fedavg", test_flower.ARGV["fedavg"], tmp_path)
    assert 0 < largest(own_ckpt["model"], flower_ckpt["model"]) <= 1e-3    # (> 0: not in the clear)
    rows = lambda res: [(r["val_acc"], r["test_acc"]) for r in res["domains"]["style0"]["history"]]
    for (val, test), (val_, test_) in zip(rows(own), rows(flower)):
        assert abs(val - val_) <= 1 / 48 + 1e-6 and abs(test - test_) <= 1 / 240 + 1e-6


def test_a_run_under_secagg_repeats_bit_for_bit(tmp_path):
    """The same FedAvg run under secagg twice, each on a grid of its own: the same model
    (torch.equal) and the same results, every accuracy and loss (each node seeds the rounding
    draws from its client's stream key, secagg.seed_rounding); with the draws left to numpy's
    global generator as it stands, the two models differ."""
    argv = test_flower.ARGV["fedavg"]
    runs = []
    for k in range(2):
        grid = test_flower.grid_of("fedavg", argv, tmp_path / str(k))
        out = tmp_path / f"{k}.json"
        fl_adapter.serve(grid, "fedavg", argv + ["--out", str(out)], clip=secagg.CLIP)
        runs.append((json.loads(out.read_text()), torch.load(f"{out}.ckpt", weights_only=True)))
    (first, a), (second, b) = runs
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    history = lambda res: [{k: v for k, v in row.items() if k != "seconds"}
                           for d in res["domains"].values() for row in d["history"]]
    assert history(first) == history(second) and len(history(first)) == 2


class Untouched(fake_grid.FakeGrid):
    """FakeGrid that fails a test when the server sends any node anything."""

    def push_messages(self, messages):
        pytest.fail(f"a message was sent: {[m.metadata.message_type for m in messages]}")


ALONE = "(no sum declared, common.replies): it cannot run under secure aggregation; nothing was run"


@pytest.mark.parametrize("method, argv, line", [
    ("fedomg", test_flower.ARGV["fedomg"], "fedomg.py: error: secagg: fedomg's exchange "
     "client_update (fedomg:client_update) sends the server each client's own reply, which its "
     "round reads one by one " + ALONE),
    ("fedloe", test_flower.ARGV["fedloe"], "fedloe.py: error: secagg: fedloe's exchanges "
     "head_update (fedloe:head_update), tuning_predictions (fedloe:tuning_predictions) send the "
     "server each client's own reply, which its round reads one by one " + ALONE),
    ("fedipg", test_flower.BASE + ["--clients", "3", "--exit", "auto"], "fedipg.py: error: "
     "secagg: fedipg's exchange risk_gradient (fedipg:risk_gradient) sends the server each "
     "client's own reply, which its round reads one by one " + ALONE),
])
def test_what_cannot_be_a_sum_is_refused_before_any_node_is_asked(method, argv, line, tmp_path):
    """A run whose exchanges (for its arguments: FedIPG's Eq. 13 estimates only with --exit auto)
    include one that needs each client's reply is refused in one line naming them, before the
    server sends any node anything (FedLOE: not after its stage 1)."""
    grid = test_flower.grid_of(method, argv, tmp_path, kind=Untouched)
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, method, argv + ["--out", str(tmp_path / "f.json")], clip=1024.0)
    assert str(e.value) == line


def test_a_lone_client_is_refused_in_one_line(tmp_path):
    argv = test_flower.BASE + ["--clients", "3", "--sample", "1"]
    grid = test_flower.grid_of("fedavg", argv, tmp_path)
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", argv + ["--out", str(tmp_path / "f.json")], clip=1024.0)
    assert str(e.value).startswith("fedavg.py: error: secagg: round 1's exchange client_update "
                                   "has one client; secure aggregation hides a client only among "
                                   "two at least")
    assert "\n" not in str(e.value)


def test_a_value_outside_the_range_ends_the_run_naming_the_node(tmp_path):
    """secagg-clip 1e-6: a training site's first Δ is outside it; its node refuses in a signed
    reply and the run ends with its line, naming the node and the site, nothing clipped."""
    argv = test_flower.ARGV["fedavg"]
    grid = test_flower.grid_of("fedavg", argv, tmp_path)
    keys = test_flower.signed(grid, tmp_path / "certs")
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", argv + ["--out", str(tmp_path / "f.json")], keys=keys,
                         clip=1e-6)
    assert "a bad reply in round 1 from node" in str(e.value)
    assert "'s delta reaches" in str(e.value) and "outside secagg-clip ±1e-06" in str(e.value)


@pytest.mark.parametrize("config, line", [
    ({"secagg": True, "secagg-clip": -1.0}, "secagg-clip must be a positive number, got -1"),
    ({"secagg": "true", "secagg-clip": float("nan")}, "secagg-clip must be a positive number, "
     "got nan"),
])
def test_the_serverapp_refuses_a_bad_secagg_clip_before_anything(config, line):
    """Run config secagg-clip: a positive number, or the run fails at once in one line (nothing
    asked of any node: the grid is never used)."""
    import fl_serverapp
    context = types.SimpleNamespace(run_config={"method": "fedavg", **config})
    with pytest.raises(fl_adapter.RunFailed, match=f"^{line}$"):
        fl_serverapp.main(None, context)


@pytest.mark.parametrize("method, argv, bound", [
    ("fediir", test_flower.ARGV["fediir"], 5e-2),
    ("perinvfl", test_flower.ARGV["perinvfl"], 2e-2),
    ("fedipg", test_flower.BASE + ["--clients", "3"], 3e-2),
    ("fedloe", STAGE1, 5e-2),
])
def test_a_method_under_secagg_is_its_own_run_within_float32_rounding(method, argv, bound,
                                                                       tmp_path):
    """Under secagg the model ends within `bound` of the method file's own, and not equal to it
    (the sums are quantised: the run went through SecAgg+). Measured on these runs, the rounding's
    draws seeded: FedIIR 5.2e-3, PerInvFL 5.8e-5, FedIPG 3.6e-3, FedLOE's stage 1 alone (its
    only form under secagg) 1.3e-6; float32 rounding alone, the same sums in another order
    (--parallel-clients on against off), moves FedIIR by 7.7e-3 and FedLOE's stage 1 by 4.7e-3
    after these rounds. The round's loss, the clients' mean, within 1% (a declared mean
    taken for the sum, no division by C, fails it)."""
    own_res, own, res, flower = run_secure(method, argv, tmp_path)
    assert 0 < largest(own["model"], flower["model"]) < bound
    loss = lambda r: [row["loss"] for d in r["domains"].values() for row in d["history"]]
    assert all(abs(a - b) < 1e-2 * a for a, b in zip(loss(own_res), loss(res)))  # the clients' mean


class Recording(fake_grid.FakeGrid):
    """FakeGrid that keeps every reply the server pulls: all that reaches the ServerApp."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received = []

    def pull_messages(self, message_ids):
        replies = super().pull_messages(message_ids)
        self.received += [r.content for r in replies if r.has_content()]
        return replies


def recording_app(vectors):
    """The App's ClientApp (fl_adapter's functions, registered as client_app does), whose nodes
    also keep, in `vectors`, each vector they hand to secaggplus_mod: a client's own update."""
    app = ClientApp()
    app.query("hello")(fl_adapter.hello)
    app.train("client")(fl_adapter.work)

    def secure(msg, context):
        reply = fl_adapter.secure_work(msg, context)
        res = compat.recorddict_to_fitres(reply.content, keep_input=True)
        vectors.append(parameters_to_ndarrays(res.parameters)[0].copy())
        return reply
    app.train(mods=[secagg.signed(fl_adapter.answer), secaggplus_mod])(secure)
    return app


def test_what_the_server_receives_of_a_fedavg_run_under_secagg(tmp_path):
    """FedAvg, 2 rounds, 2 of 3 clients a round, under secagg: of everything that reaches the
    ServerApp (every reply it pulls, the nodes' reports included), no array, read as it is or
    dequantised as the mod quantised it, is within 1 of any client's own update (n_c Δ_c and its
    loss, values up to about 9), nor within 0.5 of any site's evaluation counts (each of the 4
    sites' every round, summed as well: right and examples of its validation and test splits),
    whose sums are exact (integers: a whole number of quantisation steps each); the run ends
    within 1e-3 of the method file's own model (as in the test above)."""
    argv = test_flower.ARGV["fedavg"]
    importlib.import_module("fedavg").main(argv + ["--out", str(tmp_path / "own.json")])
    vectors = []
    grid = test_flower.grid_of("fedavg", argv, tmp_path, recording_app(vectors), Recording)
    fl_adapter.serve(grid, "fedavg", argv + ["--out", str(tmp_path / "flower.json")],
                     clip=secagg.CLIP)
    updates, counts = [v for v in vectors if v.size > 4], [v for v in vectors if v.size == 4]
    assert len(updates) == 4 and max(np.abs(v).max() for v in updates) > 1      # 2 a round
    assert len(counts) == 8 and all(v[1] + v[3] > 0 for v in counts)          # 4 sites a round
    Q, seen = secagg.levels(2), [x for content in grid.received for x in numbers(content)]
    assert sum(x.size == updates[0].size for x in seen) == 4                    # masked, each
    assert sum(x.size == 4 for x in seen) >= 8
    # each round's accuracies: the exact sums of the sites' counts (test, val: right, examples)
    history = json.loads((tmp_path / "flower.json").read_text())["domains"]["style0"]["history"]
    assert len(history) == 2 and all((v == np.round(v)).all() for v in counts)
    for k, row in enumerate(history):
        right, n = torch.tensor(sum(counts[4 * k:4 * k + 4]), dtype=torch.float32).view(2, 2).T
        assert [row["test_acc"], row["val_acc"]] == (right / n).tolist()
    clip = secagg.count_clip(240, 4)                    # (the evaluation site's 240 test images)
    for x in seen:
        for read in (x, x * 2 * secagg.CLIP / Q - secagg.CLIP):
            assert all(read.size != v.size or np.abs(read - v).max() > 1.0 for v in updates)
        for read in (x, x * 2 * clip / secagg.levels(4) - clip):
            assert all(read.size != v.size or np.abs(read - v).max() >= 0.5 for v in counts)
    own, flower = (torch.load(tmp_path / f"{k}.json.ckpt", weights_only=True)["model"]
                   for k in ("own", "flower"))
    assert largest(own, flower) <= 1e-3
