"""PerInvFL copied: its plain functions (irm_penalty, l_inv, rescale, J_i, server_update, server_adam,
q_update) lifted by their source into a torch-only namespace, driven for two rounds of Algorithm 1 by
a loop written here (the test's own model, three ragged clients of its own data, no common.py, no
data.py), and checked against perinvfl.perinvfl_round on the same data and minibatches: bit for bit
(torch.equal, CPU). The loop of docs/perinvfl.md's "Copy it" is run as printed and checked the same
way."""
import copy
import re
import types

import pytest
import torch

from test_copy import copied, three_clients, as_federation, own_model, flat, load, ARGS
from test_methods import HERE

import common
import perinvfl

PLAIN = ("irm_penalty", "l_inv", "rescale", "J_i", "server_update", "server_adam", "q_update")


def copied_perinvfl_rounds(m, clients, rounds, lam, anneal, beta, wd, gamma, eta, alpha, momentum, R, S, B,
                           reading="reset", adam=True, groupdro=False, personalize="dual", eta_q=0.5, C=3):
    """Algorithm 1 with the copied functions, every choice as perinvfl.py makes it: the C sampled
    clients; θ_i from ν^t (`reset`) or kept; per r: S steps of line 8 on J_i(θ_i; ν_{i,r}) with SGD
    (η, momentum; its state kept on the client while λ stays the same), then line 9, ν_{i,r+1} =
    ν_{i,r} − γ ∇(L_INV / rescale); R an integer or "epoch" (2 passes of minibatches of B: the
    local_epochs of test_copy.ARGS); line 10 by the server's Adam or the plain average; GroupDRO's
    q from the risks of ν^t. Each step draws a random minibatch of B (all of a client's data if B
    covers it), pixels / 255. Returns ν, the θ_i and q."""
    model, theta_net = own_model(), own_model()                   # ν_{i,r} and θ_i live in these
    gen, sampler = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    N = len(clients)
    nu = flat(model)
    theta, opt_state, opt_lam = [nu.clone() for _ in range(N)], [None] * N, [None] * N
    q, adam_state = torch.full((N,), 1.0 / N), None

    def draw(x, y):
        if B >= len(y):
            return x.float() / 255, y
        idx = torch.randperm(len(y), generator=gen)[:B]
        return x[idx].float() / 255, y[idx]

    for t in range(1, rounds + 1):
        lam_t = lam if t > anneal else 1.0
        pen = None if groupdro else lam_t                          # L_INV's IRMv1 weight (GroupDRO: none)
        pen8 = None if personalize == "l2" else pen                # IRM-L2: ERM + β||θ_i − ν||² on line 8
        deltas, risks = [], {}
        for i in torch.randperm(N, generator=sampler)[:C].tolist():
            xi, yi = clients[i]
            load(theta_net, nu if reading == "reset" else theta[i])
            opt = torch.optim.SGD(theta_net.parameters(), lr=eta, momentum=momentum)
            if opt_lam[i] == lam_t:
                opt.load_state_dict(opt_state[i])
            delta = torch.zeros_like(nu)
            for r in range(R if R != "epoch" else 2 * -(-len(yi) // B)):
                nu_ir = nu + delta
                load(model, nu_ir)
                for s in range(S):                                 # line 8
                    x, y = draw(xi, yi)
                    loss = m.J_i(theta_net(x), y, list(theta_net.parameters()), nu_ir, pen8, wd, beta)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                x, y = draw(xi, yi)                                # line 9
                params = list(model.parameters())
                loss, risk = m.l_inv(model(x), y, params, pen, wd, N * q[i] if groupdro else None)
                if r == 0:
                    risks[i] = risk.detach()
                g = torch.autograd.grad(loss / m.rescale(pen), params)
                delta -= gamma * torch.cat([gi.reshape(-1) for gi in g])
            deltas.append(delta)                                   # Δ_i, uploaded
            theta[i], opt_state[i], opt_lam[i] = flat(theta_net), opt.state_dict(), lam_t
        if adam:                                                   # line 10
            nu, adam_state = m.server_adam(nu, deltas, alpha, gamma, adam_state)
        else:
            nu = m.server_update(nu, deltas, alpha)
        if groupdro:
            ids = list(risks)
            q = m.q_update(q, ids, torch.stack([risks[i] for i in ids]), eta_q)
    return nu, theta, q


CASES = {   # the loop's arguments, and the same as perinvfl.py's flags
    # IRM, θ_i reset, R = S = 2, minibatches, line 8 with momentum, the server's Adam, λ = 50 from round 2
    "irm-reset-adam": (dict(lam=50.0, anneal=1, beta=0.5, wd=0.01, gamma=0.1, eta=0.05, alpha=1.0, momentum=0.9,
                            R=2, S=2, B=4),
                       dict(inv="irm", personalize="dual", theta="reset", opt="adam", R=2, S=2)),
    # GroupDRO, θ_i kept (its momentum carried into round 2), R = one epoch's steps, the plain average at α 0.5
    "groupdro-kept-epoch": (dict(lam=3.0, anneal=0, beta=0.7, wd=0.01, gamma=0.1, eta=0.05, alpha=0.5, momentum=0.9,
                                 R="epoch", S=1, B=4, reading="kept", adam=False, groupdro=True),
                            dict(inv="groupdro", personalize="dual", theta="kept", opt="sgd", R="epoch", S=1)),
    # IRM-L2 on line 8, IRM's rescaling at λ = 3 from round 1, full batch
    "l2-full-batch": (dict(lam=3.0, anneal=0, beta=0.7, wd=0.01, gamma=0.1, eta=0.05, alpha=1.0, momentum=0.0,
                           R=1, S=1, B=10 ** 6, personalize="l2"),
                      dict(inv="irm", personalize="l2", theta="reset", opt="adam", R=1, S=1)),
}


def flags(loop, extra):
    """perinvfl.py's args for the loop's arguments, over test_copy.ARGS (3 of 3 clients, 2 local epochs
    for --R epoch); no round is evaluated (the end-of-round check changes nothing but its numbers)."""
    return dict(ARGS, beta=loop["beta"], lam=loop["lam"], anneal=loop["anneal"], weight_decay=loop["wd"],
                lr=loop["gamma"], eta=loop["eta"], global_lr=loop["alpha"], momentum=loop["momentum"],
                batch_size=loop["B"], theta_opt="sgd", eta_q=0.5, eval_every=10 ** 6, rounds=10 ** 6, **extra)


def perinvfl_rounds(clients, T, kw):
    """perinvfl_round, `rounds` times, from own_model() and init_state, with test_copy's generators
    (test_copy.method_rounds, whose `rounds` cannot be the args' own); returns ν and the state."""
    model, fed = own_model(), as_federation(clients)
    args = types.SimpleNamespace(**kw)
    ctx = common.Context(torch.device("cpu"), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                         common.make_prep("rmnist", "cpu"))
    state = perinvfl.init_state(model, fed, args, ctx)
    for t in range(1, T + 1):
        perinvfl.perinvfl_round(t, model, fed, args, state, ctx)
    return flat(model), state


@pytest.mark.parametrize("case", CASES)
def test_perinvfl_copied(case):
    """Two rounds: ν^2, every θ_i and q of the copied loop are those of perinvfl_round, bit for bit."""
    m = copied(perinvfl, *PLAIN)
    clients = three_clients()
    loop, extra = CASES[case]
    nu, theta, q = copied_perinvfl_rounds(m, clients, 2, **loop)
    expected, state = perinvfl_rounds(clients, 2, flags(loop, extra))
    assert torch.equal(nu, expected), (nu - expected).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(theta, state["theta"]))
    assert torch.equal(q, state["q"])
    assert min((th - nu).abs().max() for th in theta) > 1e-4          # the θ_i are not ν
    if loop.get("groupdro"):
        assert (q - 1 / 3).abs().max() > 1e-4                          # and q moved
    else:
        other, _, _ = copied_perinvfl_rounds(m, clients, 2, **dict(loop, lam=0.0, anneal=0))
        assert (other - nu).abs().max() > 1e-4                         # the IRMv1 term acted


def test_perinvfl_docs_loop_is_the_method():
    """The "Copy it" loop of docs/perinvfl.md (the RC-MNIST reading: full batch, R = S = 1, θ_i ← ν^t,
    plain line-8 steps, the server's Adam, λ's switch), executed as printed with the copied functions
    and its client draw seeded like perinvfl_rounds' sampler: ν^2 and the θ_i are perinvfl_round's and
    the loop above's, bit for bit."""
    m = copied(perinvfl, *PLAIN)
    clients = three_clients()
    page = (HERE / "docs" / "perinvfl.md").read_text()
    loop = [b for b in re.findall(r"```python\n(.*?)```", page.split("## Copy it", 1)[1], re.S) if "for t in" in b][0]
    model = own_model()
    hyper = dict(lam=50.0, anneal=1, beta=0.5, wd=0.01, gamma=0.1, eta=0.05, alpha=1.0)
    ns = dict(vars(m), torch=torch, copy=copy, model=model, T=2, C=3, **hyper,
              clients=[(x.float() / 255, y) for x, y in clients])
    torch.manual_seed(2)                                                   # the loop's draw of the clients
    exec(loop, ns)
    loop_args = dict(hyper, momentum=0.0, R=1, S=1, B=10 ** 6)
    expected, state = perinvfl_rounds(clients, 2, flags(loop_args, dict(inv="irm", personalize="dual", theta="reset",
                                                                        opt="adam", R=1, S=1)))
    assert torch.equal(ns["nu"], expected), (ns["nu"] - expected).abs().max()
    assert torch.equal(flat(model), expected)                              # the model holds ν^T
    assert all(torch.equal(ns["theta"][i], state["theta"][i]) for i in range(3))
    nu, _, _ = copied_perinvfl_rounds(m, clients, 2, **loop_args)
    assert torch.equal(ns["nu"], nu)
