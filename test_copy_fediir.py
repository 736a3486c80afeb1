"""FedIIR copied: its plain functions (classifier_grads, gbar_mean, gbar_update, iir_penalty,
iir_objective, server_update) lifted by their source into a torch-only namespace, driven for two
rounds by a loop written here (the test's own model, three ragged clients of its own data, no
common.py, no data.py), and checked against fediir.fediir_round on the same data and minibatches:
bit for bit (torch.equal, CPU). The "Copy it" loop of docs/fediir.md is run too, against this one."""
import re

import pytest
import torch

from test_copy import copied, three_clients, own_model, flat, load, own_local_sgd, method_rounds
from test_methods import HERE

import fediir

PLAIN = ("classifier_grads", "gbar_mean", "gbar_update", "iir_penalty", "iir_objective", "server_update")


def copied_fediir_rounds(m, clients, rounds, gamma, v, batch_size, full_batch_gbar, size_avg, gens=None):
    """Algorithm 1 with the copied functions: step 1 the sampled clients, step 2 their classifier
    gradients at θ^{t-1} (features without a graph) averaged into g_bar and smoothed into g̃
    (Appendix C), step 3 local SGD on R_c + γ||∇_ω R_c − g̃||², step 4 the server's average. gens:
    the (minibatch, sampling) generators, drawn after own_model(); default those of method_rounds."""
    model = own_model()
    gen, sampler = gens or (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
    featurizer, classifier = model.featurizer, model.classifier
    g_tilde = [torch.zeros_like(p) for p in classifier.parameters()]            # g̃^0 = 0
    theta = flat(model)
    for t in range(rounds):
        S = torch.randperm(len(clients), generator=sampler)[:3].tolist()        # step 1
        model.train()

        def uploads():                                                          # step 2, client side
            for c in S:
                x, y = clients[c]
                with torch.no_grad():
                    z = featurizer(x.float() / 255)
                yield from m.classifier_grads(classifier, z, y, None if full_batch_gbar else batch_size)
        g_tilde = m.gbar_update(g_tilde, m.gbar_mean(uploads()), v)            # step 2, server + App. C

        def loss(model, x, y):
            return m.iir_objective(model.featurizer, model.classifier, x, y, g_tilde, gamma)
        thetas = []
        for c in S:                                                             # step 3
            load(model, theta)
            thetas.append(own_local_sgd(model, *clients[c], gen, 0.1, 0.9, batch_size, 2, loss))
        p = [float(len(clients[c][1])) if size_avg else 1.0 for c in S]
        theta = m.server_update(theta, thetas, p, 1.0)                          # step 4
        load(model, theta)
    return theta, g_tilde


@pytest.mark.parametrize("gbar,size_avg,half", [("batches", False, False), ("clients", True, True)])
def test_fediir_copied(gbar, size_avg, half):
    """Two rounds, γ = 0.5 (γ/2 with --half), v = 0.95, batch 4 over clients of 7, 12 and 9 (partial
    batches): θ^2 and g̃^2 of the copied loop are those of fediir_round, bit for bit."""
    m = copied(fediir, *PLAIN)
    clients = three_clients()
    theta, g_tilde = copied_fediir_rounds(m, clients, 2, 0.25 if half else 0.5, 0.95, 4, gbar == "clients", size_avg)
    state = {"g_tilde": [torch.zeros(3, 16), torch.zeros(3)]}                    # fediir.init_state's g̃^0
    expected = method_rounds(fediir.fediir_round, clients, 2, state, gamma=0.5, ema=0.95, half=half, gbar=gbar,
                             gbar_inputs="augmented", size_avg=size_avg)
    assert torch.equal(theta, expected), (theta - expected).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(g_tilde, state["g_tilde"]))
    assert min(g.abs().max() for g in g_tilde) > 1e-3                          # the penalty had something to align to
    fedavg_like, _ = copied_fediir_rounds(m, clients, 2, 0.0, 0.95, 4, gbar == "clients", size_avg)
    assert (fedavg_like - theta).abs().max() > 1e-4                             # and it acted: γ = 0 is elsewhere


def test_fediir_docs_loop_is_the_copied_loop():
    """The "Copy it" loop of docs/fediir.md, executed as printed with the copied functions (its draws
    from the global generator), gives the θ and g̃ of the loop above with the same draws: bit for
    bit, so the page's loop is the one checked against fediir_round."""
    m = copied(fediir, *PLAIN)
    clients = three_clients()
    page = (HERE / "docs" / "fediir.md").read_text()
    loop = re.search(r"## Copy it\n.*?```python\n(.*?)```", page, re.S).group(1)
    model = own_model()                   # seeds the global generator: the loop below draws from it as it stands
    ns = dict(vars(m), torch=torch, featurizer=model.featurizer, classifier=model.classifier, T=2, C=3, B=4, lr=0.1,
              E=2, gamma=0.5, clients=[(x.float() / 255, y) for x, y in clients])
    exec(loop, ns)
    theta, g_tilde = copied_fediir_rounds(m, clients, 2, 0.5, 0.95, 4, False, False,
                                          gens=(torch.default_generator, torch.default_generator))
    assert torch.equal(ns["theta"], theta), (ns["theta"] - theta).abs().max()
    assert torch.equal(flat(model), theta)                                      # and the model holds θ^T
    assert all(torch.equal(a, b) for a, b in zip(ns["g_tilde"], g_tilde))
