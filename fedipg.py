"""FedIPG — Invariant Federated Learning for Edge Intelligence: Mitigating Heterogeneity and Asynchrony
via Exit Strategy and Invariant Penalty (Hao, Cui, Yang, Wu, Feng, Hu). No public code: the paper
(Algorithm 1, Eq. 2, 3, 9, 13, Sections IV and VI) is the specification. Each client minimises

    f_i(w) = R_i(w) + λ d_i²,   d_i = ⟨∇R_i(w), w⟩ = d/ds R_i(s·w) at s = 1                  (Eq. 9)

Algorithm 1, round t of fedipg_round (w^t: the global model at its start):
  0. --exit auto: first --exit-warmup pre-training rounds of steps 1-4 with every client (line 1,
     Section IV), the exits after them, then w^1 again to all (lines 2-4); --warmup rounds: they are
     rounds 1..W of the T and their model is kept (the committed --exit auto runs were made so)
  1. the clients of I_ID take part (Eq. 3; --sample C draws C of them, as FedIIR)
  2. each updates the model it received, Δ_i = w_i − w^{t−τ_i} (τ_i: staleness; 0 but in the aberrant
     clients of benchmark/fedipg_aberrant.py, Section VI-A), on f_i:
       --local-step paper: w_i = w − η ∇f_i(w) over its whole split (Eq. 2, line 15; the default)
       --local-step sgd: --local-epochs of minibatch SGD with --momentum (every committed number)
  3. server: w^{t+1} = w^t + η_g Σ_i n_i Δ_i / Σ_i n_i over the arrived clients of I_ID        (Eq. 3)
  4. warm-up rounds: C_i = η (n_i/n)(⟨∇R, g_i⟩ − (L/2)||g_i||²) / ||∇R||², g_i = ∇R_i(w^{t−τ_i}), ∇R the
     n-weighted mean of the other fresh clients' g_j (Eq. 13); after the last, every client whose
     mean C_i ≤ 0, or that never arrived, exits (I_OOD); the final model is scored on them apart.
d exactly: `tangent` carries ż = d/ds z(x; s·w) beside z through a plain chain of layers (MLP,
ConvNets; measured faster than torch.func.jvp), torch.func.jvp along w for other models (ResNets).
Defaults: λ 1e-3, the middle of Figure 4's range (1e-4, 1e-2), 1e-4 for the ResNet datasets (its low
end, as advised); chosen, the paper silent (docs/fedipg.md, with every reading and measurement):
η = --lr, --exit-L 0.5, --exit-warmup 5; stained MNIST: Section VI-C's clients, IRM's MLP, lr 0.1.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common

BY_STEP = math.inf   # default of --momentum and --local-epochs: set by --local-step in check()
LAMBDA = {"rmnist": 1e-3, "stained": 1e-3, "synthetic": 1e-3, "pacs": 1e-4, "vlcs": 1e-4, "officehome": 1e-4}
CHAIN = (nn.Conv2d, nn.Linear, nn.ReLU, nn.GroupNorm, nn.MaxPool2d, common.GlobalMean, nn.Flatten)


def fedipg_round(t, model, fed, args, state, ctx, warmup=None):
    """Steps 0-4 of the docstring at round t; warmup: a round of estimates for the exit rule."""
    W = args.exit_warmup if args.exit == "auto" else 0
    if warmup is None and W and args.warmup == "pretraining" and t == 1:    # step 0, before t = 1
        w_1 = common.get_flat(model)
        for s in range(1, W + 1):
            fedipg_round(s, model, fed, args, state, ctx, warmup=True)
        common.set_flat(model, w_1)                                         # lines 2-4: t = 1, w^1 to all
    warmup = args.warmup == "rounds" and t <= W if warmup is None else warmup
    w_t, ID = common.get_flat(model), [i for i in range(len(fed.clients)) if i not in state["exited"]]  # w^t, I_ID
    S = [ID[k] for k in common.sample_clients(ctx, len(ID), len(ID) if warmup else min(args.sample, len(ID)))]
    arrived = arrivals(t, S, w_t, args, state, ctx, warmup)                 # step 1: (i, w^{t−τ_i}, τ_i)
    clients, g, losses = [fed.clients[i] for i, _, _ in arrived], [], {}
    for (_, start, _), c in zip(arrived, clients if warmup else []):        # g_i = ∇R_i(w^{t−τ_i}) (Eq. 13)
        common.set_flat(model, start)
        g.append(client_gradient(model, in_chunks(c, args.batch_size, ctx), c.n, ctx.autocast))   # unaugmented

    def deltas():                                                           # step 2: Δ_i on f_i (Eq. 9)
        if args.parallel_clients == "on":                                   # at once (--local-step sgd, from w^t)
            trained = common.train_clients(model, w_t, clients, args, ctx, objective=bound(args.lam))
            for (i, _, _), (w_i, losses[i]) in zip(arrived, trained):
                yield w_i - w_t
            return
        for (i, start, _), c in zip(arrived, clients):
            common.set_flat(model, start)                                   # w_i ← w^{t−τ_i}
            losses[i] = local_step(model, c, args, ctx)                     # Eq. 2, or SGD
            yield common.get_flat(model) - start
    common.set_flat(model, aggregate(w_t, deltas(), [float(c.n) for c in clients], args.global_lr))  # step 3 (Eq. 3)
    if warmup:                                                              # step 4 (Eq. 13), exits after the last
        exit_strategy(fed, args, state, [i for i, _, _ in arrived], g, [tau == 0 for _, _, tau in arrived], t == W)
    return losses or {ID[0]: torch.zeros((), device=w_t.device)}           # nothing arrived: loss 0


def local_step(model, client, args, ctx):
    """Step 2 on one client from the model's parameters: f_i's step (Eq. 2 with Eq. 9) or SGD on f_i."""
    if args.local_step == "paper":
        return gradient_step(model, in_chunks(client, args.batch_size, ctx, train=True), client.n, args.lr,
                             args.lam, args.weight_decay, chain(model), ctx.autocast)
    f = bound(args.lam)
    return common.local_sgd(model, client, args, ctx, lambda m, x, y: f(m, dict(m.named_parameters()),
                                                                        dict(m.named_buffers()), x, y))


def arrivals(t, S, w_t, args, state, ctx, warmup):
    """The updates of S that arrive in round t, as (i, w^{t−τ_i}, τ_i): here every one, fresh
    (benchmark/fedipg_aberrant.py swaps in its slow or unreliable client's, Section VI-A)."""
    return [(i, w_t, 0) for i in S]


# ---------------------------------- the method as plain functions: torch alone (docs/fedipg.md: Copy it)

def risk(z, y, w=None):
    """The batch's mean cross-entropy, or Σ_j w_j CE_j with common.at_once's per-example weights w."""
    return F.cross_entropy(z, y) if w is None else (F.cross_entropy(z, y, reduction="none") * w).sum()


def risk_and_d(model, x, y, w=None, layers=None):
    """R_i and d = ⟨∇R_i(w), w⟩ on the batch (Eq. 9), with their graphs: d = ⟨∂R/∂z, ż⟩ at the logits
    through `tangent` along the plain chain `layers` (the model is layers[-1](...layers[0](x))), else
    torch.func.jvp of R along w itself. No gradient inside: torch.func.vmap batches it over clients."""
    if layers:
        z, dz = tangent(layers, x)
        e = ((z.softmax(1) - torch.zeros_like(z).scatter(1, y[:, None], 1.0)) * dz).sum(1)   # per example
        return risk(z, y, w), e.mean() if w is None else (e * w).sum()
    params = dict(model.named_parameters())
    return torch.func.jvp(lambda p: risk(torch.func.functional_call(model, p, (x,)), y, w), (params,), (params,))


class Call(torch.nn.Module):
    """fn() as the forward of a module holding `model`: functional_call(Call(model, fn), ...) runs fn
    with a client's parameters in the model's layers."""
    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self):
        return self.fn()


def objective(model, params, buffers, x, y, w=None, lam=0.0, layers=None):
    """f_i = R_i + λ d² on a batch (Eq. 9) at the client's parameters and buffers: the one loss of the
    client-by-client loop (the model's own, w None) and of common.at_once (vmap over the clients)."""
    def f():
        if lam == 0:
            return risk(model(x), y, w)
        R, d = risk_and_d(model, x, y, w, layers)
        return R + lam * d * d
    return torch.func.functional_call(Call(model, f), {"model." + k: v for k, v in {**params, **buffers}.items()}, ())


def tangent(layers, x):
    """The logits z and ż = d/ds z(x; s·w) at s = 1, carried forward beside z by hand (ȧ: the input's):
    conv / linear z = W a + b: ż = W ȧ + z; GroupNorm y = γ x̂ + β: ẏ = γ rstd (ȧ − mean ȧ − x̂ mean(x̂ ȧ)) + y;
    ReLU, pools, flatten: as on a (ReLU: ȧ ⊙ 1[a > 0]; max pool: ȧ at the argmax)."""
    nn = torch.nn
    a, da = x, None                                             # da is None: ȧ = 0; da is a: ȧ = a
    for m in layers:
        same = da is a
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            z = m(a)
            if da is None:
                da = z
            elif same and m.bias is not None:
                da = 2 * z - m.bias.view(-1, *[1] * (z.dim() - 2))
            else:
                da = z + (m._conv_forward(da, m.weight, None) if isinstance(m, nn.Conv2d) else F.linear(da, m.weight))
            a = z
        elif isinstance(m, nn.GroupNorm):
            N, C, G = a.shape[0], a.shape[1], m.num_groups
            xc = a.reshape(N, G, -1) - a.reshape(N, G, -1).mean(-1, keepdim=True)
            rstd = ((xc * xc).mean(-1, keepdim=True) + m.eps).rsqrt()
            shape, gamma = (N, C) + (1,) * (a.dim() - 2), m.weight.view(1, G, -1)
            y = F.group_norm(a, G, m.weight, m.bias, m.eps)
            if da is None:
                da = y
            elif same:
                da = torch.addcmul(y, xc.view_as(a), (m.eps * rstd ** 3 * gamma).reshape(shape))
            else:
                dg = da.reshape(N, G, -1)                       # x̂ mean(x̂ ȧ) = xc rstd² mean(xc ȧ)
                dxh = torch.addcmul(dg - dg.mean(-1, keepdim=True), xc, rstd * rstd * (xc * dg).mean(-1, keepdim=True),
                                    value=-1)
                da = torch.addcmul(y, dxh.view_as(a), (rstd * gamma).reshape(shape))
            a = y
        else:
            b, idx = (F.max_pool2d(a, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, True)
                      if isinstance(m, nn.MaxPool2d) else (m(a), None))
            if same:
                da = b
            elif da is not None:
                da = (da * (a > 0).to(a.dtype) if isinstance(m, nn.ReLU) else
                      da.flatten(2).gather(2, idx.flatten(2)).view_as(b) if isinstance(m, nn.MaxPool2d) else m(da))
            a = b
    return a, da


def full_gradient(model, chunks, n, lam=0.0, layers=None, autocast=None):
    """∇f_i(w) (a tensor per parameter) and f_i(w) over the client's whole split, given as `chunks` of
    (x, y) that hold its n examples once: with a_c = n_c / n, R_i = Σ_c a_c R_c and d = Σ_c a_c d_c, so
    ∇f_i = Σ_c a_c ∇R_c + 2λ d Σ_c a_c ∇d_c, d the whole split's (the chunks change only rounding)."""
    import contextlib
    model.train()
    w = [p for p in model.parameters() if p.requires_grad]
    grad_R, grad_d = [torch.zeros_like(p) for p in w], [torch.zeros_like(p) for p in w]
    R, d = torch.zeros((), device=w[0].device), torch.zeros((), device=w[0].device)
    for x, y in chunks:
        a = len(y) / n                                                      # a_c
        with (autocast or contextlib.nullcontext)():
            risk_c, d_c = risk_and_d(model, x, y, None, layers) if lam > 0 else (risk(model(x), y), None)
        for acc, g in zip(grad_R, torch.autograd.grad(a * risk_c, w, retain_graph=d_c is not None)):
            acc += g                                                        # Σ_c a_c ∇R_c = ∇R_i
        R += a * risk_c.detach().float()
        if d_c is not None:
            for acc, g in zip(grad_d, torch.autograd.grad(a * d_c, w)):
                acc += g                                                    # Σ_c a_c ∇d_c = ∇d
            d += a * d_c.detach().float()
    return [gR + (2 * lam) * d * gd for gR, gd in zip(grad_R, grad_d)], R + lam * d * d


def gradient_step(model, chunks, n, lr, lam, weight_decay=0.0, layers=None, autocast=None):
    """Eq. 2 on f_i: w ← w − η (∇f_i(w) + wd·w) in place, over the whole split (`chunks`); returns f_i(w)."""
    grads, f = full_gradient(model, chunks, n, lam, layers, autocast)
    with torch.no_grad():
        for p, g in zip([p for p in model.parameters() if p.requires_grad], grads):
            p -= lr * (g + weight_decay * p)
    return f


def client_gradient(model, chunks, n, autocast=None):
    """g_i = ∇R_i(w) for Eq. 13, flat, over the whole split: no step, so no momentum or step count enters."""
    return torch.cat([g.reshape(-1) for g in full_gradient(model, chunks, n, autocast=autocast)[0]]).float()


def aggregate(w_t, deltas, n, global_lr=1.0):
    """Eq. 3: w^t + η_g Σ_i n_i Δ_i / Σ_i n_i (flat Δ_i, read one at a time; a stale one is applied to w^t)."""
    delta_sum, weight_sum = torch.zeros_like(w_t), 0.0
    for delta, n_i in zip(deltas, n):
        delta_sum += n_i * delta                                            # n_i Δ_i
        weight_sum += n_i
    return w_t + global_lr * (delta_sum / weight_sum) if weight_sum else w_t


def client_contributions(g, n, fresh, n_all, lr, L):
    """C_i of Eq. 13 for the clients that sent g_i (data sizes n, fresh: τ_i = 0, n_all: all clients'
    data), ∇R(w^t) the n-weighted mean of the other fresh g_j, from the Gram matrix of the g_i (one
    sync). A list of floats, None where no other client is fresh."""
    G = torch.stack(list(g))
    K = (G @ G.T).double().cpu()                                            # ⟨g_i, g_j⟩
    n = torch.tensor(n, dtype=torch.float64)
    p = n * torch.tensor(fresh, dtype=torch.float64)                        # p_j = n_j for fresh j
    Kp, pKp, k = K @ p, p @ K @ p, K.diagonal()
    P_i = p.sum() - p                                                       # the other fresh clients
    dot = (Kp - p * k) / P_i                                                # ⟨∇R(w^t), g_i⟩
    norm2 = (pKp - 2 * p * Kp + p ** 2 * k) / P_i ** 2                      # ||∇R(w^t)||²
    C = lr * (n / n_all) * (dot - L / 2 * k) / norm2                        # Eq. 13
    return [c.item() if P > 0 else None for c, P in zip(C, P_i)]


def exit_rule(C, I_ID):
    """Section IV: the clients of I_ID whose mean C_i is ≤ 0, or that sent none, leave; and the means."""
    mean = {i: sum(v) / len(v) for i, v in C.items()}
    return [i for i in I_ID if mean.get(i, 0.0) <= 0], mean


# ------------------------------------------------------ the plain functions on this project's clients

def chain(model):
    """The model as a list of layers if it is a plain chain of the layers `tangent` knows, else None."""
    parts = [model.featurizer, model.classifier] if isinstance(model, common.Net) else [model]
    layers = [m for part in parts for m in (part if isinstance(part, nn.Sequential) else [part])]
    return layers if all(type(m) in CHAIN and getattr(m, "affine", True) for m in layers) else None


def bound(lam):
    """objective with λ and the model's chain: common.at_once's objective(model, params, buffers, x, y, w)."""
    return lambda model, params, buffers, x, y, w=None: objective(model, params, buffers, x, y, w, lam, chain(model))


def in_chunks(client, batch_size, ctx, train=False):
    """The client's whole split in order, in chunks of batch_size, as model inputs (for training as
    common.local_sgd prepares them: augmented on the photo datasets)."""
    for s in range(0, client.n, batch_size):
        yield ctx.prep(client.x[s:s + batch_size], train=train, gen=ctx.gen if train else None), client.y[s:s + batch_size]


def exit_strategy(fed, args, state, ids, g, fresh, last):
    """Eq. 13's C_i^t for the arrived clients ids into state["contrib"]; after the last warm-up round,
    Section IV's exit rule: the clients it names join I_OOD (state["exited"])."""
    C = client_contributions(g, [float(fed.clients[i].n) for i in ids], fresh, sum(c.n for c in fed.clients),
                             args.lr, args.exit_L)
    for i, C_i in zip(ids, C):
        if C_i is not None:
            state["contrib"].setdefault(i, []).append(C_i)
    if not last:
        return
    ID = [i for i in range(len(fed.clients)) if i not in state["exited"]]
    out, mean = exit_rule(state["contrib"], ID)
    if len(out) == len(ID):
        raise common.UserError("every client's estimated contribution (Eq. 13) is <= 0: lower --exit-L")
    state["exited"] = sorted(state["exited"] + out)
    print("exit strategy: mean C_i (Eq. 13), lowest first: " + ", ".join(
        f"{i}: {mean[i]:.2e}" for i in sorted(mean, key=mean.get)[:5]) + f"; exiting: {out or 'none'}", flush=True)


def init_state(model, fed, args, ctx):
    P = len(fed.clients)
    bad = [i for i in args.exit_clients if not 0 <= i < P]
    if bad or len(args.exit_clients) >= P:
        raise common.UserError(f"client {bad[0]} does not exist: there are {P} clients (0..{P - 1})" if bad else
                               "--exit-clients names every client: nobody is left to train")
    return {"exited": list(args.exit_clients), "contrib": {}}             # I_OOD, C_i^t per client


def evaluate(model, fed, args, state, ctx):
    """common.evaluate_global with model selection on I_ID; with exits, also the validation accuracy
    on I_ID / I_OOD (id_acc / ood_acc) and the exited clients."""
    hit, test = (common.correct(model, x, y, ctx).float() for x, y in ((fed.val_x, fed.val_y), (fed.test_x, fed.test_y)))
    owner = torch.repeat_interleave(torch.arange(len(fed.clients)), torch.tensor([len(c.val_y) for c in fed.clients]))
    ood = torch.isin(owner.to(hit.device), torch.tensor(state["exited"], dtype=torch.long, device=hit.device))
    out = hit[~ood].mean().item(), test.mean().item(), common.group_means(test, fed.test_group, len(fed.test_names)).tolist()
    extra = {"id_acc": out[0], "ood_acc": hit[ood].mean().item() if ood.any() else None, "exited": list(state["exited"])}
    return out if args.exit == "off" and not args.exit_clients else (*out, extra)


# ------------------------------------------------------------------------------------- the CLI

def add_args(p):
    p.add_argument("--lam", type=float, default=None, help="penalty weight λ (default: 1e-3; 1e-4 for ResNets)")
    p.add_argument("--local-step", default="paper", choices=["paper", "sgd"],
                   help="paper: one step w - lr * grad f_i(w) on the whole split (Eq. 2); sgd: --local-epochs of "
                        "minibatch SGD with --momentum (the committed runs)")
    p.add_argument("--exit", default="off", choices=["off", "auto"], help="the exit strategy (Section IV)")
    p.add_argument("--exit-warmup", type=int, default=5, help="rounds of contribution estimates before exits")
    p.add_argument("--warmup", default="pretraining", choices=["pretraining", "rounds"],
                   help="the warm-up runs before round 1 (Algorithm 1), or is rounds 1..W (docs/fedipg.md)")
    p.add_argument("--exit-L", type=float, default=0.5, help="smoothness L of Eq. 13 (dimensionless here)")
    p.add_argument("--exit-clients", default="", type=client_list, help="clients that exit from the start, e.g. 3,7")
    for act in (a for a in p._actions if a.dest in ("momentum", "local_epochs")):
        act.help += f" (--local-step sgd only; default there: the dataset's, {act.dest == 'momentum' and 0.9 or 1} for rmnist)"
    p.set_defaults(momentum=BY_STEP, local_epochs=BY_STEP)


def check(args):
    given = [f"--{k.replace('_', '-')}" for k in ("momentum", "local_epochs") if getattr(args, k) != BY_STEP]
    if args.local_step == "paper" and given:
        raise common.UserError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --local-step sgd "
                               "only: the paper's step (Eq. 2) is one plain gradient step on the client's whole split")
    for k, paper in (("momentum", 0.0), ("local_epochs", 1)):     # sgd: the dataset's, as for every method
        if getattr(args, k) == BY_STEP:
            setattr(args, k, paper if args.local_step == "paper" else
                    next(t[k] for t, _ in common.default_tables(args.dataset) if k in t))
    args.lam = LAMBDA.get(args.dataset, 1e-3) if args.lam is None else args.lam
    args.sample = args.clients if args.sample is None else args.sample   # Eq. 3: every client of I_ID
    for bad, message in ((not args.lam >= 0, f"--lam must be >= 0, got {args.lam}"),
                         (args.exit == "auto" and args.exit_warmup < 1, f"--exit-warmup must be at least 1, got {args.exit_warmup}"),
                         (args.exit == "auto" and args.warmup == "rounds" and args.exit_warmup > args.rounds,
                          f"--warmup rounds: --exit-warmup must be between 1 and --rounds ({args.rounds}), got {args.exit_warmup}"),
                         (not args.exit_L > 0, f"--exit-L must be positive, got {args.exit_L}")):
        if bad:
            raise common.UserError(message)


def client_list(text):
    try:
        return sorted({int(i) for i in text.split(",") if i.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--exit-clients takes client numbers like 3,7, got {text!r}")


def parallel_reason(args):
    """common.check_parallel's `supported`: None where the clients can train at once, else why not."""
    return None if args.local_step == "sgd" else "trains with --local-step paper one client after another " \
        "(one full-batch step each, in chunks, not minibatch SGD: use --local-step sgd for clients at once)"


def main(argv=None):
    return common.main("fedipg", __doc__, fedipg_round, argv, add_args, init_state=init_state,
                       evaluate_fn=evaluate, check=check, parallel_clients=parallel_reason)


if __name__ == "__main__":
    main()
