"""benchmark/diagnostics/: the paper-specific readings, ablations and experiment setups, each
against a hand computation or the method file it varies."""

import argparse
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import data
import fedavg
import fedomg
import perinvfl

from tests.helpers import (
    fails, grad_by_hand, guarded_run, hold, J_by_hand, LOE_FULL, on_every_device, pinv_setup,
    QUICK, run, strip_times, thetas, tiny_model, TINY_TOL, with_solver,
)
import fedloe_spawn
import fedomg_readings as readings
import gpu_check
import irm_central
import mcmahan_fig1
import penalty_swap as ps
import perinvfl_variants as pv
import sensitivity


pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def gram(U, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(U, 500, generator=g, dtype=torch.float64)
    if kind == "client-like":                              # correlated, like updates from one model
        G = torch.randn(1, 500, generator=g, dtype=torch.float64) + 0.8 * G
    elif kind == "parallel":
        G = torch.randn(1, 500, generator=g, dtype=torch.float64) + 1e-3 * G
    elif kind == "wide-range":                                  # norms spanning 1e-2 .. 1e2
        G = G * torch.logspace(-2, 2, U, dtype=torch.float64)[:, None]
    K = G @ G.T
    return K / K.diagonal().sqrt().mean() ** 2, torch.full((U,), 1.0 / U, dtype=torch.float64)


def brute_force(K, p, kappa, steps=400):
    """The minimum of Eq. 15 over a dense grid of the simplex (U = 2 or 3)."""
    t = torch.linspace(0, 1, steps + 1, dtype=torch.float64)
    if len(p) == 2:
        cands = torch.stack([t, 1 - t], 1)
    else:
        a, b = torch.meshgrid(t, t, indexing="ij")
        keep = (a + b) <= 1
        cands = torch.stack([a[keep], b[keep], 1 - a[keep] - b[keep]], 1)
    vals = (cands @ K @ p + kappa * (p @ K @ p).sqrt()
            * torch.einsum("ni,ij,nj->n", cands, K, cands).clamp(min=0).sqrt())
    return vals.min().item()


# Eq. 15 as printed (ε = 0, as solve_exact takes it), the solvers' own question.
@pytest.mark.parametrize("U,kind", [(2, "random"), (3, "random"), (3, "wide-range"),
                                    (2, "parallel"), (3, "client-like")])
def test_fedomg_exact_solver_is_the_minimum(U, kind):
    K, p = gram(U, kind)
    gamma = readings.solve_exact(K, p, 0.5)
    assert gamma.min() >= 0 and abs(gamma.sum().item() - 1) < 1e-12          # on the simplex
    exact = fedomg.objective(gamma, K, p, 0.5, 0.0).item()
    assert exact <= brute_force(K, p, 0.5) + 1e-9
    assert (exact >= brute_force(K, p, 0.5, steps=50) - 0.02 * abs(brute_force(K, p, 0.5, steps=50))
            - 1e-6)


@pytest.mark.parametrize("U,kind,evals", [
    (2, "random", 21), (3, "random", 21), (5, "random", 21), (10, "random", 21),
    (3, "client-like", 21), (10, "client-like", 201), (20, "client-like", 201),
    (20, "random", 201), (3, "parallel", 21), (20, "parallel", 21)])
def test_fedomg_sgd_solver_reaches_the_exact_objective(U, kind, evals):
    K, p = gram(U, kind, seed=U)
    gamma = fedomg.solve(K, p, 0.5, 0.0, evaluations=evals)
    assert gamma.min() >= 0 and abs(gamma.sum().item() - 1) < 1e-12
    sgd = fedomg.objective(gamma, K, p, 0.5, 0.0).item()
    exact = fedomg.objective(readings.solve_exact(K, p, 0.5), K, p, 0.5, 0.0).item()
    assert exact <= sgd + 1e-12 and (sgd - exact) / abs(exact) < 1e-3


def test_fedomg_sgd_solver_falls_short_when_norms_span_orders_of_magnitude():
    """The documented limit of Table 4's solver: exact is far better here, never worse."""
    K, p = gram(10, "wide-range")
    sgd = fedomg.objective(fedomg.solve(K, p, 0.5, 0.0), K, p, 0.5, 0.0).item()
    exact = fedomg.objective(readings.solve_exact(K, p, 0.5), K, p, 0.5, 0.0).item()
    assert exact < sgd and (sgd - exact) / abs(exact) > 1e-3


def test_perinvfl_groupdro_updates_q_from_the_uploaded_risks():
    model, fed, ctx, args, state = pinv_setup(inv="groupdro")
    nu = common.get_flat(model)
    pv.variant_round(1, model, fed, args, state, ctx)
    W, b = nu[:48].view(3, 16), nu[48:]
    risks = torch.stack([F.cross_entropy(c.x.float().flatten(1) / 255 @ W.T + b, c.y)
                         for c in fed.clients])
    q = 0.5 * torch.exp(args.eta_q * risks)
    assert (torch.allclose(state["q"], q / q.sum(), atol=1e-6)
            and not torch.allclose(state["q"], torch.full((2,), 0.5)))
    # and the next round's ν-step of client i is on N q_i R_i (no IRM term under GroupDRO)
    model2, fed, ctx, args, state2 = pinv_setup(inv="groupdro")
    state2["q"] = state["q"].clone()
    pv.variant_round(1, model2, fed, args, state2, ctx)
    nu_i = []
    for i, c in enumerate(fed.clients):
        th = nu.clone().requires_grad_()
        W, b = th[:48].view(3, 16), th[48:]
        loss = (2 * state["q"][i] * F.cross_entropy(c.x.float().flatten(1) / 255 @ W.T + b, c.y)
                + 0.005 * th.pow(2).sum())
        nu_i.append(nu - args.lr * torch.autograd.grad(loss, th)[0])
    assert torch.allclose(common.get_flat(model2), sum(nu_i) / 2, atol=1e-6)


def test_perinvfl_ablations_l2_and_ft():
    model, fed, ctx, args, state = pinv_setup(personalize="ft", beta=5.0, S=2, ft_epochs=2,
                                              ft_batch=4)
    nu = common.get_flat(model)
    pv.variant_round(1, model, fed, args, state, ctx)
    # ft: θ_i is made when scored; until then it is the round's start, ν
    assert [torch.equal(th, nu) for th in thetas(state)] == [True, True]
    net, c = tiny_model(), fed.clients[1]         # ft: ν after 2 epochs of minibatch ERM, no β term
    common.set_flat(net, nu)
    gen = common.stream(0, fed.name, 1, c.id, "fine_tune", "cpu")   # the minibatch order
                                                                    # fine_tune draws
    got = pv.fine_tune(net, c, args, common.stream(0, fed.name, 1, c.id, "fine_tune", "cpu"),
                       ctx.prep)
    th = nu.clone()
    for _ in range(2):
        perm = torch.randperm(c.n, generator=gen)
        for k in range(0, c.n, 4):
            idx = perm[k:k + 4]
            t_ = th.clone().requires_grad_()
            W, b = t_[:48].view(3, 16), t_[48:]
            loss = (F.cross_entropy(c.x[idx].float().flatten(1) / 255 @ W.T + b, c.y[idx]) + 0.005
                    * t_.pow(2).sum())
            th = th - args.lr * torch.autograd.grad(loss, t_)[0]
    assert torch.allclose(got, th, atol=1e-6) and (got - nu).norm() > 1e-3
    model, fed, ctx, args, state = pinv_setup(personalize="l2", beta=0.7, theta="kept")
    theta0 = common.get_flat(model) + 0.3
    hold(ctx, [theta0, theta0])
    nu = common.get_flat(model)
    pv.variant_round(1, model, fed, args, state, ctx)
    for i, c in enumerate(fed.clients):                   # l2: ERM + β||θ − ν||², no IRM term
        t_ = theta0.clone().requires_grad_()
        W, b = t_[:48].view(3, 16), t_[48:]
        loss = (F.cross_entropy(c.x.float().flatten(1) / 255 @ W.T + b, c.y)
                + 0.005 * t_.pow(2).sum() + 0.7 * (t_ - nu).pow(2).sum())
        assert torch.allclose(thetas(state)[i], theta0 - args.lr
                              * torch.autograd.grad(loss, t_)[0], atol=1e-6)


def test_irm_central_environments_penalty_and_resumable_results(tmp_path, capsys):
    envs = irm_central.environments("colored", None, 0)  # IRM's ColoredMNIST: 5/6 of
                                                         # the training set, halved
    assert [len(y) for _, y in envs] == [2083, 2083, 834]
    for (x, y), p in zip(envs, (0.8, 0.9, 0.1)):
        assert x.shape[1:] == (2, 14, 14) and y.shape[1:] == (1,)
        colour = (x[:, 1].amax((1, 2)) > 0).float()[:, None]
        assert abs(colour.eq(y).float().mean().item() - p) < 0.04
    rot, flat = (irm_central.environments("rc", None, 0),
                 irm_central.environments("rc-norot", None, 0))
    assert [len(y) for _, y in rot] == [1041] * 4 + [832] and torch.equal(rot[1][1], flat[1][1])
    assert torch.equal(torch.rot90(rot[1][0], -1, dims=(2, 3)), flat[1][0])
    g = torch.Generator().manual_seed(0)                 # the penalty: (d/ds BCE(s·z, y) at s = 1)²
    z, y = (torch.randn(9, 1, generator=g, dtype=torch.float64),
            torch.randint(2, (9, 1), generator=g).double())
    assert torch.allclose(irm_central.penalty(z, y), (((torch.sigmoid(z) - y) * z).mean()) ** 2,
                          rtol=1e-12)
    out = tmp_path / "c.json"
    irm_central.main(["--data", "colored", "--steps", "2", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["method"], r["steps"]) for r in runs] == [("irm", 2), ("erm", 2)]
    # done runs are skipped
    irm_central.main(["--data", "colored", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == runs
    assert "| colored | irm |" in capsys.readouterr().out
    for argv in (["--steps", "0", "--out", str(out)], ["--report", str(tmp_path / "none.json")]):
        with pytest.raises(SystemExit) as e:
            irm_central.main(argv)
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


SPAWN = ["--dataset", "synthetic", "--clients", "4", "--test-domain", "1"] + LOE_FULL


def test_fedloe_spawn_trunk_is_fedloe_and_the_first_branch_is_one_shot(tmp_path, capsys):
    """The diagnostic's trunk is fedloe with one epoch per communication (the branches are undone:
    model and minibatch stream), and the branch spawned from the random start is fedloe with one
    communication, bit for bit."""
    import fedloe
    spawn, _ = run(fedloe_spawn.main, SPAWN + ["--spawn", "0", "2", "--spawn-epochs", "2"],
                   tmp_path, "s.json")
    trunk, _ = run(fedloe.main, SPAWN + ["--stage1-epochs", "4", "--stage1-comms", "4",
                                         "--stage2-comms", "0"],
                   tmp_path, "t.json")
    once, _ = run(fedloe.main, SPAWN + ["--stage1-epochs", "2", "--stage1-comms", "1",
                                        "--stage2-comms", "0"],
                  tmp_path, "o.json")
    (s,), (t,), (o,) = (list(r["domains"].values()) for r in (spawn, trunk, once))
    keys = ("val_acc", "test_acc", "loss", "in_domain_acc")
    assert [[r[k] for k in keys] for r in s["history"]] == [[r[k] for k in keys]
                                                            for r in t["history"]]
    branches = [r["spawn"] for r in s["history"]]
    assert [b and b["k"] for b in branches] == [0, None, 2, None]  # reported in the
                                                                   # row after epoch k
    first = branches[0]
    assert (first["average_test"], first["average_in_domain"]) == (
        o["test_acc"], o["history"][-1]["in_domain_acc"])
    assert all(0 <= b[k] <= 1 for b in branches if b for k in b if k != "k")
    for argv, msg in ((["--stage1-comms", "2"], "are set by --spawn and --spawn-epochs here"),
                      (["--spawn", "-1"], "--spawn must be >= 0"),
                      (["--spawn-epochs", "0"], "--spawn-epochs >= 1"),
                      (["--eval-every", "2"], "the trunk is evaluated after every epoch")):
        assert msg in fails(fedloe_spawn.main, SPAWN + argv + ["--out", str(tmp_path / "x.json")],
                            capsys)


def test_mcmahan_fig1_path_ends_at_the_two_parents(tmp_path, capsys):
    """Figure 1's path: θ = 1 is w, θ = 0 is w′ (each trained on its own 600 digits, the two samples
    disjoint), the average in between; shared initialisation means w and w′ start equal."""
    out = tmp_path / "f.json"
    runs = mcmahan_fig1.main(["--seeds", "0", "--points", "2", "--out", str(out)])
    assert ([r["init"] for r in runs] == ["different", "shared"] and runs[0]["theta"]
            == [-0.2, 0.0, 0.5, 1.0, 1.2])
    x, y, _ = data.mnist_arrays(None, test=False)
    x = x.reshape(len(y), -1).float() / 255
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    a, b = perm[:600], perm[600:1200]
    assert not set(a.tolist()) & set(b.tolist())
    assert all(torch.equal(u, v) for u, v in zip(mcmahan_fig1.two_nn(0).parameters(),
                                                 mcmahan_fig1.two_nn(0).parameters()))
    w = mcmahan_fig1.train(mcmahan_fig1.two_nn(0), x[a], y[a], 0)
    w_prime = mcmahan_fig1.train(mcmahan_fig1.two_nn(0), x[b], y[b], 1)      # the shared pair's w′
    with torch.no_grad():
        ends = [F.cross_entropy(m(x), y).item() for m in (w_prime, w)]
    shared = runs[1]
    assert (shared["loss"][1] == pytest.approx(ends[0], rel=1e-6) and shared["loss"][3]
            == pytest.approx(ends[1], rel=1e-6))
    # w′ differs
    assert runs[0]["loss"][3] == shared["loss"][3] and runs[0]["loss"][1] != shared["loss"][1]
    mid = mcmahan_fig1.mix(w.state_dict(), w_prime.state_dict(), 0.5)
    assert torch.equal(mid["1.weight"], 0.5 * w.state_dict()["1.weight"] + 0.5
                       * w_prime.state_dict()["1.weight"])
    assert ("| shared | 0 |" in capsys.readouterr().out and json.loads(out.read_text())["runs"]
            == runs)
    with pytest.raises(SystemExit) as e:
        mcmahan_fig1.main(["--points", "1", "--out", str(out)])
    assert (e.value.code == 2 and capsys.readouterr().err.strip()
            == "mcmahan_fig1.py: error: --points must be >= 2, got 1")


def test_sensitivity_moves_runs_only_by_the_given_scale(monkeypatch):
    """s = 0 reproduces every tiny case exactly (the CPU is deterministic, the wrapper adds
    nothing); s = 1e-3 moves them; the original build_model is restored."""
    cases = [c for c in gpu_check.tiny_cases() if c[0] in ("fedavg", "fedipg") and c[2] == "fp32"]
    monkeypatch.setattr(gpu_check, "tiny_cases", lambda: cases)
    build = common.build_model
    rows = sensitivity.main(["--scale", "0", "1e-3"])[2:]
    assert len(rows) == 4 and all(r.endswith("| 0.0e+00 | 0.000 |") for r in rows[0::2])
    assert (not any(r.endswith("| 0.0e+00 | 0.000 |") for r in rows[1::2])
            and common.build_model is build)


def test_fedomg_bit_for_bit_usage_line_runs_against_fedavg(tmp_path):
    """benchmark/diagnostics/fedomg_readings.py's `python ...fedomg_readings.py ...  # = python
    fedavg.py ..., bit for bit`, both run as written."""
    lines = [line.strip() for line in readings.__doc__.splitlines()]
    k = next(i for i, line in enumerate(lines) if line.startswith("# = python fedavg.py")
             and "bit for bit" in line)
    omg, avg = lines[k - 1], lines[k][len("# = "):].split(",")[0]
    assert (omg.startswith("python benchmark/diagnostics/fedomg_readings.py ")
            and avg.startswith("python fedavg.py "))
    a, _ = run(fedavg.main, avg.split()[2:], tmp_path, "avg.json")
    b, _ = run(readings.main, omg.split()[2:], tmp_path, "omg.json")
    assert len(a["domains"]) == 3 and a["domains"]["style0"]["history"]
    assert strip_times(a)["domains"] == strip_times(b)["domains"]


@pytest.mark.parametrize("argv,message", [(["--solver", "newton"],
                                           "argument --solver: invalid choice: 'newton'"),
                                          (["--solver-evals", "0"],
                                           "--solver-evals must be positive, got 0"),
                                          (["--lr-step", "0"],
                                           "--lr-step must be in (0, 1], got 0.0"),
                                          (["--server-rule", "cagrad"],
                                           "argument --server-rule: invalid choice: 'cagrad'"),
                                          (["--kappa", "-0.5"], "--kappa must be >= 0, got -0.5")])
def test_fedomg_readings_flags_bad_input(argv, message, capsys):
    assert message in fails(readings.main, argv, capsys)


def test_fedomg_solver_accuracy_as_stated():
    """Table 4's solver against SLSQP on random Gram matrices (seeds 0–9, κ = 0.5), the relative
    objective gap benchmark/diagnostics/fedomg_readings.py's docstring states; the U = 100 ranges
    are read from that docstring itself."""
    def gaps(U, kind, evaluations=21):
        out = []
        for seed in range(10):
            K, p = gram(U, kind, seed=seed)
            sgd = fedomg.objective(fedomg.solve(K, p, 0.5, evaluations=evaluations), K, p,
                                   0.5).item()
            exact = fedomg.objective(readings.solve_exact(K, p, 0.5), K, p, 0.5).item()
            out.append((sgd - exact) / abs(exact))
        return np.array(out)
    assert gaps(10, "random").min() > -1e-9 and gaps(10, "random").max() < 1.8e-3
    g20 = gaps(20, "random")
    assert 2e-3 < g20.min() and g20.max() < 1.2e-2
    g100, c100 = gaps(100, "random"), gaps(100, "client-like")
    doc = " ".join(readings.__doc__.split())
    assert (f"U = 100, {100 * g100.min():.0f}–{100 * g100.max():.0f}% "
            f"({100 * c100.min():.1f}–{100 * c100.max():.1f}%)" in doc)
    assert 0.2 < g100.min() and g100.max() < 0.45                       # not the 3–15% once stated


def grad_J(theta, centre, c, lam, args):
    theta = theta.clone().requires_grad_()
    g, = torch.autograd.grad(J_by_hand(theta, centre, c, lam, args), theta)
    return g


def adam_step_by_hand(p, g, st, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step (Kingma & Ba, with bias correction); st = (m, v, k) or None for a fresh
    Adam."""
    m, v, k = st if st is not None else (torch.zeros_like(p), torch.zeros_like(p), 0)
    k += 1
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + eps), (m, v, k)


@pytest.mark.parametrize("reading", ["reset", "kept"])
def test_theta_readings_and_r_above_one_against_a_hand_computation(reading, monkeypatch):
    """Plain steps, R = S = 2, β = 0.7, λ = 3, two rounds. Line 8's first step of each round starts
    at ν^t (`reset`) or at the client's θ_i of the round before (`kept`), and carries through the
    round's R·S steps, pulled towards ν_{i,r}; ν_{i,r+1} = ν_{i,r} − γ∇L_INV(ν_{i,r}) (line 9, R = 2
    chained steps); ν' = mean_i ν_{i,2} (line 10); the check's J_i is taken at the last centre
    ν_{i,1}."""
    model, fed, ctx, args, state = pinv_setup(beta=0.7, R=2, S=2, theta=reading, eval_every=1)
    nu0 = common.get_flat(model)
    hold(ctx, [nu0 + 0.2, nu0 - 0.2])
    starts, J_i = [], perinvfl.J_i

    def first_steps(model, params, buffers, x, y, *a, **k):   # θ at each step of line 8
                                                              # (not the check's calls)
        if torch.is_grad_enabled():
            # (6 and 10 examples)
            starts.append((len(y), torch.cat([p.detach().reshape(-1) for p in params.values()])))
        return J_i(model, params, buffers, x, y, *a, **k)
    monkeypatch.setattr(perinvfl, "J_i", first_steps)
    theta = [ctx.clients[i]["theta"].clone() for i in range(2)]
    for t in (1, 2):
        nu, ends = common.get_flat(model), []
        starts.clear()
        pv.variant_round(t, model, fed, args, state, ctx)
        for i, c in enumerate(fed.clients):
            th, nu_r = (nu.clone() if reading == "reset" else theta[i]), nu.clone()
            # line 8's θ_i^0 this round
            assert torch.equal(next(p for n, p in starts if n == c.n), th)
            for r in range(2):
                for s in range(2):
                    th = th - args.lr * grad_J(th, nu_r, c, args.lam, args)
                centre = nu_r
                nu_r = nu_r - args.lr * grad_by_hand(nu_r, c, args.lam, args.weight_decay)
            assert torch.allclose(thetas(state)[i], th, atol=1e-6), (t, i)
            want = torch.stack([J_by_hand(th, centre, c, args.lam, args),
                                J_by_hand(centre, centre, c, args.lam, args)])
            assert torch.allclose(state["eq4"][:, i], want, rtol=1e-5), (t, i)
            theta[i], ends = thetas(state)[i].clone(), ends + [nu_r]
        assert torch.allclose(common.get_flat(model), sum(ends) / 2, atol=1e-6), t


@pytest.mark.parametrize("reading", ["reset", "kept"])
def test_line8_adam_state_across_rounds_and_at_the_lambda_switch(reading):
    """--theta-opt adam, S = 1, λ = 1 for two rounds then 50. Under either reading θ_i's Adam state
    stays on its client across rounds (round 2: its second step) and restarts at the switch to the
    large λ, where the objective changes (round 3: a first step again), carrying on after it (round
    4); the step starts at ν^t (`reset`) or at θ_i of the round before (`kept`). Adam written out by
    hand."""
    model, fed, ctx, args, state = pinv_setup(opt="adam", lr=0.01, lam=50.0, anneal=2, beta=0.7,
                                              theta=reading, theta_opt="adam")
    adam, prev = [None, None], [common.get_flat(model)] * 2       # θ_i^0 = ν^0
    for t in range(1, 5):
        nu = common.get_flat(model)
        pv.variant_round(t, model, fed, args, state, ctx)
        lam = 50.0 if t > 2 else 1.0
        for i, c in enumerate(fed.clients):
            start = nu if reading == "reset" else prev[i]
            if t == 3:
                adam[i] = None
            want, adam[i] = adam_step_by_hand(start, grad_J(start, nu, c, lam, args), adam[i],
                                              args.lr)
            assert torch.allclose(thetas(state)[i], want, atol=1e-6), (t, i)
            prev[i] = thetas(state)[i].clone()


def test_the_check_is_in_the_results_and_holds_under_the_default_reading(tmp_path):
    """End to end on the embedded RC-MNIST across the switch to λ = 100: the default is `reset`, and
    at every evaluated round J_i(θ_i) < J_i(ν) for every client (`eq4_holds` 1); `--theta kept`
    records the same numbers (whatever they are)."""
    argv = ["--dataset", "rcmnist", "--rounds", "4", "--eval-every", "2", "--anneal", "2",
            "--lam", "100", "--lr", "2e-3"]
    res, _ = run(pv.main, argv, tmp_path)
    assert res["args"]["theta"] == "reset"
    hist = res["domains"]["clients"]["history"]
    assert [h["round"] for h in hist] == [2, 4]
    for h in hist:
        assert h["eq4_holds"] == 1.0 and all(a < b for a, b in zip(h["eq4_theta"], h["eq4_nu"])), h
        assert len(h["eq4_theta"]) == 4
    kept, _ = run(pv.main, argv + ["--theta", "kept"], tmp_path, "kept.json")
    last = kept["domains"]["clients"]["history"][-1]
    assert (kept["args"]["theta"] == "kept" and len(last["eq4_nu"]) == 4 and 0 <= last["eq4_holds"]
            <= 1)
    assert all(v > 0 for v in last["eq4_theta"] + last["eq4_nu"])


def test_rcmnist_ptest_rows_name_line_8s_reading():
    """benchmark/diagnostics/rcmnist_ptest.py's row of a perinvfl run names --theta and --theta-opt,
    so that runs of the two readings never merge into one row; runs made before those flags say
    so."""
    import rcmnist_ptest                                 # (benchmark/ is on the path: test_methods)
    a = {"inv": "irm", "personalize": "dual", "theta": "reset", "theta_opt": "sgd"}
    runs = [{"method": "perinvfl", "args": dict(a, **kw)} for kw in
            ({}, {"theta": "kept"}, {"theta_opt": "adam"}, {"theta": "kept", "theta_opt": "adam"})]
    old = {"method": "perinvfl", "args": {"inv": "irm", "personalize": "dual"}}
    labels = [rcmnist_ptest.label(r) for r in runs + [old]]
    assert len(set(labels)) == 5
    assert labels[0] == "perinvfl irm dual, theta reset, line 8 sgd"
    assert labels[-1] == "perinvfl irm dual, theta kept, line 8 adam (unflagged)"
    assert rcmnist_ptest.label({"method": "fedavg", "args": {}}) == "fedavg"
    # perinvfl.py's run: its defaults
    assert rcmnist_ptest.label({"method": "perinvfl", "args": {}}) == labels[0]


SWAP_TINY = ["--rounds", "2", "--anneal", "1"]


def swap_args(**kw):
    return argparse.Namespace(**{**dict(rounds=3, anneal=1, ema=0.95, device="cpu", data_root=None),
                                 **kw})


def test_irm_is_perinvfls_nu_round_for_round(tmp_path, monkeypatch):
    """penalty irm, 3 rounds with the switch to λ = 91257 (and the division by it) after round 1, on
    the embedded digits: bit for bit the ν of perinvfl.py's global model (its checkpoint), which
    moved from ν^0 (both visit the clients in the order of their ids)."""
    out = str(tmp_path / "p.json")
    perinvfl.main(["--dataset", "rcmnist", "--no-rotation", "--rounds", "3", "--anneal", "1",
                   "--device", "cpu",
                   "--out", out])                            # (penalty_swap's runs: swap_args' cpu)
    nu = torch.load(str(tmp_path / "p.json.ckpt"), weights_only=True)["model"]
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
    """The MLP at a fixed ν (not its initialisation: biases nonzero) and 40 random two-channel
    images."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(40, 2, 14, 14, generator=g), torch.randint(0, 2, (40,), generator=g)
    torch.manual_seed(0)
    model = common.build_model(argparse.Namespace(model="mlp", head="linear", no_pretrained=True),
                               argparse.Namespace(domains=[argparse.Namespace(x=x)], num_classes=2))
    common.set_flat(model, common.get_flat(model) + 0.05
                    * torch.randn(len(common.get_flat(model)), generator=g))
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
    g_tilde = [0.2 * torch.randn(2, 390, generator=torch.Generator().manual_seed(5)),
               torch.tensor([0.3, -0.2])]
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
        loss, risk, P = ps.objective(name, model, x, y, torch.cat([v.reshape(-1) for v in g_tilde]))
        assert risk.item() == pytest.approx(ell.mean(), rel=1e-5)
        assert loss.item() == pytest.approx(ell.mean() + l2, rel=1e-5) and l2 > 0.1
        if name == "none":
            assert P is None and ps.weight(name, 5, 1) is None
        else:
            assert P.item() == pytest.approx(hand[name], rel=1e-4, abs=1e-12), name
            first, = torch.autograd.grad(P, [model.featurizer[1].weight])
            assert first.abs().max() > 0, name              # in the graph: it trains the featurizer


def test_weights_and_fediir_keeps_its_ema(fixed_nu):
    """w_t = 1 up to the anneal round, then the large weight; FedIIR's g̃ after the first round is
    0.05 × the clients' mean classifier gradient at ν^0 (EMA from 0, v = 0.95), or the mean at --ema
    0."""
    assert [ps.weight("vrex", t, 2) for t in (1, 2, 3)] == [1.0, 1.0, ps.LAM] and ps.LAM > 9e4
    model, x, y, h, z, r = fixed_nu
    clients = [(x[:25], y[:25]), (x[25:], y[25:])]
    n = np.array([25, 15])
    mean_W = sum(r[s].T @ h[s] / k for s, k in zip((slice(0, 25), slice(25, 40)), n)) / 2
    w0 = common.get_flat(model)
    for v in (0.95, 0.0):
        common.set_flat(model, w0)                                           # (the round moves ν)
        state = {"adam": None, "g_tilde": torch.zeros_like(common.get_flat(model.classifier))}
        ps.swap_round(1, "fediir", model, clients, state, swap_args(ema=v))
        W = state["g_tilde"][:model.classifier.weight.numel()].view_as(model.classifier.weight)
        assert np.allclose(W.numpy(), (1 - v) * mean_W, rtol=1e-4, atol=1e-8)


def test_resumable_and_the_report(tmp_path, monkeypatch, capsys):
    """A run stopped after its first (penalty, seed) keeps it in --out; run again, only the missing
    pair is trained, and the file equals an uninterrupted run's but for the times. --report: mean ±
    std over the seeds (sample std), beside the committed centralised IRM / ERM and ν."""
    argv = ["--penalties", "none", "irm", "--seeds", "0"] + SWAP_TINY
    whole = ps.main(argv + ["--out", str(tmp_path / "whole.json")])
    out = str(tmp_path / "cut.json")
    calls, train, stopped = [], ps.train, []

    def stop_second(name, seed, args, log=print):
        calls.append((name, seed))
        if len(calls) == 2 and not stopped:                      # once: the first call's second run
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
    fake = {"settings": {}, "runs": {f"vrex/{s}": {"penalty": "vrex", "test_acc": a,
                                                   "train_acc": 0.7}
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
        if not meanwhile:                                            # (the other's own runs: plain)
            meanwhile.append(None)
            meanwhile[0] = ps.main(["--penalties", "irm", "--seeds", "0", "--out", out] + SWAP_TINY)
        return train(name, seed, args, log)
    monkeypatch.setattr(ps, "train", train_while_another_runs)
    results = ps.main(["--penalties", "none", "--seeds", "0", "--out", out] + SWAP_TINY)
    assert list(meanwhile[0]["runs"]) == ["irm/0"]
    assert (sorted(results["runs"]) == sorted(json.loads(open(out).read())["runs"])
            == ["irm/0", "none/0"])


def test_penalty_swap_bad_input_is_one_line(tmp_path, capsys):
    """Each bad input is one line on stderr and exit 2 (before any training: a missed check costs
    one round of the embedded digits, not 500)."""
    done, quick = str(tmp_path / "done.json"), ["--penalties", "none", "--seeds", "0",
                                                "--rounds", "1"]
    ps.main(quick + ["--out", done])
    (tmp_path / "junk.json").write_text("[1, 2]")
    for argv, words in ((["--rounds", "0"], "--rounds must be positive"),
                        (["--anneal", "-1"], "--anneal must be"),
                        (["--ema", "1"], "--ema must be in [0, 1)"),
                        (["--penalties", "fish"], "invalid choice"),
                        (["--report", str(tmp_path / "nothing.json")], "cannot read"),
                        (["--report", str(tmp_path / "junk.json")], "not a results file"),
                        (["--rounds", "2", "--out", done], "other settings (rounds)"),
                        (["--out", str(tmp_path / "junk.json" / "x.json")], "cannot write --out")):
        out = [] if "--out" in argv else ["--out", str(tmp_path / "o.json")]
        assert words in fails(ps.main, quick + argv + out, capsys), argv
    if not torch.cuda.is_available():
        argv = quick + ["--device", "cuda", "--out", str(tmp_path / "o.json")]
        assert "no CUDA device" in fails(ps.main, argv, capsys)


@pytest.mark.parametrize("argv,message", [
    (["--dataset", "rcmnist", "--theta", "both"], "argument --theta: invalid choice: 'both'"),
    (["--dataset", "rcmnist", "--personalize", "ft", "--ft-epochs", "0"],
     "--ft-epochs must be at least 1, got 0"),
    (["--dataset", "rcmnist", "--inv", "vrex"], "argument --inv: invalid choice: 'vrex'"),
    (["--dataset", "rcmnist", "--rounds", "1", "--inv", "groupdro", "--parallel-clients", "on"],
     "--parallel-clients on: perinvfl trains its clients one after another"),
])
def test_perinvfl_variants_flags_bad_input(argv, message, capsys):
    assert message in fails(pv.main, argv, capsys)


def test_fedomg_step_matches_eq_16_computed_directly(monkeypatch):
    with_solver(monkeypatch, "exact")
    g = torch.Generator().manual_seed(4)
    G = torch.randn(3, 50, generator=g, dtype=torch.float64)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    g_FL = p @ G
    K = G @ G.T
    Gamma = readings.solve_exact(K / K.diagonal().sqrt().mean() ** 2, p, 0.5)
    g_Gamma = Gamma @ G                                                  # without the Gram shortcut
    expected = g_FL + 0.5 * g_FL.norm() / g_Gamma.norm() * g_Gamma           # Eq. 16 as printed
    assert torch.allclose(readings.paper_step(G, g_FL, p, 0.5), expected, atol=1e-6)


@on_every_device
def test_fedomg_with_kappa_zero_is_fedavg_bit_for_bit(tmp_path, device):
    argv = QUICK + ["--clients", "4", "--sample", "2", "--test-domain", "1", "--global-lr", "0.7",
                    "--device", device]
    a, _ = run(fedavg.main, argv, tmp_path, "avg.json")
    # Eq. 16 as printed: Corollary 1
    paper = ["--server-rule", "paper", "--fresh-opt", "--lr-step", "1"]
    b, _ = run(readings.main, argv + paper + ["--kappa", "0"], tmp_path, "omg.json")
    assert strip_times(a)["domains"] == strip_times(b)["domains"]
    c, _ = run(readings.main, argv + paper + ["--kappa", "0.5"], tmp_path, "omg.json")
    assert strip_times(a)["domains"] != strip_times(c)["domains"]
    d, _ = run(readings.main, argv + ["--kappa", "0", "--fresh-opt", "--lr-step", "1"], tmp_path,
               "omg.json")
    assert strip_times(a)["domains"] != strip_times(d)["domains"]        # the code's rule: g_FL / U


def test_perinvfl_lines_8_to_10_against_a_hand_computation(dtype):
    """One round, plain steps: ν_{i,1} = ν − γ∇L_INV(ν; D_i) (line 9), θ_i = θ_i − η(∇L_INV(θ_i) +
    2β(θ_i − ν_{i,0})) (line 8, from a kept θ_i), ν' = ν − α(ν − mean_i ν_{i,1}) (line 10), for α =
    1 and 0.5. λ = 3 > 1: IRM's rescaling divides Eq. 4 as a whole, the β term included, so β keeps
    its balance against L_IRM. float64: 2.8e-17 (tolerance 1e-12); float32, measured at 1 / 2
    threads: 1.5e-8 (tolerance atol 1e-6 + rtol 1e-5: 150x)."""
    for alpha in (1.0, 0.5):
        model, fed, ctx, args, state = pinv_setup(beta=0.7, global_lr=alpha, theta="kept")
        nu = common.get_flat(model)
        theta0 = nu + 0.1 * torch.randn(len(nu), generator=torch.Generator().manual_seed(1))
        hold(ctx, [theta0, theta0])
        pv.variant_round(1, model, fed, args, state, ctx)
        nu_i = [nu - args.lr * grad_by_hand(nu, c, args.lam, args.weight_decay)
                for c in fed.clients]
        assert nu.dtype == dtype
        assert torch.allclose(common.get_flat(model), nu - alpha * (nu - sum(nu_i) / 2),
                              **TINY_TOL[dtype])
        for i, c in enumerate(fed.clients):
            pull = 2 * args.beta * (theta0 - nu) / args.lam
            want = theta0 - args.lr * (grad_by_hand(theta0, c, args.lam, args.weight_decay) + pull)
            assert torch.allclose(thetas(state)[i], want, **TINY_TOL[dtype])


def test_line8_ends_below_nu_on_its_own_objective_every_round_across_the_lambda_switch():
    """Default reading and line-8 steps, ν by the server's Adam as on RC-MNIST, λ = 1 for two rounds
    then 50 (the objective divided by λ):
    after every round J_i(θ_i; ν^t) < J_i(ν^t; ν^t) for both clients, J written out independently,
    whatever θ_i held before the round (here far from ν); the file's own check records the same two
    numbers per client."""
    model, fed, ctx, args, state = pinv_setup(opt="adam", lr=0.01, lam=50.0, anneal=2, beta=1.0,
                                              eval_every=1)
    nu0 = common.get_flat(model)
    hold(ctx, [nu0 + 3.0, nu0 - 3.0])
    for t in range(1, 6):
        nu = common.get_flat(model)
        pv.variant_round(t, model, fed, args, state, ctx)
        lam = 50.0 if t > 2 else 1.0
        for i, c in enumerate(fed.clients):
            j_theta, j_nu = (J_by_hand(thetas(state)[i], nu, c, lam, args),
                             J_by_hand(nu, nu, c, lam, args))
            assert j_theta < j_nu, (t, i, j_theta.item(), j_nu.item())
            assert torch.allclose(state["eq4"][:, i], torch.stack([j_theta, j_nu]), rtol=1e-5,
                                  atol=0), t


VARIANT_SYNTH = ["--dataset", "synthetic", "--test-domain", "1"]
VARIANT_PINV = ["perinvfl_variants.variant_update", "common.local_train"]


@on_every_device
@pytest.mark.parametrize("script,argv,steps", [   # as tests/test_sync.py's, for the variants
    pytest.param("fediir_readings", VARIANT_SYNTH + ["--rounds", "1", "--gbar", "clients",
                                                     "--parallel-clients", "off"],
                 ["common.local_train", "fediir_readings.readings_gradient"],
                 id="fediir-readings-gbar-clients"),
    pytest.param("perinvfl_variants", ["--dataset", "rcmnist", "--rounds", "2", "--theta", "kept",
                                       "--theta-opt", "adam", "--anneal", "1"], VARIANT_PINV,
                 id="perinvfl-kept-adam"),
    pytest.param("perinvfl_variants", ["--dataset", "rcmnist", "--rounds", "1", "--personalize",
                                       "l2", "--inv", "groupdro", "--opt", "sgd"], VARIANT_PINV,
                 id="perinvfl-l2-groupdro"),
    pytest.param("perinvfl_variants", ["--dataset", "rcmnist", "--rounds", "1", "--personalize",
                                       "ft", "--ft-batch", "256"],
                 VARIANT_PINV + ["perinvfl_variants.fine_tune"], id="perinvfl-ft"),
])
def test_the_variants_have_no_host_sync_inside_a_per_step_loop(tmp_path, monkeypatch, device,
                                                              script, argv, steps):
    guarded_run(script, argv, steps, device, tmp_path, monkeypatch)
