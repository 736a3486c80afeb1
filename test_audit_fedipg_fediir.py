"""FedIPG and FedIIR against their sources (issue 28): FedIPG's local step as Eq. 2 (one gradient step
on f_i of Eq. 9 over the client's whole split) and its warm-up as Algorithm 1's pre-training phase
(before round 1, outside the T rounds, then w^1 again); FedIIR's g_bar over augmented inputs on the
photo datasets, as the official code's training loaders, and its --half. Each computed value is
checked against a computation written here independently of the method files."""
import copy

import pytest
import torch
import torch.nn.functional as F

from test_methods import (QUICK, interrupted_then_resumed, ipg_args, planted_federation, run, scaled_risk_derivative,
                          strip_times, tiny_ctx, tiny_federation, tiny_model)

import common
import data
import fedavg
import fediir
import fedipg


# --------------------------------------------------------------------- FedIPG: the local step (Eq. 2)

def paper_step_by_hand(model, client, lam, lr, wd):
    """w − η (∇f_i(w) + wd·w), f_i = R_i + λ (d/ds R_i(s·w) at s = 1)² on the client's whole training
    split at once (Eq. 1, 9), in float64, and f_i(w)."""
    m = copy.deepcopy(model).double()
    x, y = client.x.double() / 255, client.y
    f = F.cross_entropy(m(x), y) + lam * scaled_risk_derivative(m, x, y) ** 2
    g = torch.autograd.grad(f, list(m.parameters()))
    return torch.cat([(p - lr * (gp + wd * p)).reshape(-1) for p, gp in zip(m.parameters(), g)]).detach(), f.item()


@pytest.mark.parametrize("penalty", ["tangent", "layers", "params"])
def test_fedipg_paper_step_is_one_gradient_step_on_eq_9(penalty):
    """Eq. 2 with Eq. 9: one step, the whole split (taken in chunks of 3, 3, 3 and 1: the penalty is
    the square of the whole split's d, not a sum of the chunks' squares), and the step returns f_i(w)."""
    fed, model = tiny_federation((7, 10)), tiny_model()
    client = fed.clients[1]
    args = ipg_args(lam=5.0, penalty=penalty, lr=0.5, weight_decay=0.01, batch_size=3, local_step="paper")
    want, f = paper_step_by_hand(model, client, 5.0, 0.5, 0.01)
    plain, _ = paper_step_by_hand(model, client, 0.0, 0.5, 0.01)
    loss = fedipg.local_step(model, client, args, tiny_ctx())
    got = common.get_flat(model)
    assert torch.allclose(got.double(), want, atol=2e-6)
    assert (want - plain).abs().max() > 1e-3                       # the penalty's part of the step is visible
    assert abs(loss.item() - f) < 1e-5


def test_fedipg_round_with_the_paper_step_averages_one_step_per_client():
    """Eq. 2 then Eq. 3: w^{t+1} = Σ_i n_i (w − η ∇f_i(w)) / Σ_i n_i over the clients (7 and 10)."""
    fed, model = tiny_federation((7, 10)), tiny_model()
    w = common.get_flat(model).double()
    steps = [paper_step_by_hand(model, c, 0.3, 0.5, 0.0)[0] for c in fed.clients]
    want = (7 * steps[0] + 10 * steps[1]) / 17
    args = ipg_args(lam=0.3, lr=0.5, batch_size=4, local_step="paper")
    fedipg.fedipg_round(1, model, fed, args, fedipg.init_state(model, fed, args, None), tiny_ctx())
    assert torch.allclose(common.get_flat(model).double(), want, atol=2e-6)
    assert (want - w).abs().max() > 1e-2


def test_fedipg_defaults_to_the_papers_step_and_warm_up_and_that_step_is_fedsgd(tmp_path):
    """By default a round is one full-batch step per client: at λ = 0, what fedavg.py computes with one
    batch of the whole split and no momentum (FedSGD), to rounding, whatever --batch-size (here 32:
    only the chunks of the gradient pass); --local-step sgd takes the minibatch steps."""
    argv = QUICK + ["--clients", "4", "--sample", "2", "--test-domain", "1"]
    a, _ = run(fedavg.main, argv + ["--batch-size", "1000", "--momentum", "0", "--parallel-clients", "off"],
               tmp_path, "avg.json")
    b, _ = run(fedipg.main, argv + ["--lam", "0"], tmp_path, "ipg.json")
    assert (b["args"]["local_step"], b["args"]["warmup"]) == ("paper", "pretraining")
    ha, hb = a["domains"]["style1"]["history"], b["domains"]["style1"]["history"]
    assert [r["val_acc"] for r in ha] == [r["val_acc"] for r in hb]
    assert all(abs(u["loss"] - v["loss"]) < 1e-5 for u, v in zip(ha, hb))
    c, _ = run(fedipg.main, argv + ["--lam", "0", "--local-step", "sgd"], tmp_path, "sgd.json")
    assert abs(c["domains"]["style1"]["history"][-1]["loss"] - hb[-1]["loss"]) > 1e-3   # 14 steps of 32, momentum


# ------------------------------------------------------------- FedIPG: the warm-up as a pre-training phase

def smallconv():
    torch.manual_seed(0)
    return common.build_model(type("A", (), dict(model="smallconv", head="linear")), data.synthetic())


def test_fedipg_pretraining_runs_before_round_1_and_round_1_starts_from_w1(monkeypatch):
    """Algorithm 1: line 1 (pre-training: W rounds of every client, the exits after them), lines 2-4
    (t = 1, the initial w^1 to all): round 1 is one ordinary round from w^1 over I_ID; the W
    pre-training rounds are not among the T."""
    fed, W = planted_federation(), 3
    args = ipg_args(sample=6, lr=0.05, exit="auto", exit_warmup=W, lam=1e-3, local_step="paper", warmup="pretraining")
    model = smallconv()
    w1 = common.get_flat(model)
    calls = []
    step = fedipg.local_step
    monkeypatch.setattr(fedipg, "local_step", lambda m, c, *a: calls.append(c.id) or step(m, c, *a))
    state = fedipg.init_state(model, fed, args, None)
    fedipg.fedipg_round(1, model, fed, args, state, tiny_ctx())
    assert state["exited"] == [3]                                          # the planted client
    assert all(len(state["contrib"][i]) == W for i in range(6))            # W estimates each, all before round 1
    assert len(calls) == W * 6 + 5                                         # W pre-training rounds, then round 1
    pretrained = smallconv()                                               # what keeping the warm model would give
    keep = ipg_args(sample=6, lr=0.05, exit="auto", exit_warmup=W, lam=1e-3, local_step="paper", warmup="rounds")
    s_keep, ctx = fedipg.init_state(pretrained, fed, keep, None), tiny_ctx()
    for t in range(1, W + 2):
        fedipg.fedipg_round(t, pretrained, fed, keep, s_keep, ctx)
    monkeypatch.undo()
    ref = smallconv()                                                      # one round from w^1 without client 3
    plain = ipg_args(sample=6, lr=0.05, exit="off", exit_clients=[3], lam=1e-3, local_step="paper")
    fedipg.fedipg_round(1, ref, fed, plain, fedipg.init_state(ref, fed, plain, None), tiny_ctx())
    got, want = common.get_flat(model), common.get_flat(ref)
    assert torch.allclose(got, want, atol=1e-6)                            # (client order: rounding only)
    assert (got - common.get_flat(pretrained)).abs().max() > 1e-3          # not the warmed-up model
    assert s_keep["exited"] == [3] and not torch.equal(w1, got)
    for t in (2, 3):                                                       # no estimates after the phase
        fedipg.fedipg_round(t, model, fed, args, state, tiny_ctx())
    assert all(len(v) == W for v in state["contrib"].values())


def test_fedipg_pretraining_gives_the_slow_client_w1_again(monkeypatch):
    """After the pre-training phase every client receives w^1 (line 4): a slow client's unfinished
    update from the phase is dropped, and its first update of the T rounds is computed from w^1."""
    fed, model = tiny_federation((8, 8, 8)), tiny_model()
    for c in fed.clients:                                                  # alike: every contribution > 0
        c.x, c.y = fed.clients[0].x, fed.clients[0].y
    w1 = common.get_flat(model)
    args = ipg_args(sample=3, aberrant=["slow", 2], aberrant_client=1, exit="auto", exit_warmup=3,
                    local_step="paper", warmup="pretraining", lr=0.1)
    state, starts = fedipg.init_state(model, fed, args, None), []
    step = fedipg.local_step

    def record(m, c, *a):
        starts.append((c.id, common.get_flat(m)))
        return step(m, c, *a)
    monkeypatch.setattr(fedipg, "local_step", record)
    fedipg.fedipg_round(1, model, fed, args, state, tiny_ctx())              # pre-training s = 1, 2, 3, then t = 1
    assert [i for i, _ in starts].count(1) == 1                            # slow:2 arrives in s = 2 only
    assert 1 not in state["exited"]
    assert state["since"] == 1 and torch.equal(state["received"], w1)      # it holds w^1, since round 1
    starts.clear()
    fedipg.fedipg_round(2, model, fed, args, state, tiny_ctx())
    mine = [w for i, w in starts if i == 1]
    assert len(mine) == 1 and torch.equal(mine[0], w1)                     # τ = 1: computed from w^1


def test_fedipg_resumes_after_the_pretraining_phase(tmp_path, monkeypatch, capsys):
    """Killed right after round 1 (the phase and round 1 checkpointed), --resume goes on at round 2
    with the phase's exits and the unreliable client's last download, and does not run it again."""
    argv = QUICK + ["--rounds", "3", "--eval-every", "1", "--clients", "4", "--sample", "4", "--test-domain", "1",
                    "--exit", "auto", "--exit-warmup", "2", "--aberrant", "unreliable:0.5", "--exit-L", "1e-3"]
    full, _ = run(fedipg.main, argv, tmp_path, "full.json")
    assert capsys.readouterr().out.count("exit strategy:") == 1
    seen = []
    resumed = interrupted_then_resumed(fedipg.main, argv, str(tmp_path / "cut.json"), monkeypatch,
                                       lambda blob: blob["round"] == 1, check=lambda blob: seen.append(blob["state"]))
    out = capsys.readouterr().out
    assert out.count("exit strategy:") == 1 and "resuming from" in out    # the phase ran once, before the cut
    assert all(len(v) == 2 for v in seen[0]["contrib"].values())
    assert strip_times(resumed) == strip_times(full)


# ------------------------------------------------------------------ FedIIR: g_bar on augmented inputs

def photo_setup(tmp_path):
    data.make_fake_tree(tmp_path, per_class=2)
    ds = data.load("pacs", str(tmp_path), size=32)
    fed = common.federate(ds, 3, 3, seed=0, device="cpu")
    torch.manual_seed(0)
    model = common.build_model(type("A", (), dict(model="smallconv", head="linear")), ds)
    ctx = common.Context(torch.device("cpu"), torch.Generator().manual_seed(5), torch.Generator().manual_seed(0),
                         common.make_prep("pacs", "cpu"))
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
    """A PACS-like tree: by default g_bar is taken on the inputs the training loaders give (augmented,
    from the minibatch stream), as the official code's mean_grad; --gbar-inputs plain on the images."""
    p = common.make_parser("fediir", fediir.__doc__)
    fediir.add_args(p)
    assert p.parse_args([]).gbar_inputs == "augmented"
    fed, model, ctx = photo_setup(tmp_path)
    S, prep = [2, 0], common.make_prep("pacs", "cpu")
    replay = torch.Generator().manual_seed(5)                                  # ctx.gen's draws, redone
    augmented = [prep(fed.clients[c].x, train=True, gen=replay) for c in S]
    plain = [prep(fed.clients[c].x) for c in S]
    assert not torch.allclose(augmented[0], plain[0], atol=1e-2)
    got = {}
    for how in ("augmented", "plain"):
        args = type("A", (), dict(batch_size=4, gbar="batches", gbar_inputs=how))
        before = ctx.gen.get_state()
        got[how] = torch.cat([g.reshape(-1) for g in fediir.global_gradient(model, fed, S, args, ctx)])
        assert torch.equal(ctx.gen.get_state(), before) == (how == "plain")   # only augmentation draws
    assert torch.allclose(got["augmented"], mean_batch_gradient(model, augmented, S, fed, 4), atol=1e-6)
    assert torch.allclose(got["plain"], mean_batch_gradient(model, plain, S, fed, 4), atol=1e-6)
    assert (got["augmented"] - got["plain"]).abs().max() > 1e-4


def test_fediir_gbar_inputs_change_nothing_on_the_digits(tmp_path):
    argv = QUICK + ["--rounds", "2", "--clients", "3", "--test-domain", "1"]
    a, _ = run(fediir.main, argv, tmp_path, "a.json")
    b, _ = run(fediir.main, argv + ["--gbar-inputs", "plain"], tmp_path, "b.json")
    assert strip_times(a)["domains"] == strip_times(b)["domains"]


def test_fediir_half_is_the_papers_gamma_over_2(tmp_path):
    """--half: the local objective R + (γ/2)||∇_ω R − g̃||² (FedIIR's Eq.), i.e. a run with --gamma γ
    --half is the run with --gamma γ/2, bit for bit, and not the run with γ."""
    argv = QUICK + ["--rounds", "2", "--eval-every", "1", "--clients", "3", "--test-domain", "1"]
    half, _ = run(fediir.main, argv + ["--gamma", "2", "--half"], tmp_path, "half.json")
    over2, _ = run(fediir.main, argv + ["--gamma", "1"], tmp_path, "over2.json")
    full, _ = run(fediir.main, argv + ["--gamma", "2"], tmp_path, "full.json")
    assert strip_times(half)["domains"] == strip_times(over2)["domains"]
    assert strip_times(half)["domains"] != strip_times(full)["domains"]
