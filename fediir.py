"""FedIIR — Out-of-Distribution Generalization of Federated Learning via Implicit Invariant
Relationships (Yaming Guo, Kai Guo, Xiaofeng Cao, Tieru Wu, Yi Chang; ICML 2023). Official code:
github.com/YamingGuo98/FedIIR.

The model is f = w ∘ Φ with θ = (φ, ω): featurizer φ and classifier ω (model.featurizer and
model.classifier). Clients learn invariant relationships implicitly by aligning the gradient of
their risk w.r.t. the classifier with the global one:

    (FEDIIR)   min_θ  E_c [ R_c(θ) + γ/2 ||∇_ω R_c(θ) − ∇_ω R(θ)||² ]

Algorithm 1 (one communication round t):
    1. sample a subset S of C clients
    2. g_bar_ω = (1/|S|) Σ_{c∈S} ∇_ω R_c(θ^{t-1})           the global classifier gradient
       g̃^t = v g̃^{t-1} + (1 − v) g_bar_ω                   Appendix C: EMA, v = 0.95, g̃^0 = 0
    3. on every c ∈ S: θ_c ← θ^{t-1}; K minibatch steps on
           R_c(θ_c; ζ) + γ ||∇_ω R_c(θ_c; ζ) − g̃^t||²        (the penalised local step)
       Δ_c = θ_c − θ^{t-1}
    4. θ^t = θ^{t-1} + η_g (1/C) Σ_c Δ_c
Steps 2 to 4 are plain functions of tensors and modules above the round function, to copy into another
training loop (docs/fediir.md, "Copy it"): the client's classifier_grads (its upload for g_bar) and
iir_objective (step 3); the server's gbar_mean, gbar_update (the EMA) and server_update (step 4).
With --parallel-clients on (auto: on CUDA) step 3 trains the sampled clients at once (common.at_once)
on the same iir_objective (one function of the parameters, ∇_ω R_c a nested torch.func.grad),
to float tolerance, not bit for bit (test_methods.py, test_parallel_*); the g_bar pass stays client by client.

Where the paper and the official code differ, the numbers of the paper's tables come from the code,
so the defaults follow the code (github.com/YamingGuo98/FedIIR, read at commit 3e7a785; the files
named below):
- The 1/2. The code adds γ Σ_ω-tensors ||g_c − g̃||² (no 1/2: domainbed/algorithms.py, FedIIR.update)
  and Table 3's γ were tuned with that form, so it is the default; `--half` gives the paper's γ/2.
- g_bar. Paper: the mean of the sampled clients' full-batch gradients (`--gbar clients`). Code: the
  mean of the classifier gradients of every minibatch of every sampled client (`--gbar batches`,
  default; domainbed/algorithms.py, FedIIR.mean_grad), so a client weighs in proportion to its
  number of batches, i.e. its size. Algorithm 2 makes the clients of one domain equal, not the
  domains: in the small scenario (one client per domain) the clients' sizes are the domains'
  (PACS: weights 0.25 / 0.28 / 0.47 when photo is held out), and the two rules differ.
- The g_bar pass's inputs. The code's mean_grad iterates over the clients' training loaders
  (main.py, train_loaders), whose images are augmented on the photo datasets (domainbed/datasets.py,
  augment_transform for every training domain; hparams_registry.py: data_augmentation True), so
  g_bar is taken on augmented images there: the default (`--gbar-inputs augmented`); the paper's
  R_c, the risk on the client's data as it is, is `--gbar-inputs plain` (this file's only form
  until 2026-11-23). The draws come from the minibatch stream (ctx.gen) before the local steps, so
  on pacs / vlcs / officehome the two give a seed different minibatches and augmentations (no
  photo-dataset run is committed); the digit datasets have no augmentation: unchanged (tested). The
  featurizer runs once per example without a graph: only ω needs a gradient there. (The code's
  validation images are augmented too; this file validates on plain images, as common.py does for
  every method.)
- Aggregation: Algorithm 1 and the code average the sampled clients uniformly (1/C), the default;
  `--size-avg` weights them by data size (fedavg.py's default). With γ = 0 this file computes bit for
  bit what `fedavg.py --uniform-avg` computes, and with `--size-avg` what fedavg.py does (tested).
- The classifier's weights start Kaiming-normal as in the code (common.build_model, for every method).
- Model selection (common.py): the evaluation with the best pooled validation accuracy, every 10
  rounds and at the last. The code evaluates after rounds 1, 11, ..., 91 and 100 and selects on the
  mean of the training domains' validation accuracies (the same as pooled when the domains are equal
  in size, as in RotatedMNIST; not on PACS / VLCS / OfficeHome); both keep the earliest of equal bests.
The EMA starts from zeros without bias correction, as in the code (round 1 aligns to 0.05 g_bar).

Defaults: FedIIR Table 3 — RotatedMNIST lr 1e-2 / batch 64 / γ 1e-2; VLCS 1e-3 / 32 / 5e-3; PACS
2.5e-3 / 32 / 1e-3; OfficeHome 1e-3 / 32 / 5e-4 (ResNet-18 for VLCS / PACS, ResNet-50 for OfficeHome,
with the code's two-layer classifier); v = 0.95; 100 rounds; 1 local epoch; SGD momentum 0.9.
Small scenario: one client per training domain, all sampled (the default). Large scenario:
`--clients 50` (C = number of training domains, split by Algorithm 2).

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
    time); p: their weights (ones: Algorithm 1's and the code's 1/C; data sizes: --size-avg)."""
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


def global_gradient(model, fed, S, args, ctx):
    """Step 2: g_bar_ω at θ^{t-1} over the sampled clients S (train mode; augmented inputs unless
    --gbar-inputs plain), as the mean over every minibatch ('batches', the code) or over the
    clients' full-batch gradients ('clients', the paper). Client by client, gradient by gradient."""
    model.train()
    batch_size = args.batch_size if args.gbar == "batches" else None

    def uploads():
        for c in S:
            client = fed.clients[c]
            z = client_features(model, client, ctx, args.gbar_inputs == "augmented")
            yield from classifier_grads(model.classifier, z, client.y, batch_size)
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
        g_bar = global_gradient(model, fed, S, args, ctx)
        state["g_tilde"] = gbar_update(state["g_tilde"], g_bar, args.ema)
    gamma = args.gamma / 2 if args.half else args.gamma
    # step 3: on every c ∈ S, θ_c ← θ^{t-1}, then K minibatch steps on the penalised objective
    trained = common.train_clients(model, theta, [fed.clients[c] for c in S], args, ctx,
                                   loss_fn=iir_loss(state["g_tilde"], gamma),
                                   objective=iir_loss_at(state["g_tilde"], gamma))   # the same, at once
    losses = {}

    def uploads():                                                     # θ_c, client by client
        for c, (theta_c, loss) in zip(S, trained):
            losses[c] = loss
            yield theta_c
    p = [float(fed.clients[c].n) if args.size_avg else 1.0 for c in S]
    common.set_flat(model, server_update(theta, uploads(), p, args.global_lr))   # step 4: 1/C Σ_c Δ_c
    return losses


def init_state(model, fed, args, ctx):
    return {"g_tilde": [torch.zeros_like(p) for p in model.classifier.parameters()]}  # g̃^0 = 0


def add_args(p):
    p.add_argument("--gamma", type=float, default=None, help="penalty weight γ (default: Table 3 per dataset)")
    p.add_argument("--ema", type=float, default=0.95, help="EMA rate v of the global gradient (Appendix C)")
    p.add_argument("--gbar", default="batches", choices=["batches", "clients"],
                   help="g_bar as the mean over minibatches (official code) or over clients (paper)")
    p.add_argument("--gbar-inputs", default="augmented", choices=["augmented", "plain"],
                   help="the g_bar pass on the photo datasets: augmented inputs, as the official code's "
                        "training loaders, or the images without augmentation (this file before)")
    p.add_argument("--half", action="store_true", help="the paper's γ/2 instead of the code's γ")
    p.add_argument("--size-avg", action="store_true",
                   help="weight the clients by data size instead of Algorithm 1's and the code's 1/C")


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
