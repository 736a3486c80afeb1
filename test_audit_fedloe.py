"""FedLOE against its sources: the terms of Eq. 11 in the base code's form (V-REx, IRMv1),
Fish's inner optimiser kept across server steps, every default against the table or code it comes
from, and stage 2 over several communications. Each computed value is checked against a computation
written here independently of fedloe.py (plain floats, or per-client torch loops)."""
import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from test_methods import LOE_ENV, tiny_args, tiny_ctx, tiny_federation, tiny_model, tiny_predictions

import common
import fedloe


# ------------------------------------------------------------------ the terms of Eq. 11, by hand

def sample_losses_by_hand(phi, Y, y):
    """ℓ(Σ_k φ_k ŷ_k, y) of every row, in plain floats (two heads, two classes)."""
    out = []
    for i in range(len(y)):
        s = [sum(phi[k] * Y[i][k][j] for k in range(2)) for j in range(2)]
        out.append(math.log(sum(math.exp(v) for v in s)) - s[y[i]])
    return out


def rex_by_hand(phi, T):
    """Per client c: R_c and V_c, the population variance of its per-example losses; plain floats."""
    ell = sample_losses_by_hand(phi, T.Y.tolist(), T.y.tolist())
    R, V = [], []
    for c in (0, 1):
        mine = [v for v, e in zip(ell, LOE_ENV) if e == c]
        R.append(sum(mine) / len(mine))
        V.append(sum((v - R[-1]) ** 2 for v in mine) / len(mine))
    return R, V


def test_rex_penalty_is_the_base_codes_within_client_variance_by_default():
    """V-REx: the FedDG benchmark's VREx.irm_penalty (per-example loss variance within each client, mean
    over the clients) by default; Appendix C.1's sum over the clients (paper); §2.1 / DomainBed's variance
    of the clients' risks (domainbed). Each against the hand computation; the three differ here."""
    T = tiny_predictions()
    phi = torch.tensor([0.3, 0.7], dtype=torch.float64)
    R, V = rex_by_hand(phi.tolist(), T)
    want = {"feddg": (V[0] + V[1]) / 2, "paper": V[0] + V[1], "domainbed": ((R[0] - R[1]) / 2) ** 2}
    assert math.isclose(fedloe.rex_penalty(phi, T).item(), want["feddg"], abs_tol=1e-12)          # the default
    for form, value in want.items():
        assert math.isclose(fedloe.rex_penalty(phi, T, form).item(), value, abs_tol=1e-12), form
    assert min(abs(a - b) for a, b in [(want["feddg"], want["paper"]), (want["feddg"], want["domainbed"]),
                                       (want["paper"], want["domainbed"])]) > 1e-3


def irm_derivatives_by_hand(phi, T):
    """∂R_c(w·Σφŷ)/∂w at w = 1 per client, in plain floats: mean over c's rows of Σ_j p_j s_j − s_y."""
    Y, y, d, n = T.Y.tolist(), T.y.tolist(), [0.0, 0.0], [0, 0]
    for i, c in enumerate(LOE_ENV):
        s = [sum(phi[k] * Y[i][k][j] for k in range(2)) for j in range(2)]
        e = [math.exp(v) for v in s]
        d[c] += sum(e[j] / sum(e) * s[j] for j in range(2)) - s[y[i]]
        n[c] += 1
    return [d[c] / n[c] for c in (0, 1)]


def server_args(**kw):
    a = dict(dg="irm", dg_form="feddg", dg_lambda=100.0, stage2_lr=0.05, stage2_wd=5e-4, server_steps=5, meta_lr=0.05)
    a.update(kw)
    return argparse.Namespace(**a)


def eq11_by_hand(phi, T, dg, form, lam):
    """Eq. 11's objective written per client with torch (differentiable), independently of fedloe:
    risks weighted 1/P (feddg, domainbed) or p(c) (paper); IRMv1 / V-REx as the docstring's table."""
    P, R, pen = len(T.rows), [], []
    for c in range(P):
        rows = [i for i, e in enumerate(LOE_ENV) if e == c]
        s = torch.einsum("nkm,k->nm", T.Y[rows], phi)
        ell = F.cross_entropy(s, T.y[rows], reduction="none")
        R.append(ell.mean())
        if dg == "irm":
            w = torch.ones((), dtype=phi.dtype, requires_grad=True)
            d, = torch.autograd.grad(F.cross_entropy(w * s, T.y[rows]), w, create_graph=True)
            pen.append(d ** 2)
        else:
            pen.append(((ell - ell.mean()) ** 2).mean())
    R, pen = torch.stack(R), torch.stack(pen)
    if dg == "rex" and form == "domainbed":
        pen = torch.stack([((R - R.mean()) ** 2).mean()])
    q = T.p if form == "paper" else torch.full((P,), 1.0 / P, dtype=phi.dtype)
    return (q * R).sum() + lam * (pen.sum() if form == "paper" else pen.mean())


def adam_on(objective, P, lr, wd, steps, dtype=torch.float64):
    phi = torch.full((P,), 1.0 / P, dtype=dtype, requires_grad=True)
    opt = torch.optim.Adam([phi], lr=lr, weight_decay=wd)
    for _ in range(steps):
        opt.zero_grad()
        objective(phi).backward()
        opt.step()
    return phi.detach()


def test_irm_penalty_is_averaged_over_the_clients_by_default():
    """IRMv1 as the base code reduces it (penalty /= n_groups): the mean over the clients by default, the
    sum with --dg-form paper (Appendix C.1); and the server's default fit is Eq. 11 with that mean and the
    clients' risks averaged (the code's avg_loss), against Adam on the objective written per client."""
    T = tiny_predictions(n_train=(10, 40))                   # p(c) = 0.2 / 0.8: the risk weights matter
    phi = torch.tensor([0.3, 0.7], dtype=torch.float64)
    d = irm_derivatives_by_hand(phi.tolist(), T)
    assert math.isclose(fedloe.irm_penalty(phi, T).item(), (d[0] ** 2 + d[1] ** 2) / 2, abs_tol=1e-12)
    assert math.isclose(fedloe.irm_penalty(phi, T, "paper").item(), d[0] ** 2 + d[1] ** 2, abs_tol=1e-12)
    ends = {}
    for form in ("feddg", "paper", "domainbed"):
        for dg in ("irm", "rex"):
            want = adam_on(lambda f: eq11_by_hand(f, T, dg, form, 100.0), 2, 0.05, 5e-4, 5)
            ends[form, dg] = fedloe.solve_phi(T, server_args(dg=dg, dg_form=form))
            assert torch.allclose(ends[form, dg], want, atol=1e-12), (form, dg)
    assert (ends["feddg", "irm"] - ends["paper", "irm"]).abs().max() > 1e-4
    assert (ends["feddg", "rex"] - ends["domainbed", "rex"]).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------- Fish

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
            rows = [i for i, e in enumerate(LOE_ENV) if e == c]
            Y, y = T.Y.tolist(), T.y.tolist()
            g = [0.0, 0.0]
            for i in rows:                                   # ∇_φ̃ of client c's mean loss
                s = [sum(tilde[k] * Y[i][k][j] for k in range(2)) for j in range(2)]
                e = [math.exp(u) for u in s]
                for k in range(2):
                    g[k] += (sum(e[j] / sum(e) * Y[i][k][j] for j in range(2)) - Y[i][k][y[i]]) / len(rows)
            g = [weights[c] * g[k] + wd * tilde[k] for k in range(2)]
            m = [b1 * m[k] + (1 - b1) * g[k] for k in range(2)]
            v = [b2 * v[k] + (1 - b2) * g[k] ** 2 for k in range(2)]
            tilde = [tilde[k] - lr * m[k] / (1 - b1 ** t) / (math.sqrt(v[k] / (1 - b2 ** t)) + eps) for k in range(2)]
        phi = [phi[k] + meta * (tilde[k] - phi[k]) for k in range(2)]
    return phi


@pytest.mark.parametrize("form,weights", [("feddg", [1.0, 1.0]), ("paper", [0.4, 1.6])])
def test_fish_keeps_the_inner_adam_state_across_server_steps(form, weights):
    """solve_phi's Fish against the hand-written loop with the inner Adam's state carried over the
    meta steps; the restarted Adam (the former code) ends elsewhere."""
    T = tiny_predictions(n_train=(10, 40))
    lr, wd, meta, steps = 0.1, 0.01, 0.5, 6
    got = fedloe.solve_phi(T, server_args(dg="fish", dg_form=form, stage2_lr=lr, stage2_wd=wd, meta_lr=meta,
                                          server_steps=steps))
    kept = fish_by_hand(T, weights, lr, wd, meta, steps)
    restarted = fish_by_hand(T, weights, lr, wd, meta, steps, keep=False)
    assert torch.allclose(got, torch.tensor(kept, dtype=torch.float64), atol=1e-12)
    assert max(abs(a - b) for a, b in zip(kept, restarted)) > 1e-2


# ------------------------------------------------------------------------- defaults and sources

LODO = ("pacs", "vlcs", "officehome", "rmnist", "synthetic")
RC, FL = ("rcmnist", "rcfmnist"), ("mnist", "emnist", "cifar10", "cifar100")     # fixed clients, with waterbird
DATASETS = LODO + RC + FL + ("waterbird",)


def by(lodo, rc, fl, waterbird):
    """A default per dataset: leave-one-domain-out (a value, or a dict), RC-MNIST / RC-FMNIST, label skew, waterbird."""
    return {**(lodo if isinstance(lodo, dict) else dict.fromkeys(LODO, lodo)), **dict.fromkeys(RC, rc),
            **dict.fromkeys(FL, fl), "waterbird": waterbird}


# flag, value (the same for every dataset, or one per dataset), source
DEFAULTS = [
    ("batch_size", by(128, 25000, 16, 32), "Table 5 (batch size); fixed clients: FedAvg's there (common.py)"),
    ("stage1_epochs", by(256, 512, 96, 96), "Table 5 (stage 1 iterations, read as the local-epoch budget E1); "
                                            "fixed clients: E1 = 32·K1 (Table 5's 256 / 8)"),
    ("stage1_comms", by(8, 16, 3, 3), "Table 5 (stage 1 total communication); fixed clients: the local epochs per "
                                      "client of FedAvg's default run / 32, rounded (500 -> 16, 100 -> 3)"),
    ("lr", by(dict(pacs=5e-5, vlcs=5e-5, officehome=3e-5, rmnist=1e-3, synthetic=1e-2), 1e-3, 1e-3, 5e-5),
     "Table 5 (stage 1 lr: PACS, OfficeHome; VLCS as PACS); DomainBed hparams_registry.py (MNIST; the models "
     "trained from scratch); synthetic chosen; waterbird's pretrained ResNet as PACS"),
    ("weight_decay", by(0.0, 2.2e-3, 0.0, 0.0), "Table 5 gives no stage-1 weight decay; RC-MNIST: FedAvg's, IRM's L2"),
    ("global_lr", 1.0, "Eq. 4 (the weighted average itself)"),
    ("stage2_epochs", 8, "Table 5 (stage 2 iterations)"),
    ("stage2_comms", 4, "Table 5 (stage 2 total communication)"),
    ("stage2_lr", 0.05, "Table 5 (stage 2 learning rate)"),
    ("stage2_wd", 5e-4, "Table 5 (stage 2 weight decay)"),
    ("momentum", 0.0, "Table 5 (stage 2 optimiser: SGD, no momentum given)"),
    ("dg", "irm", "Table 2's first FedLOE row (chosen)"),
    ("dg_lambda", 100.0, "Table 5 (IRM λ, REx λ)"),
    ("meta_lr", 0.05, "Table 5 (Fish meta lr, PACS and OfficeHome)"),
    ("dg_form", "feddg", "FedDG_Benchmark src/client.py (IRM.step, VREx.irm_penalty, Fish.step)"),
    ("server_steps", 100, "chosen (docstring)"),
    ("clients", by(20, 4, 100, 4), "Figure 1a (20 clients); fixed clients: the split's (FedAvg's)"),
    ("sample", by(20, 4, 100, 4), "Eq. 4 and 11 run over every client"),
    ("select", "last", "Table 5 (stopping criterion: fixed iteration)"),
    ("eval_every", 1, "every communication evaluated"),
    ("model", by(dict(pacs="resnet50", vlcs="resnet50", officehome="resnet50", rmnist="convnet", synthetic="smallconv"),
                 "mlp", "cnn", "resnet18"),
     "Appendix D.3 (ResNet-50); the others common.py's models for the dataset"),
    ("head", "linear", "Appendix D.3 (a linear classifier; Eq. 12 needs one)"),
    ("rounds", by(12, 20, 7, 7), "K1 + K2 communications"),
    ("local_epochs", 32, "E1 / K1"),
]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """The arguments fedloe.main would run with, per dataset, nothing given but the dataset."""
    out = {}
    for name in DATASETS:
        p = common.make_parser("fedloe", fedloe.__doc__)
        fedloe.add_args(p)
        args = p.parse_args(["--dataset", name, "--out", str(tmp_path_factory.mktemp(name) / "r.json")])
        common.resolve(args, "fedloe", fedloe.DEFAULTS)
        fedloe.check(args)
        out[name] = args
    return out


@pytest.mark.parametrize("flag,value,source", DEFAULTS, ids=[row[0] for row in DEFAULTS])
def test_every_default_follows_its_source(resolved, flag, value, source):
    for name in DATASETS:
        want = value[name] if isinstance(value, dict) else value
        assert getattr(resolved[name], flag) == want, f"--{flag.replace('_', '-')} on {name}: source {source}"


def test_the_defaults_table_covers_every_fedloe_flag():
    p = argparse.ArgumentParser()
    fedloe.add_args(p)
    flags = {a.dest for a in p._actions if a.dest != "help"} | {k for t in fedloe.DEFAULTS.values() for k in t}
    assert flags <= {row[0] for row in DEFAULTS}, flags - {row[0] for row in DEFAULTS}
    assert all(f"--{flag.replace('_', '-')}" in fedloe.__doc__ for flag, _, _ in DEFAULTS
               if flag not in ("sample", "rounds", "local_epochs"))   # the docstring's table names the rest


# ---------------------------------------------------------------- stage 2, several communications

def test_stage2_over_several_communications_by_hand():
    """K2 = 3 communications of E2 = 6 epochs: every client trains its head E2/K2 = 2 full-batch SGD epochs
    (weight decay) from the broadcast ψ, the server fits φ from uniform by Adam with the stage-2 weight
    decay on Eq. 11 (V-REx, the default form), and ψ = Σ φ_c ψ̂_c goes down; all by hand, round by round."""
    fed, model = tiny_federation((40, 60)), tiny_model()
    fedloe.split_appendix_d2(fed, 0)
    lr, wd, lam, steps = 0.5, 0.05, 1.0, 4
    args = tiny_args(batch_size=100, stage2_lr=lr, stage2_wd=wd, stage2_epochs=6, stage2_comms=3, server_steps=steps,
                     dg="rex", dg_form="feddg", dg_lambda=lam, meta_lr=0.05)
    assert all(c.n < args.batch_size for c in fed.clients) and fed.clients[0].n != fed.clients[1].n
    state = {"bytes": {"stage1": [0, 0], "stage2": [0, 0]}}
    W, b = model.classifier.weight.detach().clone(), model.classifier.bias.detach().clone()
    prep, ctx = (lambda x: x.float().flatten(1) / 255), tiny_ctx()
    for t in range(3):
        fedloe.stage2_round(3 + t, model, fed, args, state, ctx)
        heads = []
        for c in fed.clients:                                # 2.1: E2/K2 = 2 full-batch epochs from the broadcast ψ
            Wc, bc = W.clone(), b.clone()
            for _ in range(2):
                Wc.requires_grad_(), bc.requires_grad_()
                gW, gb = torch.autograd.grad(F.cross_entropy(F.linear(prep(c.x), Wc, bc), c.y), [Wc, bc])
                Wc, bc = (Wc - lr * (gW + wd * Wc)).detach(), (bc - lr * (gb + wd * bc)).detach()
            heads.append((Wc, bc))
        groups = []                                          # 2.2: every head on every client's tuning split
        for c in fed.clients:
            Y = torch.stack([F.linear(prep(c.tune_x), Wk, bk) for Wk, bk in heads], 1)     # [n_c, P, m]
            groups.append((Y, c.tune_y))

        def objective(phi):                                  # (1/P) Σ_c R_c + λ (1/P) Σ_c V_c, per client
            R, V = [], []
            for Y, y in groups:
                ell = F.cross_entropy(torch.einsum("nkm,k->nm", Y, phi), y, reduction="none")
                R.append(ell.mean())
                V.append(((ell - ell.mean()) ** 2).mean())
            return torch.stack(R).mean() + lam * torch.stack(V).mean()
        phi = adam_on(objective, 2, lr, wd, steps, dtype=torch.float32)
        W, b = phi[0] * heads[0][0] + phi[1] * heads[1][0], phi[0] * heads[0][1] + phi[1] * heads[1][1]
        assert torch.allclose(state["phi"], phi, atol=1e-5), t
        assert torch.allclose(model.classifier.weight, W, atol=1e-5), t
        assert torch.allclose(model.classifier.bias, b, atol=1e-5), t
    assert not torch.allclose(phi, torch.full((2,), 0.5), atol=1e-3)        # the server did move φ
