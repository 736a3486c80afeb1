"""benchmark/diagnostics/penalty_swap.py (issue 29, section 3): every penalty in ν's federated optimisation.
Its irm run is perinvfl.py's ν round for round; each penalty is the method's own, checked at a fixed ν
against a computation by hand; the results file is resumable; bad input is one line."""
import argparse
import json
import sys

import numpy as np
import pytest
import torch

from test_methods import HERE, fails

import common
import perinvfl

sys.path.insert(0, str(HERE / "benchmark" / "diagnostics"))
import penalty_swap as ps  # noqa: E402

TINY = ["--rounds", "2", "--anneal", "1"]


def swap_args(**kw):
    return argparse.Namespace(**{**dict(rounds=3, anneal=1, ema=0.95, device="cpu", data_root=None), **kw})


def test_irm_is_perinvfls_nu_round_for_round(tmp_path, monkeypatch):
    """penalty irm, 3 rounds with the switch to λ = 91257 (and the division by it) after round 1, on the
    embedded digits: bit for bit the ν of perinvfl.py's global model (its checkpoint), which moved from ν^0.
    (perinvfl.py visits the clients in a random order, which changes the mean's rounding: here in order.)"""
    monkeypatch.setattr(common, "sample_clients", lambda ctx, P, C: list(range(P)))
    out = str(tmp_path / "p.json")
    perinvfl.main(["--dataset", "rcmnist", "--no-rotation", "--rounds", "3", "--anneal", "1", "--out", out])
    nu = torch.load(str(tmp_path / "p.ckpt"), weights_only=True)["model"]
    _, model = ps.train("irm", 0, swap_args(), log=lambda *a, **k: None)
    torch.manual_seed(0)
    nu0 = common.build_model(argparse.Namespace(model="mlp", head="linear", no_pretrained=True),
                             ps.data.load("rcmnist", None, 0, rotation=False)).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, nu[k]), (k, (v - nu[k]).abs().max().item())
        assert (v - nu0[k]).abs().max() > 1e-4, k                             # it moved


def softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.fixture
def fixed_nu():
    """The MLP at a fixed ν (not its initialisation: biases nonzero) and 40 random two-channel images."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(40, 2, 14, 14, generator=g), torch.randint(0, 2, (40,), generator=g)
    torch.manual_seed(0)
    model = common.build_model(argparse.Namespace(model="mlp", head="linear", no_pretrained=True),
                               argparse.Namespace(domains=[argparse.Namespace(x=x)], num_classes=2))
    common.set_flat(model, common.get_flat(model) + 0.05 * torch.randn(len(common.get_flat(model)), generator=g))
    with torch.no_grad():
        h, z = model.featurizer(x).double().numpy(), model(x).double().numpy()
    return model, x, y, h, z, softmax(z) - np.eye(2)[y.numpy()]


def test_each_penalty_against_a_hand_computation(fixed_nu):
    """At a fixed ν: IRMv1 = (mean_n ⟨p_n − e_yn, z_n⟩)² (∂/∂s of the mean CE of s·z); FedIIR =
    ||∇_ω R − g̃||² with ∇_W R = (p − Y)ᵀh / n, ∇_b R = mean(p − Y); FedIPG = d², d = d/ds R(s·w) at
    s = 1 by central differences in float64; V-REx = the population variance of the per-example CE;
    none: no penalty. In every case the risk is the mean CE and the rest of L_INV IRM's l2 on ν."""
    model, x, y, h, z, r = fixed_nu
    ell = -np.log(softmax(z)[np.arange(len(y)), y.numpy()])
    g_tilde = [0.2 * torch.randn(2, 390, generator=torch.Generator().manual_seed(5)), torch.tensor([0.3, -0.2])]
    W, b = (t.double().numpy() for t in g_tilde)
    fd = model.double()
    w0 = common.get_flat(fd)

    def R(s):
        common.set_flat(fd, s * w0)
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(fd(x.double()), y).item()
    d = (R(1 + 1e-6) - R(1 - 1e-6)) / 2e-6
    model = model.float()
    common.set_flat(model, w0.float())
    hand = {"irm": np.mean((r * z).sum(1)) ** 2,
            "fediir": ((r.T @ h / len(y) - W) ** 2).sum() + ((r.mean(0) - b) ** 2).sum(),
            "fedipg": d * d, "vrex": ell.var()}
    l2 = 1.10794568e-3 * (w0 ** 2).sum().item()
    for name in ps.PENALTIES:
        loss, risk, P = ps.objective(name, model, x, y, g_tilde)
        assert risk.item() == pytest.approx(ell.mean(), rel=1e-5)
        assert loss.item() == pytest.approx(ell.mean() + l2, rel=1e-5) and l2 > 0.1
        if name == "none":
            assert P is None and ps.weight(name, 5, 1) is None
        else:
            assert P.item() == pytest.approx(hand[name], rel=1e-4, abs=1e-12), name
            first, = torch.autograd.grad(P, [model.featurizer[1].weight])
            assert first.abs().max() > 0, name                              # in the graph: it trains the featurizer


def test_weights_and_fediir_keeps_its_ema(fixed_nu):
    """w_t = 1 up to the anneal round, then the large weight; FedIIR's g̃ after the first round is
    0.05 × the clients' mean classifier gradient at ν^0 (EMA from 0, v = 0.95), or the mean at --ema 0."""
    assert [ps.weight("vrex", t, 2) for t in (1, 2, 3)] == [1.0, 1.0, ps.LAM] and ps.LAM > 9e4
    model, x, y, h, z, r = fixed_nu
    clients = [(x[:25], y[:25]), (x[25:], y[25:])]
    n = np.array([25, 15])
    mean_W = sum(r[s].T @ h[s] / k for s, k in zip((slice(0, 25), slice(25, 40)), n)) / 2
    w0 = common.get_flat(model)
    for v in (0.95, 0.0):
        common.set_flat(model, w0)                                           # (the round moves ν)
        state = {"adam": None, "g_tilde": [torch.zeros_like(p) for p in model.classifier.parameters()]}
        ps.swap_round(1, "fediir", model, clients, state, swap_args(ema=v))
        assert np.allclose(state["g_tilde"][0].numpy(), (1 - v) * mean_W, rtol=1e-4, atol=1e-8)


def test_resumable_and_the_report(tmp_path, monkeypatch, capsys):
    """A run stopped after its first (penalty, seed) keeps it in --out; run again, only the missing pair
    is trained, and the file equals an uninterrupted run's but for the times. --report: mean ± std over
    the seeds (sample std), beside the committed centralised IRM / ERM and ν."""
    argv = ["--penalties", "none", "irm", "--seeds", "0"] + TINY
    whole = ps.main(argv + ["--out", str(tmp_path / "whole.json")])
    out = str(tmp_path / "cut.json")
    calls, train, stopped = [], ps.train, []

    def stop_second(name, seed, args, log=print):
        calls.append((name, seed))
        if len(calls) == 2 and not stopped:                                  # once: the first call's second run
            stopped.append(True)
            raise KeyboardInterrupt
        return train(name, seed, args, log)
    monkeypatch.setattr(ps, "train", stop_second)
    with pytest.raises(KeyboardInterrupt):
        ps.main(argv + ["--out", out])
    assert list(json.loads(open(out).read())["runs"]) == ["none/0"]
    calls.clear()
    resumed = ps.main(argv + ["--out", out])
    assert calls == [("irm", 0)]

    def untimed(results):
        for r in results["runs"].values():
            r.pop("seconds")
            for row in r["history"]:
                row.pop("seconds")
        return results
    assert untimed(resumed) == untimed(whole) == untimed(json.loads(open(out).read()))
    fake = {"settings": {}, "runs": {f"vrex/{s}": {"penalty": "vrex", "test_acc": a, "train_acc": 0.7}
                                     for s, a in enumerate((0.5, 0.6, 0.7))}}
    (tmp_path / "fake.json").write_text(json.dumps(fake))
    capsys.readouterr()
    ps.main(["--report", str(tmp_path / "fake.json")])
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()}
    assert rows["vrex"] == "| vrex | 60.0 ± 10.0 | 3 | 70.0 ± 0.0 |"
    assert "| 66.8 ± 1.6 | 3 | 70.0 ± 0.4 |" in rows["centralised IRM (irm_central.py, rc-norot)"]
    assert "| 11.4 ± 0.3 | 3 | 88.0 ± 0.1 |" in rows["centralised ERM (irm_central.py, rc-norot)"]
    assert "| 63.8 ± 0.8 | 3 |" in rows["federated IRM ν (perinvfl.py, rcmnist-full-norot)"]


def test_two_processes_share_one_out(tmp_path, monkeypatch):
    """A second process (other --penalties, the same --out) that finishes a run while the first is
    training: the first adds its own run to the file as it then is, which keeps both."""
    out, train, meanwhile = str(tmp_path / "s.json"), ps.train, []

    def train_while_another_runs(name, seed, args, log=print):
        if not meanwhile:                                                    # (the other's own runs: plain)
            meanwhile.append(None)
            meanwhile[0] = ps.main(["--penalties", "irm", "--seeds", "0", "--out", out] + TINY)
        return train(name, seed, args, log)
    monkeypatch.setattr(ps, "train", train_while_another_runs)
    results = ps.main(["--penalties", "none", "--seeds", "0", "--out", out] + TINY)
    assert list(meanwhile[0]["runs"]) == ["irm/0"]
    assert sorted(results["runs"]) == sorted(json.loads(open(out).read())["runs"]) == ["irm/0", "none/0"]


def test_bad_input_is_one_line(tmp_path, capsys):
    """Each bad input is one line on stderr and exit 2 (before any training: a missed check costs one
    round of the embedded digits, not 500)."""
    done, quick = str(tmp_path / "done.json"), ["--penalties", "none", "--seeds", "0", "--rounds", "1"]
    ps.main(quick + ["--out", done])
    (tmp_path / "junk.json").write_text("[1, 2]")
    for argv, words in ((["--rounds", "0"], "--rounds must be positive"), (["--anneal", "-1"], "--anneal must be"),
                        (["--ema", "1"], "--ema must be in [0, 1)"), (["--penalties", "fish"], "invalid choice"),
                        (["--report", str(tmp_path / "nothing.json")], "cannot read"),
                        (["--report", str(tmp_path / "junk.json")], "not a results file"),
                        (["--rounds", "2", "--out", done], "other settings (rounds)"),
                        (["--out", str(tmp_path / "junk.json" / "x.json")], "cannot write --out")):
        out = [] if "--out" in argv else ["--out", str(tmp_path / "o.json")]
        assert words in fails(ps.main, quick + argv + out, capsys), argv
    if not torch.cuda.is_available():
        argv = quick + ["--device", "cuda", "--out", str(tmp_path / "o.json")]
        assert "no CUDA device" in fails(ps.main, argv, capsys)
