"""The teaching core, what every method's round is made of (it knows no specific method and no
command line); then what a method file copied with data.py needs where harness/ is absent.

Read in this order (a method file calls into it where its round needs it):
  models               Net = classifier ∘ featurizer; build_model; get_flat / set_flat (θ as one
                       vector: what the server sends and averages)
  a round's clients    sample_clients (the server's draw); on_clients runs a client function for
                       each sampled client, one_by_one or all_at_once, each with its own Site: its
                       data, its random stream (stream), its state, a scratch model
  local training       local_train: minibatch steps of an objective from θ (batches, sgd,
                       cross_entropy); at_once: the same for stacked clients (torch.func.vmap);
                       chunks, features: what a client computes over its whole split
  evaluation           correct; score: a site's own counts; evaluate_global, accuracies: the
                       server's sums
  the loop over rounds train: global_model, make_context, then round after round, an evaluation
                       every args.eval_every rounds; rounds: a method's, on any federation
Then what a method file copied with common.py and data.py needs where the harness is absent:
  a method's record    Method: what a method file declares (METHOD)
  a run's settings     PROTOCOL, RUN: every default but a method's own; settings(method, dataset,
                       **given): a run's settings in one call; check; after_load: the counts of
                       clients that the data settles
  a copy's program     program: the method file as a program (flags from the tables, the
                       harness's rounds and evaluations, printed)

A method plugs in with its round, round_fn(t, model, fed, args, state, ctx) -> its losses, and
optionally init_state and evaluate_fn, declared in a Method with its client functions and what
each replies (replies): docs/protocol.md.
"""
import argparse
import contextlib
import copy
import functools
import hashlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.deterministic

import data
from data import UserError

# cuBLAS reproduces its matrix products only with a fixed workspace, and it reads this setting
# once, when CUDA starts: so it is set here, at import, before anything touches the GPU (a value
# the user exported wins). It costs nothing on the CPU and little on the GPU (README: GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# ------------------------------------------------------------------------------------ models
class Net(nn.Module):
    """f = classifier ∘ featurizer, i.e. θ = (φ, ω) in FedIIR's notation."""

    def __init__(self, featurizer, classifier):
        super().__init__()
        self.featurizer, self.classifier = featurizer, classifier

    def forward(self, x):
        return self.classifier(self.featurizer(x))


class GlobalMean(nn.Module):
    """Global average pooling written as a mean (AdaptiveAvgPool2d(1)'s numbers; a deterministic
    CUDA backward)."""

    def forward(self, x):
        return x.mean((2, 3), keepdim=True)


def conv_net(in_ch, width=64):
    """DomainBed's MNIST ConvNet: 4 conv3x3 (w, 2w, 2w, 2w; the 2nd strided), each ReLU +
    GroupNorm(8), global average pool -> 2w features (128 for w = 64)."""
    layers = []
    c = in_ch
    for out, stride in ((width, 1), (2 * width, 2), (2 * width, 1), (2 * width, 1)):
        layers += [nn.Conv2d(c, out, 3, stride, 1), nn.ReLU(), nn.GroupNorm(8, out)]
        c = out
    return nn.Sequential(*layers, GlobalMean(), nn.Flatten()), c


def small_cnn(in_ch, size):
    """FedOMG's FL CNN: conv5x5(32) ReLU maxpool, conv5x5(64) ReLU maxpool, FC 512 ReLU (+ head)."""
    s = ((size - 4) // 2 - 4) // 2
    return nn.Sequential(nn.Conv2d(in_ch, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * s * s, 512), nn.ReLU()), 512


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
        # a deterministic backward on CUDA (no parameters: the weights load as before)
        self.net.avgpool = GlobalMean()

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, x):
        return self.net(x)


def build_model(args, ds):
    """The model for `ds`: featurizer args.model, classifier args.head (linear, or FedIIR's
    d -> d/2 -> C), initialised as each source's code does (docs/protocol.md)."""
    x0, C = ds.domains[0].x, ds.num_classes
    phi, d = {"convnet": lambda: conv_net(x0.shape[1]),
              "smallconv": lambda: conv_net(x0.shape[1], width=8),
              "cnn": lambda: small_cnn(x0.shape[1], x0.shape[-1]),
              "mlp": lambda: mlp(math.prod(x0.shape[1:])),
              "resnet18": lambda: (ResNet(18, not args.no_pretrained), 512),
              "resnet50": lambda: (ResNet(50, not args.no_pretrained), 2048)}[args.model]()
    omega = nn.Linear(d, C) if args.head == "linear" else \
        nn.Sequential(nn.Linear(d, d // 2), nn.ReLU(), nn.Linear(d // 2, C))
    net = Net(phi, omega)
    for m in (net if args.model == "mlp" else omega).modules():   # others: PyTorch's defaults
        if isinstance(m, nn.Linear) and args.model in ("convnet", "resnet18", "resnet50"):
            nn.init.kaiming_normal_(m.weight)   # the FedIIR code's: the head's weights (not biases)
        elif isinstance(m, nn.Linear) and args.model == "mlp":   # IRM's ColoredMNIST code, for
            nn.init.xavier_uniform_(m.weight)                    # which its warm-up and penalty
            nn.init.zeros_(m.bias)                               # weight were tuned
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
@dataclass
class Context:
    device: torch.device
    sampler: torch.Generator   # on the CPU: the server's own draws (which clients take part)
    prep: object               # uint8 batch -> model input, see data.make_prep
    amp: bool = False
    args: object = None
    fed: object = None         # the federation (data.Federation) of this held-out domain
    model: object = None       # a scratch model of the global one's architecture, for clients
    clients: dict = None       # {client id: its own state}, kept across rounds (in the state)
    engine: object = None      # how on_clients runs the clients: one_by_one, all_at_once, Flower

    def autocast(self):
        return torch.autocast("cuda", torch.bfloat16) if self.amp else contextlib.nullcontext()


@dataclass
class Site:
    """Where a client's work runs: its data, its own random stream and state, and a model to
    compute with. Stacked (all at once): `client`, `gen` and `state` are lists, one per client."""
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
    """C of the P clients, uniformly without replacement, on the server's generator; in the order
    of their ids (in which every engine returns the replies: the server sums in one order)."""
    return sorted(torch.randperm(P, generator=ctx.sampler)[:C].tolist())


def stream(seed, domain, t, client, phase, device):
    """Client `client`'s random stream in round t's exchange `phase` of the run (seed, held-out
    domain): a generator seeded with 64 bits of BLAKE2b of the five (docs/protocol.md)."""
    key = f"{seed}/{domain}/{t}/{client}/{phase}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return torch.Generator(device).manual_seed(seed)


def stackable(fn):
    """Marks a client function that also runs for a stacked Site (all_at_once: every client)."""
    fn.stackable = True
    return fn


def replies(schema, every=None, **reduced):
    """Declares a client function's reply for a server that holds no client's data (Flower checks
    each reply against it): schema(site, sent) -> {key: a tensor of its shape and dtype, a Count,
    or a number of its type}, from the model, what was sent and the client's sizes (site.client);
    reduced: {key: "sum" or "mean"}, all the server uses of it (on_clients returns that alone);
    every="sum": each key of the reply summed."""
    def declared(fn):
        fn.replies, fn.reduced = schema, every or reduced or None
        return fn
    return declared


SCALAR = torch.empty((), device="meta")                       # a float32 number, as a tensor


@dataclass(frozen=True)
class Count:
    """In a declared reply: how many of `most` examples (int64, 0..most; a tensor of `shape`)."""
    most: int
    shape: tuple = ()


def keep(site, key, value):
    """value into the client's own state, site.state[key], never sent (stacked: row j, client j)."""
    for state, v in zip(site.state, value) if site.stacked else [(site.state, value)]:
        state[key] = v.clone() if site.stacked else v


def on_clients(fn, S, sent, t, ctx, phase=None):
    """Each client c of S runs fn(site, sent_c) and replies with a dict: the replies, in the order
    of S, or their sums and means (fn's `replies`, reduced). sent: one dict for all, or a list of
    one per client; phase (default fn's name) names the exchange in the streams."""
    sents = sent if isinstance(sent, list) else [sent] * len(S)
    out = (ctx.engine or one_by_one)(fn, list(S), sents, t, phase or fn.__name__, ctx)
    how = getattr(fn, "reduced", None)
    if not how or not isinstance(out, list):          # (an engine that aggregates securely: sums)
        return out
    how = dict.fromkeys(out[0] if out else (), how) if isinstance(how, str) else how
    # in the clients' order, as Python's sum; a mean as torch's of them stacked
    return {k: sum(r[k] for r in out) if h == "sum" else torch.stack([r[k] for r in out]).mean(0)
            for k, h in how.items()}


def site(ctx, c, t, phase):
    """The Site of client c (a list: those clients stacked) in round t's exchange `phase`."""
    if isinstance(c, list):
        one = [site(ctx, i, t, phase) for i in c]
        return Site([s.client for s in one], [s.gen for s in one], [s.state for s in one],
                    ctx.model, ctx.args, ctx.prep, ctx.amp)
    return Site(ctx.fed.sites[c], stream(ctx.args.seed, ctx.fed.name, t, c, phase, ctx.device),
                ctx.clients.setdefault(c, {}), ctx.model, ctx.args, ctx.prep, ctx.amp)


def sizes(site, device):
    """n_c, a client's training examples (a float; stacked: a column [C, 1]): its weight."""
    if site.stacked:
        return torch.tensor([float(c.n) for c in site.client], device=device)[:, None]
    return float(site.client.n)


def one_by_one(fn, S, sents, t, phase, ctx):
    """The clients one after another, in process."""
    return [fn(site(ctx, c, t, phase), sent) for c, sent in zip(S, sents)]


def all_at_once(fn, S, sents, t, phase, ctx):
    """The clients at once, in process, where fn is stackable (else one_by_one): what was sent to
    each stacked (tensors on a new first dimension), one call, and the replies' tensors split back
    by client."""
    if not getattr(fn, "stackable", False) or len(S) == 1:
        return one_by_one(fn, S, sents, t, phase, ctx)
    differ = lambda k, v: torch.is_tensor(v) and any(s[k] is not v for s in sents)
    sent = {k: torch.stack([s[k] for s in sents]) if differ(k, v) else v
            for k, v in sents[0].items()}
    out = fn(site(ctx, S, t, phase), sent)
    return [{k: v[j] if torch.is_tensor(v) else v for k, v in out.items()} for j in range(len(S))]


# ------------------------------------------------------------------------------ local training
def cross_entropy(model, params, buffers, x, y, w):
    """A client's minibatch loss in the form every local objective takes: Σ_j w_j CE(f(x_j), y_j)
    at the parameters `params` (dicts by name, through functional_call), w_j = 1 / (real
    examples), 0 on padding."""
    logits = torch.func.functional_call(model, (params, buffers), (x,))
    return (F.cross_entropy(logits, y, reduction="none") * w).sum()


def sgd(params, args, lr=None):
    """The local optimiser: SGD with --lr (or lr), --momentum, --weight-decay, one update for all
    tensors (foreach)."""
    return torch.optim.SGD(params, lr=args.lr if lr is None else lr, momentum=args.momentum,
                           weight_decay=args.weight_decay, foreach=True)


def batches(n, batch_size, gen, device, epochs=None, steps=None):
    """Index tensors of a client's minibatches from its stream `gen`, no host synchronisation:
    `epochs` shuffled passes over its n examples (each last, partial batch kept: the FedIIR code),
    or `steps` batches drawn afresh (the whole split, in order, when batch_size covers it)."""
    if steps is not None:
        for _ in range(steps):
            yield torch.arange(n, device=device) if batch_size >= n else \
                torch.randperm(n, generator=gen, device=device)[:batch_size]
        return
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen, device=device)
        for i in range(0, n, batch_size):
            yield perm[i:i + batch_size]


def chunks(site, x, y=None, train=False, size=512):
    """A client's images x (and labels y) in order, in chunks of `size`, prepared for the model
    (train: augmented from the client's stream): for what a client computes over all its data."""
    gen = site.gen if train else None
    for i in range(0, len(x), size):
        yield site.prep(x[i:i + size], train=train, gen=gen), None if y is None else y[i:i + size]


def features(site, theta, x, train=False, chunk=512):
    """The featurizer's Φ(x) of a client's images x at θ (flat), without a graph, in chunks of
    `chunk` rows: eval mode and the images as they are, or (train) train mode and the images
    augmented from the client's stream, as its local steps see them."""
    model = site.model
    set_flat(model, theta)
    model.train(train)
    with torch.no_grad(), site.autocast():
        z = torch.cat([model.featurizer(xb) for xb, _ in chunks(site, x, None, train, chunk)])
    return z.to(theta.dtype)                                    # (bf16 under --amp)


def local_train(site, theta, objective=cross_entropy, make_opt=None, epochs=None, steps=None,
                keep_momentum=False):
    """A client's local training from θ (flat): minibatch steps (`batches`: --local-epochs passes,
    or `steps` fresh draws) of make_opt (default `sgd`) on objective(model, params, buffers, x, y,
    w); keep_momentum: SGD's momentum kept in site.state across rounds. Returns (θ_c, mean loss);
    a stacked Site trains every client at once (at_once): θ_c [C, |θ|] and the losses [C]."""
    args, make_opt = site.args, make_opt or (lambda params: sgd(params, site.args))
    epochs = None if steps is not None else epochs or args.local_epochs
    if site.stacked:
        return at_once(site, theta, objective, make_opt, epochs, steps, keep_momentum)
    model, client, device = site.model, site.client, theta.device
    set_flat(model, theta)
    params = list(model.parameters())
    opt = make_opt(params)
    if keep_momentum and "momentum" in site.state:   # the client's SGD momentum of its last round
        for p, m in zip(params, site.state["momentum"].split([p.numel() for p in params])):
            opt.state[p]["momentum_buffer"] = m.view_as(p).clone()
    model.train()
    named, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    weights = {}                                                # 1 / b for each minibatch size b
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
        buffer = lambda p: opt.state[p].get("momentum_buffer", torch.zeros_like(p))
        site.state["momentum"] = torch.cat([buffer(p).reshape(-1) for p in params])
    return get_flat(model), total / max(count, 1)


def at_once(site, theta, objective, make_opt, epochs=None, steps=None, keep_momentum=False):
    """local_train for the stacked clients of `site`: parameters stacked on a new first dimension,
    one vmap(grad(objective)) and optimiser step per minibatch for all, each client's minibatches
    from its own stream. θ: [|θ|] or [C, |θ|]. Longest first: those still training are a prefix;
    the others are put back after every step and never move again (docs/protocol.md)."""
    clients, gens, states, args, model = site.client, site.gen, site.state, site.args, site.model
    if site.args.dataset in data.PHOTOS:   # (refused before: their augmentation is per client)
        raise UserError("the clients of a photo dataset train one after another")
    C = len(clients)
    device = theta.device
    plans = [list(batches(c.n, args.batch_size, g, device, epochs, steps))
             for c, g in zip(clients, gens)]
    order = sorted(range(C), key=lambda i: -len(plans[i]))              # longest first
    K, B = len(plans[order[0]]), max(len(i) for p in plans for i in p)
    offset = [sum(c.n for c in clients[:i]) for i in range(C)]          # each client's rows in X
    # [step, client, example] into X; -1: padding
    plan = torch.full((K, C, B), -1, dtype=torch.long, device=device)
    for j, i in enumerate(order):
        for k, idx in enumerate(plans[i]):
            plan[k, j, :len(idx)] = idx + offset[i]
    X, Y = torch.cat([c.x for c in clients]), torch.cat([c.y for c in clients])
    steps_of = [len(plans[i]) for i in order]
    real = plan >= 0
    weight = real / real.sum(-1, keepdim=True).clamp(min=1)         # 1 / (real examples) on each
    count = real.any(-1).sum(0).clamp(min=1)                        # each client's steps
    plan = plan.clamp(min=0)
    sizes = [p.numel() for p in model.parameters()]
    start = torch.stack([theta[i] for i in order]) if theta.dim() == 2 else \
        theta.expand(C, -1)                                         # (no index copy)
    params = {name: t.reshape(C, *p.shape).clone()
              for (name, p), t in zip(model.named_parameters(), start.split(sizes, 1))}
    buffers = {name: b.expand(C, *b.shape).clone() for name, b in model.named_buffers()}
    opt = make_opt(list(params.values()))
    if keep_momentum:            # a client without one yet starts from zeros: the same first step
        zeros = torch.zeros_like(theta[0] if theta.dim() == 2 else theta)
        kept = torch.stack([states[i].get("momentum", zeros) for i in order])
        for p, m in zip(params.values(), kept.split(sizes, 1)):
            opt.state[p]["momentum_buffer"] = m.reshape(p.shape).clone()
    grad_and_loss = torch.func.vmap(torch.func.grad_and_value(functools.partial(objective, model)))
    every = getattr(args, "compile", False)  # compiled: all C clients every step (one graph)
    grad_and_loss = compiled(grad_and_loss, device) if every else grad_and_loss
    model.train()
    total = torch.zeros(C, device=device)
    for k in range(K):
        m = sum(s > k for s in steps_of)                            # the first m still train
        r = C if every else m                                           # (those done weigh 0)
        x = site.prep(X[plan[k, :r].reshape(-1)], train=True)
        with site.autocast():
            grads, losses = grad_and_loss({n: p[:r] for n, p in params.items()},
                                          {n: b[:r] for n, b in buffers.items()},
                                          x.view(r, -1, *x.shape[1:]), Y[plan[k, :r]],
                                          weight[k, :r])
        total[:m] += (losses if r == m else losses[:m]).detach().float()
        if m == C:
            for name, p in params.items():
                p.grad = grads[name]
            opt.step()
            continue
        own = lambda p: (v for v in opt.state[p].values()          # its optimiser's state
                         if torch.is_tensor(v) and v.shape == p.shape)
        held = [(t, t[m:].clone()) for p in params.values()   # the clients done, to put back
                for t in (p, *own(p))]
        for name, p in params.items():
            p.grad = grads[name] if r == C else \
                torch.cat([grads[name], grads[name].new_zeros(C - m, *p.shape[1:])])
        opt.step()
        for t, rows in held:
            t[m:] = rows
    back = [order.index(i) for i in range(C)]                           # the site's order
    if keep_momentum:
        kept = torch.cat([opt.state[p]["momentum_buffer"].reshape(C, -1)
                          for p in params.values()], 1)
        for i, j in enumerate(back):
            states[i]["momentum"] = kept[j].clone()
    thetas = torch.cat([p.detach().reshape(C, -1) for p in params.values()], 1)
    losses = total / count
    return torch.stack([thetas[j] for j in back]), torch.stack([losses[j] for j in back])


def compiled(step, device):
    """torch.compile(step) as one graph: on CUDA a CUDA graph, replayed (each call's outputs
    overwrite the last's); in a deterministic run Inductor picks kernels without timing them."""
    import torch._inductor.config as inductor
    if hasattr(inductor, "deterministic"):                          # (not in older torch)
        inductor.deterministic = torch.are_deterministic_algorithms_enabled()
    fn = torch.compile(step, mode="reduce-overhead" if device.type == "cuda" else None,
                       fullgraph=True)
    return lambda *a: (torch.compiler.cudagraph_mark_step_begin(), fn(*a))[1]


# ---------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def correct(model, x, y, ctx, batch_size=512):
    """Per-example correctness (bool tensor on the device) of model on uint8 images x."""
    model.eval()
    with ctx.autocast():
        hits = [model(ctx.prep(x[i:i + batch_size])).argmax(1) == y[i:i + batch_size]
                for i in range(0, len(y), batch_size)]
    return torch.cat(hits) if hits else y == y


SPLITS = ("val", "test")            # what a site scores unless the server names others


def split(client, k):
    """A client's split k ("val", "test", FedLOE's "id"): (x, y), or (None, None) if it has none."""
    return getattr(client, f"{k}_x", None), getattr(client, f"{k}_y", None)


def size(client, k):
    y = split(client, k)[1]
    return 0 if y is None else len(y)


@replies(lambda site, sent: {k: Count(size(site.client, k), (sent["groups"], 2))
                             for k in sent["splits"]}, every="sum")
def score(site, sent):
    """A site's own evaluation, for sums: of each of its splits k (sent["splits"]; none: 0 of 0),
    how many examples θ (sent["theta"]) classifies right and how many there are, in row
    sent["group"] of a [sent["groups"], 2] count, zeros elsewhere (scores)."""
    set_flat(site.model, sent["theta"])
    out = {}
    for k in sent["splits"]:
        x, y = split(site.client, k)
        out[k] = torch.zeros(sent["groups"], 2, dtype=torch.long, device=sent["theta"].device)
        if y is not None:
            out[k][sent["group"], 0] = correct(site.model, x, y, site).sum()
            out[k][sent["group"], 1] = len(y)
    return out


def scores(t, model, fed, ctx, splits=SPLITS, subsets=(), fn=score):
    """The sites' scores (fn) of the global model after round t, summed in groups: {split: [test
    set, subset, (right, examples)]}; a site's group is its test set and which of `subsets` (lists
    of site ids) it is in, the sites in none the last subset. The server sees these sums alone."""
    T, U = len(fed.test_names), len(subsets) + 1
    test_set = lambda s: fed.test_names.index(s.domain) if s.test_y is not None else 0
    theta = get_flat(model)
    sent = [{"theta": theta, "splits": tuple(splits), "groups": T * U, "group": test_set(s) * U
             + next((u for u, sub in enumerate(subsets) if c in sub), U - 1)}
            for c, s in enumerate(fed.sites)]
    sums = on_clients(fn, range(len(fed.sites)), sent, t, ctx)
    return {k: v.view(T, U, 2) for k, v in sums.items()}


def evaluate_global(t, model, fed, args, state, ctx):
    """The global model's accuracy on the clients' validation splits, on the test sets and on each
    test set (one per fixed client): each site scores its own data, the server sums them."""
    return accuracies(scores(t, model, fed, ctx))


def accuracies(sums, subset=None, keys=("val", "test")):
    """(validation, test, [each test set]) accuracy from scores' sums: Σ right / Σ examples, in
    float32 (the mean of the pooled answers); the validation sites those of `subset` (an index of
    scores' subsets, -1 the sites in none, or a list of them; default all)."""
    val, test = torch.stack([sums[k] for k in keys]).cpu().float()            # one host read
    val = val[:, slice(None) if subset is None else subset].reshape(-1, 2).sum(0)
    per = test.sum(1)                                                           # [test set, 2]
    return ((val[0] / val[1]).item(), (per[:, 0].sum() / per[:, 1].sum()).item(),
            (per[:, 0] / per[:, 1].clamp(min=1)).tolist())


# ----------------------------------------------------------------------- the loop over rounds
def global_model(args, ds, device):
    """The initial global model (seeded by --seed) on the device, channels-last where faster
    (docs/gpu-and-speed.md)."""
    torch.manual_seed(args.seed)
    model = build_model(args, ds).to(device)
    nhwc = args.model.startswith("resnet") and device.type == "cuda" or \
        args.model == "convnet" and device.type == "cpu"
    return model.to(memory_format=torch.channels_last) if nhwc else model


def make_context(args, fed, model, engine=None, prep=None):
    """A held-out domain's Context: the server's sampler (by the seed and the domain), a scratch
    model for the clients, on_clients' engine (all_at_once with --parallel-clients on, or None);
    prep(x, train=False, gen=None): a batch as the model takes it (default: the dataset's)."""
    device = torch.device(args.device)
    salt = sum(map(ord, fed.name))
    engine = engine or (all_at_once if args.parallel_clients == "on" else None)
    return Context(device, torch.Generator().manual_seed(args.seed * 104729 + salt),
                   prep or data.make_prep(args.dataset, device), args.amp, args, fed,
                   copy.deepcopy(model), {}, engine)


def train(round_fn, model, fed, args, state, ctx, evaluate_fn=None, start=1, check=None):
    """Rounds start..args.rounds, an evaluation (evaluate_fn, default evaluate_global) after every
    args.eval_every-th and the last. Yields (t, the round's losses, the evaluation or None): its
    {client id, or the clients' ids: mean loss} (tensors: no host read), or check(t, losses, model,
    state, fed) of them (the harness's `checked`: their mean, a non-finite number refused). The
    caller keeps the history, picks the best round, saves and stops (harness/runner.py).

        for t, losses, scores in common.train(fediir.fediir_round, model, fed, args, state, ctx):
            ...
    """
    evaluate_fn = evaluate_fn or evaluate_global
    for t in range(start, args.rounds + 1):
        losses = round_fn(t, model, fed, args, state, ctx)
        losses = check(t, losses, model, state, fed) if check else losses
        due = t % args.eval_every == 0 or t == args.rounds
        yield t, losses, evaluate_fn(t, model, fed, args, state, ctx) if due else None


def rounds(method, model, fed, args, prep=None):
    """A method's rounds (a Method: a method file's METHOD) on the federation `fed` from `model`:
    its Context (make_context; prep: your batches' own, e.g. for tensors that are not uint8
    images) and its state (init_state), then train's rounds and evaluations. As the harness runs
    them, without checkpoints:

        for t, losses, scores in common.rounds(fediir.METHOD, model, fed, args): ...
    """
    ctx = make_context(args, fed, model, prep=prep)
    state = method.init_state(model, fed, args, ctx) if method.init_state else {}
    ctx.clients = state.setdefault("clients", {})   # the clients' own states, kept in the state
    return train(method.round, model, fed, args, state, ctx, method.evaluate)


# ------------------------------------------------------------------------------ a method's record
@dataclass(frozen=True)
class Method:
    """What a method file declares (docs/protocol.md: the contract): its round (round(t, model,
    fed, args, state, ctx) -> its losses), init_state(model, fed, args, ctx) -> state and its
    evaluation, which `train` runs; `clients`, the client functions its rounds pass to on_clients
    (or args -> those of a run; all a federated node may run). For its settings (settings, the
    harness's command line, program's): add_args(p), its flags (help, no defaults); defaults
    ({"*": every dataset, dataset: where it differs}); auto, {flag: its rule} for a value "auto";
    derive(args) -> {flag: value} that follow from others; check(args, given) refuses bad values;
    parallel: can its clients train at once (a bool, or args -> None, else the reason). A
    variant: dataclasses.replace(METHOD, round=..., ...)."""
    name: str
    doc: str
    round: Callable
    init_state: Callable = None
    evaluate: Callable = evaluate_global
    add_args: Callable = None
    defaults: dict = field(default_factory=dict)
    derive: Callable = None
    check: Callable = None
    parallel: object = False
    clients: tuple = ()
    auto: dict = field(default_factory=dict)
    evaluations: tuple = (score,)


# ---------------------------------------------------------------------------- a run's settings
# Every value of a run, declared once: the protocol's per dataset here (PROTOCOL; its sources:
# docs/protocol.md), the run's own (RUN), a method's in its file (Method.defaults, add_args).
# settings() gives them in one call; the command line (harness/config.py) and a copied method's
# program read the same tables. FedIIR's Table 3 for the DG benchmarks, FedOMG's Table 1 for
# label skew, PerInvFL's Table 6 with IRM's ColoredMNIST MLP (full batch, last round) for
# RC-MNIST. sample "all": every client in every round.
_ALL = dict(rounds=100, local_epochs=1, momentum=0.9, weight_decay=0.0, global_lr=1.0,
            eval_every=10, alpha=0.1, head="linear", select="val", p_test=0.1)
_FL = dict(_ALL, model="cnn", lr=5e-3, batch_size=16, local_epochs=5, momentum=0.0, clients=100,
           sample=20)
_RC = dict(_ALL, model="mlp", lr=0.1, batch_size=25000, momentum=0.0, weight_decay=2.2e-3,
           clients=4, sample=4, rounds=500, eval_every=50, select="last")
_PHOTO = dict(_ALL, model="resnet18", lr=1e-3, batch_size=32, head="mlp")
PROTOCOL = {
    "rmnist": dict(_ALL, model="convnet", lr=1e-2, batch_size=64),
    "vlcs": _PHOTO,
    "pacs": dict(_PHOTO, lr=2.5e-3),
    "officehome": dict(_PHOTO, model="resnet50"),
    "synthetic": dict(_ALL, model="smallconv", lr=5e-2, batch_size=32),
    "stained": dict(_ALL, model="mlp", lr=0.1, batch_size=64, sample="all"),  # FedIPG VI-C
    **{name: _FL for name in data.FL},
    "rcmnist": _RC,
    "rcfmnist": _RC,
    "waterbird": dict(_PHOTO, head="linear", clients=4, sample=4, select="last"),
}
# The run's own settings, the same for every dataset (clients, sample, client_size: None until
# the data settles them, after_load)
RUN = dict(dataset="rmnist", data_root=None, test_domain="all", clients=None, client_size=None,
           sample=None, stain="fg", no_rotation=False, no_pretrained=False, seed=0,
           device="auto", amp=False, nondeterministic=False, parallel_clients="auto",
           compile=False)
CHOICES = dict(model=("convnet", "smallconv", "cnn", "mlp", "resnet18", "resnet50"),
               head=("linear", "mlp"), select=("val", "last"), stain=("fg", "bg", "both"),
               device=("auto", "cpu", "cuda"), parallel_clients=("auto", "on", "off"))


def settings(method, dataset="rmnist", **given):
    """Every setting of a run of `method` on `dataset` in one call, as the command line resolves
    them where it names only `given` ({setting: value}, e.g. rounds=20): given, else the method's
    derive for what follows from other settings, else its table (Method.defaults) for the dataset
    and for every dataset, else PROTOCOL's, else RUN's or its flag's own; "auto" device and
    parallel_clients resolved; then checked (UserError, one line). The counts of clients that only
    the data settles stay None until after_load. A name no setting has: TypeError.

        args = common.settings(fediir.METHOD, "rmnist", rounds=20, device="cpu")
    """
    if "test_domain" in given:                      # (an index is text on a command line)
        given["test_domain"] = str(given["test_domain"])
    args = argparse.Namespace(**{**RUN, **flags(method), "dataset": dataset, **given})
    rows = [RUN, flags(method), *PROTOCOL.values(), *method.defaults.values()]
    unknown = set(given) - {k for row in rows for k in row}
    if unknown:
        raise TypeError(f"settings: no setting named {', '.join(sorted(unknown))}")
    given = {k for k, v in vars(args).items() if v is not None}
    derived = fill(method, args, given)
    check(method, args, given, derived)
    return args


def flags(method):
    """The method's own flags (its add_args) and their own defaults."""
    p = argparse.ArgumentParser()
    if method.add_args:
        method.add_args(p)
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def table(method, dataset):
    """The defaults for `dataset`: the method's for it, else the method's for every dataset, else
    PROTOCOL's."""
    own = method.defaults
    return {**PROTOCOL.get(dataset, {}), **own.get("*", {}), **own.get(dataset, {})}


def fill(method, args, given):
    """args' unset settings (None) from the tables, then the method's derive for those not in
    `given`; returns what derive gave. An unknown dataset: UserError."""
    if args.dataset not in data.NAMES:
        raise UserError(f"unknown dataset {args.dataset!r}; choose from {', '.join(data.NAMES)}")
    for k, v in table(method, args.dataset).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    derived = method.derive(args) if method.derive else {}
    for k, v in derived.items():
        if k not in given:
            setattr(args, k, v)
    return derived


def check(method, args, given, derived=()):
    """Refuse, before any work, a setting no run can take (UserError, one line: the first that
    holds), then the method's own check(args, given); "auto" device and parallel_clients resolved.
    A value the method derived (`derived`, fill's), not given, is the method's to check."""
    check_kinds(method, args)
    check_data_args(args)
    check_test_domain(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = lambda k: k in given or k not in derived
    positive = ("rounds", "local_epochs", "batch_size", "eval_every", "lr", "global_lr")
    for bad, message in [   # in order: the first that holds is the error
            (not 0 <= args.seed < 2 ** 31, f"--seed must be in [0, 2**31), got {args.seed}"),
            *[(not getattr(args, k) > 0, f"--{k.replace('_', '-')} must be positive, got "
               f"{getattr(args, k)}") for k in positive if ours(k) and getattr(args, k) != "auto"],
            (ours("momentum") and not 0 <= args.momentum < 1,
             f"--momentum must be in [0, 1), got {args.momentum}"),
            (args.weight_decay < 0, f"--weight-decay must be >= 0, got {args.weight_decay}"),
            (args.device == "cuda" and not torch.cuda.is_available(),
             "--device cuda: no CUDA device is visible"),
            (args.amp and args.device != "cuda", "--amp needs a CUDA device")]:
        if bad:
            raise UserError(message)
    if method.check:
        method.check(args, given)
    check_parallel(args, method)


def check_kinds(method, args):
    """What a command line's parser refuses, for settings given in code: a value outside its
    choices (CHOICES), a word where a number belongs (but "all" for sample, "auto" where the
    method has the rule), a number that is not finite."""
    words = {"sample": ("all",), **{k: ("auto",) for k in method.auto}}
    numbers = ("clients", "client_size", "sample", "alpha", "p_test", "rounds", "local_epochs",
               "batch_size", "lr", "momentum", "weight_decay", "global_lr", "eval_every", "seed")
    for k, v in vars(args).items():
        flag = f"--{k.replace('_', '-')}"
        if k in CHOICES and v not in CHOICES[k]:
            raise UserError(f"{flag} must be one of {', '.join(CHOICES[k])}, got {v!r}")
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if k in numbers and v is not None and not number and v not in words.get(k, ()):
            raise UserError(f"{flag} expects a number, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{flag} must be a finite number, got {v}")


def check_data_args(args):
    """Refuse, before any work, a value of the dataset's flags that no dataset could take, or one
    given to a dataset it does not apply to (the counts of clients: after_load)."""
    positive = [(getattr(args, k) is not None and not getattr(args, k) > 0,
                 f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
                for k in ("clients", "client_size", "alpha")]   # None: settled by after_load
    for bad, message in [   # in order: the first that holds is the error
            (args.data_root == "",
             "--data-root is empty: give a folder or file name, or leave the flag out"),
            *positive,
            (args.client_size is not None and args.dataset != "stained",
             f"--client-size applies to stained only, not {args.dataset}"),
            (args.no_rotation and args.dataset not in ("rcmnist", "rcfmnist"),
             f"--no-rotation applies to rcmnist and rcfmnist only, not {args.dataset}"),
            (not 0 <= args.p_test <= 1, f"--p-test must be in [0, 1], got {args.p_test}")]:
        if bad:
            raise UserError(message)


def check_test_domain(args):
    """--test-domain against the dataset's domains, before any data loads; a photo dataset's are
    its folders, where they are (a missing one is refused when it loads, with the command that
    fetches it)."""
    if args.dataset in data.FOLDERS and (args.data_root is None or not os.path.isdir(
            os.path.join(args.data_root, data.FOLDERS[args.dataset]))):
        return
    held_out(args.dataset, data.domain_names(args.dataset, args.data_root), args.test_domain)


def parallel(args):
    """--parallel-clients: 'auto' is on for CUDA except for the photos and ResNets, off on the
    CPU."""
    return args.parallel_clients == "on" or (
        args.parallel_clients == "auto" and str(args.device).startswith("cuda")
        and args.dataset not in data.PHOTOS and not args.model.startswith("resnet"))


def check_parallel(args, method):
    """Refuse --parallel-clients on where it cannot apply and record what 'auto' chose
    (method.parallel: a bool, or a function of args giving None where it applies, else the
    reason)."""
    supported = method.parallel
    reason = supported(args) if callable(supported) else None if supported else \
        "trains its clients one after another (its local loss is not written with torch.func)"
    supported = reason is None
    if args.parallel_clients == "on" and not supported:
        raise UserError(f"--parallel-clients on: {method.name} {reason}; use off")
    if args.parallel_clients == "on" and args.dataset in data.PHOTOS:
        raise UserError(f"--parallel-clients on: not for {args.dataset} (each client's "
                        f"augmentation draws from its own stream, and a ResNet fills a GPU "
                        f"alone); use off")
    args.parallel_clients = "on" if supported and parallel(args) else "off"
    if getattr(args, "compile", False) and args.parallel_clients == "off":   # the stacked step
        raise UserError(f"--compile: {method.name} {reason}, and --compile compiles the step of "
                        f"clients trained at once" if reason else "--compile compiles the step "
                        "of the clients trained at once: add --parallel-clients on (the default "
                        "on CUDA)")


def load_data(args, load=None):
    """The dataset of a run (load: data.load's stand-in, e.g. a cached one)."""
    return (load or data.load)(args.dataset, args.data_root, args.seed,
                               clients=args.clients or 100, alpha=args.alpha, p_test=args.p_test,
                               stain=args.stain, rotation=not args.no_rotation)


def after_load(args, ds):
    """Indices of the domains to hold out, from --test-domain ([None]: the fixed clients), once
    --clients, --sample and (stained) --client-size are settled: by default one client per
    training domain (a fixed split: its clients) and min(P, training domains) per round ('all':
    every client), then checked against what the data allows (data.enough_clients,
    data.stained_clients: every client holds one full minibatch of --batch-size)."""
    names = None if ds.protocol == "clients" else [d.name for d in ds.domains]
    todo = held_out(ds.name, names, args.test_domain)
    n_train = len(ds.domains) - (ds.protocol == "lodo")
    if ds.protocol == "clients" and args.clients != n_train:
        raise UserError(f"--clients {args.clients} does not match the {n_train} clients of the "
                        f"split")
    if args.dataset == "stained":
        args.clients, args.client_size, args.sample = data.stained_clients(
            ds, args.stain, args.clients, args.client_size, args.sample, args.batch_size)
        return todo
    args.clients = n_train if args.clients is None else args.clients
    args.sample = min(args.clients, n_train) if args.sample is None else \
        args.clients if args.sample == "all" else args.sample
    if args.clients < n_train:
        raise UserError(f"--clients {args.clients} is below the {n_train} training domains (a "
                        f"client never mixes domains)")
    if not 1 <= args.sample <= args.clients:
        raise UserError(f"--sample must be between 1 and --clients ({args.clients}), got "
                        f"{args.sample}")
    if ds.protocol == "lodo":
        data.enough_clients(ds, todo, args.clients, args.batch_size)
    return todo


def held_out(dataset, names, pick):
    """The indices of the domains to hold out, one after another, for --test-domain `pick` ('all', a
    domain's name or its index) among `names`; [None] where the clients are fixed (names None)."""
    if names is None:
        if pick != "all":
            raise UserError(f"--test-domain does not apply to {dataset}: its clients have their "
                            f"own test sets")
        return [None]
    M = len(names)
    if pick == "all":
        return list(range(M))
    if pick in names:
        return [names.index(pick)]
    if pick.lstrip("-").isdigit() and 0 <= int(pick) < M:
        return [int(pick)]
    raise UserError(f"unknown test domain {pick!r} for {dataset}; choose 'all', one of "
                    f"{', '.join(names)} or an index 0..{M - 1}")


def federation(args, ds, test):
    """The federation of held-out domain `test` (None: the fixed clients) on args.device."""
    device = torch.device(args.device)
    if test is None:
        return data.federate_fixed(ds, args.seed, device)
    return data.federate(ds, test, args.clients, args.seed, device, client_size=args.client_size)


def deterministic(on=True):
    """Reproducible kernels (the default) or CUDA's fastest (--nondeterministic), set before
    anything meets CUDA; CPU numbers are the same either way. Deterministic mode's NaN fill of
    new tensors is off: nothing here reads unwritten memory. torch's flag set directly where torch
    has it: torch.use_deterministic_algorithms imports torch._inductor (2.1 s of a 3.6 s node
    setup, flower/node_cost.py, torch 2.14) for a setting that common.compiled makes itself."""
    flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if flag is not None:
        flag(on)
    else:                                                               # (another torch)
        torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 is IEEE fp32 on CUDA too (TF32 rounds
    torch.backends.cudnn.allow_tf32 = False         # to 10 bits); --amp is the fast, lower path


# ------------------------------------------------------------------------- a copy's program
# Where the run harness is absent (a method file copied with common.py and data.py, and assets/
# for the embedded digits), `python fedomg.py ...` runs this: the settings above as flags, and
# the harness's rounds and evaluations, so the same numbers at the same flags, printed, never
# written. The harness's own flags (results files, checkpoints, --resume, locks): one line.
HARNESS = ("out", "resume", "overwrite", "allow_code_change", "checkpoint_minutes")


def program(method, argv=None):
    """A method file's program without the harness: bad input and the harness's flags one line
    and exit 2 before any work; then every held-out domain trained as the harness trains it, each
    evaluation and the table printed (--print-config: every setting, the counts from the data);
    a method's refusal on the way exit 2, a non-finite loss exit 1, a Ctrl-C exit 130, each in
    one line on stderr."""
    prog = f"{method.name}.py"
    try:
        args, show = parse(method, prog, sys.argv[1:] if argv is None else argv)
        ds = load_data(args)
        todo = after_load(args, ds)
        if show:
            for k, v in vars(args).items():
                print(f"  --{k.replace('_', '-'):<22} {v}")
            return None
        deterministic(not args.nondeterministic)
        print(f"{method.name} on {args.dataset}: {args.clients} clients, {args.sample} per round, "
              f"{args.rounds} rounds, device {args.device} (no harness: nothing is written)")
        done = {}
        for test in todo:
            done.update(domain(method, args, ds, federation(args, ds, test)))
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted; nothing was saved (a copy writes no checkpoint)\n")
        sys.exit(130)
    except (UserError, FloatingPointError) as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        sys.exit(2 if isinstance(e, UserError) else 1)
    sel = "(last)" if args.select == "last" else "(best val)"
    print(f"\n{'test domain':<11}  test acc {sel:<10}  last round  best round")
    for name, (acc, last, best) in done.items():
        print(f"{name:<11}  {acc:19.4f}  {last:10.4f}  {best:10d}")
    return done


def domain(method, args, ds, fed):
    """One held-out domain, as the harness runs it: {its name: (test accuracy at the best round
    by --select, the last round's, the best round)}."""
    model = global_model(args, ds, torch.device(args.device))
    print(f"-- test domain {fed.name}: {len(fed.clients)} clients")
    best = None
    for t, losses, scores in rounds(method, model, fed, args):
        loss = torch.stack(list(losses.values())).mean()
        if not bool(torch.cat([loss[None], get_flat(model)]).isfinite().all()):   # one host read
            raise FloatingPointError(f"non-finite loss or model after round {t} (testing on "
                                     f"{fed.name})")
        if scores is not None:
            val, test = scores[:2]
            print(f"round {t:4d}/{args.rounds} | val {val:.4f} | test {test:.4f}", flush=True)
            if best is None or val > best[0] or args.select == "last":
                best = (val, test, t)
    return {fed.name: (best[1], test, best[2])}


def parse(method, prog, argv):
    """The settings from a command line: the method's flags (its add_args) and every other setting
    as --<name> <value>, read as its defaults are (reader); the harness's flags refused. Returns
    (settings, whether --print-config was asked)."""
    p = argparse.ArgumentParser(prog=prog, description=method.doc.strip().split("\n\n")[0],
                                epilog="Copied without the project's harness/: the numbers are "
                                "printed, not written (no results file, checkpoint or --resume).")
    p.error = lambda message: p.exit(2, f"{prog}: error: {message}\n")
    if method.add_args:
        method.add_args(p)
    for act in p._actions:                      # the method's own float flags: finite numbers
        act.type = reader(act.dest, [0.0]) if act.type is float else act.type
    shown = argparse.Namespace(**{**RUN, **flags(method)})        # --help: rmnist's values
    fill(method, shown, set())
    shown = {k: "from the data" if v is None and k in ("clients", "sample", "client_size") else v
             for k, v in vars(shown).items()}
    rows = [RUN, *PROTOCOL.values(), *method.defaults.values()]
    own = flags(method)
    for k in {**RUN, **{k: None for row in rows for k in row}}:
        if k in own:
            continue
        seen = [row[k] for row in rows if k in row]                 # its defaults
        if seen == [False] and isinstance(seen[0], bool):
            p.add_argument(f"--{k.replace('_', '-')}", action="store_true",
                           help="on/off (default: off)")
        else:
            p.add_argument(f"--{k.replace('_', '-')}", type=reader(k, seen), choices=CHOICES.get(k))
    for act in p._actions[1:]:                     # every help ends with rmnist's value
        if act.nargs != 0:
            said = f"{act.help}; " if act.help else ""
            act.help = f"{said}default for rmnist: {shown[act.dest]}".replace("%", "%%")
    for k in HARNESS:
        p.add_argument(f"--{k.replace('_', '-')}", nargs="?", const=True, help=argparse.SUPPRESS)
    p.add_argument("--print-config", action="store_true", help="print every setting, then exit")
    args = p.parse_args(argv)
    asked = [k for k in HARNESS if getattr(args, k) is not None]
    if asked:
        raise UserError(f"--{asked[0].replace('_', '-')} needs the project's harness/ (results "
                        f"files, checkpoints, locks): this copy prints its numbers, writes none")
    show = args.print_config
    for k in (*HARNESS, "print_config"):
        delattr(args, k)
    return settings(method, **{k: v for k, v in vars(args).items() if v is not None}), show


def reader(k, seen):
    """How --k's text is read, as its defaults `seen` are: a name as it is; a number (a whole one
    where every default is), finite, or one of the words its defaults are ('all', 'auto')."""
    if k in CHOICES or k in ("dataset", "data_root", "test_domain"):
        return None
    words = {v for v in seen if isinstance(v, str)}
    to = float if any(isinstance(v, float) for v in seen) else int

    def read(text):
        if text in words:
            return text
        try:
            number = to(text)
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            kind = "a number" if to is float else "a whole number"
            raise argparse.ArgumentTypeError(f"expects {kind}{' or ' * bool(words)}"
                                             f"{' or '.join(sorted(words))}, got {text!r}")
        return number
    return read
