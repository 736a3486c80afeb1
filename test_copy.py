"""Copy a method, not the project: each method's plain functions are lifted by their source into a
namespace that holds torch alone, driven by a loop written here (its own model, three clients of its
own data, no common.py, no data.py), and checked against the method file's own round on the same
data and minibatches."""
import inspect
import textwrap
import types

import pytest
import torch

import common
import fedavg


def copied(module, *names):
    """The source of module's functions `names`, executed in a fresh namespace with torch alone
    (and torch.nn.functional as F, math): a function that reaches for the project fails here."""
    src = "\n\n".join(textwrap.dedent(inspect.getsource(getattr(module, n))) for n in names)
    ns = {"__name__": "copied"}
    exec("import math\nimport torch\nimport torch.nn.functional as F\n\n" + src, ns)
    return types.SimpleNamespace(**{n: ns[n] for n in names})


def test_copied_reaches_for_nothing_of_the_project():
    """The harness itself: a function that names common fails when copied."""
    def leaky(theta):
        return common.get_flat(theta)
    mod = types.ModuleType("m")
    mod.leaky = leaky
    with pytest.raises(NameError):
        copied(mod, "leaky").leaky(torch.zeros(1))


def three_clients(seed=0, sizes=(7, 12, 9), shape=(1, 4, 4), classes=3):
    """Three clients of uint8 images and labels, as a user's own data would be."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(n, *shape, generator=g) * 255).to(torch.uint8), torch.randint(classes, (n,), generator=g))
            for n in sizes]


def as_federation(clients):
    """The same clients for the method file's own round."""
    cs = [common.Client(i, "d", x, y, x[:1], y[:1]) for i, (x, y) in enumerate(clients)]
    return common.Federation("d", cs, None, None, None, None, None, [])


def own_model(seed=0):
    torch.manual_seed(seed)
    return common.Net(torch.nn.Flatten(), torch.nn.Linear(16, 3))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model, vec):
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vec[i:i + p.numel()].view_as(p))
            i += p.numel()


def own_local_sgd(model, x, y, gen, lr, momentum, batch_size, epochs, loss_fn):
    """The test's own client loop: shuffled passes of minibatch SGD (the draws of a generator the
    caller owns), pixels / 255."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch_size):
            idx = perm[i:i + batch_size]
            loss = loss_fn(model, x[idx].float() / 255, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return flat(model)


def ce(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


ARGS = dict(sample=3, batch_size=4, local_epochs=2, lr=0.1, momentum=0.9, weight_decay=0.0, global_lr=1.0,
            uniform_avg=False, parallel_clients="off")


def method_rounds(round_fn, clients, rounds, state=None, **kw):
    """The method file's own round, `rounds` times, from own_model(); returns the final θ."""
    model, fed = own_model(), as_federation(clients)
    args = types.SimpleNamespace(**dict(ARGS, **kw))
    ctx = common.Context(torch.device("cpu"), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                         common.make_prep("rmnist", "cpu"))
    for t in range(1, rounds + 1):
        round_fn(t, model, fed, args, state if state is not None else {}, ctx)
    return flat(model)


@pytest.mark.parametrize("uniform", [False, True])
def test_fedavg_copied(uniform):
    m = copied(fedavg, "server_update")
    clients = three_clients()
    model, gen, sampler = own_model(), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    theta = flat(model)
    for t in range(2):
        S = torch.randperm(3, generator=sampler).tolist()
        thetas = []
        for c in S:
            load(model, theta)
            thetas.append(own_local_sgd(model, *clients[c], gen, 0.1, 0.9, 4, 2, ce))
        n = [1.0 if uniform else float(len(clients[c][1])) for c in S]
        theta = m.server_update(theta, thetas, n, 1.0)
    expected = method_rounds(fedavg.fedavg_round, clients, 2, uniform_avg=uniform)
    assert torch.allclose(theta, expected, atol=1e-6), (theta - expected).abs().max()
