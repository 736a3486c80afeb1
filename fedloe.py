"""FedLOE — Federated Domain Generalization via Locally Overfit Ensemble (anonymous, under review;
code: anonymous.4open.science/r/fedloe-542D (Appendix E), built on the FedDG benchmark of Bai et al.,
github.com/inouye-lab/FedDG_Benchmark, whose src/client.py holds the IRM, VREx and Fish clients).

A featurizer g_θ and a linear head h_ψ(z) = W z + b, ψ = (W, b). Every client is an expert on its own
domain; FedLOE lets the experts overfit locally and ensembles them, twice (Table 1; [the function below]):
Stage 1 — FedAvg with infrequent communication (Eq. 4): E1 = --stage1-epochs local epochs, averaged
    K1 = --stage1-comms times. Client c: (θ_c, ψ_c) ← (θ, ψ), E1/K1 epochs of Adam on its risk L_c;
    server: (θ, ψ) ← Σ_c p(c) (θ_c, ψ_c), p(c) ∝ n_c (§2.2)                                [average]
    K1 = E1 is minibatch-SGD-like ERM, K1 = 1 one-shot averaging (Figure 1a's two ends).
Stage 2 — θ̂ frozen; K2 = --stage2-comms communications (Algorithm 1):
    2.1 client c, from the broadcast ψ: E2/K2 = --stage2-epochs / K2 epochs of SGD on L_c(θ̂, ψ_c)
        → ψ̂_c (Eq. 10), uploaded                                                       [overfit_head]
    2.2 all heads go down; client c uploads ŷ_{c,c'} = h_{ψ̂_c'}(g_θ̂(x)) of every head c' on its
        tuning split, with the labels                                                   [head_predictions]
        server, each client an environment, φ from uniform (Eq. 11; q_c below):         [fit_phi]
            φ̂ = argmin_φ Σ_c q_c R_c(Σ_c' φ_c' ŷ_c') + λ r(Σ_c' φ_c' ŷ_c')
        and ψ = Σ_c φ̂_c ψ̂_c goes down (Eq. 12; exact: Σ_c φ_c (W_c z + b_c) = (Σ φ_c W_c) z + Σ φ_c b_c)
                                                                                        [ensemble]
`--stage2-comms 0` stops after stage 1: the paper's "our FedAvg". A round of common.py (evaluation,
checkpoint, --resume) is one communication: rounds 1..K1 are stage 1, the next K2 stage 2; --rounds
and --local-epochs follow from the stage flags. The reported accuracy is the last round's (Table 5
stops at a fixed iteration), never a stage-1 checkpoint picked by validation.

Protocols. Every client keeps 90% of its training split to train on and 10% as its tuning split
(Appendix D.2). Leave-one-domain-out: the 10% that common.federate holds out of every client is halved
into validation and in-domain test (D.2's 5% + 5%); history rows carry `in_domain_acc` beside the
held-out domain's `test_acc`. Fixed clients (rcmnist, rcfmnist, waterbird; label skew: mnist, emnist,
cifar10, cifar100; not in the paper): the split's clients are the environments of Eq. 11, the
validation hold-out stays whole, and the final model is scored on the clients' own test sets as
FedAvg is (`per_client_test_acc`).

Communication (float32 bytes, printed after each stage): stage 1 θ^0 down, then per communication P·|θ|
up and P·|θ| down; stage 2 per communication P·|ψ| up (heads), P·P·|ψ| down (every head to every
client), Σ_c n_c^tune·(P·m floats + 1 label) up (predictions), P·|ψ| down (the ensemble).

The terms of Eq. 11 (--dg-form). The paper's tables came from its code, so the default, `feddg`, is
FedLOE's base code (FedDG_Benchmark src/client.py: IRM.step, VREx.irm_penalty, Fish.step); `paper` is
Appendix C.1 as printed; `domainbed` DomainBed's algorithms.py (github.com/facebookresearch/DomainBed):
                      feddg (default)              paper                        domainbed
    risk weight q_c   1/P                          p(c) = n_c / Σ_c' n_c'       1/P
    irm  λ ·          mean_c (∂_w R_c)²            Σ_c (∂_w R_c)²               mean_c (∂_w R_c)²
    rex  λ ·          mean_c V_c                   Σ_c V_c                      Var_c R_c (§2.1's r_REx)
    fish inner step   on R_c                       on P·p(c)·R_c                on R_c
  R_c: client c's risk on its tuning split; ∂_w R_c = ∂R_c(w · Σφŷ)/∂w at w = 1 (IRMv1), squared on the
  whole split (the codes multiply a minibatch's even and odd halves: an unbiased estimate of it); V_c:
  the population variance of the per-example losses on c's split (C.1's V_{p_c}[ℓ]); Var_c R_c: that
  of the clients' risks. feddg's IRMv1 term is λ/P of the paper's (5 at 20 clients). No warm-up of λ.
  fish (Table 5: a meta lr, no λ): per server step, from φ̃ = φ, one Adam step on w_c R_c(φ̃) for every
    client c in turn, then φ ← φ + meta_lr (φ̃ − φ); the inner Adam keeps its state across server steps
    (DomainBed's create_clone) and starts fresh each communication, as φ does. To first order in the
    inner lr α (SGD; Shi et al.) it descends Σ_c w_c R_c − (α/2) Σ_{c<c'} w_c w_c' ⟨∇R_c, ∇R_c'⟩: P times
    Eq. 11's risk term plus r_fish = −Σ_{c≠c'} ⟨∇R_c, ∇R_c'⟩ weighted by w_c w_c' (1 for equal clients).

Choices where the paper is silent:
- A fresh Adam per client per communication in stage 1, as the base code (ERM.init_train builds one at
  every fit; keeping P states would cost 2|θ| floats per client: ResNet-50, 100 clients, 19 GB); a fresh
  SGD per client per communication for the heads.
- Table 5's "stage 2: 8 iterations, 4 communications" read like its stage 1: 8 head epochs over 4
  communications (Algorithm 1 can also be read as 4 head epochs: --stage2-epochs 4).
- Stage-2 features: once per client, no augmentation (θ̂ is frozen; after --resume from the same θ̂).
- Server: φ uniform at every communication (FedLOE's code's initial mixing weights), --server-steps
  full-batch steps of Adam (DomainBed's optimiser for IRM, V-REx, Fish) at Table 5's stage-2 lr and
  weight decay: Table 5's SGD, used for the heads, diverged on φ at lr 0.05 with IRM λ = 100 (φ
  non-finite in the second communication on the synthetic domains). Every client in every
  communication (Eq. 4 and 11 run over all c).
- Fixed clients: FedAvg's protocol there (common.py: model, batch, weight decay, clients); Adam's lr
  1e-3 for the models trained from scratch (DomainBed's MNIST lr; IRM's ColoredMNIST code trains
  RC-MNIST's MLP by full-batch Adam at 1e-3 with this L2 for about 500 steps, which 512 epochs at the
  full batch of 25,000 are), 5e-5 for waterbird's pretrained ResNet (as PACS). E1 = 32·K1 (Table 5's
  256 / 8), K1 the whole number nearest to 1/32 of the local epochs a client trains in FedAvg's default
  run (rounds × local epochs × sample / clients): rcmnist 500 → 16; label skew 100 × 5 × 20/100 → 3.

Defaults, each with its source (a test checks every one):
    --batch-size 128                     Table 5; fixed clients FedAvg's (rcmnist 25000, mnist 16, waterbird 32)
    --stage1-epochs 256, --stage1-comms 8   Table 5 (stage 1 iterations = the epoch budget E1; total
                                         communication); fixed clients above (rcmnist 512 / 16, others 96 / 3)
    --lr 5e-5 pacs, 3e-5 officehome      Table 5 (stage 1 Adam lr); vlcs (not in the paper): as pacs
    --lr 1e-3 rmnist, fixed clients      DomainBed hparams_registry.py (MNIST); waterbird 5e-5 (as pacs)
    --lr 1e-2 synthetic                  chosen: the tests learn in a few epochs
    --weight-decay 0                     stage 1: Table 5 gives none; rcmnist 2.2e-3 (FedAvg's, IRM's L2)
    --global-lr 1                        Eq. 4 (the server takes the weighted average itself)
    --stage2-epochs 8, --stage2-comms 4  Table 5 (stage 2 iterations and communications)
    --stage2-lr 0.05, --stage2-wd 5e-4   Table 5 (stage 2 lr and weight decay: heads and server)
    --momentum 0                         Table 5 (stage 2: SGD, no momentum given)
    --dg-lambda 100, --meta-lr 0.05      Table 5 (IRM and REx λ; Fish meta lr, PACS and OfficeHome)
    --dg irm, --server-steps 100         chosen (Table 2's first FedLOE row; above)
    --dg-form feddg                      FedDG_Benchmark src/client.py (above)
    --clients 20                         Figure 1a (its code's PACS config: 100); fixed clients: the split's
    --select last, --eval-every 1        Table 5 (fixed iteration); every communication evaluated
    --model resnet50, --head linear      Appendix D.3 (pacs, vlcs, officehome: ResNet-50, 2048 features);
                                         the others common.py's (rmnist ConvNet, rcmnist MLP, mnist CNN, ...)

    python fedloe.py --dataset pacs --data-root ./data --dg fish
    python fedloe.py --stage1-epochs 8 --stage1-comms 2 --test-domain 0      # a quick look
    python fedloe.py --dataset rcmnist --no-rotation --dg rex                # fixed clients
    python fedloe.py --stage2-comms 0                                         # "our FedAvg"
"""
import math

import torch
import torch.nn.functional as F

import common
import data

EVERY = math.inf      # default of --sample: every client, set in check()
PHOTO = dict(model="resnet50", head="linear")
RC = dict(lr=1e-3, weight_decay=2.2e-3, batch_size=25000, clients=4, stage1_epochs=512, stage1_comms=16)
FL = dict(lr=1e-3, batch_size=16, clients=100, stage1_epochs=96, stage1_comms=3)
DEFAULTS = {"pacs": dict(PHOTO, lr=5e-5), "vlcs": dict(PHOTO, lr=5e-5), "officehome": dict(PHOTO, lr=3e-5),
            "rmnist": dict(lr=1e-3), "synthetic": dict(lr=1e-2),
            "rcmnist": RC, "rcfmnist": RC, "mnist": FL, "emnist": FL, "cifar10": FL, "cifar100": FL,
            "waterbird": dict(lr=5e-5, batch_size=32, clients=4, stage1_epochs=96, stage1_comms=3),
            "*": dict(batch_size=128, momentum=0.0, clients=20, sample=EVERY, eval_every=1, select="last",
                      stage1_epochs=256, stage1_comms=8)}
BY_STAGES = math.inf  # default of --rounds and --local-epochs: set from the stage flags in check()


# ---------------------------------------------------------------- the method as plain functions
# Tensors, modules and numbers only. Stage 1's client step is plain local Adam (any training loop);
# its server step is `average`. Stage 2: the client's overfit_head and head_predictions, the server's
# Tuning (what it holds), fit_phi (Eq. 11, with the terms below) and ensemble (Eq. 12).

def average(theta, thetas, n, global_lr=1.0):
    """Eq. 4: θ + η_g Σ_c n_c (θ_c − θ) / Σ_c n_c, the p(c)-weighted mean of the uploads at η_g = 1.
    theta: the broadcast (θ, ψ), flat; thetas: the clients' trained ones (flat; any iterable, read
    one at a time); n: their training sizes n_c."""
    delta_sum, weight_sum = torch.zeros_like(theta), 0.0
    for theta_c, n_c in zip(thetas, n):
        delta_sum += n_c * (theta_c - theta)
        weight_sum += n_c
    return theta + global_lr * delta_sum / weight_sum


def overfit_head(W, b, z, y, batches, lr, momentum=0.0, weight_decay=0.0):
    """Eq. 10 on a client: from the broadcast ψ = (W [m, d], b [m]), one SGD step on the cross-entropy of
    its features z [n, d] (g_θ̂(x)) and labels y per index tensor of `batches`. Returns ψ̂_c (its upload)
    and the mean loss."""
    W, b = W.clone().requires_grad_(), b.clone().requires_grad_()
    opt = torch.optim.SGD([W, b], lr=lr, momentum=momentum, weight_decay=weight_decay)
    total, steps = torch.zeros((), device=z.device), 0
    for idx in batches:
        loss = F.cross_entropy(F.linear(z[idx], W, b), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach()
        steps += 1
    return W.detach(), b.detach(), total / max(steps, 1)


def head_predictions(z, Ws, bs):
    """2.2 on a client: ŷ_{c,c'} = h_{ψ̂_c'}(z) [n, P, m] of every head (Ws [P, m, d], bs [P, m]) on its
    tuning features z [n, d]; uploaded with the labels."""
    return torch.einsum("nd,kmd->nkm", z, Ws) + bs


class Tuning:
    """What the server holds in 2.2: Y [N, P, m], every head's predictions on the N tuning examples, client by
    client, their labels y [N], and the clients' tuning and training sizes (ints). Client c's rows: the slice
    rows[c] (a boolean mask would make the host wait for the device); its sums: products with `member` [N, P]."""

    def __init__(self, Y, y, n_tune, n_train):
        self.Y, self.y, self.n_train, self.rows, end = Y, y, list(n_train), [], 0
        for k in n_tune:
            self.rows.append(slice(end, end + k))
            end += k
        env = torch.cat([torch.full((k,), c, device=y.device) for c, k in enumerate(n_tune)])
        self.member = F.one_hot(env, len(n_tune)).to(Y.dtype)
        self.n_tune = torch.tensor(n_tune, dtype=Y.dtype, device=Y.device)
        n = torch.tensor(n_train, dtype=Y.dtype, device=Y.device)
        self.p = n / n.sum()                                               # p(c), Eq. 11 (--dg-form paper)


def sample_losses(phi, T, scale=None):
    """ℓ(Σ_c' φ_c' ŷ_c', y) of every tuning example [N]. `scale` [P]: IRMv1's dummy multiplier w per client."""
    logits = torch.einsum("nkm,k->nm", T.Y, phi)
    if scale is not None:
        logits = logits * (T.member @ scale)[:, None]                      # w of each example's client
    return F.cross_entropy(logits, T.y, reduction="none")


def risks(phi, T, scale=None):
    """R_c [P]: each client's risk of Σ_c' φ_c' ŷ_c' on its tuning split. A product with the one-hot membership:
    reproducible on CUDA (index_add_'s float sums follow no fixed order outside deterministic mode)."""
    return (sample_losses(phi, T, scale) @ T.member) / T.n_tune


def risk_weights(T, form="feddg"):
    """q_c, the weight of client c's risk in Eq. 11: p(c) (paper), or 1/P (the codes' mean over the groups)."""
    return T.p if form == "paper" else torch.full_like(T.p, 1.0 / len(T.rows))


def irm_penalty(phi, T, form="feddg"):
    """IRMv1 (Appendix C.1): (∂R_c(w · Σφŷ)/∂w at w = 1)² per client, one gradient call for all clients;
    summed over the clients (paper), or their mean (feddg, domainbed: src/client.py's penalty /= n_groups)."""
    w = torch.ones(len(T.rows), dtype=T.Y.dtype, device=T.Y.device, requires_grad=True)
    grad, = torch.autograd.grad(risks(phi, T, w).sum(), w, create_graph=True)
    return (grad ** 2).sum() if form == "paper" else (grad ** 2).mean()


def rex_penalty(phi, T, form="feddg"):
    """V-REx. feddg / paper: V_c, the population variance of the per-example losses on client c's tuning
    split (Appendix C.1; src/client.py's VREx.irm_penalty), averaged (feddg) or summed (paper) over the
    clients; domainbed: the population variance of the clients' risks R_c (§2.1, DomainBed's VREx)."""
    ell = sample_losses(phi, T)
    R = (ell @ T.member) / T.n_tune
    if form == "domainbed":
        return ((R - R.mean()) ** 2).mean()
    V = (((ell - T.member @ R) ** 2) @ T.member) / T.n_tune              # V_c, every client at once
    return V.sum() if form == "paper" else V.mean()


def fish_weights(T, form="feddg"):
    """Fish's weight of each client's inner step: P·p(c) (paper: Eq. 11's p(c), 1 for equal clients), or 1."""
    P, total = len(T.n_train), sum(T.n_train)
    return [P * n / total if form == "paper" else 1.0 for n in T.n_train]


def fish_step(phi, T, w, meta_lr, tilde, inner):
    """One Fish step (DomainBed's): φ̃ ← φ, one step of the inner Adam on w_c R_c(φ̃) for each client c in turn,
    then φ + meta_lr (φ̃ − φ). `inner` optimises `tilde` and keeps its state (DomainBed's create_clone)."""
    with torch.no_grad():
        tilde.copy_(phi)                                                  # φ̃ ← φ
    for c, rows in enumerate(T.rows):
        R_c = F.cross_entropy(torch.einsum("nkm,k->nm", T.Y[rows], tilde), T.y[rows])  # mean over client c's rows
        inner.zero_grad(set_to_none=True)
        (w[c] * R_c).backward()
        inner.step()
    return phi + meta_lr * (tilde.detach() - phi)


def fit_phi(T, r="irm", form="feddg", lam=100.0, lr=0.05, weight_decay=5e-4, steps=100, meta_lr=0.05):
    """Eq. 11 on the server: the ensemble weights φ [P] from uniform; `steps` full-batch Adam steps on
    Σ_c q_c R_c + λ r for r = "irm" or "rex", or `steps` Fish meta steps (r = "fish"); form: --dg-form."""
    P = len(T.rows)
    phi = torch.full((P,), 1.0 / P, dtype=T.Y.dtype, device=T.Y.device)
    if r == "fish":
        w = fish_weights(T, form)
        tilde = phi.clone().requires_grad_()                             # φ̃ and its Adam: one per communication
        inner = torch.optim.Adam([tilde], lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            phi = fish_step(phi, T, w, meta_lr, tilde, inner)
        return phi
    q = risk_weights(T, form)
    phi.requires_grad_()
    opt = torch.optim.Adam([phi], lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        penalty = irm_penalty(phi, T, form) if r == "irm" else rex_penalty(phi, T, form)
        loss = (q * risks(phi, T)).sum() + lam * penalty                 # Eq. 11
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return phi.detach()


def ensemble(phi, Ws, bs):
    """Eq. 12: the heads (Ws [P, m, d], bs [P, m]) combined by φ [P] into one linear head ψ = (W, b)."""
    return torch.einsum("k,kmd->md", phi, Ws), phi @ bs


# ------------------------------------------------------------- the rounds: the above with common.py

tuning = Tuning        # the server's view of 2.2's uploads, built once per communication


def split_appendix_d2(fed, seed, lodo=True):
    """Each client's training split -> 90% train / 10% tune. lodo: each client's 10% hold-out -> half
    validation (pooled: fed.val_x) and half in-domain test (pooled: fed.id_x). Seeded, in place."""
    g = torch.Generator().manual_seed(seed)
    for c in fed.clients:
        if c.n < 2:
            raise common.UserError(f"client {c.id} has {c.n} training example(s), too few for a train/tune split; "
                                   f"use fewer --clients")
        perm = torch.randperm(c.n, generator=g).to(c.y.device)
        k = max(1, int(0.1 * c.n))
        c.tune_x, c.tune_y, c.x, c.y = c.x[perm[:k]], c.y[perm[:k]], c.x[perm[k:]], c.y[perm[k:]]
        if lodo:
            h = len(c.val_y) // 2
            c.id_x, c.id_y, c.val_x, c.val_y = c.val_x[:h], c.val_y[:h], c.val_x[h:], c.val_y[h:]
    if lodo:
        fed.val_x, fed.val_y = torch.cat([c.val_x for c in fed.clients]), torch.cat([c.val_y for c in fed.clients])
        fed.id_x, fed.id_y = torch.cat([c.id_x for c in fed.clients]), torch.cat([c.id_y for c in fed.clients])


def stage1_round(model, fed, args, state, ctx):
    """One synchronisation of Eq. 4: every client E1/K1 epochs of Adam from (θ, ψ), then the average."""
    theta, losses = common.get_flat(model), {}
    adam = lambda params: torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
    trained = common.train_clients(model, theta, fed.clients, args, ctx, adam)  # (θ_c, ψ_c) ← (θ, ψ); Adam

    def uploads():                                                       # θ_c, client by client
        for c, (theta_c, loss) in enumerate(trained):
            losses[c] = loss
            yield theta_c
    common.set_flat(model, average(theta, uploads(), [c.n for c in fed.clients], args.global_lr))  # Eq. 4
    count(state, "stage1", up=len(fed.clients) * theta.numel() * 4, down=len(fed.clients) * theta.numel() * 4)
    return losses


@torch.no_grad()
def features(model, x, ctx, chunk=512):
    """g_θ̂(x) for a client's images: no graph (θ̂ is frozen), no augmentation."""
    model.eval()
    with ctx.autocast():
        return torch.cat([model.featurizer(ctx.prep(x[i:i + chunk])).float() for i in range(0, len(x), chunk)])


def solve_phi(T, args):
    return fit_phi(T, args.dg, args.dg_form, args.dg_lambda, args.stage2_lr, args.stage2_wd, args.server_steps,
                   args.meta_lr)


def stage2_round(t, model, fed, args, state, ctx):
    P, head = len(fed.clients), model.classifier
    W0, b0 = head.weight.detach(), head.bias.detach()                    # the broadcast ψ
    Ws, bs, losses = [], [], {}
    for c, client in enumerate(fed.clients):                             # 2.1, on the clients
        if not hasattr(client, "z"):      # θ̂ is frozen: one featurizer pass per client for all of stage 2
            client.z, client.z_tune = features(model, client.x, ctx), features(model, client.tune_x, ctx)
        minibatches = common.batches(len(client.y), args.batch_size, args.stage2_epochs // args.stage2_comms, ctx)
        W, b, losses[c] = overfit_head(W0, b0, client.z, client.y, minibatches, args.stage2_lr, args.momentum,
                                       args.stage2_wd)                   # Eq. 10
        Ws.append(W)
        bs.append(b)
    Ws, bs = torch.stack(Ws), torch.stack(bs)                            # heads up, all heads down
    Y = torch.cat([head_predictions(c.z_tune, Ws, bs) for c in fed.clients])  # 2.2: ŷ_{c,c'} up
    T = tuning(Y, torch.cat([c.tune_y for c in fed.clients]), [len(c.tune_y) for c in fed.clients],
               [c.n for c in fed.clients])
    phi = solve_phi(T, args)                                             # Eq. 11, on the server
    if not bool(torch.isfinite(phi).all()):                               # one host sync per round
        raise common.NonFinite(f"non-finite ensemble weights φ in round {t} (server, --dg {args.dg}, testing on "
                               f"{fed.name}); lower --dg-lambda or --stage2-lr")
    W, b = ensemble(phi, Ws, bs)                                         # Eq. 12: ψ = Σ_c φ_c ψ̂_c
    with torch.no_grad():
        head.weight.copy_(W)
        head.bias.copy_(b)
    state["phi"] = phi
    print(f"round {t}: φ in [{phi.min():.4f}, {phi.max():.4f}], sum {phi.sum():.4f} (uniform: {1 / P:.4f})", flush=True)
    n_psi, m = W0.numel() + b0.numel(), b0.numel()
    count(state, "stage2", up=P * n_psi * 4 + len(T.y) * (P * m * 4 + T.y.element_size()),
          down=P * P * n_psi * 4 + P * n_psi * 4)
    return losses


def fedloe_round(t, model, fed, args, state, ctx):
    if t <= args.stage1_comms:
        losses = stage1_round(model, fed, args, state, ctx)
    else:
        losses = stage2_round(t, model, fed, args, state, ctx)
    for stage, k in (("stage1", args.stage1_comms), ("stage2", args.stage2_comms)):
        if k and t == (args.stage1_comms if stage == "stage1" else args.rounds):
            up, down = state["bytes"][stage]
            print(f"{stage}: {k} communications with {len(fed.clients)} clients, {up / 2**20:.2f} MiB up, "
                  f"{down / 2**20:.2f} MiB down", flush=True)
    return losses


def count(state, stage, up, down):
    state["bytes"][stage] = [state["bytes"][stage][0] + up, state["bytes"][stage][1] + down]


def init_state(model, fed, args, ctx):
    split_appendix_d2(fed, args.seed, lodo=args.dataset in data.LODO)
    n_theta = sum(p.numel() for p in model.parameters())
    return {"bytes": {"stage1": [0, len(fed.clients) * n_theta * 4], "stage2": [0, 0]},  # θ^0 goes down
            "phi": torch.zeros(0, device=ctx.device)}


def evaluate(model, fed, args, state, ctx):
    """common's scores (fixed clients: each client's own test set too); leave-one-domain-out: the in-domain test."""
    val, test, per = common.evaluate_global(model, fed, args, state, ctx)
    if args.dataset not in data.LODO:
        return val, test, per, {}
    in_domain = common.correct(model, fed.id_x, fed.id_y, ctx).float().mean().item() if len(fed.id_y) else None
    return val, test, per, {"in_domain_acc": in_domain}


def add_args(p):
    a = p.add_argument
    a("--stage1-epochs", type=int, default=None, help="stage 1 budget of local epochs E1")
    a("--stage1-comms", type=int, default=None, help="stage 1 communications K1; E1/K1 epochs between averages")
    a("--stage2-epochs", type=int, default=8, help="stage 2 epochs of local head training in all (Table 5)")
    a("--stage2-comms", type=int, default=4, help="stage 2 communications K2 (Table 5); 0 = stage 1 only")
    a("--stage2-lr", type=float, default=0.05, help="stage 2 lr: heads (SGD) and server (Adam) (Table 5)")
    a("--stage2-wd", type=float, default=5e-4, help="stage 2 weight decay, heads and server (Table 5)")
    a("--dg", default="irm", choices=["irm", "fish", "rex"], help="invariance term r of Eq. 11")
    a("--dg-lambda", type=float, default=100.0, help="λ of IRM and REx (Table 5)")
    a("--meta-lr", type=float, default=0.05, help="Fish meta lr (Table 5)")
    a("--dg-form", default="feddg", choices=["feddg", "paper", "domainbed"],
      help="the terms of Eq. 11 (docstring table): FedLOE's base code (FedDG_Benchmark src/client.py), Appendix "
           "C.1 as printed (risks by p(c); penalties summed over the clients), or DomainBed's (V-REx across clients)")
    a("--server-steps", type=int, default=100, help="server steps on φ per communication (chosen)")
    p.set_defaults(rounds=BY_STAGES, local_epochs=BY_STAGES)


def check(args):
    if args.rounds != BY_STAGES or args.local_epochs != BY_STAGES:
        raise common.UserError("fedloe sets the rounds and local epochs from --stage1-epochs, --stage1-comms "
                               "and --stage2-comms; drop --rounds / --local-epochs")
    if args.head != "linear":
        raise common.UserError("fedloe ensembles linear heads (Eq. 12 is exact only for them): use --head linear")
    if args.sample not in (None, EVERY) and args.sample != args.clients:
        raise common.UserError("fedloe uses every client at every communication (Eq. 4, Eq. 11): drop --sample")
    if args.stage1_comms < 1 or args.stage1_epochs < 1 or args.stage1_epochs % args.stage1_comms:
        raise common.UserError(f"--stage1-epochs ({args.stage1_epochs}) must be a positive multiple of "
                               f"--stage1-comms ({args.stage1_comms}) >= 1")
    if args.stage2_comms < 0 or args.stage2_epochs < 0 or (args.stage2_comms and args.stage2_epochs % args.stage2_comms):
        raise common.UserError(f"--stage2-epochs ({args.stage2_epochs}) must be a multiple of --stage2-comms "
                               f"({args.stage2_comms}), both >= 0")
    if args.select == "val" and args.stage2_comms:   # the best validation round could be a stage-1 (FedAvg) one
        raise common.UserError("fedloe reports the end of stage 2 (Table 5 stops at a fixed iteration); "
                               "--select val would pick among stage-1 rounds too: drop it")
    for k in ("stage2_lr", "meta_lr"):
        if not getattr(args, k) > 0:
            raise common.UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    for k in ("stage2_wd", "dg_lambda", "server_steps"):
        if not getattr(args, k) >= 0:
            raise common.UserError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k)}")
    args.sample = args.clients
    args.rounds = args.stage1_comms + args.stage2_comms
    args.local_epochs = args.stage1_epochs // args.stage1_comms


def main(argv=None):
    return common.main("fedloe", __doc__, fedloe_round, argv, add_args, DEFAULTS, init_state, evaluate, check,
                       parallel_clients=True)


if __name__ == "__main__":
    main()
