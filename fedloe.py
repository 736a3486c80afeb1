"""FedLOE — Federated Domain Generalization via Locally Overfit Ensemble (anonymous, under review;
code: anonymous.4open.science/r/fedloe-542D (Appendix E), built on the FedDG benchmark of Bai et al.,
github.com/inouye-lab/FedDG_Benchmark, whose src/client.py holds the IRM, VREx and Fish clients).

The model is a featurizer g_θ (model.featurizer) and one linear head h_ψ(z) = W z + b
(model.classifier), ψ = (W, b). Every client is an expert on its own domain; FedLOE lets the experts
overfit locally and then ensembles them, twice (paper Table 1):

Stage 1 — FedAvg with infrequent communication (Eq. 4). A budget of E1 = --stage1-epochs local
    epochs, synchronised K1 = --stage1-comms times (every E1/K1 epochs):
        every client c: (θ_c, ψ_c) ← (θ, ψ); E1/K1 epochs of Adam on its risk L_c(θ_c, ψ_c)
        server:         (θ, ψ) ← Σ_c p(c) (θ_c, ψ_c),   p(c) ∝ n_c (§2.2: "based on the training size")
    K1 = E1 is minibatch-SGD-like ERM, K1 = 1 is one-shot averaging (Figure 1a's two ends).
Stage 2 — θ̂ frozen; K2 = --stage2-comms times (Eq. 12, Algorithm 1):
    2.1 every client starts from the broadcast head ψ and overfits it on its training split (Eq. 10):
        E2/K2 = --stage2-epochs / --stage2-comms epochs of SGD on L_c(θ̂, ψ_c) → ψ̂_c; uploads ψ̂_c
    2.2 the server broadcasts all heads; client c sends the predictions ŷ_{c,c'} = h_{ψ̂_c'}(g_θ̂(x))
        of every head c' on its tuning split, and the labels; treating each client as an
        environment, the server fits one weight per head (Eq. 11)
            φ̂ = argmin_φ Σ_c q_c E_c^tune[ℓ(Σ_c' φ_c' ŷ_c', y)] + λ r(Σ_c' φ_c' ŷ_c', y)
        (q_c: the weight of client c's risk, below) and broadcasts ψ = Σ_c φ̂_c ψ̂_c (Eq. 12).
    Why Eq. 12 is exact: an ensemble of linear heads is a linear head,
        Σ_c φ_c (W_c z + b_c) = (Σ_c φ_c W_c) z + Σ_c φ_c b_c.
`--stage2-comms 0` stops after stage 1: the paper's "our FedAvg".

A round (common.py's unit: evaluation, checkpoint, --resume) is one communication: rounds 1..K1 are
stage 1, rounds K1+1..K1+K2 stage 2. --rounds and --local-epochs follow from the stage flags. The
reported test accuracy is the last round's, the end of stage 2 (Table 5 stops at a fixed iteration),
never a stage-1 (FedAvg) checkpoint picked by validation.

Data (Appendix D.2): of every training domain 5% validation (model selection), 5% in-domain test,
the rest over the clients (one domain per client, common.federate's Algorithm 2 split); each client
keeps 90% as its training split and 10% as its tuning split. Here the 10% that common.federate holds
out of every client is halved into validation and in-domain test (same proportions, held out per
client). The history rows carry `in_domain_acc` beside the held-out domain's `test_acc`.

Communication (counted in float32 bytes and printed at the end of each stage):
    stage 1:  down θ^0, then per communication P·|θ| up and P·|θ| down
    stage 2:  per communication P·|ψ| up (heads), P·P·|ψ| down (every head to every client),
              Σ_c n_c^tune·(P·m floats + 1 label) up (predictions), P·|ψ| down (the ensemble)
The predictions are m numbers per example and head, far less than the images they come from.

The invariance terms of Eq. 11, with each client an environment, by --dg-form. Where the paper and
the code disagree the paper's tables came from the code, so the default, `feddg`, is FedLOE's base
code: the FedDG benchmark's src/client.py (IRM.step, VREx.irm_penalty, Fish.step). `paper` is
Eq. 11 with Appendix C.1 as printed; `domainbed` is DomainBed's algorithms.py (IRM, VREx, Fish;
github.com/facebookresearch/DomainBed), whose V-REx is §2.1's r_REx:
                      feddg (default)              paper                        domainbed
    risk weight q_c   1/P                          p(c) = n_c / Σ_c' n_c'       1/P
    irm  λ ·          mean_c (∂_w R_c)²            Σ_c (∂_w R_c)²               mean_c (∂_w R_c)²
    rex  λ ·          mean_c V_c                   Σ_c V_c                      Var_c R_c
    fish inner step   on R_c                       on P·p(c)·R_c                on R_c
  R_c is client c's risk on its tuning split; ∂_w R_c = ∂R_c(w · Σφŷ)/∂w at w = 1 (IRMv1), the
  square taken on the client's whole tuning split (the codes take the product of the derivatives
  on the even and the odd examples of a minibatch, an unbiased estimate of the same square; the
  server holds the whole split). V_c is the population variance of the per-example losses on client
  c's tuning split (Appendix C.1's V_{p_c}[ℓ]: the base code's VREx.irm_penalty, averaged over the
  groups like its IRM penalty); Var_c R_c the population variance of the clients' risks (§2.1,
  DomainBed). The codes average their groups' risks uniformly; Eq. 11 weighs them by p(c), as Eq. 4
  does. The IRMv1 term of `feddg` and `domainbed` is λ/P of the paper's (5 at 20 clients for
  λ = 100). No warm-up of λ (Table 5 gives λ alone).
  fish: Fish's algorithm (Table 5 gives a meta lr, not a λ): per server step, from φ̃ = φ, one
    step of Adam on w_c R_c(φ̃) for every client c in turn (w_c the inner-step weight above), then
    φ ← φ + meta_lr (φ̃ − φ). The inner Adam's state (moments, step count) is kept from one server
    step to the next, as in DomainBed's Fish (create_clone reloads optimizer_inner_state) and the
    base code's Fish (one client optimiser for all its steps); it starts fresh at each
    communication, as φ does. The risk term is implicit: to first order in the inner lr α (SGD
    inner steps, averaged over the client order, Shi et al.) the meta step descends
    Σ_c w_c R_c − (α/2) Σ_{c<c'} w_c w_c' ⟨∇R_c, ∇R_c'⟩, i.e. P times Eq. 11's risk term, with the
    paper's r_fish = −Σ_{c≠c'} ⟨∇R_c, ∇R_c'⟩ weighted pair by pair by w_c w_c' (1 for equal clients:
    then the two weightings agree bit for bit). Adam normalises each coordinate, so the weights act
    through its moments only. Fish's per-client risks read client c's rows as a slice: the tuning
    predictions are laid out client by client, with offsets fixed once per communication (a
    boolean mask would make the host wait for the device, per client per step).

Choices where the paper is silent:
- Stage-1 optimiser: a fresh Adam per client per communication (weight decay --weight-decay, 0), as
  the base code (src/client.py: ERM.init_train builds a new optimiser at every fit; its saved state
  is never reloaded). Keeping the P Adam states would also cost 2|θ| floats per client (ResNet-50,
  100 clients: 19 GB). Stage 2: a fresh SGD per client per communication, momentum --momentum 0.
- Table 5's "stage 2: 8 iterations, 4 communications" is read like its stage 1 (256 iterations =
  the epoch budget): --stage2-epochs 8 over 4 communications, 2 epochs of head SGD before each.
  Algorithm 1 can also be read as 4 head epochs alternating with 4 server fits (--stage2-epochs 4).
- Stage-2 features are computed once, without augmentation, and kept with the client: θ̂ is
  frozen, so the head training and the predictions of all of stage 2 need one featurizer pass per
  client (the paper's code may augment during 2.1; on the digits there is no augmentation anyway;
  after a --resume they are recomputed from the same θ̂).
- Server (Eq. 11): φ starts uniform (1/P) at every communication, as FedLOE's code initialises its
  mixing weights; --server-steps 100 full-batch steps (not given: φ has P entries and the
  predictions are few, so 100 steps cost milliseconds) of Adam with Table 5's stage-2 lr 0.05 and
  weight decay 5e-4. Table 5 names SGD for stage 2; this file uses it for the heads (2.1). For φ,
  SGD at lr 0.05 diverged with IRM λ = 100 (φ non-finite in the second communication on the
  synthetic domains: the penalty grows with the square of the logits); Adam's steps are bounded by
  its lr, and DomainBed (whose IRM / V-REx / Fish the FedDG benchmark follows) trains them with Adam.
- Every client takes part in every communication (Eq. 4 and 11 run over all c): --sample = P.

Defaults, each with its source (a test checks every one):
    --batch-size 128                     Table 5
    --stage1-epochs 256                  Table 5 (stage 1 iterations, read as the epoch budget E1)
    --stage1-comms 8                     Table 5 (stage 1 total communication)
    --lr 5e-5 pacs, 3e-5 officehome      Table 5 (stage 1 Adam lr); vlcs (not in the paper): as pacs
    --lr 1e-3 rmnist                     DomainBed hparams_registry.py (lr of the MNIST datasets)
    --lr 1e-2 synthetic                  chosen: the tests learn in a few epochs
    --weight-decay 0                     stage 1: Table 5 gives none
    --global-lr 1                        Eq. 4 (the server takes the weighted average itself)
    --stage2-epochs 8, --stage2-comms 4  Table 5 (stage 2 iterations and communications)
    --stage2-lr 0.05, --stage2-wd 5e-4   Table 5 (stage 2 lr and weight decay: heads and server)
    --momentum 0                         Table 5 (stage 2: SGD, no momentum given)
    --dg-lambda 100                      Table 5 (IRM λ, REx λ)
    --meta-lr 0.05                       Table 5 (Fish meta lr, PACS and OfficeHome)
    --dg irm                             Table 2's first FedLOE row (chosen)
    --dg-form feddg                      FedDG_Benchmark src/client.py (above)
    --server-steps 100                   chosen (above)
    --clients 20                         Figure 1a (FedLOE's code's PACS config used 100: --clients 100)
    --select last, --eval-every 1        Table 5 (fixed iteration); every communication evaluated
    --model resnet50, --head linear      Appendix D.3 (pacs, vlcs, officehome: ResNet-50, 2048 features);
                                         rmnist: the ConvNet, synthetic: the small ConvNet (common.py)

    python fedloe.py --dataset pacs --data-root ./data --dg fish
    python fedloe.py --stage1-epochs 8 --stage1-comms 2 --test-domain 0      # a quick look
    python fedloe.py --stage2-comms 0                                         # "our FedAvg"
"""
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
import data

PHOTO = dict(model="resnet50", head="linear")
DEFAULTS = {"pacs": dict(PHOTO, lr=5e-5), "vlcs": dict(PHOTO, lr=5e-5), "officehome": dict(PHOTO, lr=3e-5),
            "rmnist": dict(lr=1e-3), "synthetic": dict(lr=1e-2),
            "*": dict(batch_size=128, momentum=0.0, clients=20, eval_every=1, select="last")}
BY_STAGES = math.inf  # default of --rounds and --local-epochs: set from the stage flags in check()


# ------------------------------------------------------------------------ data, Appendix D.2

def split_appendix_d2(fed, seed):
    """Each client's training split -> 90% train / 10% tune; each client's 10% hold-out -> half
    validation (pooled: fed.val_x) and half in-domain test (pooled: fed.id_x). Seeded, in place."""
    g = torch.Generator().manual_seed(seed)
    for c in fed.clients:
        if c.n < 2:
            raise common.UserError(f"client {c.id} has {c.n} training example(s), too few for a train/tune split; "
                                   f"use fewer --clients")
        perm = torch.randperm(c.n, generator=g).to(c.y.device)
        k = max(1, int(0.1 * c.n))
        c.tune_x, c.tune_y, c.x, c.y = c.x[perm[:k]], c.y[perm[:k]], c.x[perm[k:]], c.y[perm[k:]]
        h = len(c.val_y) // 2
        c.id_x, c.id_y, c.val_x, c.val_y = c.val_x[:h], c.val_y[:h], c.val_x[h:], c.val_y[h:]
    fed.val_x, fed.val_y = torch.cat([c.val_x for c in fed.clients]), torch.cat([c.val_y for c in fed.clients])
    fed.id_x, fed.id_y = torch.cat([c.id_x for c in fed.clients]), torch.cat([c.id_y for c in fed.clients])


# ------------------------------------------------------------------------- stage 1, Eq. 4

def stage1_round(model, fed, args, state, ctx):
    """One synchronisation of Eq. 4: every client trains E1/K1 epochs from (θ, ψ), then the average."""
    theta = common.get_flat(model)
    delta_sum, weight_sum, losses = torch.zeros_like(theta), 0.0, {}
    adam = lambda params: torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
    trained = common.train_clients(model, theta, fed.clients, args, ctx, adam)  # (θ_c, ψ_c) ← (θ, ψ); Adam
    for c, (client, (theta_c, loss)) in enumerate(zip(fed.clients, trained)):
        losses[c] = loss
        delta_sum += client.n * (theta_c - theta)
        weight_sum += client.n
    common.set_flat(model, theta + args.global_lr * delta_sum / weight_sum)  # Eq. 4: Σ_c p(c)(θ_c, ψ_c)
    count(state, "stage1", up=len(fed.clients) * theta.numel() * 4, down=len(fed.clients) * theta.numel() * 4)
    return losses


# ------------------------------------------------------------------ stage 2, Eq. 10 - 12

@torch.no_grad()
def features(model, x, ctx, chunk=512):
    """g_θ̂(x) for a client's images: no graph (θ̂ is frozen), no augmentation."""
    model.eval()
    with ctx.autocast():
        return torch.cat([model.featurizer(ctx.prep(x[i:i + chunk])).float() for i in range(0, len(x), chunk)])


def overfit_head(W, b, z, y, epochs, args, ctx):
    """Eq. 10: from the broadcast ψ = (W, b), `epochs` of minibatch SGD on the client's features."""
    W, b = W.clone().requires_grad_(), b.clone().requires_grad_()
    opt = torch.optim.SGD([W, b], lr=args.stage2_lr, momentum=args.momentum, weight_decay=args.stage2_wd)
    total, steps = torch.zeros((), device=z.device), 0
    for idx in common.batches(len(y), args.batch_size, epochs, ctx):
        loss = F.cross_entropy(F.linear(z[idx], W, b), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach()
        steps += 1
    return W.detach(), b.detach(), total / max(steps, 1)


def ensemble(phi, Ws, bs):
    """Eq. 12: the heads (Ws [P, m, d], bs [P, m]) combined by φ [P] into one linear head."""
    return torch.einsum("k,kmd->md", phi, Ws), phi @ bs


@dataclass
class Tuning:
    """What the server holds in 2.2: every head's predictions on every client's tuning split, laid out
    client by client, and the clients' sizes. Client c's rows are the slice rows[c], fixed once per
    communication: selecting them by a boolean mask would make the host wait for the device."""
    Y: torch.Tensor       # [N, P, m]: ŷ_{c,c'} = h_{ψ̂_c'}(g_θ̂(x)) for the N = Σ_c n_c^tune tuning examples
    y: torch.Tensor       # [N] labels
    member: torch.Tensor  # [N, P] one-hot: the client of each row
    n_tune: torch.Tensor  # [P] n_c^tune
    rows: list            # [P] slices of the N rows
    n_train: list         # [P] n_c, the clients' training sizes (Python ints)
    p: torch.Tensor       # [P] p(c) = n_c / Σ_c' n_c', Eq. 11's client weights (--dg-form paper)


def tuning(Y, y, n_tune, n_train):
    """Tuning from the pooled predictions and labels (client by client; n_tune, n_train: Python ints).
    Once per communication, before the server's steps (the copies of the sizes to the device wait for it)."""
    ends = list(itertools.accumulate(n_tune))
    env = torch.cat([torch.full((n,), c, device=y.device) for c, n in enumerate(n_tune)])
    n = torch.tensor(n_train, dtype=Y.dtype, device=Y.device)
    return Tuning(Y, y, F.one_hot(env, len(n_tune)).to(Y.dtype), torch.tensor(n_tune, dtype=Y.dtype, device=Y.device),
                  [slice(e - k, e) for k, e in zip(n_tune, ends)], list(n_train), n / n.sum())


def sample_losses(phi, T, scale=None):
    """ℓ(Σ_c' φ_c' ŷ_c', y) of every tuning example [N]. `scale` [P]: IRMv1's dummy multiplier w per client."""
    logits = torch.einsum("nkm,k->nm", T.Y, phi)
    if scale is not None:
        logits = logits * (T.member @ scale)[:, None]                      # w of each example's client
    return F.cross_entropy(logits, T.y, reduction="none")


def risks(phi, T, scale=None):
    """Per-client risks R_c of the combined prediction Σ_c' φ_c' ŷ_c' on the tuning splits T. Per-client
    sums as products with the one-hot membership: reproducible on CUDA in either mode (index_add_'s
    float sums are unordered there outside deterministic mode)."""
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
    """One Fish step (DomainBed's, client c's risk weighted by w[c]): from φ̃ = φ, one step of the inner
    Adam on w_c R_c(φ̃) for each client c in turn (its rows: a slice), then φ ← φ + meta_lr (φ̃ − φ).
    `tilde` is the inner Adam's parameter: it is reset to φ, the Adam keeps its state (DomainBed's create_clone)."""
    with torch.no_grad():
        tilde.copy_(phi)                                                  # φ̃ ← φ
    for c, rows in enumerate(T.rows):
        R_c = F.cross_entropy(torch.einsum("nkm,k->nm", T.Y[rows], tilde), T.y[rows])  # mean over client c's rows
        inner.zero_grad(set_to_none=True)
        (w[c] * R_c).backward()
        inner.step()
    return phi + meta_lr * (tilde.detach() - phi)


def solve_phi(T, args):
    """Eq. 11 on the server: φ from uniform, args.server_steps full-batch Adam steps (Fish: meta steps)."""
    P = len(T.rows)
    phi = torch.full((P,), 1.0 / P, dtype=T.Y.dtype, device=T.Y.device)
    if args.dg == "fish":
        w = fish_weights(T, args.dg_form)
        tilde = phi.clone().requires_grad_()                             # φ̃ and its Adam: one per communication
        inner = torch.optim.Adam([tilde], lr=args.stage2_lr, weight_decay=args.stage2_wd)
        for _ in range(args.server_steps):
            phi = fish_step(phi, T, w, args.meta_lr, tilde, inner)
        return phi
    q = risk_weights(T, args.dg_form)
    phi.requires_grad_()
    opt = torch.optim.Adam([phi], lr=args.stage2_lr, weight_decay=args.stage2_wd)
    for _ in range(args.server_steps):
        penalty = irm_penalty(phi, T, args.dg_form) if args.dg == "irm" else rex_penalty(phi, T, args.dg_form)
        loss = (q * risks(phi, T)).sum() + args.dg_lambda * penalty      # Eq. 11
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return phi.detach()


def stage2_round(t, model, fed, args, state, ctx):
    P, head = len(fed.clients), model.classifier
    W0, b0 = head.weight.detach(), head.bias.detach()                    # the broadcast ψ
    Ws, bs, losses, Zt = [], [], {}, []
    for c, client in enumerate(fed.clients):                             # 2.1, on the clients
        if not hasattr(client, "z"):      # θ̂ is frozen: one featurizer pass per client for all of stage 2
            client.z, client.z_tune = features(model, client.x, ctx), features(model, client.tune_x, ctx)
        W, b, losses[c] = overfit_head(W0, b0, client.z, client.y, args.stage2_epochs // args.stage2_comms, args, ctx)
        Ws.append(W)
        bs.append(b)
        Zt.append(client.z_tune)
    Ws, bs = torch.stack(Ws), torch.stack(bs)                            # heads up, all heads down
    Y = torch.cat([torch.einsum("nd,kmd->nkm", z, Ws) + bs for z in Zt])  # ŷ_{c,c'}, client by client
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


# ------------------------------------------------------------------------------ the rounds

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
    split_appendix_d2(fed, args.seed)
    n_theta = sum(p.numel() for p in model.parameters())
    return {"bytes": {"stage1": [0, len(fed.clients) * n_theta * 4], "stage2": [0, 0]},  # θ^0 goes down
            "phi": torch.zeros(0, device=ctx.device)}


def evaluate(model, fed, args, state, ctx):
    val, test, per = common.evaluate_global(model, fed, args, state, ctx)
    in_domain = common.correct(model, fed.id_x, fed.id_y, ctx).float().mean().item() if len(fed.id_y) else None
    return val, test, per, {"in_domain_acc": in_domain}


def add_args(p):
    a = p.add_argument
    a("--stage1-epochs", type=int, default=256, help="stage 1 budget of local epochs E1 (Table 5)")
    a("--stage1-comms", type=int, default=8, help="stage 1 communications K1 (Table 5); E1/K1 epochs between averages")
    a("--stage2-epochs", type=int, default=8, help="stage 2 epochs of local head training in all (Table 5)")
    a("--stage2-comms", type=int, default=4, help="stage 2 communications K2 (Table 5); 0 = stage 1 only")
    a("--stage2-lr", type=float, default=0.05, help="stage 2 lr: heads (SGD) and server (Adam) (Table 5)")
    a("--stage2-wd", type=float, default=5e-4, help="stage 2 weight decay, heads and server (Table 5)")
    a("--dg", default="irm", choices=["irm", "fish", "rex"], help="invariance term r of Eq. 11")
    a("--dg-lambda", type=float, default=100.0, help="λ of IRM and REx (Table 5)")
    a("--meta-lr", type=float, default=0.05, help="Fish meta lr (Table 5)")
    a("--dg-form", default="feddg", choices=["feddg", "paper", "domainbed"],
      help="the terms of Eq. 11 (docstring table). feddg: FedLOE's base code, FedDG_Benchmark src/client.py "
           "(clients' risks averaged; IRMv1 and V-REx's per-example loss variance averaged over the clients; Fish "
           "uniform); paper: Eq. 11 / Appendix C.1 (risks weighted by p(c); IRMv1 and the per-example variances "
           "summed over the clients; Fish's client steps weighted by P·p(c)); domainbed: DomainBed's algorithms.py "
           "(as feddg, but V-REx is the variance of the clients' risks, §2.1)")
    a("--server-steps", type=int, default=100, help="server steps on φ per communication (chosen)")
    p.set_defaults(rounds=BY_STAGES, local_epochs=BY_STAGES)


def check(args):
    if args.dataset not in data.LODO:
        raise common.UserError(f"fedloe is leave-one-domain-out; {args.dataset} has fixed clients "
                               f"(choose one of {', '.join(data.LODO)})")
    if args.rounds != BY_STAGES or args.local_epochs != BY_STAGES:
        raise common.UserError("fedloe sets the rounds and local epochs from --stage1-epochs, --stage1-comms "
                               "and --stage2-comms; drop --rounds / --local-epochs")
    if args.head != "linear":
        raise common.UserError("fedloe ensembles linear heads (Eq. 12 is exact only for them): use --head linear")
    if args.sample is not None and args.sample != args.clients:
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
