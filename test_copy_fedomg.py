"""FedOMG copied: its server step (server_update on code_step / paper_step, the Gram matrix and the
Γ solvers) lifted by source into a namespace holding torch alone, driven by the loop of
docs/fedomg.md's "Copy it" (each client's SGD kept across rounds, as the official DG code; the DG
code's lr step), and checked against fedomg_round on the same data and minibatches."""
import re
import types

import pytest
import torch

import fedomg
from test_methods import HERE
from test_copy import copied, flat, load, method_rounds, own_model, three_clients

FUNCTIONS = ("gram", "solve_sgd", "solve_exact", "solve", "code_step", "paper_step", "server_update")
R = 2                                           # rounds: the DG code's lr step (0.8 R) falls on round 2


def own_rounds(m, clients, kappa, rule, weighted, eta_g, keep, rounds=R, lr=0.1, momentum=0.9, weight_decay=1e-2,
               batch_size=4, epochs=2, seeds=(1, 2)):
    """The loop of docs/fedomg.md, with the generators of test_copy (minibatch order, sampling; seeds
    None: torch's global one, as the docs' loop) and pixels / 255: each client trains its own SGD
    from θ (kept across rounds when `keep`), the server steps by server_update. eta_g(U): the
    round's η_g."""
    model = own_model()
    gen, sampler = (None, None) if seeds is None else (torch.Generator().manual_seed(s) for s in seeds)
    theta, opts = flat(model), {}
    for r in range(1, rounds + 1):
        S = torch.randperm(len(clients), generator=sampler).tolist()
        lr_r = lr * (0.1 if r > 0.8 * rounds else 1.0)               # the DG code's StepLR

        def trained(c):                                              # client c: E epochs of SGD from θ
            x, y = clients[c]
            load(model, theta)
            if keep and c in opts:
                opts[c].param_groups[0]["lr"] = lr_r
            else:
                opts[c] = torch.optim.SGD(model.parameters(), lr=lr_r, momentum=momentum, weight_decay=weight_decay)
            for _ in range(epochs):
                perm = torch.randperm(len(y), generator=gen)
                for i in range(0, len(y), batch_size):
                    idx = perm[i:i + batch_size]
                    opts[c].zero_grad()
                    torch.nn.functional.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
                    opts[c].step()
            return flat(model)                                       # the upload θ_u
        N = [len(clients[c][1]) for c in S]
        theta = m.server_update(theta, (trained(c) for c in S), N, eta_g(len(S)), kappa, rule, weighted)
    return theta


def fedomg_rounds(clients, **kw):
    """fedomg_round R times (test_copy's harness, with args.rounds = R for the lr step)."""
    def round_fn(t, model, fed, args, state, ctx):
        return fedomg.fedomg_round(t, model, fed, types.SimpleNamespace(**vars(args), rounds=R), state, ctx)
    args = dict(kappa=0.5, server_rule="code", solver="sgd", solver_evals=21, fresh_opt=False, lr_step=0.8,
                dataset="synthetic", global_lr=None, weight_decay=1e-2)
    return method_rounds(round_fn, clients, R, state={"momentum": {}}, **{**args, **kw})


@pytest.mark.parametrize("rule,kappa,fl,keep", [("code", 0.5, False, True),   # the defaults: η_g = U (1 + κ²)
                                                ("code", 0.0, False, False),  # κ = 0: FedAvg's step, fresh SGD
                                                ("code", 0.5, True, True),    # the FL code: w_u = 1, η_g = 1
                                                ("paper", 0.5, False, False)])  # Eq. 15–17 as printed
def test_fedomg_copied(rule, kappa, fl, keep):
    m = copied(fedomg, *FUNCTIONS)
    clients = three_clients()
    eta_g = (lambda U: 1.0) if fl or rule == "paper" else (lambda U: U * (1 + kappa ** 2))
    theta = own_rounds(m, clients, kappa, rule, not fl, eta_g, keep)
    expected = fedomg_rounds(clients, kappa=kappa, server_rule=rule, fresh_opt=not keep,
                             **(dict(dataset="mnist", global_lr=1.0) if fl else {}))
    assert (theta - flat(own_model())).norm() > 1e-2 * flat(own_model()).norm()   # the rounds moved θ
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
    assert torch.equal(m.server_update(theta, thetas, N, 1.0, 0.0, "paper"), theta + g_FL)


def test_fedomg_docs_loop_is_the_tested_loop():
    """The loop of docs/fedomg.md's "Copy it", run as written (but 20 rounds, for time) on the copied
    functions (own_model, three clients as float images, U = 3), finds the θ of own_rounds with the
    docs' settings and torch's global generator: the page shows the loop that test_fedomg_copied checks."""
    page = (HERE / "docs" / "fedomg.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page.split("## Copy it")[1].split("\n## ")[0], re.S)
    assert len(blocks) == 2
    m = copied(fedomg, *FUNCTIONS)
    clients = three_clients()
    model = own_model()                                  # seeds torch's generator, as own_rounds does
    ns = dict(vars(m), model=model, clients=[(x.float() / 255, y) for x, y in clients], U=3)
    loop = blocks[1].replace("R, kappa, lr, E, B = 100,", "R, kappa, lr, E, B = 20,")
    assert loop != blocks[1]
    exec(loop, ns)
    expected = own_rounds(m, clients, 0.5, "code", True, lambda U: U * 1.25, True, rounds=20, lr=1e-3,
                          weight_decay=5e-4, batch_size=16, epochs=5, seeds=None)
    assert torch.equal(flat(model), expected) and torch.equal(ns["theta"], expected)
