"""The teaching core: what every method's round is made of. Nothing here knows a specific method,
a command line, a results file or a checkpoint (the run harness, harness/, makes a run a program).

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
                       every args.eval_every rounds
  a method's record    Method: what a method file declares (METHOD)

A method plugs in with its round, round_fn(t, model, fed, args, state, ctx) -> its losses, and
optionally init_state and evaluate_fn, declared in a Method with its client functions and what
each replies (replies): docs/protocol.md.
"""
import contextlib
import copy
import functools
import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def make_context(args, fed, model, engine=None):
    """A held-out domain's Context: the server's sampler (by the seed and the domain), a scratch
    model for the clients, on_clients' engine (all_at_once with --parallel-clients on, or None)."""
    device = torch.device(args.device)
    salt = sum(map(ord, fed.name))
    engine = engine or (all_at_once if args.parallel_clients == "on" else None)
    return Context(device, torch.Generator().manual_seed(args.seed * 104729 + salt),
                   data.make_prep(args.dataset, device), args.amp, args, fed,
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


# ------------------------------------------------------------------------------ a method's record
@dataclass(frozen=True)
class Method:
    """What a method file declares (docs/protocol.md: the contract): its round (round(t, model,
    fed, args, state, ctx) -> its losses), init_state(model, fed, args, ctx) -> state and its
    evaluation, which `train` runs; `clients`, the client functions its rounds pass to on_clients
    (or args -> those of a run; all a federated node may run). For the harness: add_args(p), its
    flags (help, no defaults); defaults ({"*": every dataset, dataset: where it differs}); auto,
    {flag: its rule} for a value "auto"; derive(args) -> {flag: value} that follow from others;
    check(args, given) refuses bad values; parallel: can its clients train at once (a bool, or
    args -> None, else the reason). A variant: dataclasses.replace(METHOD, round=..., ...)."""
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
