"""FedIIR — Out-of-Distribution Generalization of Federated Learning via Implicit Invariant
Relationships (Yaming Guo, Kai Guo, Xiaofeng Cao, Tieru Wu, Yi Chang; ICML 2023). Official code:
github.com/YamingGuo98/FedIIR (read at commit 3e7a785). f = w ∘ Φ, θ = (φ, ω): model.featurizer,
model.classifier. Each client aligns its classifier gradient with the global one:

    (FEDIIR)   min_θ  E_c [ R_c(θ) + γ/2 ||∇_ω R_c(θ) − ∇_ω R(θ)||² ]

Algorithm 1 (one round t), in the official code's forms (Table 3's numbers come from the code):
    1. sample a subset S of C clients                                  common.sample_clients
    2. g_bar_ω = mean of ∇_ω R_c(θ^{t-1}; ζ) over every minibatch ζ     global_gradient: classifier_grads,
       of every c ∈ S (the code's mean_grad, augmented inputs)          gbar_mean
       g̃^t = v g̃^{t-1} + (1 − v) g_bar_ω   (Appendix C, g̃^0 = 0)     gbar_update
    3. on every c ∈ S: θ_c ← θ^{t-1}; K minibatch steps on              iir_objective (client by client
       R_c(θ_c; ζ) + γ ||∇_ω R_c(θ_c; ζ) − g̃^t||²  (the code: no 1/2)  or at once: common.at_once)
    4. θ^t = θ^{t-1} + η_g (1/C) Σ_c (θ_c − θ^{t-1})                   server_update
The paper's readings (g_bar over clients, γ/2, data-size weights, g_bar on plain inputs) run in
benchmark/diagnostics/fediir_readings.py.

Defaults: γ from Table 3 (RotatedMNIST 1e-2, VLCS 5e-3, PACS 1e-3, OfficeHome 5e-4, the code's form),
lr / batch from Table 3 (RotatedMNIST 1e-2 / 64); v = 0.95 (Appendix C); 100 rounds, 1 local epoch,
SGD momentum 0.9 (the code). Small scenario: one client per training domain, all sampled (default);
large: `--clients 50` (Algorithm 2). Paper against code, measurements, "Copy it": docs/fediir.md.

    python fediir.py                                  # RotatedMNIST, embedded digits
    python fediir.py --clients 50 --test-domain 0
    python fediir.py --dataset pacs --data-root ./data
"""
import torch
import torch.nn.functional as F

import common

GAMMA = {"rmnist": 1e-2, "vlcs": 5e-3, "pacs": 1e-3, "officehome": 5e-4}  # Table 3


# ---------------------------------------------------------------- the method as plain functions
# Tensors, modules and numbers only (no args, no project objects): what a client computes and
# uploads, and what the server does with it. featurizer Φ and classifier w are two modules (ω: the
# classifier's parameters); gradients are lists of tensors, one per parameter of the classifier.

def classifier_grads(classifier, z, y, batch_size=None):
    """Step 2, on client c, what it uploads for g_bar: ∇_ω R(θ^{t-1}; ζ) of the cross-entropy of the
    classifier on features z = Φ(x) (a plain tensor, computed without a graph: only ω needs a
    gradient here), one per consecutive minibatch ζ of batch_size rows (the code's mean_grad), or one
    over all of z with batch_size None (the paper's full-batch ∇_ω R_c). A generator: one gradient
    in memory at a time."""
    params, b = list(classifier.parameters()), batch_size or len(y)
    for i in range(0, len(y), b):
        # clone: z may be an inference tensor (torch.inference_mode), which cannot enter autograd
        loss = F.cross_entropy(classifier(z[i:i + b].clone()), y[i:i + b])
        yield torch.autograd.grad(loss, params)


def gbar_mean(grads):
    """Step 2, server: g_bar_ω, the mean of the uploaded classifier gradients (any iterable, read
    one at a time: a running sum, memory one copy of ω whatever their number)."""
    total, count = None, 0
    for g in grads:
        if total is None:
            total = [torch.zeros_like(gi) for gi in g]
        total = [a + gi for a, gi in zip(total, g)]
        count += 1
    return [a / count for a in total]


def gbar_update(g_tilde, g_bar, v):
    """Appendix C, server: g̃^t = v g̃^{t-1} + (1 − v) g_bar_ω (v = 0.95, g̃^0 = 0, no bias correction,
    as the code); g̃^t is what the clients align to in step 3."""
    return [v * gt + (1 - v) * gb for gt, gb in zip(g_tilde, g_bar)]


def iir_penalty(g, g_tilde):
    """||g − g̃||², summed over the classifier's parameter tensors (no normalisation, as the code)."""
    return sum(((gi - gt) ** 2).sum() for gi, gt in zip(g, g_tilde))


def iir_objective(featurizer, classifier, x, y, g_tilde, gamma, phi=None, omega=None, w=None):
    """Step 3, on client c, the local objective of one minibatch ζ = (x, y) (Algorithm 1, FedIIR's
    g_c line; the (FEDIIR) objective): R_c(θ; ζ) + γ ||∇_ω R_c(θ; ζ) − g̃||², in the code's form (for
    the paper's γ/2, pass γ/2), as a function of the parameters: φ and ω dicts of tensors by the
    featurizer's and the classifier's own names (parameters and buffers; None: the modules' own, the
    client-by-client loop). ∇_ω R_c is a nested
    torch.func.grad, kept in the graph, so that the penalty's gradient reaches both ω and φ (double
    backward). w: per-example weights (1/b on a batch's b real examples, 0 on padding: the clients at
    once, through vmap), or None: the minibatch's mean. γ = 0: the plain cross-entropy (FedAvg's)."""
    own = lambda module: {**dict(module.named_parameters()), **dict(module.named_buffers())}
    phi, omega = own(featurizer) if phi is None else phi, own(classifier) if omega is None else omega
    z = torch.func.functional_call(featurizer, phi, (x,))

    def risk(omega):
        out = torch.func.functional_call(classifier, omega, (z,))
        return F.cross_entropy(out, y) if w is None else (F.cross_entropy(out, y, reduction="none") * w).sum()
    if gamma == 0:
        return risk(omega)
    g, r = torch.func.grad_and_value(risk)(omega)                      # ∇_ω R_c(θ; ζ), in the graph
    return r + gamma * iir_penalty([g[name] for name, _ in classifier.named_parameters()], g_tilde)


def server_update(theta, thetas, p, global_lr=1.0):
    """Step 4, server: θ^t = θ^{t-1} + η_g Σ_c p_c Δ_c / Σ_c p_c with Δ_c = θ_c − θ^{t-1}. theta: θ^{t-1}
    as a flat vector; thetas: the sampled clients' trained θ_c (flat, any iterable, read one at a
    time); p: their weights (ones: Algorithm 1's and the code's 1/C)."""
    delta_sum, weight_sum = torch.zeros_like(theta), 0.0
    for theta_c, p_c in zip(thetas, p):
        delta_sum += p_c * (theta_c - theta)                                  # p_c Δ_c
        weight_sum += p_c
    return theta + global_lr * (delta_sum / weight_sum)


# ------------------------------------------------------------------- the project's plumbing

def client_features(model, client, ctx, augmented, chunk=256):
    """Φ(x) for all of a client's training data at θ^{t-1}: no graph (only ω needs a gradient in
    step 2), in large chunks (fewer, fuller kernel launches than minibatches). augmented: the inputs
    the local steps train on (the photo datasets' augmentation, drawn from the minibatch stream
    ctx.gen; the digits are never augmented and draw nothing), as the code's g_bar pass."""
    with torch.inference_mode(), ctx.autocast():
        return torch.cat([model.featurizer(ctx.prep(client.x[i:i + chunk], train=augmented, gen=ctx.gen)).float()
                          for i in range(0, client.n, chunk)])


def global_gradient(model, fed, S, ctx, batch_size, augmented=True):
    """Step 2: g_bar_ω at θ^{t-1} over the sampled clients S (train mode), the mean over every
    minibatch of batch_size rows (the code; None: over the clients' full-batch gradients, the paper),
    on the inputs the local steps train on (augmented; False: the plain images). Client by client,
    gradient by gradient."""
    model.train()

    def uploads():
        for c in S:
            z = client_features(model, fed.clients[c], ctx, augmented)
            yield from classifier_grads(model.classifier, z, fed.clients[c].y, batch_size)
    return gbar_mean(uploads())


def iir_loss(g_tilde, gamma):
    """iir_objective as the local loop's loss_fn(model, x, y) (model.featurizer, model.classifier)."""
    def loss_fn(model, x, y):
        return iir_objective(model.featurizer, model.classifier, x, y, g_tilde, gamma)
    return loss_fn


def iir_loss_at(g_tilde, gamma):
    """iir_objective as common.at_once's objective(model, params, buffers, x, y, w): the model's
    dicts split into the featurizer's φ and the classifier's ω (--parallel-clients on)."""
    def objective(model, params, buffers, x, y, w):
        part = lambda prefix: {k[len(prefix):]: v for d in (params, buffers) for k, v in d.items()
                               if k.startswith(prefix)}
        return iir_objective(model.featurizer, model.classifier, x, y, g_tilde, gamma,
                             part("featurizer."), part("classifier."), w)
    return objective


# ------------------------------------------------------------------------------------ one round

def fediir_round(t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                     # θ^{t-1}
    S = common.sample_clients(ctx, len(fed.clients), args.sample)      # step 1
    if args.gamma > 0:                        # step 2 (+ EMA, App. C); skipped at γ = 0: FedAvg exactly
        g_bar = global_gradient(model, fed, S, ctx, args.batch_size)   # over every minibatch, augmented
        state["g_tilde"] = gbar_update(state["g_tilde"], g_bar, args.ema)
    # step 3: on every c ∈ S, θ_c ← θ^{t-1}, then K minibatch steps on the penalised objective (γ, no 1/2)
    trained = common.train_clients(model, theta, [fed.clients[c] for c in S], args, ctx,
                                   loss_fn=iir_loss(state["g_tilde"], args.gamma),
                                   objective=iir_loss_at(state["g_tilde"], args.gamma))   # the same, at once
    losses = {}

    def uploads():                                                     # θ_c, client by client
        for c, (theta_c, loss) in zip(S, trained):
            losses[c] = loss
            yield theta_c
    common.set_flat(model, server_update(theta, uploads(), [1.0] * len(S), args.global_lr))   # step 4: 1/C Σ_c Δ_c
    return losses


def init_state(model, fed, args, ctx):
    return {"g_tilde": [torch.zeros_like(p) for p in model.classifier.parameters()]}  # g̃^0 = 0


def add_args(p):
    p.add_argument("--gamma", type=float, default=None, help="penalty weight γ (default: Table 3 per dataset)")
    p.add_argument("--ema", type=float, default=0.95, help="EMA rate v of the global gradient (Appendix C)")


def check(args):
    if args.gamma is None:
        args.gamma = GAMMA.get(args.dataset, 1e-2)
    if not args.gamma >= 0:
        raise common.UserError(f"--gamma must be >= 0, got {args.gamma}")
    if not 0 <= args.ema < 1:
        raise common.UserError(f"--ema must be in [0, 1), got {args.ema}")


def main(argv=None):
    return common.main("fediir", __doc__, fediir_round, argv, add_args, init_state=init_state, check=check,
                       parallel_clients=True)


if __name__ == "__main__":
    main()
