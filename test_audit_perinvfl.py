"""PerInvFL's Algorithm 1, line 8 (issue 28): which θ_i line 8 starts from (`--theta reset|kept`), its
optimiser's state across rounds and across the switch to the large λ, line 8 ending no worse than ν on
its own objective J_i (Eq. 4, as the file defines it), and R > 1 local steps of ν."""
import pytest
import torch

import common
import perinvfl
from test_methods import run, pinv_setup, pinv_loss_by_hand, grad_by_hand


def J_by_hand(theta, centre, c, lam, args):
    """Line 8's objective written out: (risk + λ·IRMv1 penalty + L2 + β||θ − ν||²) / λ once λ > 1."""
    scale = lam if lam > 1 else 1.0
    return (pinv_loss_by_hand(theta, c.x.float() / 255, c.y, lam, args.weight_decay)
            + args.beta * (theta - centre).pow(2).sum() / scale)


def grad_J(theta, centre, c, lam, args):
    theta = theta.clone().requires_grad_()
    g, = torch.autograd.grad(J_by_hand(theta, centre, c, lam, args), theta)
    return g


def adam_step_by_hand(p, g, st, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step (Kingma & Ba, with bias correction); st = (m, v, k) or None for a fresh Adam."""
    m, v, k = st if st is not None else (torch.zeros_like(p), torch.zeros_like(p), 0)
    k += 1
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + eps), (m, v, k)


def test_line8_ends_below_nu_on_its_own_objective_every_round_across_the_lambda_switch():
    """Default reading and line-8 steps, ν by the server's Adam as on RC-MNIST, λ = 1 for two rounds
    then 50 (the objective divided by λ):
    after every round J_i(θ_i; ν^t) < J_i(ν^t; ν^t) for both clients, J written out independently,
    whatever θ_i held before the round (here far from ν); the file's own check records the same two
    numbers per client."""
    model, fed, ctx, args, state = pinv_setup(opt="adam", lr=0.01, lam=50.0, anneal=2, beta=1.0, eval_every=1)
    nu0 = common.get_flat(model)
    state["theta"] = [nu0 + 3.0, nu0 - 3.0]
    for t in range(1, 6):
        nu = common.get_flat(model)
        perinvfl.perinvfl_round(t, model, fed, args, state, ctx)
        lam = 50.0 if t > 2 else 1.0
        for i, c in enumerate(fed.clients):
            j_theta, j_nu = J_by_hand(state["theta"][i], nu, c, lam, args), J_by_hand(nu, nu, c, lam, args)
            assert j_theta < j_nu, (t, i, j_theta.item(), j_nu.item())
            assert torch.allclose(state["eq4"][:, i], torch.stack([j_theta, j_nu]), rtol=1e-5, atol=0), t


@pytest.mark.parametrize("reading", ["reset", "kept"])
def test_theta_readings_and_r_above_one_against_a_hand_computation(reading, monkeypatch):
    """Plain steps, R = S = 2, β = 0.7, λ = 3, two rounds. Line 8's first step of each round starts at
    ν^t (`reset`) or at the client's θ_i of the round before (`kept`), and carries through the round's
    R·S steps, pulled towards ν_{i,r}; ν_{i,r+1} = ν_{i,r} − γ∇L_INV(ν_{i,r}) (line 9, R = 2 chained
    steps); ν' = mean_i ν_{i,2} (line 10); the check's J_i is taken at the last centre ν_{i,1}."""
    model, fed, ctx, args, state = pinv_setup(beta=0.7, R=2, S=2, theta=reading, eval_every=1)
    nu0 = common.get_flat(model)
    state["theta"] = [nu0 + 0.2, nu0 - 0.2]
    starts, loss = [], perinvfl.theta_loss

    def first_steps(net, centre, x, y, *a):               # θ at each step of line 8 (not the check's calls)
        if torch.is_grad_enabled():
            starts.append((len(y), common.get_flat(net)))   # (the clients hold 6 and 10 examples)
        return loss(net, centre, x, y, *a)
    monkeypatch.setattr(perinvfl, "theta_loss", first_steps)
    theta = [t.clone() for t in state["theta"]]
    for t in (1, 2):
        nu, ends = common.get_flat(model), []
        starts.clear()
        perinvfl.perinvfl_round(t, model, fed, args, state, ctx)
        for i, c in enumerate(fed.clients):
            th, nu_r = (nu.clone() if reading == "reset" else theta[i]), nu.clone()
            assert torch.equal(next(p for n, p in starts if n == c.n), th)   # line 8's θ_i^0 this round
            for r in range(2):
                for s in range(2):
                    th = th - args.lr * grad_J(th, nu_r, c, args.lam, args)
                centre = nu_r
                nu_r = nu_r - args.lr * grad_by_hand(nu_r, c, args.lam, args.weight_decay)
            assert torch.allclose(state["theta"][i], th, atol=1e-6), (t, i)
            want = torch.stack([J_by_hand(th, centre, c, args.lam, args), J_by_hand(centre, centre, c, args.lam, args)])
            assert torch.allclose(state["eq4"][:, i], want, rtol=1e-5), (t, i)
            theta[i], ends = state["theta"][i].clone(), ends + [nu_r]
        assert torch.allclose(common.get_flat(model), sum(ends) / 2, atol=1e-6), t


@pytest.mark.parametrize("reading", ["reset", "kept"])
def test_line8_adam_state_across_rounds_and_at_the_lambda_switch(reading):
    """--theta-opt adam, S = 1, λ = 1 for two rounds then 50. Under either reading θ_i's Adam state stays on
    its client across rounds (round 2: its second step) and restarts at the switch to the large λ,
    where the objective changes (round 3: a first step again), carrying on after it (round 4); the
    step starts at ν^t (`reset`) or at θ_i of the round before (`kept`). Adam written out by hand."""
    model, fed, ctx, args, state = pinv_setup(opt="adam", lr=0.01, lam=50.0, anneal=2, beta=0.7, theta=reading,
                                              theta_opt="adam")
    adam, prev = [None, None], [t.clone() for t in state["theta"]]
    for t in range(1, 5):
        nu = common.get_flat(model)
        perinvfl.perinvfl_round(t, model, fed, args, state, ctx)
        lam = 50.0 if t > 2 else 1.0
        for i, c in enumerate(fed.clients):
            start = nu if reading == "reset" else prev[i]
            if t == 3:
                adam[i] = None
            want, adam[i] = adam_step_by_hand(start, grad_J(start, nu, c, lam, args), adam[i], args.lr)
            assert torch.allclose(state["theta"][i], want, atol=1e-6), (t, i)
            prev[i] = state["theta"][i].clone()


def test_the_check_is_in_the_results_and_holds_under_the_default_reading(tmp_path):
    """End to end on the embedded RC-MNIST across the switch to λ = 100: the default is `reset`, and at
    every evaluated round J_i(θ_i) < J_i(ν) for every client (`eq4_holds` 1); `--theta kept` records
    the same numbers (whatever they are)."""
    argv = ["--dataset", "rcmnist", "--rounds", "4", "--eval-every", "2", "--anneal", "2", "--lam", "100",
            "--lr", "2e-3"]
    res, _ = run(perinvfl.main, argv, tmp_path)
    assert res["args"]["theta"] == "reset"
    hist = res["domains"]["clients"]["history"]
    assert [h["round"] for h in hist] == [2, 4]
    for h in hist:
        assert h["eq4_holds"] == 1.0 and all(a < b for a, b in zip(h["eq4_theta"], h["eq4_nu"])), h
        assert len(h["eq4_theta"]) == 4
    kept, _ = run(perinvfl.main, argv + ["--theta", "kept"], tmp_path, "kept.json")
    last = kept["domains"]["clients"]["history"][-1]
    assert kept["args"]["theta"] == "kept" and len(last["eq4_nu"]) == 4 and 0 <= last["eq4_holds"] <= 1
    assert all(v > 0 for v in last["eq4_theta"] + last["eq4_nu"])


def test_one_environments_irmv1_penalty_is_its_head_gradient_against_the_head():
    """With a linear head (W, b), d/dw R(w·f)|_{w=1} = ⟨∇_(W,b) R, (W,b)⟩, so the IRMv1 penalty of one
    environment is zero wherever its risk is stationary in the head (the docstring's reason why Eq. 4
    with one context per client has no invariance content of its own)."""
    torch.manual_seed(0)
    net = common.Net(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.ReLU()),
                     torch.nn.Linear(8, 3)).double()
    x, y = torch.randn(20, 1, 4, 4, dtype=torch.float64), torch.randint(3, (20,))
    W, b = net.classifier.weight, net.classifier.bias
    gW, gb = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x), y), [W, b])
    inner = (gW * W).sum() + (gb * b).sum()
    assert inner.abs() > 1e-3 and torch.allclose(perinvfl.irm_penalty(net(x), y), inner.pow(2), rtol=1e-10)
