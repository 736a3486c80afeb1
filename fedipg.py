"""FedIPG — Invariant Federated Learning for Edge Intelligence: Mitigating Heterogeneity and Asynchrony
via Exit Strategy and Invariant Penalty (Hao, Cui, Yang, Wu, Feng, Hu). No public code exists: the
paper (Algorithm 1, Eq. 3, 9, 13, Sections IV and VI) is the specification.

Every client minimises its risk plus an invariance penalty on the whole parameter vector w:

    f_i(w) = R_i(w) + λ ⟨∇R_i(w), w⟩²                                               (Eq. 9)

⟨∇R_i(w), w⟩ = d/ds R_i(s·w) at s = 1: the risk must not change, to first order, when the model is
rescaled (Eq. 7–8: the gradient orthogonal to the invariant parameters). The server averages only
the in-distribution clients I_ID, by data size (Eq. 3). Clients whose participation is detrimental
leave I_ID after a warm-up (the exit strategy: Section IV, Algorithm 1 line 1); the final model still
serves them and is scored on them separately (OOD).

Algorithm 1 (--exit auto: first a pre-training phase, line 1; then rounds t = 1..T from w^1):
    0. pre-training (line 1; Section IV: "prior to formal training, ... all clients and the server
       jointly conduct a pre-training phase ... that assesses each client's delay and data quality"):
       --exit-warmup rounds s = 1..W of steps 1-4 with every client of I_ID, each round estimating
       C_i^s (step 4); after the last, the exits. Then lines 2-4: t = 1 and the server sends "the
       initialized model parameters w^1" to all nodes: the T rounds start from the model the run
       started with and the W rounds are not among them (`--warmup pretraining`, the default).
       `--warmup rounds`: rounds 1..W of the T are the warm-up and training goes on from their model
       (the committed --exit auto runs, docs/fedipg.md, were made so).
One communication round t (w^t: the global model at its start):
    1. the clients that take part: every client of I_ID, as Eq. 3; `--sample C` samples C of them
       per round after the warm-up instead (FedIIR's protocol, which Table II's 50-client rows follow)
    2. each of them whose update arrives this round (aberrant clients below) starts from the global
       model it last received, w^{t−τ_i} (τ_i: its staleness), and updates it; Δ_i = w_i − w^{t−τ_i}:
         --local-step paper (default): one gradient step on f_i over its whole training split,
           w_i = w^{t−τ_i} − η ∇f_i(w^{t−τ_i})         (Eq. 2, Algorithm 1 line 15, Section III-B:
           "each client locally takes a step of gradient descent"; `gradient_step`)
         --local-step sgd: --local-epochs of minibatch SGD with --momentum on f_i, the penalty on
           each minibatch (FedIIR's local training, shared with fedavg.py). Not the paper's, but
           every committed FedIPG number (docs/fedipg.md, benchmark/results) was measured with it.
         --parallel-clients on (auto: on CUDA where it applies) trains them at once (common.at_once)
           on local_objective_at, f_i with `tangent` and per-example weights, to float tolerance
           (test_methods.py, test_parallel_*): with --local-step sgd, the tangent penalty and every client starting
           from w^t (no slow or unreliable client); refused otherwise (parallel_reason). The paper's
           step, one full-batch step per client in chunks, stays client by client.
    3. server: w^{t+1} = w^t + η_g Σ_i n_i Δ_i / Σ_i n_i over the arrived i ∈ I_ID           (Eq. 3)
       (Algorithm 1 averages models, Σ n_i w_i / Σ n_i: the same for fresh updates and η_g = 1; a
       stale Δ_i is applied to the current model, as the analysis of Eq. 12–13 assumes)
    4. warm-up rounds only: the contribution of every arrived client
         C_i^t = η (n_i/n) (⟨∇R(w^t), g_i⟩ − (L/2) ||g_i||²) / ||∇R(w^t)||²,   g_i = ∇R_i(w^{t−τ_i})  (Eq. 13)
       after the last warm-up round, every client whose mean C_i is ≤ 0, or whose update never
       arrived, exits (I_OOD) for good.

Where the paper is silent, and what this file does:
- g_i = ∇R_i(w^{t−τ_i}) exactly: one gradient pass of the client's risk over its training split at
  the model it starts from, before its local step (no augmentation, no step, no random draw: the
  training is the same with or without the estimates); unlike the mean local step −Δ_i/(η s_i), it
  does not grow with momentum or the step count. ∇R(w^t), for client i, is the data-weighted mean
  of the other fresh (τ = 0) clients' g_j, so a client does not vouch for itself; n is the data of
  all clients. Eq. 13 is then free of the gradients' scale and L dimensionless: C_i > 0 ⟺
  ⟨∇R, g_i⟩ / ||g_i||² > L/2 (a client equal to the mean: ∝ 1 − L/2, Eq. 17's "L < 2").
  --exit-L 0.5 is chosen, not the paper's (docs/fedipg.md: the ratios measured with a planted
  rotated client, and what the rule removes at full scale).
- η of Eq. 2 is --lr: the paper gives none (Section IV only bounds it, η ≤ 2n/(n_min L)). The
  per-dataset defaults were set for minibatch SGD with momentum 0.9, under which one plain step per
  round trains much less at the same T; no η is tuned for it here (docs/fedipg.md: measured).
- A client that delivered nothing during the warm-up exits: its delay exceeds the warm-up, and by
  Theorem 2 a contribution turns negative as τ grows. --exit-warmup defaults to 5 rounds (chosen: a
  slow:K client with K ≤ 5 arrives at least once). Clients can also be named: --exit-clients 3,7.
- The penalty and its gradient, exactly, three ways (--penalty; equal up to rounding, tested against
  finite differences and against d/ds R(s·w) by scaling the model): tangent carries ż = d/ds z(x; s·w)
  forward beside z by hand and takes d = ⟨∂R/∂z, ż⟩ at the logits (plain chains of layers: MLP,
  ConvNets); layers uses that every layer holding parameters is affine in them (conv, linear,
  GroupNorm, BatchNorm), so d = Σ_l ⟨∂R/∂z_l, z_l⟩ over their outputs (any such model: ResNets);
  params takes d = ⟨∇_w R, w⟩ from the parameter gradients. auto: tangent where it applies, else
  layers; a round costs 2.4× FedAvg's with tangent, 2.9× with layers, 3.4× with params
  (docs/fedipg.md: Cost).
- λ (Figure 4: (1e-4, 1e-2) helps, smaller for complex tasks): 1e-3 for rmnist, stained and
  synthetic (the middle of the range), 1e-4 for the ResNet datasets (its low end, as advised).
- Stained MNIST (Section VI-C; docs/datasets.md): the MLP of IRM's ColoredMNIST on 14×14×3 images,
  Section VI-C's clients (common.stained_clients), every client in every round; lr 0.1 and batch 64
  are chosen (the paper gives none; at rmnist's 1e-2 the MLP barely moves: loss 2.30 → 2.29 in 30
  rounds of FedAvg).
- Aberrant clients (Section VI-A), --aberrant KIND:VALUE on client --aberrant-client (default 0):
  slow:K      its update takes K rounds: it receives w^t, its Δ is computed from w^t and arrives in
              round t + K − 1 (τ = K − 1); then it receives the model of the next round
  unreliable:P  each round its download and its upload each succeed with probability P; it always
              trains from the last model it received, so its updates arrive late and stale
  rotate:DEG  its images (training and validation) are turned by a further DEG degrees
  slow and unreliable need every client to take part in every round (--sample = --clients), as
  Algorithm 1 ("for all clients") and Section VI-A's 20 clients. All clients receive w^1 (line 4),
  again after the pre-training phase: a slow client's unfinished update is dropped then.
- Evaluation: model selection on the pooled validation split of I_ID; with exits or an aberrant
  client, the results add id_acc / ood_acc (validation accuracy on I_ID / I_OOD; Figure 3 uses
  training accuracy), aberrant_acc / regular_acc and the exited clients.

With λ = 0, exit off, no aberrant client and --local-step sgd, this file computes bit for bit what
fedavg.py computes (with the paper's step, what fedavg.py computes with one full-batch step of plain
gradient descent, to rounding: FedSGD).

    python fedipg.py                                              # Table II: RotatedMNIST-5
    python fedipg.py --local-step sgd                             # E epochs of SGD (the committed runs)
    python fedipg.py --clients 50 --sample 5                      # RotatedMNIST-50, 5 sampled as FedIIR
    python fedipg.py --dataset stained --stain bg                 # Table III (MLP, 5 clients x 2,000)
    python fedipg.py --clients 20 --test-domain 75 --aberrant rotate:180 --exit auto   # Section VI-A
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from data import rotate

BY_STEP = math.inf   # default of --momentum and --local-epochs: set by --local-step in check()
LAMBDA = {"rmnist": 1e-3, "stained": 1e-3, "synthetic": 1e-3, "pacs": 1e-4, "vlcs": 1e-4, "officehome": 1e-4}
AFFINE = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.BatchNorm2d)   # outputs affine in their own parameters
CHAIN = (nn.Conv2d, nn.Linear, nn.ReLU, nn.GroupNorm, nn.MaxPool2d, common.GlobalMean, nn.Flatten)


# ---------------------------------------------------------------- the method as plain functions
# What a client computes (f_i of Eq. 9 and its step, Eq. 2; g_i, which it uploads for Eq. 13) and
# what the server does with it (Eq. 3; Eq. 13 and the exit rule), as functions of modules, tensors
# and numbers that need torch alone (docs/fedipg.md: Copy it). A model is any nn.Module; `layers` (a
# plain chain: the model is layers[-1](...layers[0](x))) or `affine` (its layers that hold
# parameters, each affine in them) choose how d = ⟨∇R_i(w), w⟩ is computed, else from the parameter
# gradients; `autocast`, if given, makes the context of the forward passes.

def tangent(layers, x):
    """The logits z and ż = d/ds z(x; s·w) at s = 1, carried forward by hand beside z, as ordinary
    differentiable tensors (forward mode along w itself; autograd then differentiates both streams):
        conv / linear  z = W a + b    ż = W ȧ + z                  ȧ = 0: ż = z;  ȧ = a: ż = 2z − b
        GroupNorm      y = γ x̂ + β    ẏ = γ ⊙ rstd (ȧ − mean ȧ − x̂ mean(x̂ ȧ)) + y      (per group)
                                      ȧ = a: ẏ = γ ⊙ x̂ eps rstd² + y  (scale-free but for eps)
        ReLU, pools, flatten: piecewise linear, applied to ȧ as to a (ReLU: ȧ ⊙ 1[a > 0]; max pool:
        ȧ at the argmax).
    ȧ = 0 and ȧ = a hold exactly from the input up to the first GroupNorm or hidden linear layer;
    they are tracked (da is None, da is a) to skip the products they make unnecessary."""
    nn = torch.nn
    a, da = x, None
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
            if isinstance(m, nn.MaxPool2d):
                b, idx = F.max_pool2d(a, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, True)
            else:
                b = m(a)
            if same:
                da = b
            elif da is not None:
                da = (da * (a > 0).to(a.dtype) if isinstance(m, nn.ReLU) else
                      da.flatten(2).gather(2, idx.flatten(2)).view_as(b) if isinstance(m, nn.MaxPool2d) else m(da))
            a = b
    return a, da


def risk_and_d(model, x, y, layers=None, affine=None):
    """R_i and d = ⟨∇R_i(w), w⟩ on the batch (x, y), both with their graphs, exactly: through
    `tangent` if `layers` is given (no gradient inside: one ordinary backward of the result), from
    the `affine` layers' outputs (d = Σ_l ⟨∂R/∂z_l, z_l⟩) if they are given, else from the gradients
    of the model's parameters (d = Σ ⟨∂R/∂w, w⟩)."""
    if layers:                                                  # d = ⟨∂R/∂z, ż⟩ at the logits
        z, dz = tangent(layers, x)
        onehot = torch.zeros_like(z).scatter(1, y[:, None], 1.0)   # F.one_hot's values; vmap can batch it
        d = ((z.softmax(1) - onehot) * dz).sum(1).mean()
        return F.cross_entropy(z, y), d
    if affine is None:                                          # d = Σ ⟨∂R/∂w, w⟩ over the parameters
        risk = F.cross_entropy(model(x), y)
        w = [p for p in model.parameters() if p.requires_grad]
        g = torch.autograd.grad(risk, w, create_graph=True)
        return risk, sum((gi * wi).sum() for gi, wi in zip(g, w))
    z = []                                                      # d = Σ_l ⟨∂R/∂z_l, z_l⟩

    def keep(module, inputs, out):
        z.append(out)
        return out.clone()                                      # later in-place ops (ResNet's +=) hit the copy
    hooks = [m.register_forward_hook(keep) for m in affine]
    try:
        risk = F.cross_entropy(model(x), y)
    finally:
        for h in hooks:
            h.remove()
    dz = torch.autograd.grad(risk, z, create_graph=True)
    return risk, sum((a * b).sum() for a, b in zip(dz, z))


def local_objective(model, x, y, lam, layers=None, affine=None):
    """f_i = R_i + λ d², d = ⟨∇R_i(w), w⟩, on the batch (x, y) (Eq. 9): the loss of a minibatch step."""
    if lam == 0:
        return F.cross_entropy(model(x), y)
    risk, d = risk_and_d(model, x, y, layers, affine)
    return risk + lam * d * d


def local_objective_at(layers, x, y, w, lam):
    """local_objective through `tangent` with per-example weights w (1/b on a batch's b real examples,
    0 on padding): f_i = Σ_j w_j CE_j + λ d², d = Σ_j w_j ⟨∂CE_j/∂z_j, ż_j⟩ (Eq. 9), the batch's
    means over its real examples. No gradient is taken inside, so torch.func.vmap batches it over
    clients whose parameters torch.func.functional_call puts in the layers."""
    z, dz = tangent(layers, x)
    onehot = torch.zeros_like(z).scatter(1, y[:, None], 1.0)
    d = (((z.softmax(1) - onehot) * dz).sum(1) * w).sum()                  # ⟨∇R_i(w), w⟩
    return (F.cross_entropy(z, y, reduction="none") * w).sum() + lam * d * d


def gradient_step(model, chunks, n, lr, lam, weight_decay=0.0, layers=None, affine=None, autocast=None):
    """The client's local step: w ← w − η ∇f_i(w) in place (Eq. 2, Algorithm 1 line 15), f_i = R_i + λ d²
    over its whole training split (Eq. 1, 9), given as `chunks`, an iterable of (x, y) that together
    hold its n examples once. The chunks change nothing but rounding: R_i = Σ_c a_c R_c and
    d = Σ_c a_c d_c (a_c = n_c / n, both linear in the per-example losses), so ∇f_i = Σ_c a_c ∇R_c +
    2λ d Σ_c a_c ∇d_c, with d the whole split's. weight_decay adds wd·w, as SGD's does. Returns f_i(w)
    before the step (a tensor; no host synchronisation)."""
    import contextlib
    model.train()
    w = [p for p in model.parameters() if p.requires_grad]
    grad_R, grad_d = [torch.zeros_like(p) for p in w], [torch.zeros_like(p) for p in w]
    R, d = torch.zeros((), device=w[0].device), torch.zeros((), device=w[0].device)
    for x, y in chunks:
        a = len(y) / n                                                      # a_c
        with (autocast or contextlib.nullcontext)():
            risk_c, d_c = risk_and_d(model, x, y, layers, affine) if lam > 0 else (F.cross_entropy(model(x), y), None)
        for acc, g in zip(grad_R, torch.autograd.grad(a * risk_c, w, retain_graph=d_c is not None)):
            acc += g                                                        # Σ_c a_c ∇R_c = ∇R_i
        R += a * risk_c.detach().float()
        if d_c is not None:
            for acc, g in zip(grad_d, torch.autograd.grad(a * d_c, w)):
                acc += g                                                    # Σ_c a_c ∇d_c = ∇d
            d += a * d_c.detach().float()
    with torch.no_grad():
        for p, gR, gd in zip(w, grad_R, grad_d):                            # w − η (∇R_i + 2λ d ∇d)
            p -= lr * (gR + (2 * lam) * d * gd + weight_decay * p)          # Eq. 2 with Eq. 9
    return R + lam * d * d                                                  # f_i(w)


def client_gradient(model, chunks, n, autocast=None):
    """g_i = ∇R_i(w), what a client uploads for Eq. 13: the gradient of its mean cross-entropy over
    its whole training split (`chunks` as in gradient_step), as one flat float vector in the order of
    model.parameters(). It takes no step, so neither momentum nor the number of local steps enters."""
    import contextlib
    model.train()
    w = [p for p in model.parameters() if p.requires_grad]
    g = [torch.zeros_like(p) for p in w]
    for x, y in chunks:
        with (autocast or contextlib.nullcontext)():
            risk = F.cross_entropy(model(x), y) * (len(y) / n)
        for a, b in zip(g, torch.autograd.grad(risk, w)):
            a += b
    return torch.cat([a.reshape(-1) for a in g]).float()


def aggregate(w_t, deltas, n, global_lr=1.0):
    """The server's step (Eq. 3): w^{t+1} = w^t + η_g Σ_i n_i Δ_i / Σ_i n_i over the clients of I_ID
    whose update arrived (Δ_i = w_i − w^{t−τ_i}, flat; a stale one is applied to the current w^t).
    deltas is read one at a time (a generator keeps one client's in memory); none: w^t."""
    delta_sum, weight_sum = torch.zeros_like(w_t), 0.0
    for delta, n_i in zip(deltas, n):
        delta_sum += n_i * delta                                            # n_i Δ_i
        weight_sum += n_i
    return w_t + global_lr * (delta_sum / weight_sum) if weight_sum else w_t


def client_contributions(g, n, fresh, n_all, lr, L):
    """C_i^t of Eq. 13 for the clients that sent g (their g_i), with n their data sizes, fresh whether
    each update is fresh (τ_i = 0), n_all the data of all clients, lr the η of Eq. 2, L the smoothness:
        C_i = η (n_i / n_all) (⟨∇R(w^t), g_i⟩ − (L/2) ||g_i||²) / ||∇R(w^t)||²
    with ∇R(w^t), for client i, the n-weighted mean of the other fresh clients' g_j (from the Gram
    matrix of the g_i, one sync). A list of floats, None where no other client is fresh."""
    G = torch.stack(list(g))
    K = (G @ G.T).double().cpu()                                            # ⟨g_i, g_j⟩
    n = torch.tensor(n, dtype=torch.float64)
    p = n * torch.tensor(fresh, dtype=torch.float64)                        # p_j = n_j for fresh j
    Kp, pKp, P = K @ p, p @ K @ p, p.sum()
    C = []
    for k in range(len(n)):
        P_i = P - p[k]                                                      # the other fresh clients
        if P_i <= 0:
            C.append(None)                                                  # nobody else to compare with
            continue
        dot = (Kp[k] - p[k] * K[k, k]) / P_i                                # ⟨∇R(w^t), g_i⟩
        norm2 = (pKp - 2 * p[k] * Kp[k] + p[k] ** 2 * K[k, k]) / P_i ** 2   # ||∇R(w^t)||²
        C.append((lr * (n[k] / n_all) * (dot - L / 2 * K[k, k]) / norm2).item())   # Eq. 13
    return C


def exit_rule(C, I_ID):
    """After the warm-up (Section IV): the clients of I_ID whose mean contribution is ≤ 0, or that
    never sent one (their delay exceeds the warm-up), leave for good. C: {client: [C_i^t, ...]}.
    Returns those clients and the mean contributions."""
    mean = {i: sum(v) / len(v) for i, v in C.items()}
    return [i for i in I_ID if mean.get(i, 0.0) <= 0], mean


# ------------------------------------------------- the plain functions on this project's clients

def chain(model):
    """The model as a list of layers if it is a plain chain of the layers `tangent` knows, else None."""
    parts = [model.featurizer, model.classifier] if isinstance(model, common.Net) else [model]
    layers = [m for part in parts for m in (part if isinstance(part, nn.Sequential) else [part])]
    ok = all(type(m) in CHAIN and getattr(m, "affine", True) for m in layers)
    return layers if ok else None


def affine_layers(model):
    layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    bad = [type(m).__name__ for m in layers if not isinstance(m, AFFINE)]
    if bad:
        raise common.UserError(f"--penalty layers needs layers affine in their parameters, not {bad[0]}; "
                               f"use --penalty params")
    return layers


def penalty_layers(model, mode, lam):
    """risk_and_d's (layers, affine) as --penalty says: the chain for tangent (auto, where the model
    is one), the affine layers for layers (auto otherwise), neither for params or λ = 0."""
    layers = chain(model) if lam > 0 and mode in ("tangent", "auto") else None
    return (layers, None) if layers else (None, None if mode == "params" or lam == 0 else affine_layers(model))


def ipg_loss(lam, mode="auto"):
    """f_i of Eq. 9 on a minibatch, as common.local_sgd's loss (--local-step sgd)."""
    def loss_fn(model, x, y):
        return local_objective(model, x, y, lam, *penalty_layers(model, mode, lam))
    return loss_fn


class Applied(nn.Module):
    """fn(*inputs) as the forward of a module holding `model`, so that torch.func.functional_call puts
    a client's parameters in the model's layers for a function other than model.forward."""

    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def ipg_loss_at(lam):
    """ipg_loss as common.at_once's objective(model, params, buffers, x, y, w), for --parallel-clients
    on: the penalty through `tangent` (parallel_reason refuses the other --penalty forms, which take
    gradients inside the loss)."""
    def objective(model, params, buffers, x, y, w):
        if lam == 0:
            return common.weighted_cross_entropy(model, params, buffers, x, y, w)
        layers = chain(model)
        host = Applied(model, lambda x, y, w: local_objective_at(layers, x, y, w, lam))
        return torch.func.functional_call(host, {"model." + k: v for d in (params, buffers) for k, v in d.items()},
                                          (x, y, w))
    return objective


def parallel_reason(args):
    """common.check_parallel's `supported`: None where the round's clients can train at once through
    common.train_clients, else why not."""
    if args.local_step == "paper":
        return ("trains with --local-step paper one client after another (one full-batch step each, in "
                "chunks, not minibatch SGD: use --local-step sgd for clients at once)")
    if args.aberrant and args.aberrant[0] in ("slow", "unreliable"):
        return f"--aberrant {args.aberrant[0]}: a stale client starts from an older model than the others"
    if args.lam > 0 and (args.penalty in ("layers", "params") or args.model.startswith("resnet")):
        return ("takes the penalty at once through --penalty tangent only (the other forms differentiate "
                "inside the loss)")
    return None


def in_chunks(client, batch_size, ctx, train=False):
    """The client's whole training split, in order, in chunks of batch_size (memory only), as model
    inputs: for training as common.local_sgd prepares them (augmented on the photo datasets, from
    the minibatch stream; the digits draw nothing), else plain."""
    for s in range(0, client.n, batch_size):
        x = client.x[s:s + batch_size]
        yield ctx.prep(x, train=True, gen=ctx.gen) if train else ctx.prep(x), client.y[s:s + batch_size]


def paper_step(model, client, args, ctx):
    """--local-step paper: one step on f_i over the client's whole split (Eq. 2); momentum has no
    step to act on."""
    return gradient_step(model, in_chunks(client, args.batch_size, ctx, train=True), client.n, args.lr, args.lam,
                         args.weight_decay, *penalty_layers(model, args.penalty, args.lam), autocast=ctx.autocast)


def local_step(model, client, args, ctx):
    """Step 2's local update from the model's current parameters, as --local-step says."""
    if args.local_step == "paper":
        return paper_step(model, client, args, ctx)                         # one step on f_i (Eq. 2)
    return common.local_sgd(model, client, args, ctx, ipg_loss(args.lam, args.penalty))   # E epochs on f_i


def risk_gradient(model, client, ctx, batch_size):
    """g_i = ∇R_i(w) at the model's parameters, over the client's training split, unaugmented."""
    return client_gradient(model, in_chunks(client, batch_size, ctx), client.n, ctx.autocast)


def contributions(fed, args, state, ids, g, fresh):
    """C_i^t of Eq. 13 for the arrived clients ids, appended to state["contrib"]."""
    C = client_contributions(g, [float(fed.clients[i].n) for i in ids], fresh, sum(c.n for c in fed.clients),
                             args.lr, args.exit_L)
    for i, C_i in zip(ids, C):
        if C_i is not None:
            state["contrib"].setdefault(i, []).append(C_i)


def decide_exits(fed, state):
    """The exit rule after the last warm-up round: the exited clients join I_OOD."""
    ID = [i for i in range(len(fed.clients)) if i not in state["exited"]]
    out, mean = exit_rule(state["contrib"], ID)
    if len(out) == len(ID):
        raise common.UserError("every client's estimated contribution (Eq. 13) is <= 0: lower --exit-L")
    state["exited"] = sorted(state["exited"] + out)
    ranked = sorted(mean, key=mean.get)
    print("exit strategy: mean C_i (Eq. 13), lowest first: " +
          ", ".join(f"{i}: {mean[i]:.2e}" for i in ranked[:5]) + f"; exiting: {out or 'none'}", flush=True)


# --------------------------------------------------------------------------------- one round

def fedipg_round(t, model, fed, args, state, ctx):
    exits = args.exit == "auto"
    if exits and args.warmup == "pretraining" and t == 1:                  # Algorithm 1 line 1, before t = 1
        w_1 = common.get_flat(model)
        for s in range(1, args.exit_warmup + 1):                            # pre-training rounds s = 1..W
            one_round(s, model, fed, args, state, ctx, warmup=True, last=s == args.exit_warmup)
        common.set_flat(model, w_1)                                         # lines 2-4: t = 1, w^1 to all
        state.update(aberrant_start(w_1, args))
    warmup = exits and args.warmup == "rounds" and t <= args.exit_warmup   # rounds 1..W of T
    return one_round(t, model, fed, args, state, ctx, warmup, last=t == args.exit_warmup)


def one_round(t, model, fed, args, state, ctx, warmup, last):
    """Steps 1-4 of the docstring at round t; warmup: estimate C_i^t (Eq. 13), and decide the exits
    after the last warm-up round."""
    w_t = common.get_flat(model)                                            # w^t
    ID = [i for i in range(len(fed.clients)) if i not in state["exited"]]  # I_ID
    C = len(ID) if warmup else min(args.sample, len(ID))                   # the warm-up: all of I_ID
    S = [ID[k] for k in common.sample_clients(ctx, len(ID), C)]            # step 1
    arrived = arrivals(t, S, w_t, args, state, ctx)                         # (i, w^{t−τ_i}, τ_i)
    losses, g = {}, []

    def deltas():                                                           # step 2, client by client
        if args.parallel_clients == "on":           # at once (parallel_reason: --local-step sgd, all fresh)
            ids = [i for i, _, _ in arrived]
            common.set_flat(model, w_t)
            if warmup:                                                      # g_i = ∇R_i(w^t), no draws
                g.extend(risk_gradient(model, fed.clients[i], ctx, args.batch_size) for i in ids)
            for i, (w_i, loss) in zip(ids, common.train_clients(model, w_t, [fed.clients[i] for i in ids], args, ctx,
                                                                loss_fn=ipg_loss(args.lam, args.penalty),
                                                                objective=ipg_loss_at(args.lam))):
                losses[i] = loss
                yield w_i - w_t                                             # Δ_i
            return
        for i, start, tau in arrived:
            common.set_flat(model, start)                                   # w_i ← w^{t−τ_i}
            if warmup:
                g.append(risk_gradient(model, fed.clients[i], ctx, args.batch_size))   # g_i = ∇R_i(w^{t−τ_i})
            losses[i] = local_step(model, fed.clients[i], args, ctx)       # Eq. 2 on f_i (Eq. 9)
            yield common.get_flat(model) - start                            # Δ_i
    n = [float(fed.clients[i].n) for i, _, _ in arrived]
    common.set_flat(model, aggregate(w_t, deltas(), n, args.global_lr))    # step 3 (Eq. 3)
    if warmup:                                                              # step 4 (Eq. 13)
        contributions(fed, args, state, [i for i, _, _ in arrived], g, [tau == 0 for _, _, tau in arrived])
        if last:
            decide_exits(fed, state)
    return losses or {ID[0]: torch.zeros((), device=w_t.device)}           # nothing arrived: loss 0


def arrivals(t, S, w_t, args, state, ctx):
    """The clients of S whose update arrives in round t, as (i, w^{t−τ_i}, τ_i): all of them, fresh,
    but the slow or unreliable aberrant client (docstring)."""
    kind, value = args.aberrant or (None, None)
    arrived = []
    for i in S:
        start, tau = w_t, 0
        if i == args.aberrant_client and kind == "slow":
            if state["since"] is None:                                     # idle: receives w^t, starts
                state["since"], state["received"] = t, w_t
            if t - state["since"] < value - 1:
                continue                                                   # still computing
            start, tau, state["since"] = state["received"].to(w_t.device), t - state["since"], None  # τ = K − 1
        elif i == args.aberrant_client and kind == "unreliable":
            down, up = (torch.rand(2, generator=ctx.sampler) < value).tolist()
            if down:
                state["since"], state["received"] = t, w_t
            if not up:
                continue                                                   # upload lost
            start, tau = state["received"].to(w_t.device), t - state["since"]   # (a resume loads it on the CPU)
        arrived.append((i, start, tau))
    return arrived


# ----------------------------------------------------------------------- state and evaluation

def init_state(model, fed, args, ctx):
    P = len(fed.clients)
    for i in args.exit_clients + ([args.aberrant_client] if args.aberrant else []):
        if not 0 <= i < P:
            raise common.UserError(f"client {i} does not exist: there are {P} clients (0..{P - 1})")
    if args.aberrant and args.aberrant[0] in ("slow", "unreliable") and args.sample != P:
        raise common.UserError(f"--aberrant {args.aberrant[0]} needs every client in every round: "
                               f"--sample {P} (got {args.sample})")
    if args.aberrant and args.aberrant[0] == "rotate":                     # this client's images turn
        c = fed.clients[args.aberrant_client]
        c.x, c.val_x = (rotate(v.cpu(), args.aberrant[1]).to(v.device) for v in (c.x, c.val_x))
        fed.val_x = torch.cat([c.val_x for c in fed.clients])
    if args.penalty == "tangent" and args.lam > 0 and not chain(model):
        raise common.UserError(f"--penalty tangent needs a chain of {', '.join(m.__name__ for m in CHAIN)} "
                               f"(not --model {args.model}); use --penalty layers")
    if args.penalty in ("auto", "layers") and args.lam > 0 and not chain(model):
        affine_layers(model)                                               # refuse other layers early
    if len(args.exit_clients) >= P:
        raise common.UserError("--exit-clients names every client: nobody is left to train")
    return {"exited": list(args.exit_clients), "contrib": {},              # I_OOD, C_i^t per client
            **aberrant_start(common.get_flat(model), args)}


def aberrant_start(w, args):
    """A slow or unreliable client's state when the server sends w to all (Algorithm 1 line 4):
    it has received w, in round 1."""
    kind = args.aberrant[0] if args.aberrant else None
    return {"since": 1 if kind == "unreliable" else None,                  # round of the last download
            "received": w if kind in ("slow", "unreliable") else None}     # the model it last received


def evaluate(model, fed, args, state, ctx):
    """Validation accuracy on I_ID (model selection) and test accuracy, as common.evaluate_global;
    with exits or an aberrant client, also the accuracy on I_ID, I_OOD and the aberrant client."""
    hit = common.correct(model, fed.val_x, fed.val_y, ctx).float()
    owner = torch.repeat_interleave(torch.arange(len(fed.clients)),
                                    torch.tensor([len(c.val_y) for c in fed.clients])).to(hit.device)
    ood = torch.isin(owner, torch.tensor(state["exited"], dtype=torch.long, device=hit.device))
    val = hit[~ood].mean() if state["exited"] else hit.mean()
    test = common.correct(model, fed.test_x, fed.test_y, ctx).float()
    per = common.group_means(test, fed.test_group, len(fed.test_names))
    if not (args.exit != "off" or args.exit_clients or args.aberrant):
        return val.item(), test.mean().item(), per.tolist()
    extra = {"id_acc": val.item(), "ood_acc": hit[ood].mean().item() if ood.any() else None,
             "exited": list(state["exited"])}
    if args.aberrant:
        mine = owner == args.aberrant_client
        extra.update(aberrant_acc=hit[mine].mean().item(), regular_acc=hit[~mine].mean().item())
    return val.item(), test.mean().item(), per.tolist(), extra


# ------------------------------------------------------------------------------------- the CLI

def add_args(p):
    p.add_argument("--lam", type=float, default=None, help="penalty weight λ (default: 1e-3; 1e-4 for ResNets)")
    p.add_argument("--penalty", default="auto", choices=["auto", "tangent", "layers", "params"],
                   help="⟨∇R, w⟩ carried forward (tangent), from the layer outputs or from the parameter "
                        "gradients; auto: tangent for chains of plain layers (MLP, ConvNets), else layers")
    p.add_argument("--exit", default="off", choices=["off", "auto"], help="the exit strategy (Section IV)")
    p.add_argument("--local-step", default="paper", choices=["paper", "sgd"],
                   help="paper: one gradient step w - lr * grad f_i(w) on the client's whole split per round "
                        "(Eq. 2; --local-epochs and --momentum do not apply); sgd: --local-epochs of minibatch SGD "
                        "with --momentum on f_i (the committed runs)")
    p.add_argument("--exit-warmup", type=int, default=5, help="rounds of contribution estimates before exits")
    p.add_argument("--warmup", default="pretraining", choices=["pretraining", "rounds"],
                   help="pretraining: the warm-up runs before round 1, outside the T rounds, which start again "
                        "from w^1 (Algorithm 1); rounds: it is rounds 1..W of T and its model is kept")
    p.add_argument("--exit-L", type=float, default=0.5, help="smoothness L of Eq. 13 (dimensionless here)")
    p.add_argument("--exit-clients", default="", help="clients that exit from the start, e.g. 3,7")
    p.add_argument("--aberrant", default=None, help="slow:K, unreliable:P or rotate:DEG (Section VI-A)")
    p.add_argument("--aberrant-client", type=int, default=0, help="which client is aberrant")
    rmnist = dict(momentum=0.9, local_epochs=1)
    for act in p._actions:
        if act.dest in rmnist:
            act.help += f" (--local-step sgd only; default there: the dataset's, {rmnist[act.dest]} for rmnist)"
    p.set_defaults(momentum=BY_STEP, local_epochs=BY_STEP)


def check(args):
    if args.local_step == "paper":
        given = [f for f, v in (("--momentum", args.momentum), ("--local-epochs", args.local_epochs)) if v != BY_STEP]
        if given:
            raise common.UserError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --local-step sgd only: the paper's step (Eq. 2) "
                                   f"is one plain gradient step on the client's whole split")
        args.momentum, args.local_epochs = 0.0, 1      # what that step does
    for k in ("momentum", "local_epochs"):      # --local-step sgd: the dataset's, as for every method
        if getattr(args, k) == BY_STEP:
            setattr(args, k, next(t[k] for t, _ in common.default_tables(args.dataset) if k in t))
    if args.lam is None:
        args.lam = LAMBDA.get(args.dataset, 1e-3)
    if args.sample is None:
        args.sample = args.clients          # Eq. 3: every client of I_ID (None: one per domain, all of them)
    if not args.lam >= 0:
        raise common.UserError(f"--lam must be >= 0, got {args.lam}")
    if args.exit == "auto" and args.exit_warmup < 1:
        raise common.UserError(f"--exit-warmup must be at least 1, got {args.exit_warmup}")
    if args.exit == "auto" and args.warmup == "rounds" and args.exit_warmup > args.rounds:
        raise common.UserError(f"--warmup rounds: --exit-warmup must be between 1 and --rounds ({args.rounds}), "
                               f"got {args.exit_warmup}")
    if not args.exit_L > 0:
        raise common.UserError(f"--exit-L must be positive, got {args.exit_L}")
    try:
        args.exit_clients = sorted({int(i) for i in args.exit_clients.split(",") if i.strip()}) \
            if isinstance(args.exit_clients, str) else args.exit_clients
    except ValueError:
        raise common.UserError(f"--exit-clients takes client numbers like 3,7, got {args.exit_clients!r}")
    if isinstance(args.aberrant, str):
        kind, _, value = args.aberrant.partition(":")
        try:
            value = {"slow": int, "unreliable": float, "rotate": float}[kind](value)
        except (KeyError, ValueError):
            raise common.UserError(f"--aberrant takes slow:K, unreliable:P or rotate:DEG, got {args.aberrant!r}")
        if (kind == "slow" and value < 1) or (kind == "unreliable" and not 0 < value <= 1):
            raise common.UserError(f"--aberrant {args.aberrant}: K must be >= 1 and P in (0, 1]")
        args.aberrant = [kind, value]


def main(argv=None):
    return common.main("fedipg", __doc__, fedipg_round, argv, add_args, init_state=init_state,
                       evaluate_fn=evaluate, check=check, parallel_clients=parallel_reason)


if __name__ == "__main__":
    main()
