"""What every method shares: models, federation, the round skeleton, evaluation, model selection, logging,
checkpoints and results; nothing here knows about a specific method. A method file plugs in with
main("name", doc, round_fn, ...), where round_fn(t, model, fed, args, state, ctx) runs one communication
round and returns {client id: mean local loss}; optional init_state(model, fed, args, ctx) -> state and
evaluate_fn(model, fed, args, state, ctx) -> (val_acc, test_acc, per-test-set accs[, extra]).
The contract in full: docs/protocol.md ("Adding a method").
"""
import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.deterministic

import data
from data import Parser, UserError

# cuBLAS reproduces its matrix products only with a fixed workspace, and it reads this setting once,
# when CUDA starts: so it is set here, at import, before anything touches the GPU (a value the user
# exported wins). It costs nothing on the CPU and little on the GPU (README: GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# ------------------------------------------------------------------------------------ defaults
# One table per dataset (the sources: docs/protocol.md): FedIIR's Table 3 for the DG benchmarks, FedOMG's
# Table 1 for label skew, PerInvFL's Table 6 with IRM's ColoredMNIST MLP (full batch, last round) for RC-MNIST.
_ALL = dict(rounds=100, local_epochs=1, momentum=0.9, weight_decay=0.0, global_lr=1.0, eval_every=10, alpha=0.1,
            head="linear", select="val", p_test=0.1)
_FL = dict(_ALL, model="cnn", lr=5e-3, batch_size=16, local_epochs=5, momentum=0.0, clients=100, sample=20)
_RC = dict(_ALL, model="mlp", lr=0.1, batch_size=25000, momentum=0.0, weight_decay=2.2e-3, clients=4, sample=4,
           rounds=500, eval_every=50, select="last")
_PHOTO = dict(_ALL, model="resnet18", lr=1e-3, batch_size=32, head="mlp")
DATASET_DEFAULTS = {
    "rmnist": dict(_ALL, model="convnet", lr=1e-2, batch_size=64), "vlcs": _PHOTO, "pacs": dict(_PHOTO, lr=2.5e-3),
    "officehome": dict(_PHOTO, model="resnet50"), "synthetic": dict(_ALL, model="smallconv", lr=5e-2, batch_size=32),
    "stained": dict(_ALL, model="mlp", lr=0.1, batch_size=64),  # FedIPG VI-C (lr: fedipg.py docstring)
    "mnist": _FL, "emnist": _FL, "cifar10": _FL, "cifar100": _FL, "rcmnist": _RC, "rcfmnist": _RC,
    "waterbird": dict(_PHOTO, head="linear", clients=4, sample=4, select="last"),
}
# Stained MNIST (FedIPG Section VI-C): clients P and examples per client by --stain, drawn from the
# pooled training combinations (stained_clients)
STAINED = {"fg": (5, 600), "bg": (5, 2000), "both": (20, 2000)}

# -------------------------------------------------------------------------------------- models


class Net(nn.Module):
    """f = classifier ∘ featurizer, i.e. θ = (φ, ω) in FedIIR's notation."""

    def __init__(self, featurizer, classifier):
        super().__init__()
        self.featurizer, self.classifier = featurizer, classifier

    def forward(self, x):
        return self.classifier(self.featurizer(x))


class GlobalMean(nn.Module):
    """Global average pooling written as a mean (AdaptiveAvgPool2d(1)'s numbers; a deterministic CUDA backward)."""

    def forward(self, x):
        return x.mean((2, 3), keepdim=True)


def conv_net(in_ch, width=64):
    """DomainBed's MNIST ConvNet: 4 conv3x3 (w, 2w, 2w, 2w; the 2nd strided), each ReLU + GroupNorm(8),
    global average pool -> 2w features (128 for w = 64)."""
    layers, c = [], in_ch
    for out, stride in ((width, 1), (2 * width, 2), (2 * width, 1), (2 * width, 1)):
        layers += [nn.Conv2d(c, out, 3, stride, 1), nn.ReLU(), nn.GroupNorm(8, out)]
        c = out
    return nn.Sequential(*layers, GlobalMean(), nn.Flatten()), c


def small_cnn(in_ch, size):
    """FedOMG's FL CNN: conv5x5(32) ReLU maxpool, conv5x5(64) ReLU maxpool, FC 512 ReLU (+ head)."""
    s = ((size - 4) // 2 - 4) // 2
    return nn.Sequential(nn.Conv2d(in_ch, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * s * s, 512), nn.ReLU()), 512


def mlp(in_dim, hidden=390):
    """The MLP of IRM's ColoredMNIST: in -> 390 -> 390 (ReLU) (+ head)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_dim, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU()), hidden


class ResNet(nn.Module):
    """torchvision ResNet-18/50 without its fc; BatchNorm always in eval mode (the FedIIR code:
    running statistics stay at their ImageNet values, the affine weights still train)."""

    def __init__(self, depth, pretrained):
        super().__init__()
        import torchvision
        weights = "IMAGENET1K_V1" if pretrained else None
        try:
            self.net = getattr(torchvision.models, f"resnet{depth}")(weights=weights)
        except Exception as e:
            raise UserError(f"could not get the ImageNet weights of resnet{depth} ({data.why(e)}); "
                            f"run once with network access or pass --no-pretrained")
        self.net.fc = nn.Identity()
        self.net.avgpool = GlobalMean()   # deterministic backward on CUDA (no parameters: weights load as before)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, x):
        return self.net(x)


def build_model(args, ds):
    """The model for `ds`: featurizer args.model, classifier args.head (linear, or FedIIR's d -> d/2 -> C),
    initialised as each source's code does (docs/protocol.md)."""
    x0 = ds.domains[0].x
    if args.model == "convnet":
        phi, d = conv_net(x0.shape[1])
    elif args.model == "smallconv":
        phi, d = conv_net(x0.shape[1], width=8)
    elif args.model == "cnn":
        phi, d = small_cnn(x0.shape[1], x0.shape[-1])
    elif args.model == "mlp":
        phi, d = mlp(x0[0].numel())
    else:
        phi = ResNet(18 if args.model == "resnet18" else 50, not args.no_pretrained)
        d = 512 if args.model == "resnet18" else 2048
    C = ds.num_classes
    omega = nn.Linear(d, C) if args.head == "linear" else \
        nn.Sequential(nn.Linear(d, d // 2), nn.ReLU(), nn.Linear(d // 2, C))
    if args.model in ("convnet", "resnet18", "resnet50"):   # the FedIIR code's models: Kaiming-normal
        # weights, PyTorch's default biases (IRM's MLP: below; the others keep PyTorch's defaults)
        for m in omega.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight)
    net = Net(phi, omega)
    if args.model == "mlp":   # IRM's ColoredMNIST code, for which its warm-up and penalty weight were tuned
        for m in net.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
    return net


def get_flat(model):
    """All trainable parameters as one vector (a copy). BatchNorm buffers are not included: the
    ResNets keep BN in eval mode, so parameters are everything that training changes."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat(model, vec):
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vec[i:i + p.numel()].view_as(p))
            i += p.numel()


# --------------------------------------------------------------------------------- federation

@dataclass
class Client:
    id: int
    domain: str
    x: torch.Tensor          # training split (uint8 images, on the device)
    y: torch.Tensor
    val_x: torch.Tensor      # this client's validation hold-out
    val_y: torch.Tensor
    test_x: torch.Tensor | None = None   # fixed-clients protocol: the client's own test set
    test_y: torch.Tensor | None = None

    @property
    def n(self):
        return len(self.y)


@dataclass
class Federation:
    name: str                # results key: the held-out domain, or "clients"
    clients: list
    val_x: torch.Tensor      # pooled validation split of all clients (model selection)
    val_y: torch.Tensor
    test_x: torch.Tensor     # pooled test set(s)
    test_y: torch.Tensor
    test_group: torch.Tensor  # index into test_names for every test example
    test_names: list


def split_counts(sizes, P):
    """FedIIR's Algorithm 2: one client per domain, then each further client goes to the domain with
    the most examples per client so far (ties: the first such domain)."""
    k = [1] * len(sizes)
    for _ in range(P - len(sizes)):
        m = max(range(len(sizes)), key=lambda i: sizes[i] / k[i])
        k[m] += 1
    return k


def holdout(x, y, frac, g):
    """Shuffle, then the first `frac` of the examples is validation (at least one, but never the
    last training example), the rest train."""
    perm = torch.randperm(len(y), generator=g)
    nv = min(len(y) - 1, max(1, int(frac * len(y))))
    return x[perm[nv:]], y[perm[nv:]], x[perm[:nv]], y[perm[:nv]]


def federate(ds, test, P, seed, device, val_frac=0.1, client_size=None):
    """Leave-one-domain-out: domain `test` is the test set; every other domain is cut into Algorithm 2's
    clients (split_counts), each holding out `val_frac` for validation. client_size (stained): clients are
    disjoint seeded samples of the pooled training domains instead (docs/protocol.md)."""
    g = torch.Generator().manual_seed(seed)
    train = [d for i, d in enumerate(ds.domains) if i != test]
    clients = []
    if client_size is not None:
        origin = torch.cat([torch.full((len(d.y),), i) for i, d in enumerate(train)])
        if P * client_size > len(origin):
            raise UserError(f"{P} clients x {client_size} examples exceed the {len(origin):,} of the training domains")
        X, Y = torch.cat([d.x for d in train]), torch.cat([d.y for d in train])
        perm = torch.randperm(len(origin), generator=g)
        for j in range(P):
            idx = perm[j * client_size:(j + 1) * client_size]
            x, y, vx, vy = holdout(X[idx], Y[idx], val_frac, g)
            name = "+".join(train[i].name for i in origin[idx].unique().tolist())
            clients.append(Client(len(clients), name, x, y, vx, vy))
        t = ds.domains[test]
        return _finish(t.name, clients, [(t.name, t.x, t.y)], device)
    for d, k in zip(train, split_counts([len(d.y) for d in train], P)):
        perm = torch.randperm(len(d.y), generator=g)
        size = len(perm) // k
        for j in range(k):
            idx = perm[j * size:(j + 1) * size if j < k - 1 else len(perm)]
            x, y, vx, vy = holdout(d.x[idx], d.y[idx], val_frac, g)
            clients.append(Client(len(clients), d.name, x, y, vx, vy))
    t = ds.domains[test]
    return _finish(t.name, clients, [(t.name, t.x, t.y)], device)


def federate_fixed(ds, seed, device, val_frac=0.1):
    """Fixed clients: every Domain of `ds` is a client with its own test set."""
    g = torch.Generator().manual_seed(seed)
    clients = []
    for d in ds.domains:
        x, y, vx, vy = holdout(d.x, d.y, val_frac, g)
        clients.append(Client(len(clients), d.name, x, y, vx, vy, d.x_test, d.y_test))
    return _finish("clients", clients, [(d.name, d.x_test, d.y_test) for d in ds.domains], device)


def _finish(name, clients, tests, device):
    for c in clients:
        for f in ("x", "y", "val_x", "val_y", "test_x", "test_y"):
            if getattr(c, f) is not None:
                setattr(c, f, getattr(c, f).to(device))
    group = torch.cat([torch.full((len(y),), i) for i, (_, _, y) in enumerate(tests)])
    return Federation(name, clients, torch.cat([c.val_x for c in clients]), torch.cat([c.val_y for c in clients]),
                      torch.cat([x for _, x, _ in tests]).to(device), torch.cat([y for _, _, y in tests]).to(device),
                      group.to(device), [n for n, _, _ in tests])


# ------------------------------------------------------------------------------ local training

@dataclass
class Context:
    device: torch.device
    gen: torch.Generator       # on the device: minibatch order and augmentation
    sampler: torch.Generator   # on the CPU: which clients take part in a round
    prep: object               # uint8 batch -> model input, see data.make_prep
    amp: bool = False

    def autocast(self):
        return torch.autocast("cuda", torch.bfloat16) if self.amp else contextlib.nullcontext()


def sample_clients(ctx, P, C):
    """C of the P clients, uniformly without replacement."""
    return torch.randperm(P, generator=ctx.sampler)[:C].tolist()


def batches(n, batch_size, epochs, ctx):
    """Index tensors of the minibatches of `epochs` shuffled passes over n examples (the last,
    partial batch of each pass is kept, as in the FedIIR code). No host synchronisation."""
    for _ in range(epochs):
        perm = torch.randperm(n, generator=ctx.gen, device=ctx.device)
        for i in range(0, n, batch_size):
            yield perm[i:i + batch_size]


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


def sgd(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def local_sgd(model, client, args, ctx, loss_fn=cross_entropy, opt=None, epochs=None):
    """`epochs` (default args.local_epochs) passes of minibatch steps on loss_fn over the client's split,
    with a fresh SGD unless `opt` is given. Returns the mean loss as a device tensor."""
    model.train()
    opt = opt or sgd(model, args)
    total, steps = torch.zeros((), device=ctx.device), 0
    for idx in batches(client.n, args.batch_size, epochs or args.local_epochs, ctx):
        x, y = ctx.prep(client.x[idx], train=True, gen=ctx.gen), client.y[idx]
        with ctx.autocast():
            loss = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach().float()
        steps += 1
    return total / steps


# ------------------------------------------------------------------ the sampled clients of a round

def train_clients(model, theta, clients, args, ctx, make_opt=None, momentum=None, loss_fn=cross_entropy, epochs=None,
                  objective=None):
    """Each of `clients` trained from θ (flat) as local_sgd trains one, with make_opt(params) (default SGD);
    `momentum`: {client id: flat momentum buffer}, loaded before and kept after. Yields (θ_c, mean loss) in
    order; with --parallel-clients on, all at once (at_once) on `objective`, loss_fn's torch.func form."""
    make_opt = make_opt or (lambda params: torch.optim.SGD(params, lr=args.lr, momentum=args.momentum,
                                                           weight_decay=args.weight_decay))
    if parallel(args):
        if loss_fn is not cross_entropy and objective is None:
            raise UserError("--parallel-clients on: this local loss has no torch.func form; use off")
        yield from at_once(model, theta, clients, args, ctx, make_opt, momentum, epochs,
                           objective or weighted_cross_entropy)
        return
    for client in clients:
        set_flat(model, theta)
        opt = make_opt(model.parameters())
        if momentum is not None and client.id in momentum:
            set_momentum(opt, momentum[client.id])
        loss = local_sgd(model, client, args, ctx, loss_fn, opt, epochs)
        if momentum is not None:
            momentum[client.id] = get_momentum(opt)
        yield get_flat(model), loss     # lazily: one client's parameters in memory at a time


def parallel(args):
    """--parallel-clients: 'auto' is on for CUDA except for the photos and ResNets, off on the CPU."""
    return args.parallel_clients == "on" or (args.parallel_clients == "auto" and str(args.device).startswith("cuda")
                                             and args.dataset not in data.PHOTOS and not args.model.startswith("resnet"))


def check_parallel(args, method, supported):
    """Refuse --parallel-clients on where it cannot apply and record what 'auto' chose. supported: a bool,
    or a function of args giving None where it applies, else the reason (a phrase)."""
    reason = supported(args) if callable(supported) else None if supported else \
        "trains its clients one after another (its local loss is not written with torch.func)"
    supported = reason is None
    if args.parallel_clients == "on" and not supported:
        raise UserError(f"--parallel-clients on: {method} {reason}; use off")
    if args.parallel_clients == "on" and args.dataset in data.PHOTOS:
        raise UserError(f"--parallel-clients on: not for {args.dataset} (its augmentation draws from the "
                        f"minibatch stream between batches, and a ResNet fills a GPU alone); use off")
    args.parallel_clients = "on" if supported and parallel(args) else "off"


def minibatch_plan(clients, batch_size, epochs, ctx, order=None):
    """The minibatches of every client as `batches` draws them: [K, C, B] indices into the pooled data,
    -1 for padding; clients stacked in `order` (a list: no host synchronisation)."""
    plans, start = [], 0
    for client in clients:
        nb = -(-client.n // batch_size)
        plans.append(torch.cat([F.pad(torch.randperm(client.n, generator=ctx.gen, device=ctx.device) + start,
                                      (0, nb * batch_size - client.n), value=-1).view(nb, batch_size)
                                for _ in range(epochs)]))
        start += client.n
    K = max(len(p) for p in plans)
    return torch.stack([F.pad(plans[i], (0, 0, 0, K - len(plans[i])), value=-1)
                        for i in (order or range(len(plans)))], 1)


def weighted_cross_entropy(model, params, buffers, x, y, w):
    """One client's minibatch loss as at_once takes it: Σ_j w_j CE(f(x_j), y_j) through functional_call, w_j =
    1 / (real examples) and 0 on padding. A method's objective has this signature."""
    return (F.cross_entropy(torch.func.functional_call(model, (params, buffers), (x,)), y, reduction="none") * w).sum()


def at_once(model, theta, clients, args, ctx, make_opt, momentum=None, epochs=None, objective=weighted_cross_entropy):
    """The clients' local updates at once: parameters stacked on a new first dimension, vmap(grad(objective))
    per step, one optimiser over the stack; clients stacked longest first, so those still training are a
    prefix and the others are put back after every step. Returns [(θ_c, mean loss)] (docs/protocol.md)."""
    C, epochs = len(clients), epochs or args.local_epochs
    order = sorted(range(C), key=lambda i: -clients[i].n)               # longest first
    plan = minibatch_plan(clients, args.batch_size, epochs, ctx, order)  # drawn in the clients' order
    X, Y = torch.cat([c.x for c in clients]), torch.cat([c.y for c in clients])
    clients = [clients[i] for i in order]
    steps = [epochs * -(-c.n // args.batch_size) for c in clients]
    real = plan >= 0
    weight = real / real.sum(-1, keepdim=True).clamp(min=1)             # 1 / (real examples) on each
    plan = plan.clamp(min=0)
    sizes = [p.numel() for p in model.parameters()]
    params = {name: t.view_as(p).expand(C, *p.shape).clone()
              for (name, p), t in zip(model.named_parameters(), theta.split(sizes))}
    buffers = {name: b.expand(C, *b.shape).clone() for name, b in model.named_buffers()}
    opt = make_opt(list(params.values()))
    if momentum is not None:             # a client without one yet starts from zeros: the same first step
        kept = torch.stack([momentum.get(c.id, torch.zeros_like(theta)) for c in clients])
        for p, m in zip(params.values(), kept.split(sizes, 1)):
            opt.state[p]["momentum_buffer"] = m.reshape(p.shape).clone()

    def loss(p, b, x, y, w):
        return objective(model, p, b, x, y, w)
    grad_and_loss = torch.func.vmap(torch.func.grad_and_value(loss))
    model.train()
    total = torch.zeros(C, device=ctx.device)
    for k in range(plan.shape[0]):
        m = sum(s > k for s in steps)                                   # clients[:m] still train
        x = ctx.prep(X[plan[k, :m].reshape(-1)], train=True, gen=ctx.gen)
        with ctx.autocast():
            grads, losses = grad_and_loss({n: p[:m] for n, p in params.items()}, {n: b[:m] for n, b in buffers.items()},
                                          x.view(m, -1, *x.shape[1:]), Y[plan[k, :m]], weight[k, :m])
        total[:m] += losses.detach().float()
        if m == C:
            for name, p in params.items():
                p.grad = grads[name]
            opt.step()
            continue
        held = [(t, t[m:].clone()) for p in params.values()     # the clients that are done, to put back
                for t in (p, *(v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape))]
        for name, p in params.items():
            p.grad = torch.cat([grads[name], grads[name].new_zeros(C - m, *p.shape[1:])])
        opt.step()
        for t, rows in held:
            t[m:] = rows
    if momentum is not None:
        kept = torch.cat([opt.state[p]["momentum_buffer"].reshape(C, -1) for p in params.values()], 1)
        momentum.update({c.id: m.clone() for c, m in zip(clients, kept)})
    thetas = torch.cat([p.detach().reshape(C, -1) for p in params.values()], 1)
    return [(thetas[j], total[j] / steps[j]) for j in (order.index(i) for i in range(C))]   # the callers' order


def get_momentum(opt):
    """An SGD optimiser's momentum buffers as one flat vector (zeros where it has none yet)."""
    ps = [p for g in opt.param_groups for p in g["params"]]
    return torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) if "momentum_buffer" in opt.state[p]
                      else torch.zeros_like(p).reshape(-1) for p in ps])


def set_momentum(opt, flat):
    i = 0
    for p in (p for g in opt.param_groups for p in g["params"]):
        opt.state[p]["momentum_buffer"] = flat[i:i + p.numel()].view_as(p).clone()
        i += p.numel()


# ---------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def correct(model, x, y, ctx, batch_size=512):
    """Per-example correctness (bool tensor on the device) of model on uint8 images x."""
    model.eval()
    out = []
    for i in range(0, len(y), batch_size):
        with ctx.autocast():
            out.append(model(ctx.prep(x[i:i + batch_size])).argmax(1) == y[i:i + batch_size])
    return torch.cat(out)


def evaluate_global(model, fed, args, state, ctx):
    """Accuracy of the global model on the pooled validation split and on the pooled test set(s),
    plus the accuracy on each test set (one per client in the fixed-clients protocol)."""
    val = correct(model, fed.val_x, fed.val_y, ctx).float().mean()
    hit = correct(model, fed.test_x, fed.test_y, ctx).float()
    return val.item(), hit.mean().item(), group_means(hit, fed.test_group, len(fed.test_names)).tolist()


def group_means(v, group, k):
    """The mean of v over each of the k groups (0 if empty), as a product with the one-hot membership."""
    member = F.one_hot(group, k).to(v.dtype)
    return (v @ member) / member.sum(0).clamp(min=1)


# ------------------------------------------------------------------------------------- the CLI

def finite(text):
    """The type of every float flag: a finite number (nan and inf are refused when parsing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def make_parser(method, doc):
    """The common flags; a default of None is filled per dataset by `resolve` (default_tables)."""
    p = Parser(prog=f"{method}.py", description=" ".join(doc.strip().split("\n\n")[0].split()))
    a = p.add_argument
    a("--dataset", default="rmnist", help=f"one of {', '.join(data.NAMES)}")
    a("--data-root", default=None, help="dataset folder; none: the MNIST family reads the embedded 5,000 digits "
                                        "(the others need one: python data.py --help)")
    a("--test-domain", default="all", help="held-out domain: 'all' (each in turn), a name or an index")
    a("--clients", type=int, default=None, help="number of clients P")
    a("--client-size", type=int, default=None,
      help="stained only: examples per client, drawn from the pooled training combinations")
    a("--sample", type=int, default=None, help="clients per round C")
    a("--rounds", type=int, default=None, help="communication rounds T")
    a("--local-epochs", type=int, default=None, help="local epochs per round")
    a("--batch-size", type=int, default=None, help="local batch size")
    a("--lr", type=finite, default=None, help="local learning rate")
    a("--momentum", type=finite, default=None, help="local SGD momentum")
    a("--weight-decay", type=finite, default=None, help="local SGD weight decay")
    a("--global-lr", type=finite, default=None, help="server step size eta_g")
    a("--alpha", type=finite, default=None, help="Dirichlet label-skew concentration (mnist, cifar*, emnist)")
    a("--p-test", type=finite, default=None, help="rcmnist / rcfmnist: colour-label agreement of the test contexts")
    a("--no-rotation", action="store_true",
      help="rcmnist / rcfmnist: the same four clients and colour laws without the rotation by 90·i degrees")
    a("--select", default=None, choices=["val", "last"],
      help="report the round with the best validation accuracy, or the last")
    a("--stain", default="fg", choices=["fg", "bg", "both"], help="stained MNIST: foreground, background or both")
    a("--model", default=None, choices=["convnet", "smallconv", "cnn", "mlp", "resnet18", "resnet50"],
      help="featurizer")
    a("--head", default=None, choices=["linear", "mlp"], help="classifier")
    a("--no-pretrained", action="store_true",
      help="ResNets from random weights: no ImageNet download (needed offline; the accuracies are then far lower)")
    a("--eval-every", type=int, default=None, help="evaluate (and checkpoint) every this many rounds")
    a("--seed", type=int, default=0, help="seeds the data split, the initialisation, the client sampling and the "
                                          "minibatch order")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if one is visible, else cpu")
    a("--amp", action="store_true", help="bf16 autocast (CUDA only)")
    a("--nondeterministic", action="store_true",
      help="CUDA: let cuDNN and cuBLAS pick their fastest kernels; two runs then differ (README: GPU)")
    a("--parallel-clients", default="auto", choices=["auto", "on", "off"],
      help="train the sampled clients of a round at once (torch.func); auto: on for CUDA, off on the CPU")
    a("--out", default=None, help="results JSON, default results/<method>-<dataset>-seed<seed>.json; "
                                  "the checkpoint is <out>.ckpt")
    a("--resume", action="store_true", help="continue from <out>.ckpt if it exists")
    return p


def default_tables(dataset, defaults=None):
    """Where a flag left unset takes its value, first match wins: (table, is it per dataset)."""
    defaults = defaults or {}
    return ((defaults.get(dataset, {}), True), (defaults.get("*", {}), False), (DATASET_DEFAULTS.get(dataset, {}), True))


def fill_defaults(args, defaults=None):
    for table, _ in default_tables(args.dataset, defaults):
        for k, v in table.items():
            if getattr(args, k, None) is None:
                setattr(args, k, v)


def help_defaults(p, method, defaults, argv):
    """Every flag's help ends with its default for the --dataset of argv, looked up in default_tables;
    the flags whose help already speaks of its default are left as they are."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--dataset", default="rmnist")
    dataset = pre.parse_known_args(argv)[0].dataset
    dataset = dataset if dataset in data.NAMES else "rmnist"
    for act in p._actions:
        if act.nargs == 0 or not act.option_strings or not act.help or "default" in act.help.lower() or act.default == "":
            continue
        value, where = act.default, ""
        if value is None:
            value, where = next(((t[act.dest], f" for {dataset}") for t, _ in default_tables(dataset, defaults)
                                 if act.dest in t), ("per dataset, see docs/protocol.md", ""))
        if isinstance(value, float) and not math.isfinite(value):     # a method's marker: its check() sets it
            value = f"set by {method} from its own flags"
        act.help += f" (default{where}: {value})".replace("%", "%%")
    p.epilog = f"Defaults for --dataset {dataset}; python {method}.py --dataset NAME --help shows those of NAME."


def resolve(args, method, defaults=None):
    """Fill the flags left unset (default_tables), then refuse bad values before any work."""
    if args.dataset not in data.NAMES:
        raise UserError(f"unknown dataset {args.dataset!r}; choose from {', '.join(data.NAMES)}")
    fill_defaults(args, defaults)
    for flag in ("data_root", "out"):
        if getattr(args, flag) == "":
            raise UserError(f"--{flag.replace('_', '-')} is empty: give a folder or file name, or leave the flag out")
    if not 0 <= args.seed < 2 ** 31:     # it seeds torch's generators with seed * 104729 + a salt
        raise UserError(f"--seed must be in [0, 2**31), got {args.seed}")
    if args.clients is not None and args.clients < 1:
        raise UserError(f"--clients must be positive, got {args.clients}")
    for k in ("rounds", "local_epochs", "batch_size", "eval_every", "lr", "global_lr", "alpha"):
        if not getattr(args, k) > 0:
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.client_size is not None and args.dataset != "stained":
        raise UserError(f"--client-size applies to stained only, not {args.dataset}")
    if args.client_size is not None and args.client_size <= 0:
        raise UserError(f"--client-size must be positive, got {args.client_size}")
    if args.no_rotation and args.dataset not in ("rcmnist", "rcfmnist"):
        raise UserError(f"--no-rotation applies to rcmnist and rcfmnist only, not {args.dataset}")
    if not 0 <= args.p_test <= 1:
        raise UserError(f"--p-test must be in [0, 1], got {args.p_test}")
    if math.isfinite(args.momentum) and not 0 <= args.momentum < 1:   # inf: a method's marker (never a user's)
        raise UserError(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.weight_decay < 0:
        raise UserError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.amp and args.device != "cuda":
        raise UserError("--amp needs a CUDA device")
    args.out = args.out or f"results/{method}-{args.dataset}-seed{args.seed}.json"
    check_out(args.out)
    return args


def check_out(out):
    """Refuse, before any work, an --out that could not take the results or the checkpoint beside it:
    a folder, a path under a file, a folder that cannot be written."""
    out = Path(out)
    for path in (out, out.with_suffix(".ckpt")):
        if path.is_dir():
            raise UserError(f"--out {out}: {path} is a folder; give a file name, e.g. {out / 'results.json'}")
    above = next((q for q in out.parents if q.exists()), Path("."))
    if not above.is_dir():
        raise UserError(f"--out {out}: {above} is not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".probe-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write --out {out}: {e.strerror or e}")


def test_domains(args, ds):
    """Indices of the domains to hold out, from --test-domain (and the clients/sample checks)."""
    M = len(ds.domains)
    if ds.protocol == "clients":
        if args.test_domain != "all":
            raise UserError(f"--test-domain does not apply to {ds.name}: its clients have their own test sets")
        if args.clients != M:
            raise UserError(f"--clients {args.clients} does not match the {M} clients of the split")
        todo, n_train = [None], M
    else:
        names = [d.name for d in ds.domains]
        if args.test_domain == "all":
            todo = list(range(M))
        elif args.test_domain in names:
            todo = [names.index(args.test_domain)]
        elif args.test_domain.lstrip("-").isdigit() and 0 <= int(args.test_domain) < M:
            todo = [int(args.test_domain)]
        else:
            raise UserError(f"unknown test domain {args.test_domain!r} for {ds.name}; choose 'all', "
                            f"one of {', '.join(names)} or an index 0..{M - 1}")
        n_train = M - 1
    if args.dataset == "stained":
        stained_clients(args, ds)
        return todo
    args.clients = n_train if args.clients is None else args.clients
    args.sample = min(args.clients, n_train) if args.sample is None else args.sample
    if args.clients < n_train:
        raise UserError(f"--clients {args.clients} is below the {n_train} training domains (a client "
                        f"never mixes domains)")
    if not 1 <= args.sample <= args.clients:
        raise UserError(f"--sample must be between 1 and --clients ({args.clients}), got {args.sample}")
    if ds.protocol == "lodo":
        enough_examples(args, ds, todo)
    return todo


def max_clients(sizes, P):
    """The most clients, up to P, that Algorithm 2 can cut domains of these sizes into with >= 2 examples each."""
    k = [1] * len(sizes)
    if min(sizes) < 2:
        return 0
    for n in range(len(sizes), P):
        m = max(range(len(sizes)), key=lambda i: sizes[i] / k[i])
        if sizes[m] // (k[m] + 1) < 2:
            return n
        k[m] += 1
    return P


def enough_examples(args, ds, todo):
    """Refuse, before any split, a --clients that leaves a client without a training and a validation
    example (federate: Algorithm 2's chunks of floor(n / k)), for every held-out domain to be run."""
    sizes = {test: [len(d.y) for i, d in enumerate(ds.domains) if i != test] for test in todo}
    top = {test: max_clients(n, min(args.clients, sum(n) // 2 + 1)) for test, n in sizes.items()}
    test = min(todo, key=top.get)                                       # the held-out domain that allows fewest
    if args.clients > top[test]:
        raise UserError(f"--clients {args.clients} leaves clients without a training and a validation example: "
                        f"testing on {ds.domains[test].name}, the {len(sizes[test])} training domains of {ds.name} "
                        f"hold {sum(sizes[test]):,} examples, enough for at most {top[test]:,} clients (Algorithm 2 "
                        f"cuts each domain into equal chunks of at least 2)")


def stained_clients(args, ds):
    """Stained MNIST's clients (FedIPG VI-C): --clients x --client-size, defaults by --stain (STAINED), a default
    size shrunk to fit the pool, every client sampled unless --sample says otherwise (docs/protocol.md)."""
    P0, n0 = STAINED[args.stain]
    args.clients = P0 if args.clients is None else args.clients
    args.sample = args.clients if args.sample is None else args.sample
    pool = sum(len(d.y) for d in ds.domains) - max(len(d.y) for d in ds.domains)
    if args.clients < 1:
        raise UserError(f"--clients must be positive, got {args.clients}")
    if args.client_size is None:
        args.client_size = min(n0, pool // args.clients)
        if args.client_size < n0:
            print(f"note: stained {args.stain}: {args.clients} clients x {n0:,} examples exceed the {pool:,} of the "
                  f"nine training combinations; each client gets {pool:,} // {args.clients} = {args.client_size:,}")
    elif args.clients * args.client_size > pool:
        raise UserError(f"--client-size {args.client_size} x --clients {args.clients} exceeds the {pool:,} examples "
                        f"of the nine training combinations (at most {pool // args.clients:,} per client)")
    if args.client_size < 2:
        raise UserError(f"{args.clients} clients leave {args.client_size} example(s) each: too few for a "
                        f"training and a validation split; use fewer --clients")
    if not 1 <= args.sample <= args.clients:
        raise UserError(f"--sample must be between 1 and --clients ({args.clients}), got {args.sample}")


# ------------------------------------------------------------------- results and checkpoints

def write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def save_checkpoint(path, blob):
    tmp = f"{path}.tmp"
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, args):
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        saved = blob["args"]
    except Exception as e:
        raise UserError(f"corrupt checkpoint {path} ({type(e).__name__}); delete it or run without --resume")
    now = identity(args)
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        raise UserError(f"--resume: {path} was made with other arguments ("
                        + ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff) + ")")
    return blob


def to_device(obj, device):
    """A method's state (tensors in dicts and lists) moved to `device`."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def identity(args):
    """The arguments that decide the numbers of a run (everything but --resume)."""
    return {k: v for k, v in vars(args).items() if k != "resume"}


def device_name(device):
    """The device by name: the GPU's, or the CPU model's (Linux: /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def provenance(method, argv, device):
    """What a reader needs to redo a result: the versions, the device by name, the commit of this
    checkout (and whether tracked files differ from it; none outside git) and the command line."""
    here = Path(__file__).resolve().parent
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(here), *a], capture_output=True, text=True, timeout=10)
        head = git("rev-parse", "HEAD")
        commit = head.stdout.strip() if head.returncode == 0 else None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    import numpy
    return {"command": shlex.join(["python", f"{method}.py", *argv]), "commit": commit, "dirty": dirty,
            "date": time.strftime("%Y-%m-%d"), "device": device_name(device), "torch": torch.__version__,
            "numpy": numpy.__version__, "python": platform.python_version()}


def size(path):
    n = os.path.getsize(path)
    return next(f"{n / 1024 ** k:.0f} {unit}" for k, unit in ((3, "GB"), (2, "MB"), (1, "kB"), (0, "bytes"))
                if n >= 1024 ** k or k == 0)


def seconds(s):
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# --------------------------------------------------------------------------------- the skeleton

def set_deterministic(on=True):
    """Reproducible kernels (the default) or CUDA's fastest (--nondeterministic); CPU numbers are the same
    either way. Deterministic mode's NaN fill of new tensors is off: nothing here reads unwritten memory."""
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on
    torch.utils.deterministic.fill_uninitialized_memory = False


def run(method, args, round_fn, init_state=None, evaluate_fn=evaluate_global, argv=None):
    """Load, then for every held-out domain: federate and train_domain; results JSON and checkpoint.
    argv: the command line, recorded in the provenance."""
    set_deterministic(not args.nondeterministic)      # before the model or anything else meets CUDA
    ds = data.load(args.dataset, args.data_root, args.seed, clients=args.clients or 100, alpha=args.alpha,
                   p_test=args.p_test, stain=args.stain, rotation=not args.no_rotation)
    print(f"data: {ds.source}\ndata: {counts(ds)}", flush=True)
    todo = test_domains(args, ds)
    device = torch.device(args.device)
    ckpt_path = str(Path(args.out).with_suffix(".ckpt"))
    results = {"method": method, "dataset": args.dataset, "seed": args.seed, "args": vars(args),
               "source": ds.source, "protocol": ds.protocol, "domains": {}, "mean_test_acc": None, "complete": False,
               "provenance": provenance(method, sys.argv[1:] if argv is None else argv, device)}
    blob = None
    if args.resume and os.path.exists(ckpt_path):
        blob = load_checkpoint(ckpt_path, args)
        results["domains"] = blob["finished"]
        print(f"resuming from {ckpt_path}: {len(blob['finished'])} domain(s) done, "
              f"'{blob['domain']}' at round {blob['round']}")
    elif args.resume:
        print(f"note: no checkpoint at {ckpt_path}; starting from the beginning")
    print(f"{method} on {args.dataset}: {args.clients} clients, {args.sample} per round, {args.rounds} rounds, "
          f"{args.local_epochs} local epoch(s), lr {args.lr}, batch {args.batch_size}, device {device}")
    saved = blob is not None             # a checkpoint of this run (or of the one resumed) is on disk
    for k, test in enumerate(todo):
        if ("clients" if test is None else ds.domains[test].name) in results["domains"]:
            continue                                            # finished before a --resume
        fed = federate_fixed(ds, args.seed, device) if test is None else \
            federate(ds, test, args.clients, args.seed, device, client_size=getattr(args, "client_size", None))
        resume = blob if blob is not None and blob["domain"] == fed.name else None
        try:
            with progress_line():
                results["domains"][fed.name] = train_domain(method, args, ds, fed, round_fn, init_state, evaluate_fn,
                                                            resume, results, ckpt_path, len(todo) - k - 1)
        except NonFinite as e:   # name only the files this run wrote (or resumed from), never an older run's
            kept = [f"the last good checkpoint ({ckpt_path})"] * (saved or e.saved) + \
                   [f"the results of the finished test domains ({args.out})"] * bool(results["domains"])
            raise NonFinite(f"{e}; stopped; " + (" and ".join(kept) + " are kept" if kept else
                                                  "nothing of this run was saved")) from None
        saved = True
        write_json(args.out, with_mean(results))
    results["complete"] = True                                  # every held-out domain is done
    write_json(args.out, with_mean(results))
    print_table(results)
    print(f"results: {args.out}")
    if os.path.exists(ckpt_path):    # the only copy of the trained model: kept, and said what it costs
        print(f"checkpoint: {ckpt_path} ({size(ckpt_path)}: the final model and the method's state; "
              f"--resume continues from it; delete it if you do not need the model)")
    return results


def counts(ds):
    """One line: how many domains (or clients), classes and images a dataset holds."""
    images = sum(len(d.y) + (0 if d.y_test is None else len(d.y_test)) for d in ds.domains)
    parts = f"{len(ds.domains)} domains ({', '.join(d.name for d in ds.domains)})" if ds.protocol == "lodo" \
        else f"{len(ds.domains)} clients"
    return f"{parts}, {ds.num_classes} classes, {images:,} images"


def with_mean(results):
    accs = [r["test_acc"] for r in results["domains"].values()]
    results["mean_test_acc"] = sum(accs) / len(accs)
    return results


def train_domain(method, args, ds, fed, round_fn, init_state, evaluate_fn, resume, results, ckpt_path, remaining):
    """T rounds on one federation: a round, every args.eval_every rounds an evaluation, the best kept, a checkpoint."""
    model, state, ctx = start_domain(args, ds, fed, init_state)
    start, history, best, spent = 1, [], None, 0.0
    if resume is not None:
        state, start, history, best, spent = restore(resume, model, ctx)
    saved = resume is not None           # a checkpoint of this domain is on disk (for NonFinite's message)
    pace = Pace(start, spent, args.rounds, remaining)
    losses = []
    for t in range(start, args.rounds + 1):
        losses.append(checked_round(round_fn, t, model, fed, args, state, ctx, saved))
        if t % args.eval_every and t != args.rounds:
            status(f"round {t:4d}/{args.rounds} | round loss {losses[-1]:.4f} | {pace(t)}")
            continue
        val, test, per, *more = evaluate_fn(model, fed, args, state, ctx)
        extra = more[0] if more else {}   # further numbers of a method (PerInvFL: the global model's)
        row = {"round": t, "val_acc": val, "test_acc": test, "loss": sum(losses) / len(losses),
               "seconds": pace.seconds(ctx.device), **extra}
        history.append(row)
        if best is None or val > best["val_acc"] or args.select == "last":
            best = dict(row, per_test=per)
        shown = "".join(f" | {k} {v:.4f}" for k, v in extra.items() if isinstance(v, float))
        print(f"round {t:4d}/{args.rounds} | val {val:.4f} | test {test:.4f}{shown} | mean loss (rounds "
              f"{t - len(losses) + 1}-{t}) {row['loss']:.4f} | {pace(t)}", flush=True)
        losses = []
        save_checkpoint(ckpt_path, {"args": identity(args), "finished": results["domains"], "domain": fed.name,
                                    "round": t, "model": model.state_dict(), "state": state,
                                    "gen": ctx.gen.get_state(), "sampler": ctx.sampler.get_state(),
                                    "torch_rng": torch.get_rng_state(), "history": history, "best": best,
                                    "seconds": row["seconds"]})
        saved = True
    return domain_result(ds, fed, history, best)


def start_domain(args, ds, fed, init_state):
    """The initial model (seeded), the method's state and the domain's random streams (fixed by the seed)."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = build_model(args, ds).to(device)
    if args.model.startswith("resnet") and device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    salt = sum(map(ord, fed.name))  # a per-domain stream, fixed by the seed
    ctx = Context(device, torch.Generator(device).manual_seed(args.seed * 7919 + salt),
                  torch.Generator().manual_seed(args.seed * 104729 + salt), data.make_prep(args.dataset, device), args.amp)
    state = init_state(model, fed, args, ctx) if init_state else {}
    print(f"-- test domain {fed.name}: {len(fed.clients)} clients, {sum(c.n for c in fed.clients):,} training / "
          f"{len(fed.val_y):,} validation / {len(fed.test_y):,} test examples")
    return model, state, ctx


def restore(resume, model, ctx):
    """A checkpoint's model and random streams back in place: (state, next round, history, best, seconds)."""
    model.load_state_dict(resume["model"])
    ctx.gen.set_state(resume["gen"])
    ctx.sampler.set_state(resume["sampler"])
    torch.set_rng_state(resume["torch_rng"])
    state = to_device(resume["state"], ctx.device)   # checkpoints load on the CPU
    return state, resume["round"] + 1, resume["history"], resume["best"], resume["seconds"]


def checked_round(round_fn, t, model, fed, args, state, ctx, saved):
    """Round t, then one host read: its clients' mean loss, or NonFinite naming the first non-finite
    client loss, else the model's or the state's tensors that are not finite."""
    try:
        out = round_fn(t, model, fed, args, state, ctx)
    except NonFinite as e:          # a method's own check (FedLOE's φ)
        e.saved = e.saved or saved
        raise
    ids, vals = list(out), torch.stack([out[c] for c in out])
    vals = torch.cat([vals, all_finite(model, state).to(vals.dtype)[None]]).cpu()   # one sync per round
    bad = [c for c, v in zip(ids, vals.tolist()) if not math.isfinite(v)]
    if bad:
        c = fed.clients[bad[0]]
        raise NonFinite(f"non-finite loss in round {t} on client {c.id} (training domain {c.domain}, "
                        f"testing on {fed.name})", saved)
    if not vals[-1]:                # the server's step or a server quantity: never written as a result
        raise NonFinite(f"non-finite {', '.join(nonfinite(model, state))} after the server step of round {t} "
                        f"(testing on {fed.name})", saved)
    return vals[:-1].mean().item()


class Pace:
    """Seconds spent on a domain (counting those before a --resume), and the pace and ETA of a round."""

    def __init__(self, start, spent, rounds, remaining):
        self.start, self.spent, self.rounds, self.remaining, self.t0 = start, spent, rounds, remaining, time.perf_counter()

    def seconds(self, device):
        if device.type == "cuda":
            torch.cuda.synchronize()
        return self.spent + time.perf_counter() - self.t0

    def __call__(self, t):
        rate = (time.perf_counter() - self.t0) / (t - self.start + 1)
        return f"{rate:.2f} s/round | ETA {seconds(rate * (self.rounds - t + self.remaining * self.rounds))}"


def domain_result(ds, fed, history, best):
    out = {"test_acc": best["test_acc"], "val_acc": best["val_acc"], "best_round": best["round"],
           "train_examples": sum(c.n for c in fed.clients),
           "last_test_acc": history[-1]["test_acc"], "history": history,
           **{k: v for k, v in best.items() if k not in ROW_KEYS}}   # a method's extra numbers
    if ds.protocol == "clients":
        out["per_client_test_acc"] = dict(zip(fed.test_names, best["per_test"]))
    return out


class Progress:
    """stdout on a terminal: `show` writes a line that the next one overwrites; other output erases it first."""

    def __init__(self, stream):
        self.stream, self.shown = stream, False

    def show(self, text):
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self.shown = bool(text)

    def write(self, text):
        if text and self.shown:
            self.show("")
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def progress_line():
    """A progress line per round on a terminal (`status`); a log file or a pipe gets none of it."""
    if not getattr(sys.stdout, "isatty", lambda: False)():
        yield
        return
    line = Progress(sys.stdout)
    with contextlib.redirect_stdout(line):
        try:
            yield
        finally:
            if line.shown:
                line.show("")


def status(text):
    if isinstance(sys.stdout, Progress):
        sys.stdout.show(text)


ROW_KEYS = ("round", "val_acc", "test_acc", "loss", "seconds", "per_test")


def tensors(obj, name):
    """(name, tensor) for every floating tensor in a method's state (dicts and lists of tensors). A key
    that starts with "_" holds a diagnostic, not a server quantity (nan: not measured): left out."""
    if torch.is_tensor(obj):
        return [(name, obj)] if obj.is_floating_point() else []
    items = [(k, v) for k, v in obj.items() if not str(k).startswith("_")] if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else []
    return [pair for k, v in items for pair in tensors(v, f"{name}[{k!r}]")]


def all_finite(model, state):
    """One device flag (no host read): every floating tensor of the global model and of the method's
    state (server quantities, client states) is finite."""
    ts = [v for v in model.state_dict().values() if v.is_floating_point()] + [v for _, v in tensors(state, "state")]
    device = next(model.parameters()).device
    return torch.stack([v.isfinite().all().to(device) for v in ts if v.device.type != "meta"]).all()


def nonfinite(model, state):
    """The names of the non-finite tensors, model first (read only once all_finite said there are some)."""
    named = [(f"model {k}", v) for k, v in model.state_dict().items() if v.is_floating_point()] + tensors(state, "state")
    bad = [k for k, v in named if v.device.type != "meta" and not bool(v.isfinite().all())]
    return bad[:3] + [f"{len(bad) - 3} more"] * (len(bad) > 3)


class NonFinite(Exception):
    """A non-finite loss or server quantity: exit 1. `saved`: a checkpoint of this run is on disk."""

    def __init__(self, message, saved=False):
        super().__init__(message)
        self.saved = saved


def print_table(results):
    rows = results["domains"]
    width = max([11] + [len(k) for k in rows])
    sel = "(last)" if results["args"].get("select") == "last" else "(best val)"
    print(f"\n{'test domain':<{width}}  test acc {sel:<10}  last round  best round")
    for name, r in rows.items():
        print(f"{name:<{width}}  {r['test_acc']:19.4f}  {r['last_test_acc']:10.4f}  {r['best_round']:10d}")
    if len(rows) > 1:
        print(f"{'mean':<{width}}  {results['mean_test_acc']:19.4f}  "
              f"{sum(r['last_test_acc'] for r in rows.values()) / len(rows):10.4f}")


def main(method, doc, round_fn, argv=None, add_args=None, defaults=None, init_state=None,
         evaluate_fn=evaluate_global, check=None, parallel_clients=False):
    """The entry point of every method script: bad input -> one line on stderr and exit 2. parallel_clients:
    a bool, or check_parallel's `supported` function."""
    p = make_parser(method, doc)
    if add_args:
        add_args(p)
    for act in p._actions:          # the method's own float flags: finite too
        if act.type is float:
            act.type = finite
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "-h" or a.startswith("--hel") and "--help".startswith(a) for a in argv):
        help_defaults(p, method, defaults, argv)
    args = p.parse_args(argv)
    try:
        resolve(args, method, defaults)
        if check:
            check(args)
        check_parallel(args, method, parallel_clients)
        return run(method, args, round_fn, init_state, evaluate_fn, argv)
    except UserError as e:
        print(f"{method}.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFinite as e:
        print(f"{method}.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"\n{method}.py: interrupted; continue with the same arguments and --resume", file=sys.stderr)
        sys.exit(130)
