"""Copy FedIPG, not the project (issue 30): its plain functions, lifted by their source into a namespace
that holds torch alone, driven by the loop of docs/fedipg.md ("Copy it") written here — the pre-training
phase with g_i, Eq. 13 and the exit rule, then rounds of Eq. 2 on f_i (Eq. 9) and Eq. 3 — against
fedipg.py's own round on the same three clients."""
import pytest
import torch

from test_copy import ARGS, copied, flat, load, method_rounds, own_local_sgd, own_model, three_clients

import fedipg

FUNCTIONS = ("tangent", "risk_and_d", "local_objective", "gradient_step", "client_gradient", "aggregate",
             "client_contributions", "exit_rule")
W, T, LAM = 2, 2, 0.5


def chunks(x, y, b):
    """The client's whole split, in order, in chunks of b, pixels / 255."""
    return [(x[s:s + b].float() / 255, y[s:s + b]) for s in range(0, len(y), b)]


def copied_loop(m, clients, local_step, penalty, L):
    """The docs' loop: W pre-training rounds (t ≤ 0) with every client, each sending g_i; Eq. 13;
    the exit rule; w^1 again; then T rounds over I_ID. The clients come in the order of the method's
    draw (randperm on the sampler's generator), so that the sums round alike."""
    model, gen, sampler = own_model(), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    pen = {"tangent": dict(layers=[model.featurizer, model.classifier]), "layers": dict(affine=[model.classifier]),
           "params": {}}[penalty]
    lr, b = ARGS["lr"], ARGS["batch_size"]
    n = [float(len(y)) for _, y in clients]
    w1, I_ID, C = flat(model), [0, 1, 2], {}
    for t in range(1 - W, T + 1):
        w, g = flat(model), []
        S = [I_ID[k] for k in torch.randperm(len(I_ID), generator=sampler).tolist()]

        def deltas():
            for i in S:
                x, y = clients[i]
                load(model, w)
                if t <= 0:
                    g.append(m.client_gradient(model, chunks(x, y, b), n[i]))            # g_i, for Eq. 13
                if local_step == "paper":
                    m.gradient_step(model, chunks(x, y, b), n[i], lr, LAM, **pen)        # Eq. 2 on f_i (Eq. 9)
                else:
                    own_local_sgd(model, x, y, gen, lr, ARGS["momentum"], b, ARGS["local_epochs"],
                                  lambda mod, xb, yb: m.local_objective(mod, xb, yb, LAM, **pen))
                yield flat(model) - w                                                   # Δ_i
        load(model, m.aggregate(w, deltas(), [n[i] for i in S]))                        # Eq. 3
        if t <= 0:
            for i, c in zip(S, m.client_contributions(g, [n[i] for i in S], [True] * len(S), sum(n), lr, L)):
                C.setdefault(i, []).append(c)                                           # Eq. 13
        if t == 0:
            out, _ = m.exit_rule(C, I_ID)
            I_ID = [i for i in I_ID if i not in out]
            load(model, w1)                                                             # w^1 to all
    return flat(model), I_ID, C


@pytest.mark.parametrize("local_step,penalty,L", [("paper", "tangent", 0.2), ("paper", "layers", 0.2),
                                                  ("paper", "params", 0.2), ("sgd", "tangent", 0.4)])
def test_fedipg_copied(local_step, penalty, L):
    """The copied functions in the test's loop give fedipg.py's w after W pre-training rounds and T
    rounds, its contributions and its exits (L: some of the three clients leave, not all): bit for
    bit, in w and in every C_i (the same operations in the same order)."""
    m = copied(fedipg, *FUNCTIONS)
    clients = three_clients()
    w, I_ID, C = copied_loop(m, clients, local_step, penalty, L)
    state = {"exited": [], "contrib": {}, "since": None, "received": None}
    expected = method_rounds(fedipg.fedipg_round, clients, T, state, lam=LAM, penalty=penalty, exit="auto",
                             exit_warmup=W, exit_L=L, exit_clients=[], aberrant=None, aberrant_client=0,
                             local_step=local_step, warmup="pretraining")
    assert 0 < len(I_ID) < 3 and state["exited"] == [i for i in range(3) if i not in I_ID]
    assert C == state["contrib"] and all(len(c) == W for c in C.values())
    assert torch.equal(w, expected), (w - expected).abs().max()
    assert (w - flat(own_model())).abs().max() > 1e-3                                    # it trained
