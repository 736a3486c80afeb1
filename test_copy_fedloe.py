"""FedLOE copied: its plain functions (Eq. 4's average, Eq. 10's overfit_head, the tuning predictions,
the server's Tuning, Eq. 11's fit_phi with its terms, Eq. 12's ensemble) lifted by source into a
namespace holding torch alone, driven by the loop of docs/fedloe.md's "Copy it" (a tiny model of the
test's own with a trainable featurizer, three clients with their own tuning splits), and checked
against fedloe_round on the same data and minibatches: bit for bit on the CPU."""
import re
import types

import pytest
import torch
import torch.nn.functional as F

import common
import fedloe
from test_copy import as_federation, copied, flat, load, three_clients
from test_methods import HERE

FUNCTIONS = ("average", "overfit_head", "head_predictions", "Tuning", "sample_losses", "risks", "risk_weights",
             "irm_penalty", "rex_penalty", "fish_weights", "fish_step", "fit_phi", "ensemble")
SIZES = (30, 40, 50)


class Tiny(torch.nn.Module):
    """The test's own model: a featurizer with weights (stage 1 trains it, stage 2 freezes it), a linear head."""

    def __init__(self):
        super().__init__()
        self.featurizer = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 6), torch.nn.ReLU())
        self.classifier = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.classifier(self.featurizer(x))


def tiny(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def split(clients):
    """Each client's own tuning split: its last 10% (at least one example); uint8 images."""
    return [(x[:-max(1, len(y) // 10)], y[:-max(1, len(y) // 10)], x[-max(1, len(y) // 10):], y[-max(1, len(y) // 10):])
            for x, y in clients]


def as_floats(clients):
    return [(x.float() / 255, y, xt.float() / 255, yt) for x, y, xt, yt in clients]


def own_rounds(m, clients, K1, E1, K2, E2, B, lr, wd, lr2, wd2, r, form, lam, steps, meta_lr, gen=None):
    """The loop of docs/fedloe.md's "Copy it" with its numbers as arguments and the minibatch order drawn
    from `gen` (None: torch's global generator, as the docs' loop). Returns the final θ and the last φ."""
    model = tiny()

    def epochs_of(n, E):                                         # E shuffled passes of minibatches of B
        for _ in range(E):
            perm = torch.randperm(n, generator=gen)
            yield from (perm[i:i + B] for i in range(0, n, B))
    theta = flat(model)
    for _ in range(K1):                                          # stage 1
        thetas = []
        for x, y, _, _ in clients:                               # client c: E1/K1 epochs of a fresh Adam
            load(model, theta)
            opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
            for idx in epochs_of(len(y), E1 // K1):
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            thetas.append(flat(model))
        theta = m.average(theta, thetas, [len(y) for _, y, _, _ in clients])     # Eq. 4
    load(model, theta)
    with torch.no_grad():                                        # stage 2: θ̂ frozen
        Z = [(model.featurizer(x), model.featurizer(xt)) for x, _, xt, _ in clients]
    head, phi = model.classifier, None
    for _ in range(K2):
        W0, b0 = head.weight.detach(), head.bias.detach()
        psi = [m.overfit_head(W0, b0, z, y, epochs_of(len(y), E2 // K2), lr2, 0.0, wd2)[:2]
               for (z, _), (_, y, _, _) in zip(Z, clients)]    # Eq. 10
        Ws, bs = torch.stack([W for W, _ in psi]), torch.stack([b for _, b in psi])
        Y = torch.cat([m.head_predictions(zt, Ws, bs) for _, zt in Z])
        T = m.Tuning(Y, torch.cat([yt for *_, yt in clients]), [len(yt) for *_, yt in clients],
                     [len(y) for _, y, _, _ in clients])
        phi = m.fit_phi(T, r, form, lam, lr2, wd2, steps, meta_lr)               # Eq. 11
        W, b = m.ensemble(phi, Ws, bs)                                            # Eq. 12
        with torch.no_grad():
            head.weight.copy_(W)
            head.bias.copy_(b)
    return flat(model), phi


def fedloe_rounds(clients, K1, E1, K2, E2, B, lr, wd, lr2, wd2, r, form, lam, steps, meta_lr):
    """fedloe_round K1 + K2 times on the same clients (train and tuning splits), model and minibatch stream."""
    fed = as_federation([(x, y) for x, y, _, _ in clients])
    for c, (_, _, xt, yt) in zip(fed.clients, clients):
        c.tune_x, c.tune_y = xt, yt
    args = types.SimpleNamespace(sample=3, batch_size=B, local_epochs=E1 // K1, lr=lr, momentum=0.0, weight_decay=wd,
                                 global_lr=1.0, parallel_clients="off", stage1_comms=K1, stage2_comms=K2,
                                 stage2_epochs=E2, stage2_lr=lr2, stage2_wd=wd2, dg=r, dg_form=form, dg_lambda=lam,
                                 meta_lr=meta_lr, server_steps=steps, rounds=K1 + K2)
    ctx = common.Context(torch.device("cpu"), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                         common.make_prep("rmnist", "cpu"))
    model, state = tiny(), {"bytes": {"stage1": [0, 0], "stage2": [0, 0]}}
    for t in range(1, K1 + K2 + 1):
        fedloe.fedloe_round(t, model, fed, args, state, ctx)
    return flat(model), state["phi"]


@pytest.mark.parametrize("K1,K2,r,form", [(1, 1, "irm", "feddg"), (1, 1, "rex", "paper"), (1, 1, "fish", "feddg"),
                                          (2, 2, "fish", "paper")])
def test_fedloe_copied(K1, K2, r, form):
    """Two rounds (one communication of each stage; and two of each), every term of Eq. 11, two forms:
    the copied functions in the test's loop give fedloe_round's model and φ bit for bit."""
    m = copied(fedloe, *FUNCTIONS)
    clients = split(three_clients(sizes=SIZES))
    hp = dict(K1=K1, E1=2 * K1, K2=K2, E2=2 * K2, B=8, lr=0.01, wd=1e-3, lr2=0.3, wd2=5e-3, r=r, form=form, lam=2.0,
              steps=5, meta_lr=0.5)
    theta, phi = own_rounds(m, as_floats(clients), **hp, gen=torch.Generator().manual_seed(1))
    expected, expected_phi = fedloe_rounds(clients, **hp)
    start = flat(tiny())
    assert (theta - start).norm() > 1e-2 * start.norm()                             # the rounds moved θ
    assert not torch.allclose(phi, torch.full((3,), 1 / 3), atol=1e-3)              # and the server moved φ
    assert torch.equal(theta, expected), (theta - expected).abs().max()
    assert torch.equal(phi, expected_phi), (phi - expected_phi).abs().max()


def test_fedloe_docs_loop_is_the_tested_loop():
    """The loop of docs/fedloe.md's "Copy it", run as written (but a smaller budget, for time) on the copied
    functions, the test's model and its three clients, finds the θ of own_rounds with the docs' settings
    and torch's global generator: the page shows the loop that test_fedloe_copied checks."""
    page = (HERE / "docs" / "fedloe.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page.split("## Copy it")[1].split("\n## ")[0], re.S)
    assert len(blocks) == 2
    m = copied(fedloe, *FUNCTIONS)
    clients = as_floats(split(three_clients(sizes=SIZES)))
    model = tiny()                                       # seeds torch's generator, as own_rounds does
    ns = dict(vars(m), model=model, clients=clients)
    loop = blocks[1].replace("K1, E1, K2, E2, B = 8, 256, 4, 8, 128", "K1, E1, K2, E2, B = 2, 4, 2, 4, 16")
    assert loop != blocks[1]
    exec(loop, ns)
    expected, phi = own_rounds(m, clients, 2, 4, 2, 4, 16, 1e-3, 0.0, 0.05, 5e-4, "fish", "feddg", 100.0, 100, 0.05)
    assert torch.equal(flat(model), expected) and torch.equal(ns["phi"], phi)
