"""FedIPG — Hao, Cui, Yang, Wu, Feng, Hu, Invariant Federated Learning for Edge Intelligence:
Mitigating Heterogeneity and Asynchrony via Exit Strategy and Invariant Penalty. No public code:
Algorithm 1 is the specification, read as docs/fedipg.md says. Client i minimises (Eq. 9)
    f_i(w) = R_i(w) + λ d_i²,  d_i = ⟨∇R_i(w), w⟩ = d/ds R_i(s·w) at s = 1  (`tangent`, or jvp)
fedipg_round, round t (w^t: the global model at its start):
  0. --exit auto, before round 1: --exit-warmup pre-training rounds of 1-4 with every client
     (line 1), then the exits and w^1 again to all (lines 2-4)
  1. the clients of I_ID take part (Eq. 3; --sample C draws C of them, as FedIIR)
  2. each trains on f_i from the w^{t−τ_i} it received (τ_i = 0 here, else `arrive`): sgd,
     --local-epochs of minibatch SGD (Sec. III's words: docs/fedipg.md); paper: Eq. 2 (line 15)
  3. server: w^{t+1} = w^t + η_g Σ_i n_i Δ_i / Σ_i n_i, Δ_i = w_i − w^{t−τ_i}, arrived i (Eq. 3)
  4. warm-up: C_i = η (n_i/n)(⟨∇R, g_i⟩ − (L/2)||g_i||²) / ||∇R||² (Eq. 13), g_i = ∇R_i(w^{t−τ_i}),
     ∇R: n-weighted mean of the other fresh g_j; after the last, mean C_i ≤ 0 (or none): exit (§IV)
Defaults: --local-step sgd, that of every result here (the paper's step: docs/fedipg.md); λ 1e-3,
the middle of Figure 4's range (1e-4, 1e-2), 1e-4 (its low end) for the ResNet datasets; the paper
silent: η = --lr, --exit-L 0.5, --exit-warmup 5; stained MNIST: Section VI-C's clients, IRM's MLP.
"""
import importlib.util
if __name__ == "__main__" and importlib.util.find_spec("harness"):  # the harness first: a Ctrl-C
    import harness  # noqa: F401   while torch loads is one line, exit 130 (harness/__init__.py)
import torch
import torch.nn as nn
import torch.nn.functional as F

import common

DEFAULTS = {"*": dict(local_step="sgd", exit="off", exit_warmup=5, exit_L=0.5)}  # (docstring)
CHAIN = (nn.Conv2d, nn.Linear, nn.ReLU, nn.GroupNorm, nn.MaxPool2d, common.GlobalMean, nn.Flatten)


def fedipg_round(t, model, fed, args, state, ctx, warmup=None, arrive=None, client=None):
    """Steps 0-4 at round t; warmup: a round of Eq. 13's estimates (None: step 0 where due);
    arrive(t, S, w_t, args, state, ctx, warmup): the (i, w^{t−τ_i}, τ_i) of the updates that arrive
    (None: all of S, fresh; benchmark/fedipg_aberrant.py); client: step 2 (None: client_update)."""
    W = args.exit_warmup if args.exit == "auto" else 0
    if warmup is None and W and t == 1:                                  # step 0, before t = 1
        w_1 = common.get_flat(model)
        for s in range(1, W + 1):                                        # (round s draws as −s)
            fedipg_round(-s, model, fed, args, state, ctx, True, arrive=arrive, client=client)
        common.set_flat(model, w_1)                                      # lines 2-4: w^1 to all
    w_t = common.get_flat(model)                                         # w^t
    ID = [i for i in range(len(fed.clients)) if i not in state["exited"]]   # I_ID
    C = len(ID) if warmup else min(args.sample, len(ID))
    S = [ID[k] for k in common.sample_clients(ctx, len(ID), C)]
    arrived = arrive(abs(t), S, w_t, args, state, ctx, warmup) if arrive else \
        [(i, w_t, 0) for i in S]                                   # step 1: (i, w^{t−τ_i}, τ_i)
    ids = [i for i, _, _ in arrived]
    sent = [{"w": start} for _, start, _ in arrived]
    if not ids:                                                          # none arrived: w^t stays
        return {ID[0]: torch.zeros((), device=w_t.device)}
    if warmup:                                                           # g_i = ∇R_i(w^{t−τ_i}) up
        g = [r["g"] for r in common.on_clients(risk_gradient, ids, sent, t, ctx)]
    up = common.on_clients(client or client_update, ids, sent, t, ctx)  # step 2: Σ_i n_i Δ_i up
    n = [float(fed.clients[i].n) for i in ids]
    common.set_flat(model, aggregate(w_t, up["delta"], sum(n), args.global_lr))          # Eq. 3
    if warmup:                                               # step 4 (Eq. 13), exits after the last
        exit_strategy(fed, args, state, ids, n, g, [tau == 0 for _, _, tau in arrived], abs(t) == W)
    return {tuple(ids): up["loss"]}                                      # their mean loss


@common.stackable                # --local-step sgd with --parallel-clients on: all clients at once
@common.replies(lambda site, sent: {"delta": sent["w"], "loss": common.SCALAR},
                delta="sum", loss="mean")          # Eq. 3 needs Σ_i n_i Δ_i, no client's own
def client_update(site, sent):
    """Step 2 on client i from the w = w^{t−τ_i} it received; n_i Δ_i and the mean loss up. sgd:
    --local-epochs of minibatch SGD on f_i; paper: Δ_i = −η (∇f_i(w) + wd·w), whole split, Eq. 2."""
    args, model, w = site.args, site.model, sent["w"]             # what it has, what it received
    if args.local_step == "sgd":
        layers = chain(model)
        w_i, loss = common.local_train(site, w, lambda *a: f_i(*a, lam=args.lam, layers=layers))
        delta = w_i - w
    else:
        common.set_flat(model, w)
        grad, loss = full_gradient(model, in_chunks(site, train=True), site.client.n, args.lam,
                                   chain(model), site.autocast)
        delta = -args.lr * (grad + args.weight_decay * w)                           # Eq. 2
    return {"delta": common.sizes(site, w.device) * delta, "loss": loss}           # n_i Δ_i


@common.replies(lambda site, sent: {"g": sent["w"]})
def risk_gradient(site, sent):
    """Eq. 13's g_i = ∇R_i(w) on client i's whole split (no augmentation), at the w it received."""
    common.set_flat(site.model, sent["w"])
    g, _ = full_gradient(site.model, in_chunks(site), site.client.n, autocast=site.autocast)
    return {"g": g.float()}


# -------------------------- the method as plain functions: torch alone (docs/fedipg.md: Copy it)
def f_i(model, params, buffers, x, y, w, lam, layers=None):
    """f_i = R_i + λ d² on a minibatch (Eq. 9) at `params` (dicts by name), under vmap too."""
    def f():
        R, d = risk_and_d(model, x, y, w, layers, lam)
        return R if lam == 0 else R + lam * d * d
    named = {"model." + k: v for d in (params, buffers) for k, v in d.items()}
    return torch.func.functional_call(Beside({"model": model}), named, (f,))     # f at `params`


class Beside(torch.nn.ModuleDict):   # {"model": model}; forward(f) = f(), torch.compile traces it
    forward = staticmethod(lambda f: f())


def full_gradient(model, chunks, n, lam=0.0, layers=None, autocast=None):
    """∇f_i(w) (flat) and f_i(w) over the whole split, `chunks` of (x, y) holding its n examples
    once, each weighted 1/n: R_i = Σ_c R_c, d = Σ_c d_c, ∇f_i = ∇R_i + 2λ d ∇d (Eq. 9)."""
    model.train()
    w = [p for p in model.parameters() if p.requires_grad]
    grad = torch.zeros(2, sum(p.numel() for p in w), dtype=w[0].dtype, device=w[0].device)  # ∇R, ∇d
    value = torch.zeros(2, device=w[0].device)                                             # R, d
    for x, y in chunks:
        with (autocast or torch.enable_grad)():
            weights = torch.full((len(y),), 1 / n, device=y.device)
            parts = [v for v in risk_and_d(model, x, y, weights, layers, lam) if v is not None]
        for k, part in enumerate(parts):
            g = torch.autograd.grad(part, w, retain_graph=k < len(parts) - 1)
            grad[k] += torch.cat([gk.reshape(-1) for gk in g])
            value[k] += part.detach().float()
    return grad[0] + (2 * lam) * value[1] * grad[1], value[0] + lam * value[1] * value[1]


def risk_and_d(model, x, y, w, layers=None, lam=1.0):
    """R_i = Σ_j w_j CE_j and d = ⟨∇R_i(w), w⟩ (None if lam is 0), no gradient inside: d = ⟨∂R/∂z,
    ż⟩ by `tangent` through the chain `layers`, else torch.func.jvp along w."""
    risk = lambda z: (F.cross_entropy(z, y, reduction="none") * w).sum()
    if lam == 0:
        return risk(model(x)), None
    if layers:
        z, dz = tangent(layers, x)
        onehot = torch.zeros_like(z).scatter(1, y[:, None], 1.0)
        return risk(z), (((z.softmax(1) - onehot) * dz).sum(1) * w).sum()     # ∂CE/∂z = p − e_y
    params = dict(model.named_parameters())
    at = lambda p: risk(torch.func.functional_call(model, p, (x,)))
    return torch.func.jvp(at, (params,), (params,))


def tangent(layers, x):
    """The logits z and ż = d/ds z(x; s·w) at s = 1 by hand, layer by layer (ȧ None: 0, before the
    first weighted layer; ȧ is a: ȧ = a, which that layer gives, ż = z). z = W a + b: ż = W ȧ + z.
    GroupNorm: ẏ = γ rstd (ȧ − mean ȧ − x̂ mean(x̂ ȧ)) + y. ReLU, pools, flatten: as they map a."""
    a, da = x, None                                   # a layer's input and its tangent ȧ
    for m in layers:
        if isinstance(m, nn.GroupNorm) and da is not None:  # z = γ x̂ + β from x̂'s statistics
            N, G = a.shape[0], m.num_groups
            shape = a.shape[:2] + (1,) * (a.dim() - 2)
            xc = a.reshape(N, G, -1) - a.reshape(N, G, -1).mean(-1, keepdim=True)
            rstd = ((xc * xc).mean(-1, keepdim=True) + m.eps).rsqrt()
            gamma = m.weight.view(1, G, -1)
            scale = (rstd * gamma).reshape(shape)
            z = torch.addcmul(m.bias.view(shape[1:]), xc.view_as(a), scale)
        elif isinstance(m, nn.MaxPool2d):                     # (its argmax positions as well)
            z, idx = F.max_pool2d(a, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode,
                                  return_indices=True)
        else:
            z = m(a)
        if not isinstance(m, (nn.Conv2d, nn.Linear, nn.GroupNorm)):        # ReLU, pools, flatten
            if da is a:
                da = z                                        # positively homogeneous: ż = z
            elif da is not None and isinstance(m, nn.ReLU):
                da = da * (a > 0).to(a.dtype)
            elif da is not None and isinstance(m, nn.MaxPool2d):  # at its argmax positions
                da = da.flatten(2).gather(2, idx.flatten(2)).view_as(z)
            elif da is not None:
                da = m(da)
        elif da is None:
            da = z                                            # the first weighted layer: ż = z
        elif isinstance(m, nn.GroupNorm) and da is a:         # x̂ is scale-free but for eps
            da = torch.addcmul(z, xc.view_as(a), (m.eps * rstd ** 3 * gamma).reshape(shape))
        elif isinstance(m, nn.GroupNorm):
            dg = da.reshape(N, G, -1)                         # x̂ mean(x̂ ȧ) = xc rstd² mean(xc ȧ)
            dxh = torch.addcmul(dg - dg.mean(-1, keepdim=True), xc,
                                rstd * rstd * (xc * dg).mean(-1, keepdim=True), value=-1)
            da = torch.addcmul(z, dxh.view_as(a), scale)
        elif da is a and m.bias is not None:
            da = 2 * z - m.bias.view(-1, *[1] * (z.dim() - 2))   # W a + z = 2z − b
        else:                                                 # ż = W ȧ + z (W: no bias)
            da = z + (m._conv_forward if isinstance(m, nn.Conv2d) else F.linear)(da, m.weight, None)
        a = z
    return a, da


def aggregate(w_t, delta_sum, weight_sum, global_lr=1.0):
    """Eq. 3: w^t + η_g Σ_i n_i Δ_i / Σ_i n_i, from the clients' sum (a stale Δ_i is applied to
    w^t). ValueError unless the sum has w^t's shape and the weights a positive sum."""
    if delta_sum.shape != w_t.shape or not weight_sum > 0:
        raise ValueError(f"aggregate: a sum of shape {tuple(delta_sum.shape)} and weights "
                         f"{weight_sum} for w^t of shape {tuple(w_t.shape)}")
    return w_t + global_lr * (delta_sum / weight_sum)


def client_contributions(g, n, fresh, n_all, lr, L):
    """C_i of Eq. 13 for the clients that sent g_i (a list; sizes n, fresh: τ_i = 0, n_all: all
    data); None where no other client is fresh."""
    if not 0 < len(g) == len(n) == len(fresh) or len({x.shape for x in g}) > 1:
        raise ValueError(f"client_contributions: g_i {[x.shape for x in g]}, n {n}, fresh {fresh}")
    G = torch.stack(list(g))
    K = (G @ G.T).double().cpu()                                        # ⟨g_i, g_j⟩
    n = torch.tensor(n, dtype=torch.float64)
    p = n * torch.tensor(fresh, dtype=torch.float64)                    # p_j = n_j for fresh j
    k = K.diagonal()                                                    # ||g_i||²
    Kp, pKp = K @ p, p @ K @ p
    P_i = p.sum() - p                                                   # ∇R(w^t): the other fresh
    dot = (Kp - p * k) / P_i                                            # ⟨∇R(w^t), g_i⟩
    norm2 = (pKp - 2 * p * Kp + p ** 2 * k) / P_i ** 2                  # ||∇R(w^t)||²
    C = lr * (n / n_all) * (dot - L / 2 * k) / norm2                    # Eq. 13
    return [c.item() if P > 0 else None for c, P in zip(C, P_i)]


def chain(model):
    """The model as a list of layers if it is a plain chain of layers `tangent` knows."""
    parts = [model.featurizer, model.classifier] if isinstance(model, common.Net) else [model]
    layers = [m for part in parts for m in (part if isinstance(part, nn.Sequential) else [part])]
    return layers if all(type(m) in CHAIN and getattr(m, "affine", True) for m in layers) else None


def in_chunks(site, train=False):
    """The client's whole split in order (train: augmented), in chunks of --batch-size or, if more,
    of 2^18 input values (334 digits: fewer launches; about 1.5 GB of graph at λ > 0)."""
    b = max(site.args.batch_size, 2 ** 18 // site.client.x[0].numel())
    return common.chunks(site, site.client.x, site.client.y, train, b)


def exit_strategy(fed, args, state, ids, n, g, fresh, last):
    """Eq. 13's C_i^t of the arrived `ids` into state; after the last warm-up round, the exits."""
    n_all = sum(c.n for c in fed.clients)
    for i, C_i in zip(ids, client_contributions(g, n, fresh, n_all, args.lr, args.exit_L)):
        if C_i is not None:
            state["contrib"].setdefault(i, []).append(C_i)
    if last:
        mean = {i: sum(v) / len(v) for i, v in state["contrib"].items()}
        out = [i for i in range(len(fed.clients))
               if i not in state["exited"] and mean.get(i, 0.0) <= 0]
        if len(out) + len(state["exited"]) == len(fed.clients):
            raise common.UserError("every client's estimated contribution (Eq. 13) is <= 0: "
                                   "lower --exit-L")
        state["exited"] = sorted(state["exited"] + out)
        lowest = ", ".join(f"{i}: {mean[i]:.2e}" for i in sorted(mean, key=mean.get)[:5])
        print(f"exit strategy: mean C_i (Eq. 13), lowest: {lowest}; exiting: {out or 'none'}")


def init_state(model, fed, args, ctx):
    return {"exited": [], "contrib": {}}                               # I_OOD, C_i^t per client


def evaluate(t, model, fed, args, state, ctx):
    """common.evaluate_global, model selection on I_ID; with exits, id_acc / ood_acc and exited."""
    out = state["exited"]
    sums = common.scores(t, model, fed, ctx, subsets=[out])            # I_OOD, then the rest
    val, test, per = common.accuracies(sums, -1)
    extra = {"id_acc": val, "ood_acc": common.accuracies(sums, 0)[0] if out else None,
             "exited": list(out)}
    return (val, test, per) if args.exit == "off" and not out else (val, test, per, extra)


def add_args(p):
    a = p.add_argument
    a("--lam", type=float, help="penalty weight λ (1e-4 for the ResNets)")
    a("--local-step", choices=["sgd", "paper"], help="sgd: --local-epochs of minibatch SGD on "
      "f_i; paper: Eq. 2 as one step w - lr * grad f_i(w) on the whole split")
    a("--exit", choices=["off", "auto"], help="the exit strategy (Section IV)")
    a("--exit-warmup", type=int, help="pre-training rounds of estimates before exits")
    a("--exit-L", type=float, help="smoothness L of Eq. 13 (dimensionless here)")


def derive(args):
    """λ by the model; C: every client of I_ID (Eq. 3) where no table sets it; the paper's step."""
    paper = dict(momentum=0.0, local_epochs=1) if args.local_step == "paper" else {}
    every = dict(sample="all") if args.sample is None else {}
    lam = 1e-4 if args.model.startswith("resnet") else 1e-3       # WaterBird's ResNet-18 too
    return dict(lam=lam, **every, **paper)


def check(args, given):
    given = [f"--{k.replace('_', '-')}" for k in ("momentum", "local_epochs") if k in given]
    if args.local_step == "paper" and given:
        raise common.UserError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to "
                               "--local-step sgd only: the paper's step (Eq. 2) is one plain "
                               "gradient step on the client's whole split")
    for bad, message in ((not args.lam >= 0, f"--lam must be >= 0, got {args.lam}"),
                         (args.exit == "auto" and args.exit_warmup < 1,
                          f"--exit-warmup must be at least 1, got {args.exit_warmup}"),
                         (not args.exit_L > 0, f"--exit-L must be positive, got {args.exit_L}")):
        if bad:
            raise common.UserError(message)


METHOD = common.Method("fedipg", __doc__, fedipg_round, init_state=init_state, evaluate=evaluate,
                       add_args=add_args, defaults=DEFAULTS, derive=derive, check=check,
                       clients=lambda args: (risk_gradient, client_update) if args.exit == "auto"
                       else (client_update,),                   # (step 0's g_i: with exits only)
                       parallel=lambda args: None if args.local_step == "sgd" else "trains with "
                       "--local-step paper one client after another (sgd at once)")


def main(argv=None):                  # the program: the command line, checkpoints, results
    if importlib.util.find_spec("harness") is None:   # copied without harness/: common.program
        return common.program(METHOD, argv)
    return importlib.import_module("harness").main(METHOD, argv)


if __name__ == "__main__":
    main()
