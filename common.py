"""What every method shares: models, local training (client by client or at once), the round skeleton,
evaluation, model selection, logging, checkpoints and results (the clients: data.federate); nothing here
knows about a specific method. A method file plugs in with main("name", doc, round_fn, ...), where
round_fn(t, model, fed, args, state, ctx) runs one communication round and returns {client id: mean local
loss}; optional init_state(model, fed, args, ctx) -> state and evaluate_fn(model, fed, args, state, ctx) ->
(val_acc, test_acc, per-test-set accs[, extra]). The contract in full: docs/protocol.md ("Adding a method").
"""
import harness  # first: a Ctrl-C during the imports below is one line, exit 130
import contextlib
import copy
import functools
import hashlib
import inspect
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.deterministic

import data
from data import Parser, UserError, finite
from harness import outputs
from harness.progress import Progress

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
    x0, C = ds.domains[0].x, ds.num_classes
    phi, d = {"convnet": lambda: conv_net(x0.shape[1]), "smallconv": lambda: conv_net(x0.shape[1], width=8),
              "cnn": lambda: small_cnn(x0.shape[1], x0.shape[-1]), "mlp": lambda: mlp(x0[0].numel()),
              "resnet18": lambda: (ResNet(18, not args.no_pretrained), 512),
              "resnet50": lambda: (ResNet(50, not args.no_pretrained), 2048)}[args.model]()
    omega = nn.Linear(d, C) if args.head == "linear" else \
        nn.Sequential(nn.Linear(d, d // 2), nn.ReLU(), nn.Linear(d // 2, C))
    net = Net(phi, omega)
    for m in (net if args.model == "mlp" else omega).modules():       # the others keep PyTorch's defaults
        if isinstance(m, nn.Linear) and args.model in ("convnet", "resnet18", "resnet50"):
            nn.init.kaiming_normal_(m.weight)   # the FedIIR code's models: the head's weights (PyTorch's biases)
        elif isinstance(m, nn.Linear) and args.model == "mlp":   # IRM's ColoredMNIST code, for which its
            nn.init.xavier_uniform_(m.weight)                    # warm-up and penalty weight were tuned
            nn.init.zeros_(m.bias)
    return net


def get_flat(model):
    """All trainable parameters as one vector (a copy). BatchNorm buffers are not included: the
    ResNets keep BN in eval mode, so parameters are everything that training changes."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat(model, vec):
    with torch.no_grad():
        for p, v in zip(model.parameters(), vec.split([p.numel() for p in model.parameters()])):
            p.copy_(v.view_as(p))


# ---------------------------------------------------------------------- the clients of a round
# A round is what the server sends, what each sampled client computes from it, and what the server
# does with the replies. A client's work is a function of what it was sent, its own data, its own
# state and its own random stream, never of another client: `on_clients` runs it one client after
# another, all at once (torch.func), or on Flower's nodes (flower/), with the same replies.

@dataclass
class Context:
    device: torch.device
    sampler: torch.Generator   # on the CPU: the server's own draws (which clients take part)
    prep: object               # uint8 batch -> model input, see data.make_prep
    amp: bool = False
    args: object = None
    fed: object = None         # the federation (data.Federation) of this held-out domain
    model: object = None       # a scratch model of the global one's architecture, for the clients' work
    clients: dict = None       # {client id: its own state}, kept across rounds (in the method's state)
    engine: object = None      # how on_clients runs the clients: one_by_one, all_at_once, or Flower's

    def autocast(self):
        return torch.autocast("cuda", torch.bfloat16) if self.amp else contextlib.nullcontext()


@dataclass
class Site:
    """Where a client's work runs: its data, its own random stream and state, and a model to compute with.
    Stacked (all at once): `client`, `gen` and `state` are lists, one entry per client."""
    client: object             # data.Client: x, y (training split), val_x, val_y, id, n
    gen: object                # torch.Generator: every random draw of this client in this phase
    state: object              # dict: what the client keeps across rounds (FedOMG's momentum)
    model: nn.Module
    args: object
    prep: object
    amp: bool = False

    autocast = Context.autocast

    @property
    def stacked(self):
        return isinstance(self.client, list)


def sample_clients(ctx, P, C):
    """C of the P clients, uniformly without replacement, on the server's generator; in the order of their ids
    (the order in which every engine returns the replies, so that the server sums them in one order)."""
    return sorted(torch.randperm(P, generator=ctx.sampler)[:C].tolist())


def stream(seed, domain, t, client, phase, device):
    """Client `client`'s random stream in round t of the run (seed, held-out domain), in the exchange `phase`:
    a generator seeded with 64 bits of BLAKE2b of those five values (docs/protocol.md: Random streams)."""
    key = f"{seed}/{domain}/{t}/{client}/{phase}".encode()
    return torch.Generator(device).manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))


def stackable(fn):
    """Marks a client function that also runs for a stacked Site (its training: local_train): with
    --parallel-clients on, all_at_once calls it once for every client of the round."""
    fn.stackable = True
    return fn


def on_clients(fn, S, sent, t, ctx, phase=None):
    """Each client c of S runs fn(site, sent_c) and replies with a dict: the replies, in the order of S. sent: one
    dict for all, or a list of one per client; phase (default fn's name) names the exchange in the streams."""
    sents = sent if isinstance(sent, list) else [sent] * len(S)
    return (ctx.engine or one_by_one)(fn, list(S), sents, t, phase or fn.__name__, ctx)


def site(ctx, c, t, phase):
    """The Site of client c (a list: those clients stacked) in round t's exchange `phase`."""
    if isinstance(c, list):
        one = [site(ctx, i, t, phase) for i in c]
        return Site([s.client for s in one], [s.gen for s in one], [s.state for s in one], ctx.model, ctx.args,
                    ctx.prep, ctx.amp)
    return Site(ctx.fed.clients[c], stream(ctx.args.seed, ctx.fed.name, t, c, phase, ctx.device),
                ctx.clients.setdefault(c, {}), ctx.model, ctx.args, ctx.prep, ctx.amp)


def one_by_one(fn, S, sents, t, phase, ctx):
    """The clients one after another, in process."""
    return [fn(site(ctx, c, t, phase), sent) for c, sent in zip(S, sents)]


def all_at_once(fn, S, sents, t, phase, ctx):
    """The clients at once, in process, where fn is stackable (else one_by_one): what was sent to each stacked
    (tensors on a new first dimension), one call, and the replies' tensors split back by client."""
    if not getattr(fn, "stackable", False) or len(S) == 1:
        return one_by_one(fn, S, sents, t, phase, ctx)
    sent = {k: torch.stack([s[k] for s in sents]) if torch.is_tensor(v) and any(s[k] is not v for s in sents) else v
            for k, v in sents[0].items()}
    out = fn(site(ctx, S, t, phase), sent)
    return [{k: v[j] if torch.is_tensor(v) else v for k, v in out.items()} for j in range(len(S))]


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
        raise UserError(f"--parallel-clients on: not for {args.dataset} (each client's augmentation draws from its "
                        f"own stream, and a ResNet fills a GPU alone); use off")
    args.parallel_clients = "on" if supported and parallel(args) else "off"
    if getattr(args, "compile", False) and args.parallel_clients == "off":     # (--compile: the stacked step)
        raise UserError(f"--compile: {method} {reason}, and --compile compiles the step of clients trained at once"
                        if reason else "--compile compiles the step of the clients trained at once: add "
                        "--parallel-clients on (the default on CUDA)")


# ------------------------------------------------------------------------------ local training

def cross_entropy(model, params, buffers, x, y, w):
    """A client's minibatch loss in the form every local objective takes: Σ_j w_j CE(f(x_j), y_j) at the
    parameters `params` (dicts by name, through functional_call), w_j = 1 / (real examples), 0 on padding."""
    logits = torch.func.functional_call(model, (params, buffers), (x,))
    return (F.cross_entropy(logits, y, reduction="none") * w).sum()


def sgd(params, args, lr=None):
    """The local optimiser: SGD with --lr (or lr), --momentum, --weight-decay, one update for all tensors (foreach)."""
    return torch.optim.SGD(params, lr=args.lr if lr is None else lr, momentum=args.momentum,
                           weight_decay=args.weight_decay, foreach=True)


def batches(n, batch_size, gen, device, epochs=None, steps=None):
    """Index tensors of a client's minibatches, drawn from its stream `gen`: `epochs` shuffled passes over its n
    examples (the last, partial batch of each kept, as in the FedIIR code), or `steps` batches each drawn afresh
    (the whole split, in order, when batch_size covers it). No host synchronisation."""
    if steps is not None:
        for _ in range(steps):
            yield torch.arange(n, device=device) if batch_size >= n else \
                torch.randperm(n, generator=gen, device=device)[:batch_size]
        return
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen, device=device)
        for i in range(0, n, batch_size):
            yield perm[i:i + batch_size]


def local_train(site, theta, objective=cross_entropy, make_opt=None, epochs=None, steps=None, keep_momentum=False):
    """A client's local training from θ (flat): minibatch steps (`batches`: --local-epochs passes by default, or
    `steps` fresh draws) of make_opt (default `sgd`) on objective(model, params, buffers, x, y, w). keep_momentum:
    the SGD momentum buffer is the client's own, kept in site.state across rounds. Returns (θ_c, mean loss);
    a stacked Site trains every client at once (at_once): θ_c [C, |θ|] and the losses [C]."""
    args, make_opt = site.args, make_opt or (lambda params: sgd(params, site.args))
    epochs = None if steps is not None else epochs or args.local_epochs
    if site.stacked:
        return at_once(site, theta, objective, make_opt, epochs, steps, keep_momentum)
    model, client, device = site.model, site.client, theta.device
    set_flat(model, theta)
    params = list(model.parameters())
    opt = make_opt(params)
    if keep_momentum and "momentum" in site.state:            # the client's SGD momentum of its last round (flat)
        for p, m in zip(params, site.state["momentum"].split([p.numel() for p in params])):
            opt.state[p]["momentum_buffer"] = m.view_as(p).clone()
    model.train()
    named, buffers, weights = dict(model.named_parameters()), dict(model.named_buffers()), {}
    total, count = torch.zeros((), device=device), 0
    for idx in batches(client.n, args.batch_size, site.gen, device, epochs, steps):
        b = len(idx)
        if b not in weights:
            weights[b] = torch.full((b,), 1.0 / b, device=device)
        x, y = site.prep(client.x[idx], train=True, gen=site.gen), client.y[idx]
        with site.autocast():
            loss = objective(model, named, buffers, x, y, weights[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach().float()
        count += 1
    if keep_momentum:                                           # zeros where SGD has none yet
        site.state["momentum"] = torch.cat([opt.state[p].get("momentum_buffer", torch.zeros_like(p)).reshape(-1)
                                            for p in params])
    return get_flat(model), total / max(count, 1)


def at_once(site, theta, objective, make_opt, epochs=None, steps=None, keep_momentum=False):
    """local_train for the stacked clients of `site`: parameters stacked on a new first dimension, one
    vmap(grad(objective)) and one optimiser step per minibatch for all of them, from the minibatches each
    client's own stream draws (`batches`, as local_train). θ: one start [|θ|] or one per client [C, |θ|].
    Clients are stacked longest first, so those still training are a prefix; the others are put back after
    every step, parameters and optimiser state, and never move again (docs/protocol.md)."""
    clients, gens, states, args, model = site.client, site.gen, site.state, site.args, site.model
    if site.args.dataset in data.PHOTOS:       # (check_parallel refuses it: their augmentation is per client)
        raise UserError("the clients of a photo dataset train one after another")
    C, device = len(clients), theta.device
    plans = [list(batches(c.n, args.batch_size, g, device, epochs, steps)) for c, g in zip(clients, gens)]
    order = sorted(range(C), key=lambda i: -len(plans[i]))              # longest first
    K, B = len(plans[order[0]]), max(len(i) for p in plans for i in p)
    offset = [sum(c.n for c in clients[:i]) for i in range(C)]          # each client's rows in X
    plan = torch.full((K, C, B), -1, dtype=torch.long, device=device)   # [step, client, example] into X; -1: pad
    for j, i in enumerate(order):
        for k, idx in enumerate(plans[i]):
            plan[k, j, :len(idx)] = idx + offset[i]
    X, Y = torch.cat([c.x for c in clients]), torch.cat([c.y for c in clients])
    steps_of = [len(plans[i]) for i in order]
    real = plan >= 0
    weight = real / real.sum(-1, keepdim=True).clamp(min=1)             # 1 / (real examples) on each
    count = real.any(-1).sum(0).clamp(min=1)                            # each client's steps, on the device
    plan = plan.clamp(min=0)
    sizes = [p.numel() for p in model.parameters()]
    start = torch.stack([theta[i] for i in order]) if theta.dim() == 2 else theta.expand(C, -1)   # (no index copy)
    params = {name: t.reshape(C, *p.shape).clone()
              for (name, p), t in zip(model.named_parameters(), start.split(sizes, 1))}
    buffers = {name: b.expand(C, *b.shape).clone() for name, b in model.named_buffers()}
    opt = make_opt(list(params.values()))
    if keep_momentum:                    # a client without one yet starts from zeros: the same first step
        kept = torch.stack([states[i].get("momentum", torch.zeros_like(theta[0] if theta.dim() == 2 else theta))
                            for i in order])
        for p, m in zip(params.values(), kept.split(sizes, 1)):
            opt.state[p]["momentum_buffer"] = m.reshape(p.shape).clone()
    grad_and_loss = torch.func.vmap(torch.func.grad_and_value(functools.partial(objective, model)))
    every = getattr(args, "compile", False)  # compiled: on all C clients at every step (one shape, one graph)
    grad_and_loss = compiled(grad_and_loss, device) if every else grad_and_loss
    model.train()
    total = torch.zeros(C, device=device)
    for k in range(K):
        m = sum(s > k for s in steps_of)                                # the first m clients still train
        r = C if every else m                                           # (those done weigh 0)
        x = site.prep(X[plan[k, :r].reshape(-1)], train=True)
        with site.autocast():
            grads, losses = grad_and_loss({n: p[:r] for n, p in params.items()}, {n: b[:r] for n, b in buffers.items()},
                                          x.view(r, -1, *x.shape[1:]), Y[plan[k, :r]], weight[k, :r])
        total[:m] += (losses if r == m else losses[:m]).detach().float()
        if m == C:
            for name, p in params.items():
                p.grad = grads[name]
            opt.step()
            continue
        held = [(t, t[m:].clone()) for p in params.values()     # the clients that are done, to put back
                for t in (p, *(v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape))]
        for name, p in params.items():
            p.grad = grads[name] if r == C else torch.cat([grads[name], grads[name].new_zeros(C - m, *p.shape[1:])])
        opt.step()
        for t, rows in held:
            t[m:] = rows
    back = [order.index(i) for i in range(C)]                           # the site's order
    if keep_momentum:
        kept = torch.cat([opt.state[p]["momentum_buffer"].reshape(C, -1) for p in params.values()], 1)
        for i, j in enumerate(back):
            states[i]["momentum"] = kept[j].clone()
    thetas, losses = torch.cat([p.detach().reshape(C, -1) for p in params.values()], 1), total / count
    return torch.stack([thetas[j] for j in back]), torch.stack([losses[j] for j in back])


def compiled(step, device):
    """torch.compile(step) as one graph: on CUDA a CUDA graph, replayed (each call's outputs overwrite the last's,
    which at_once has used); in a deterministic run Inductor picks its kernels without timing them."""
    import torch._inductor.config as inductor
    if hasattr(inductor, "deterministic"):                                          # (not in older torch)
        inductor.deterministic = torch.are_deterministic_algorithms_enabled()
    fn = torch.compile(step, mode="reduce-overhead" if device.type == "cuda" else None, fullgraph=True)
    return lambda *a: (torch.compiler.cudagraph_mark_step_begin(), fn(*a))[1]


# ---------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def correct(model, x, y, ctx, batch_size=512):
    """Per-example correctness (bool tensor on the device) of model on uint8 images x."""
    model.eval()
    with ctx.autocast():
        return torch.cat([model(ctx.prep(x[i:i + batch_size])).argmax(1) == y[i:i + batch_size]
                          for i in range(0, len(y), batch_size)])


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

def make_parser(method, doc):
    """The common flags: the dataset's and its protocol's (data.add_args), then training's; a default of None is
    filled per dataset by `resolve` (dataset_defaults)."""
    p = Parser(prog=f"{method}.py", description=" ".join(doc.strip().split("\n\n")[0].split()))
    data.add_args(p)
    a = p.add_argument
    a("--rounds", type=int, default=None, help="communication rounds T")
    a("--local-epochs", type=int, default=None, help="local epochs per round")
    a("--batch-size", type=int, default=None, help="local batch size")
    a("--lr", type=finite, default=None, help="local learning rate")
    a("--momentum", type=finite, default=None, help="local SGD momentum")
    a("--weight-decay", type=finite, default=None, help="local SGD weight decay")
    a("--global-lr", type=finite, default=None, help="server step size eta_g")
    a("--select", default=None, choices=["val", "last"], help="report the best validation round, or the last")
    a("--model", default=None, choices=["convnet", "smallconv", "cnn", "mlp", "resnet18", "resnet50"],
      help="featurizer")
    a("--head", default=None, choices=["linear", "mlp"], help="classifier")
    a("--no-pretrained", action="store_true",
      help="ResNets from random weights: no ImageNet download (needed offline; the accuracies are then far lower)")
    a("--eval-every", type=int, default=None, help="evaluate (and checkpoint) every this many rounds")
    a("--seed", type=int, default=0, help="seeds the data split, the initialisation, the client sampling, the batches")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if one is visible, else cpu")
    a("--amp", action="store_true", help="bf16 autocast (CUDA only); without it CUDA computes in IEEE fp32 "
                                          "(TF32 off for matrix products and convolutions)")
    a("--nondeterministic", action="store_true",
      help="CUDA: let cuDNN and cuBLAS pick their fastest kernels; two runs then differ (README: GPU)")
    a("--parallel-clients", default="auto", choices=["auto", "on", "off"],
      help="train the sampled clients of a round at once (torch.func); auto: on for CUDA, off on the CPU")
    a("--compile", action="store_true", help="torch.compile the step of the clients trained at once, on all of them "
      "while any trains (CUDA: a CUDA graph); other floats than the eager step's (docs/gpu-and-speed.md)")
    a("--out", default=None, help="results JSON, default results/<method>-<dataset>-<test domain>-seed<seed>-"
      "<digest of the other arguments>.json; the checkpoint is <out>.ckpt (docs/results-format.md)")
    a("--resume", action="store_true", help="continue from <out>.ckpt (refused without one); with --overwrite: "
      "continue an interrupted replacement (<out>.next.ckpt)")
    a("--overwrite", action="store_true", help="replace a complete result, or an interrupted run, at --out, "
      "once the new run completes (refused without it)")
    a("--allow-code-change", action="store_true", help="--resume a checkpoint made with other code (refused "
      "without it); the result then records both versions of the code and says it is mixed")
    a("--checkpoint-minutes", type=finite, default=5.0,
      help="a checkpoint at least this often while training, besides each evaluation's")
    return p


def dataset_defaults(dataset, defaults=None):
    """The values of the flags a command line leaves unset: the method's own for this dataset (defaults[dataset]),
    else the method's for every dataset (defaults["*"]), else the dataset's (DATASET_DEFAULTS)."""
    defaults = defaults or {}
    return {**DATASET_DEFAULTS.get(dataset, {}), **defaults.get("*", {}), **defaults.get(dataset, {})}


def help_defaults(p, method, defaults=None):
    """Every flag's help ends with its default: the flag's own, or the one rmnist (the default --dataset) takes
    from the tables (docs/protocol.md gives every dataset's), unless it speaks of its default already. The
    method's own float flags become `finite` too."""
    table = dataset_defaults("rmnist", defaults)
    for act in p._actions:
        act.type = finite if act.type is float else act.type
        if act.nargs == 0 or not act.option_strings or not act.help or "default" in act.help.lower() or act.default == "":
            continue
        value, where = (act.default, "") if act.default is not None else (table[act.dest], " for rmnist") \
            if act.dest in table else ("per dataset, see docs/protocol.md", "")
        if isinstance(value, float) and not math.isfinite(value):     # a method's marker: its check() sets it
            value = f"set by {method} from its own flags"
        act.help += f" (default{where}: {value})".replace("%", "%%")
    p.epilog = "Defaults for --dataset rmnist; those of every dataset: docs/protocol.md and the method's page in docs/."


def resolve(args, method, defaults=None):
    """Fill the flags left unset (dataset_defaults), then refuse bad values before any work."""
    if args.dataset not in data.NAMES:
        raise UserError(f"unknown dataset {args.dataset!r}; choose from {', '.join(data.NAMES)}")
    for k, v in dataset_defaults(args.dataset, defaults).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    data.check_args(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for bad, message in [   # in order: the first that holds is the error
            (args.out == "", "--out is empty: give a folder or file name, or leave the flag out"),
            (not 0 <= args.seed < 2 ** 31, f"--seed must be in [0, 2**31), got {args.seed}"),   # x 104729 + a salt
            *[(not getattr(args, k) > 0, f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
              for k in ("rounds", "local_epochs", "batch_size", "eval_every", "lr", "global_lr")],
            (math.isfinite(args.momentum) and not 0 <= args.momentum < 1,     # inf: a method's marker, never a user's
             f"--momentum must be in [0, 1), got {args.momentum}"),
            (args.weight_decay < 0, f"--weight-decay must be >= 0, got {args.weight_decay}"),
            (args.device == "cuda" and not torch.cuda.is_available(), "--device cuda: no CUDA device is visible"),
            (args.amp and args.device != "cuda", "--amp needs a CUDA device")]:
        if bad:
            raise UserError(message)
    args.out = os.path.normpath(args.out or default_out(method, args))
    if not args.checkpoint_minutes > 0:
        raise UserError(f"--checkpoint-minutes must be positive, got {args.checkpoint_minutes}")
    return args


NOT_IN_THE_NAME = ("out", "resume", "overwrite", "allow_code_change", "checkpoint_minutes", "data_root",
                   "dataset", "test_domain", "seed")


def default_out(method, args):
    """results/<method>-<dataset>-<test domain>-seed<seed>-<digest>.json: every choice of the command line
    that names another experiment, the arguments other than those four as a digest of their values."""
    rest = {k: v for k, v in sorted(vars(args).items()) if k not in NOT_IN_THE_NAME}
    digest = hashlib.sha256(json.dumps(rest, default=str).encode()).hexdigest()[:8]
    test = re.sub(r"[^\w.+-]", "_", str(args.test_domain))
    return f"results/{method}-{args.dataset}-{test}-seed{args.seed}-{digest}.json"


# ------------------------------------------------------------------- results and checkpoints
# What a run owns and the rules that guard it: harness/outputs.py.

check_out, write_json, complete = outputs.check_out, outputs.write_json, outputs.complete


def save_checkpoint(path, blob):
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def code_files(round_fn):
    """The code a run's numbers come from: the method's file, common.py and data.py, by a digest each."""
    here = Path(__file__).resolve().parent
    files = {Path(inspect.getfile(round_fn)).resolve(), here / "common.py", here / "data.py"}
    return {os.path.relpath(f, here): hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in sorted(files)}


def load_checkpoint(path, args, method=None, code=None):
    """The checkpoint at `path`, refused in one line where it cannot continue this run: unreadable, made
    by another method, with other arguments, or (unless --allow-code-change) with other code. `code`:
    this run's code_files."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        saved = blob["args"]
    except Exception as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: truncated, or not a checkpoint): "
                        f"--overwrite starts the run again and replaces it once complete") from None
    if "gen" in blob:    # one minibatch stream shared by all clients: the code before commit 3c1e8ca
        raise UserError(f"--resume: {path} was made when the clients shared one random stream; this code gives each "
                        f"client its own, so that run cannot be continued: start it again with --overwrite")
    if method and blob.get("method", method) != method:
        raise UserError(f"--resume: {path} is {blob['method']}'s checkpoint, not {method}'s; give "
                        f"{blob['method']}.py the same arguments, or another --out")
    now = identity(args)
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k != "data_root")
    if diff:
        raise UserError(f"--resume: {path} was made with other arguments ("
                        + ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff) + ")")
    if code is not None:
        made = blob.get("code", [{}])[-1]
        changed = sorted(k for k in set(made.get("files", {})) | set(code)
                         if made.get("files", {}).get(k) != code.get(k))
        if changed and not args.allow_code_change:
            what = (f"{', '.join(changed)} changed since (commit {made.get('commit') or '?'}"
                    f"{', dirty' if made.get('dirty') else ''})") if made else \
                "it was made before checkpoints recorded their code"
            raise UserError(f"--resume: {path} was made with other code: {what}; --allow-code-change "
                            f"continues it anyway, the result then recorded as mixed code")
    return blob


def to_device(obj, device):
    """A method's state (tensors in dicts and lists) moved to `device`."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return type(obj)(to_device(v, device) for v in obj) if isinstance(obj, (list, tuple)) else obj


def identity(args):
    """The arguments that decide the numbers of a run (not --resume, --overwrite, --allow-code-change, --out,
    --checkpoint-minutes)."""
    return {k: v for k, v in vars(args).items()
            if k not in ("resume", "overwrite", "allow_code_change", "out", "checkpoint_minutes")}


def device_name(device):
    """The device by name: the GPU's, or the CPU model's (Linux: /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def provenance(method, argv, device, own=()):
    """What a reader needs to redo a result: the versions, the device by name, the commit of this checkout (and
    whether tracked files other than the run's own outputs `own` differ from it; none outside git, or where this
    project is not the top of its git work tree: a copy inside another repository, whose commit says nothing of
    it), the command line, and the streams the clients drew from (each its own: common.stream)."""
    here = Path(__file__).resolve().parent
    commit = dirty = None
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(here), *a], capture_output=True, text=True, timeout=10)
        top = git("rev-parse", "--show-toplevel")
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == here:
            commit = git("rev-parse", "HEAD").stdout.strip() or None
            changed = {here / c[3:] for c in git("status", "--porcelain", "-z", "-uno").stdout.split("\0") if c}
            dirty = commit and bool(changed - {Path(o).resolve() for o in own})   # a run's own outputs: not the code
    except (OSError, subprocess.SubprocessError):
        pass
    import numpy
    return {"command": shlex.join(["python", f"{method}.py", *argv]), "commit": commit, "dirty": dirty,
            "date": time.strftime("%Y-%m-%d"), "device": device_name(device), "torch": torch.__version__,
            "numpy": numpy.__version__, "python": platform.python_version(), "streams": "per client"}


def size(path):
    n = os.path.getsize(path)
    return next(f"{n / 1024 ** k:.0f} {unit}" for k, unit in ((3, "GB"), (2, "MB"), (1, "kB"), (0, "bytes"))
                if n >= 1024 ** k or k == 0)


# --------------------------------------------------------------------------------- the skeleton

def set_deterministic(on=True):
    """Reproducible kernels (the default) or CUDA's fastest (--nondeterministic); CPU numbers are the same
    either way. Deterministic mode's NaN fill of new tensors is off: nothing here reads unwritten memory."""
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = False      # fp32 is IEEE fp32 on CUDA too (TF32 rounds to 10 bits);
    torch.backends.cudnn.allow_tf32 = False            # --amp is the fast, lower-precision path


def run(method, args, round_fn, init_state=None, evaluate_fn=evaluate_global, argv=None, engine=None, plan=None):
    """Load, then for every held-out domain: federate and train_domain; results JSON and checkpoint.
    argv: the command line, recorded in the provenance; engine: on_clients' (default: one_by_one, or
    all_at_once with --parallel-clients on; flower/ passes its own); plan: what to do with --out's files
    (harness/outputs.py, claim; None: continue <out>.ckpt with --resume, and write it)."""
    if plan is None:
        files = outputs.Files(args.out)
        plan = outputs.Plan(files, read=files.ckpt if args.resume and files.ckpt.exists() else None,
                            write=files.ckpt)
    set_deterministic(not args.nondeterministic)      # before the model or anything else meets CUDA
    ds = data.load(args.dataset, args.data_root, args.seed, clients=args.clients or 100, alpha=args.alpha,
                   p_test=args.p_test, stain=args.stain, rotation=not args.no_rotation)
    print(f"data: {ds.source}\ndata: {data.counts(ds)}", flush=True)
    todo = data.test_domains(args, ds)
    device, ckpt_path, code = torch.device(args.device), str(plan.write), code_files(round_fn)
    blob = load_checkpoint(plan.read, args, method, code) if plan.read is not None else None
    if blob is not None and not plan.replacing and outputs.complete(args.out):
        print(f"{args.out} is complete, and its checkpoint was made with these arguments: nothing to continue")
        return outputs.read_result(args.out)
    results = {"method": method, "dataset": args.dataset, "seed": args.seed, "args": vars(args),
               "source": ds.source, "protocol": ds.protocol, "domains": {}, "mean_test_acc": None, "complete": False,
               "provenance": provenance(method, sys.argv[1:] if argv is None else argv, device,
                                        (args.out, plan.files.ckpt, plan.files.next))}
    made = {k: results["provenance"][k] for k in ("commit", "dirty")}
    versions = blob.get("code", []) if blob is not None else []
    if not versions or versions[-1].get("files") != code:
        versions = versions + [dict(made, files=code)]
    results["provenance"]["code"] = code
    if len(versions) > 1:            # --allow-code-change: both versions recorded, the result marked mixed
        results["provenance"]["mixed_code"] = versions
        print(f"note: continuing under other code than {plan.read} was made with; the result records both "
              f"(provenance: mixed_code)")
    if blob is not None:
        results["domains"] = blob["finished"]
        print(f"resuming from {plan.read}: {len(blob['finished'])} domain(s) done, "
              f"'{blob['domain']}' at round {blob['round']}")
    print(f"{method} on {args.dataset}: {args.clients} clients, {args.sample} per round, {args.rounds} rounds, "
          f"{args.local_epochs} local epoch(s), lr {args.lr}, batch {args.batch_size}, device {device}")
    own = {"method": method, "code": versions}
    for k, test in enumerate(todo):
        if ("clients" if test is None else ds.domains[test].name) in results["domains"]:
            continue                                            # finished before a --resume
        fed = data.federate_fixed(ds, args.seed, device) if test is None else \
            data.federate(ds, test, args.clients, args.seed, device, client_size=getattr(args, "client_size", None))
        resume = blob if blob is not None and blob["domain"] == fed.name else None
        try:
            with Progress():
                results["domains"][fed.name] = train_domain(method, args, ds, fed, round_fn, init_state, evaluate_fn,
                                                            resume, results, ckpt_path, len(todo) - k - 1, engine,
                                                            own)
        except NonFinite as e:   # name only the files this run wrote (or resumed from), never an older run's
            done = bool(results["domains"])                     # finished here, or before the --resume
            kept = [f"the last good checkpoint ({ckpt_path})"] * (blob is not None or done or e.saved) + \
                   [f"the results of the finished test domains ({args.out})"] * (done and not plan.replacing)
            said = " and ".join(kept) + (" are kept" if len(kept) > 1 else " is kept")
            raise NonFinite(f"{e}; stopped; " + (said if kept else "nothing of this run was saved")) from None
        if not plan.replacing:       # an --overwrite writes --out once complete, not before
            write_json(args.out, with_mean(results))
    results["complete"] = True                                  # every held-out domain is done
    outputs.finish(plan, with_mean(results))
    print_table(results)
    print(f"results: {args.out}")
    if plan.files.ckpt.exists():    # the only copy of the trained model: kept, and said what deleting it loses
        print(f"checkpoint: {plan.files.ckpt} ({size(plan.files.ckpt)}): the final model and the method's state, "
              f"the only copy of the trained model; deleting it loses the model, not the results")
    return results


def with_mean(results):
    accs = [r["test_acc"] for r in results["domains"].values()]
    results["mean_test_acc"] = sum(accs) / len(accs)
    return results


def train_domain(method, args, ds, fed, round_fn, init_state, evaluate_fn, resume, results, ckpt_path, remaining,
                 engine=None, own=None):
    """T rounds on one federation: a round, every args.eval_every rounds an evaluation, the best kept, a checkpoint
    at each evaluation and every --checkpoint-minutes between them; a stop signal ends it after its round's
    checkpoint (Stopped)."""
    model, state, ctx, start, history, best, spent, losses = start_domain(args, ds, fed, init_state, resume, engine)
    pace, saved, saved_at = Pace(start, spent, args.rounds, remaining), resume is not None, time.monotonic()

    def checkpoint(t):
        nonlocal saved, saved_at
        save_checkpoint(ckpt_path, {**(own or {}), "args": identity(args), "finished": results["domains"],
                                    "domain": fed.name,
                                    "round": t, "model": model.state_dict(), "state": state, "losses": losses,
                                    "sampler": ctx.sampler.get_state(), "torch_rng": torch.get_rng_state(),
                                    "history": history, "best": best, "seconds": pace.seconds(ctx.device)})
        saved, saved_at = True, time.monotonic()
    for t in range(start, args.rounds + 1):
        losses.append(checked_round(round_fn, t, model, fed, args, state, ctx, saved))
        if t % args.eval_every and t != args.rounds:
            if STOP.signal or time.monotonic() - saved_at > 60 * args.checkpoint_minutes:
                checkpoint(t)                                   # (the losses since the last evaluation too)
            if STOP.signal:
                raise Stopped(STOP.signal, ckpt_path, fed.name, t)
            if isinstance(sys.stdout, Progress):                # a terminal: a line that the next one overwrites
                sys.stdout.show(f"round {t:4d}/{args.rounds} | round loss {losses[-1]:.4f} | {pace(t)}")
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
        checkpoint(t)
        if STOP.signal and t < args.rounds:
            raise Stopped(STOP.signal, ckpt_path, fed.name, t)
    return domain_result(ds, fed, history, best)


class Stopped(Exception):
    """A SIGINT or SIGTERM honoured after a round, its checkpoint written: exit 128 + the signal."""

    def __init__(self, signum, path, domain, t):
        super().__init__(signum)
        self.signum, self.path, self.domain, self.t = signum, path, domain, t


class STOP:
    """The stop signal received while training (None: none): the round under way finishes and is saved."""
    signal = None


def stop_after_the_round(signum, frame):
    if STOP.signal is not None:         # a second one: at once (the last checkpoint stays)
        raise KeyboardInterrupt
    STOP.signal = signum
    print(f"\n{signal.Signals(signum).name}: stopping after this round and its checkpoint (again: at once)",
          file=sys.stderr, flush=True)


def start_domain(args, ds, fed, init_state, resume=None, engine=None):
    """The initial model (seeded), the method's state and the domain's random streams (fixed by the seed), then
    a checkpoint's (resume): (model, state, ctx, next round, history, best, seconds spent, round losses since the
    last evaluation)."""
    device = torch.device(args.device)
    model = global_model(args, ds, device)
    ctx = make_context(args, fed, model, engine)
    state = init_state(model, fed, args, ctx) if init_state else {}
    print(f"-- test domain {fed.name}: {len(fed.clients)} clients, {sum(c.n for c in fed.clients):,} training / "
          f"{len(fed.val_y):,} validation / {len(fed.test_y):,} test examples")
    start = (model, state, ctx, 1, [], None, 0.0, [])
    if resume is not None:
        model.load_state_dict(resume["model"])
        ctx.sampler.set_state(resume["sampler"])
        torch.set_rng_state(resume["torch_rng"])
        state = to_device(resume["state"], ctx.device)   # checkpoints load on the CPU
        start = (model, state, ctx, resume["round"] + 1, resume["history"], resume["best"], resume["seconds"],
                 resume.get("losses", []))
    ctx.clients = state.setdefault("clients", {})        # the clients' own states (on Flower: on the nodes)
    return start


def make_context(args, fed, model, engine=None):
    """A held-out domain's Context: the server's sampler (fixed by the seed and the domain), a scratch copy of the
    model for the clients' work, and on_clients' engine (default: at once with --parallel-clients on)."""
    device, salt = torch.device(args.device), sum(map(ord, fed.name))
    return Context(device, torch.Generator().manual_seed(args.seed * 104729 + salt), data.make_prep(args.dataset, device),
                   args.amp, args, fed, copy.deepcopy(model), {}, engine or (all_at_once if parallel(args) else None))


def global_model(args, ds, device):
    """The initial global model (seeded by --seed) on the device, channels-last where faster (docs/gpu-and-speed.md)."""
    torch.manual_seed(args.seed)
    model = build_model(args, ds).to(device)
    nhwc = args.model.startswith("resnet") and device.type == "cuda" or args.model == "convnet" and device.type == "cpu"
    return model.to(memory_format=torch.channels_last) if nhwc else model


def checked_round(round_fn, t, model, fed, args, state, ctx, saved):
    """Round t, then one host read: its clients' mean loss, or NonFinite naming the first non-finite
    client loss, else the model's or the state's tensors that are not finite."""
    try:
        out = round_fn(t, model, fed, args, state, ctx)
    except NonFinite as e:          # a method's own check (FedLOE's φ)
        e.saved = e.saved or saved
        raise
    ids, vals, named = list(out), torch.stack([out[c] for c in out]), tensors(model, state)
    ok = torch.stack([v.isfinite().all().to(vals.device) for _, v in named]).all()      # one flag, no host read
    vals = torch.cat([vals, ok.to(vals.dtype)[None]]).cpu()                          # one sync per round
    bad = [c for c, v in zip(ids, vals.tolist()) if not math.isfinite(v)]
    if bad:
        c = fed.clients[bad[0]]
        raise NonFinite(f"non-finite loss in round {t} on client {c.id} (training domain {c.domain}, "
                        f"testing on {fed.name})", saved)
    if not vals[-1]:                # the server's step or a server quantity: never written as a result
        bad = [k for k, v in named if not bool(v.isfinite().all())]
        raise NonFinite(f"non-finite {', '.join(bad[:3] + [f'{len(bad) - 3} more'] * (len(bad) > 3))} after the "
                        f"server step of round {t} (testing on {fed.name})", saved)
    return vals[:-1].mean().item()


def tensors(model, state):
    """(name, tensor) for every floating tensor of the global model and of the method's state (server quantities,
    client states: tensors in dicts and lists), model first. A state key that starts with "_" holds a
    diagnostic, not a server quantity (nan: not measured): left out."""
    def walk(obj, name):
        if torch.is_tensor(obj):
            return [(name, obj)] if obj.is_floating_point() else []
        items = [(k, v) for k, v in obj.items() if not str(k).startswith("_")] if isinstance(obj, dict) else \
            enumerate(obj) if isinstance(obj, (list, tuple)) else []
        return [pair for k, v in items for pair in walk(v, f"{name}[{k!r}]")]
    named = [(f"model {k}", v) for k, v in model.state_dict().items() if v.is_floating_point()] + walk(state, "state")
    return [(k, v) for k, v in named if v.device.type != "meta"]


class NonFinite(Exception):
    """A non-finite loss or server quantity: exit 1. `saved`: a checkpoint of this run is on disk."""

    def __init__(self, message, saved=False):
        super().__init__(message)
        self.saved = saved


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
        s = int(rate * (self.rounds - t + self.remaining * self.rounds))        # the ETA in seconds
        eta = f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
        return f"{rate:.2f} s/round | ETA {eta}"


def domain_result(ds, fed, history, best):
    out = {"test_acc": best["test_acc"], "val_acc": best["val_acc"], "best_round": best["round"],
           "train_examples": sum(c.n for c in fed.clients), "last_test_acc": history[-1]["test_acc"],
           "history": history, **{k: v for k, v in best.items()        # and a method's extra numbers
                                  if k not in ("round", "val_acc", "test_acc", "loss", "seconds", "per_test")}}
    if ds.protocol == "clients":
        out["per_client_test_acc"] = dict(zip(fed.test_names, best["per_test"]))
    return out


def print_table(results):
    rows, width = results["domains"], max([11] + [len(k) for k in results["domains"]])
    sel = "(last)" if results["args"].get("select") == "last" else "(best val)"
    print(f"\n{'test domain':<{width}}  test acc {sel:<10}  last round  best round")
    for name, r in rows.items():
        print(f"{name:<{width}}  {r['test_acc']:19.4f}  {r['last_test_acc']:10.4f}  {r['best_round']:10d}")
    if len(rows) > 1:
        print(f"{'mean':<{width}}  {results['mean_test_acc']:19.4f}  "
              f"{sum(r['last_test_acc'] for r in rows.values()) / len(rows):10.4f}")


def main(method, doc, round_fn, argv=None, add_args=None, defaults=None, init_state=None,
         evaluate_fn=evaluate_global, check=None, parallel_clients=False):
    """The entry point of every method script: bad input -> one line on stderr and exit 2, a non-finite loss or
    server quantity -> exit 1. parallel_clients: a bool, or check_parallel's `supported` function."""
    plan, handlers = None, {}

    def how():                   # how to continue, and what stays meanwhile
        if plan is None or not plan.write.exists():
            return "nothing was saved" + ("; the older result and checkpoint are as they were"
                                          if plan is not None and plan.replacing else "")
        if plan.replacing:
            return (f"its checkpoint: {plan.write}; the older result and checkpoint at {plan.files.out} stay "
                    f"as they were; continue the replacement with the same arguments and --overwrite --resume")
        return f"its checkpoint: {plan.write}; continue with the same arguments and --resume"
    try:
        p = make_parser(method, doc)
        if add_args:
            add_args(p)
        help_defaults(p, method, defaults)
        argv = sys.argv[1:] if argv is None else argv
        args = p.parse_args(argv)
        resolve(args, method, defaults)
        if check:
            check(args)
        check_parallel(args, method, parallel_clients)
        with outputs.claim(args.out, args.resume, args.overwrite) as plan:
            if threading.current_thread() is threading.main_thread():   # SIGINT, SIGTERM: after the round
                STOP.signal = None
                handlers = {s: signal.signal(s, stop_after_the_round) for s in (signal.SIGINT, signal.SIGTERM)}
            return run(method, args, round_fn, init_state, evaluate_fn, argv, plan=plan)
    except (UserError, NonFinite) as e:
        print(f"{method}.py: error: {e}", file=sys.stderr)
        sys.exit(1 if isinstance(e, NonFinite) else 2)
    except Stopped as e:
        print(f"{method}.py: stopped by {signal.Signals(e.signum).name} after round {e.t} (testing on {e.domain}); "
              f"{how()}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print(f"\n{method}.py: interrupted; {how()}", file=sys.stderr)
        sys.exit(130)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


harness.started()   # the imports are done: Ctrl-C is the caller's again (harness/__init__.py)
