"""FedLOE — Federated Domain Generalization via Locally Overfit Ensemble (anonymous, under review),
in the form of its base code, the FedDG benchmark (github.com/inouye-lab/FedDG_Benchmark).

A featurizer g_θ and a linear head h_ψ(z) = W z + b, ψ = (W, b); the clients overfit, the server
ensembles. Stage 1, Eq. 4 (FedAvg, few communications), K1 = --stage1-comms times:
  client c: E1/K1 epochs (E1 = --stage1-epochs) of a fresh Adam from (θ, ψ)        [stage1_update]
  server:   (θ, ψ) ← Σ_c p(c) (θ_c, ψ_c), p(c) ∝ n_c                                  [average]
Stage 2, Algorithm 1 (θ̂ frozen), K2 = --stage2-comms times:
  Eq. 10  client c: E2/K2 epochs of SGD on its head from the broadcast ψ → ψ̂_c   [overfit_head]
  2.2     client c: every head's logits ŷ_{c,c'} on its tuning split (10%, D.2)  [head_predictions]
  Eq. 11  server, each client an environment, φ from uniform:                         [fit_phi]
          φ̂ = argmin_φ (1/P) Σ_c R_c(Σ_c' φ_c' ŷ_c') + λ r by Adam, r = --dg (the base code's):
          irm   IRMv1, DomainBed's: ∂R_c(wΣφŷ)/∂w at w = 1, c's even × odd rows  [irm_penalty]
          rex   V-REx, the variance of c's losses (irm, rex: mean over clients)  [rex_penalty]
          fish  (no λ) φ̃ ← φ, an inner Adam step on R_c(φ̃) per client, φ += meta_lr (φ̃ − φ)
  Eq. 12  ψ = Σ_c φ̂_c ψ̂_c, exact for linear heads                                   [ensemble]
A round is one communication (1..K1: stage 1); the last is reported; --stage2-comms 0: stage 1
only, the paper's "our FedAvg". Defaults: Table 5 (batch 128, E1 256, K1 8, Adam lr 5e-5 PACS /
3e-5 OfficeHome, E2 8, K2 4, stage 2 lr 0.05 / wd 5e-4, λ 100, meta lr 0.05), Figure 1a (20
clients), Appendix D.3 (ResNet-50); the sources, other datasets' defaults, readings, results and
the paper-against-code discussion: docs/fedloe.md.
"""
import importlib.util
if __name__ == "__main__" and importlib.util.find_spec("harness"):  # the harness first: a Ctrl-C
    import harness  # noqa: F401   while torch loads is one line, exit 130 (harness/__init__.py)
import torch
import torch.nn.functional as F

import common
import data

PHOTO = dict(model="resnet50", head="linear")
RC = dict(lr=1e-3, weight_decay=2.2e-3, batch_size=25000, clients=4, stage1_epochs=512,
          stage1_comms=16)
FL = dict(lr=1e-3, batch_size=16, clients=100, stage1_epochs=96, stage1_comms=3)
DEFAULTS = {"pacs": dict(PHOTO, lr=5e-5), "vlcs": dict(PHOTO, lr=5e-5),
            "officehome": dict(PHOTO, lr=3e-5), "rmnist": dict(lr=1e-3),
            "synthetic": dict(lr=1e-2), "rcmnist": RC, "rcfmnist": RC, "mnist": FL, "emnist": FL,
            "cifar10": FL, "cifar100": FL, "waterbird": dict(FL, lr=5e-5, batch_size=32, clients=4),
            "*": dict(batch_size=128, momentum=0.0, clients=20, sample="all", eval_every=1,
                      select="last", stage1_epochs=256, stage1_comms=8, stage2_epochs=8,
                      stage2_comms=4, stage2_lr=0.05, stage2_wd=5e-4, dg="irm", dg_lambda=100.0,
                      meta_lr=0.05, server_steps=100)}


# ---------------------------------------------------------------- the method as plain functions

def average(theta, delta_sum, weight_sum, global_lr=1.0):
    """Eq. 4 on flat (θ, ψ): θ + η_g Σ_c n_c (θ_c − θ) / Σ_c n_c, from the clients' sum and Σ_c n_c.
    ValueError unless the sum has θ's shape and the weights a positive sum."""
    if delta_sum.shape != theta.shape or not weight_sum > 0:
        raise ValueError(f"average: a sum of shape {tuple(delta_sum.shape)} and weights "
                         f"{weight_sum} for θ of shape {tuple(theta.shape)}")
    return theta + global_lr * delta_sum / weight_sum


def overfit_head(W, b, z, y, batches, lr, momentum=0.0, weight_decay=0.0):
    """Eq. 10 on a client: from the broadcast ψ = (W [m, d], b [m]), one SGD step per index tensor
    of `batches` on the CE of features z [n, d], labels y; ψ̂_c = (W, b), its upload, mean loss."""
    W, b = W.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    opt = torch.optim.SGD([W, b], lr=lr, momentum=momentum, weight_decay=weight_decay)
    total, steps = torch.zeros((), device=z.device), 0
    for steps, idx in enumerate(batches, 1):
        loss = F.cross_entropy(F.linear(z[idx], W, b), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach()
    return W.detach(), b.detach(), total / max(steps, 1)


def head_predictions(z, Ws, bs):
    """2.2 on a client: ŷ_{c,c'} = h_{ψ̂_c'}(z) [n, P, m], every head (Ws [P, m, d], bs [P, m])."""
    return torch.einsum("nd,kmd->nkm", z, Ws) + bs


class Tuning:
    """2.2 on the server: the heads' predictions Y [N, P, m] on the N tuning examples, client by
    client, labels y [N]; one-hot `member` [N, P] (each row's client; sums as products:
    reproducible on CUDA), `halves` [N, 2P] (its client's even or odd half)."""

    def __init__(self, Y, y, n_tune):
        if not (Y.ndim == 3 and len(Y) == len(y) == sum(n_tune) > 0):
            raise ValueError(f"Tuning: Y {list(Y.shape)} and y {list(y.shape)} for n_tune {n_tune}")
        env = torch.cat([torch.full((k,), c, device=y.device) for c, k in enumerate(n_tune)])
        odd = torch.cat([torch.arange(k, device=y.device) % 2 for k in n_tune])
        self.Y, self.y, self.P = Y, y, len(n_tune)
        self.member = F.one_hot(env, self.P).to(Y.dtype)
        self.halves = F.one_hot(2 * env + odd, 2 * self.P).to(Y.dtype)
        self.n_tune = self.member.sum(0)
        ends = torch.tensor(n_tune).cumsum(0).tolist()
        self.rows = [slice(e - k, e) for k, e in zip(n_tune, ends)]


def risks(phi, T):
    """R_c [P], each client's risk of Σ_c' φ_c' ŷ_c' on its tuning split, and the losses ℓ [N]."""
    ell = F.cross_entropy(torch.einsum("nkm,k->nm", T.Y, phi), T.y, reduction="none")
    return (ell @ T.member) / T.n_tune, ell


def irm_penalty(phi, T):
    """IRMv1 as DomainBed's IRM._irm_penalty: the clients' mean (one gradient call) of ∂/∂w at w = 1
    of c's mean loss of w · Σφŷ on its even rows times that on its odd rows (0 for one row)."""
    w = torch.ones(2 * T.P, dtype=T.Y.dtype, device=T.Y.device, requires_grad=True)  # per half
    logits = torch.einsum("nkm,k->nm", T.Y, phi) * (T.halves @ w)[:, None]
    ell = F.cross_entropy(logits, T.y, reduction="none")
    half_risks = (ell @ T.halves) / T.halves.sum(0).clamp(min=1)
    grad, = torch.autograd.grad(half_risks.sum(), w, create_graph=True)
    return (grad[0::2] * grad[1::2]).mean()


def rex_penalty(phi, T):
    """V-REx as src/client.py's VREx.irm_penalty: the clients' mean variance of their losses ℓ."""
    R, ell = risks(phi, T)
    return ((((ell - T.member @ R) ** 2) @ T.member) / T.n_tune).mean()


def fit_phi(T, r="irm", lam=100.0, lr=0.05, weight_decay=5e-4, steps=100, meta_lr=0.05):
    """Eq. 11 on the server: ensemble weights φ [P] from uniform by `steps` full-batch Adam steps on
    (1/P) Σ_c R_c + λ r (r = "irm" or "rex") or DomainBed's Fish meta steps (r = "fish")."""
    phi = torch.full((T.P,), 1.0 / T.P, dtype=T.Y.dtype, device=T.Y.device)
    if r == "fish":
        tilde = phi.clone().requires_grad_()     # φ̃ and its inner Adam, kept (DomainBed's clone)
        inner = torch.optim.Adam([tilde], lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            tilde.detach().copy_(phi)                                     # φ̃ ← φ
            for rows in T.rows:                                           # R_c(φ̃): c's rows
                R_c = F.cross_entropy(torch.einsum("nkm,k->nm", T.Y[rows], tilde), T.y[rows])
                inner.zero_grad(set_to_none=True)
                R_c.backward()
                inner.step()
            phi = phi + meta_lr * (tilde.detach() - phi)                  # φ += meta_lr (φ̃ − φ)
        return phi
    opt = torch.optim.Adam([phi.requires_grad_()], lr=lr, weight_decay=weight_decay)
    penalty = irm_penalty if r == "irm" else rex_penalty
    for _ in range(steps):
        loss = risks(phi, T)[0].mean() + lam * penalty(phi, T)           # Eq. 11
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return phi.detach()


def ensemble(phi, Ws, bs):
    """Eq. 12: the heads (Ws [P, m, d], bs [P, m]) combined by φ [P] into one linear head."""
    if not (Ws.ndim == 3 and phi.shape == Ws.shape[:1] != (0,) and Ws.shape[:2] == bs.shape):
        raise ValueError(f"ensemble: φ {list(phi.shape)}, Ws {list(Ws.shape)}, bs {list(bs.shape)}")
    return torch.einsum("k,kmd->md", phi, Ws), phi @ bs


# ------------------------------------------------------------------------- what a client runs

@common.stackable                       # with --parallel-clients on, every client at once
@common.replies(lambda site, sent: {"delta": sent["theta"], "loss": common.SCALAR},
                delta="sum", loss="mean")          # the server needs Σ_c n_c Δ_c, no client's own
def stage1_update(site, sent):
    """Eq. 4 on client c: E1/K1 epochs of a fresh Adam from (θ, ψ); n_c ((θ_c, ψ_c) − (θ, ψ)) and
    its mean loss (stacked: every client's, n_c as a column)."""
    a = site.args
    adam = lambda ps: torch.optim.Adam(ps, lr=a.lr, weight_decay=a.weight_decay, foreach=True)
    theta_c, loss = common.local_train(site, sent["theta"], make_opt=adam)
    n_c = common.sizes(site, theta_c.device)
    return {"delta": n_c * (theta_c - sent["theta"]), "loss": loss}


@common.replies(lambda site, sent: {"W": site.model.classifier.weight, "loss": common.SCALAR,
                                    "b": site.model.classifier.bias})
def head_update(site, sent):
    """Eq. 10 on client c: its features g_θ̂(x) at the broadcast (θ̂ frozen, ψ), then E2/K2 epochs
    of SGD on its head from ψ, its minibatches from its own stream; ψ̂_c = (W, b) and the loss."""
    a, client, head = site.args, site.client, site.model.classifier
    z = common.features(site, sent["theta"], client.x)                # θ̂ frozen: no augmentation
    steps = common.batches(client.n, a.batch_size, site.gen, z.device,
                           epochs=a.stage2_epochs // a.stage2_comms)
    W, b, loss = overfit_head(head.weight, head.bias, z, client.y, steps, a.stage2_lr, a.momentum,
                              a.stage2_wd)
    return {"W": W, "b": b, "loss": loss}


@common.replies(lambda site, sent: {"y": site.client.tune_y, "Y": torch.empty(
    len(site.client.tune_y), *sent["Ws"].shape[:2], device="meta")})          # [n, P, m]
def tuning_predictions(site, sent):
    """2.2 on client c: every head's predictions on its tuning split (at θ̂), and its labels."""
    z = common.features(site, sent["theta"], site.client.tune_x)
    return {"Y": head_predictions(z, sent["Ws"], sent["bs"]), "y": site.client.tune_y}


# ------------------------------------------------------------------------------------ one round

def fedloe_round(t, model, fed, args, state, ctx):
    """One communication: Eq. 4 (stage 1), or Eq. 10 on each client, 2.2, Eq. 11 and 12 (server)."""
    theta = common.get_flat(model)
    every = list(range(len(fed.clients)))                                 # every client, always
    if t <= args.stage1_comms:                                            # Eq. 4
        up = common.on_clients(stage1_update, every, {"theta": theta}, t, ctx)   # their sums
        n = float(sum(c.n for c in fed.clients))                          # Σ_c n_c
        common.set_flat(model, average(theta, up["delta"], n, args.global_lr))
        return {tuple(every): up["loss"]}                                 # their mean loss
    up = common.on_clients(head_update, every, {"theta": theta}, t, ctx)  # Eq. 10: the heads up
    Ws, bs = torch.stack([r["W"] for r in up]), torch.stack([r["b"] for r in up])   # all down
    sent = {"theta": theta, "Ws": Ws, "bs": bs}
    pred = common.on_clients(tuning_predictions, every, sent, t, ctx)      # 2.2: ŷ up
    T = Tuning(torch.cat([r["Y"] for r in pred]), torch.cat([r["y"] for r in pred]),
               [len(r["y"]) for r in pred])
    phi = fit_phi(T, args.dg, args.dg_lambda, args.stage2_lr, args.stage2_wd, args.server_steps,
                  args.meta_lr)                                            # Eq. 11
    if not bool(torch.isfinite(phi).all()):                                # one host sync a round
        raise common.NonFinite(f"non-finite ensemble weights φ in round {t} (server, --dg "
                               f"{args.dg}, testing on {fed.name}); lower --dg-lambda or "
                               f"--stage2-lr")
    W, b = ensemble(phi, Ws, bs)                                           # Eq. 12
    model.classifier.load_state_dict({"weight": W, "bias": b})
    state["phi"] = phi
    print(f"round {t}: φ in [{phi.min():.4f}, {phi.max():.4f}], sum {phi.sum():.4f} "
          f"(uniform: {1 / len(every):.4f})", flush=True)
    return {c: r["loss"] for c, r in zip(every, up)}


def init_state(model, fed, args, ctx):
    """Appendix D.2, seeded, in place: each client's training split -> 90% train / 10% tune;
    leave-one-domain-out: its 10% hold-out -> half validation, half in-domain test (id_x)."""
    g = torch.Generator().manual_seed(args.seed)
    for c in fed.clients:
        if c.n < 2:
            raise common.UserError(f"client {c.id} has {c.n} training example(s), too few for a "
                                   f"train/tune split; use fewer --clients")
        c.x, c.y, c.tune_x, c.tune_y = data.holdout(c.x, c.y, 0.1, g)   # at least one to tune on
        if args.dataset in data.LODO:
            h = len(c.val_y) // 2
            c.id_x, c.id_y, c.val_x, c.val_y = c.val_x[:h], c.val_y[:h], c.val_x[h:], c.val_y[h:]
    return {"phi": torch.zeros(0, device=ctx.device)}


def evaluate(t, model, fed, args, state, ctx):
    """common's accuracies; leave-one-domain-out: the in-domain test accuracy as well."""
    lodo = args.dataset in data.LODO
    sums = common.scores(t, model, fed, ctx, ("val", "test", "id") if lodo else common.SPLITS)
    val, test, per = common.accuracies(sums)
    right, n = sums["id"].sum((0, 1)) if lodo else (0, 0)                 # (right, examples)
    in_domain = (right.float() / int(n)).item() if n else None
    return val, test, per, {"in_domain_acc": in_domain} if lodo else {}


def add_args(p):
    a = p.add_argument
    a("--stage1-epochs", type=int, help="stage 1 budget of local epochs E1")
    a("--stage1-comms", type=int, help="stage 1 communications K1; E1/K1 epochs between averages")
    a("--stage2-epochs", type=int, help="stage 2 epochs of head training (Table 5)")
    a("--stage2-comms", type=int, help="stage 2 communications K2 (Table 5); 0 = stage 1 only")
    a("--stage2-lr", type=float, help="stage 2 lr: heads (SGD) and server (Adam) (Table 5)")
    a("--stage2-wd", type=float, help="stage 2 weight decay, heads and server")
    a("--dg", choices=["irm", "fish", "rex"], help="invariance term r of Eq. 11")
    a("--dg-lambda", type=float, help="λ of IRM and REx (Table 5)")
    a("--meta-lr", type=float, help="Fish meta lr (Table 5)")
    a("--server-steps", type=int, help="server steps on φ per communication (chosen)")


def derive(args):
    """A round is a communication: K1 + K2 rounds, E1/K1 local epochs in stage 1."""
    return dict(rounds=args.stage1_comms + args.stage2_comms,
                local_epochs=args.stage1_epochs // max(args.stage1_comms, 1))


def check(args, given):
    e1, k1, e2, k2 = args.stage1_epochs, args.stage1_comms, args.stage2_epochs, args.stage2_comms
    for bad, message in [      # in order: the first that holds is the error
            (given & {"rounds", "local_epochs"}, "fedloe sets the rounds and local epochs from "
             "--stage1-epochs, --stage1-comms and --stage2-comms; drop --rounds / --local-epochs"),
            (args.head != "linear",
             "fedloe ensembles linear heads (Eq. 12 is exact only for them): use --head linear"),
            (args.sample not in ("all", args.clients),
             "fedloe uses every client at every communication (Eq. 4, Eq. 11): drop --sample"),
            (k1 < 1 or e1 < 1 or e1 % k1,
             f"--stage1-epochs ({e1}) must be a positive multiple of --stage1-comms ({k1}) >= 1"),
            (k2 < 0 or e2 < 0 or k2 and e2 % k2,
             f"--stage2-epochs ({e2}) must be a multiple of --stage2-comms ({k2}), both >= 0"),
            (args.select == "val" and k2, "fedloe reports the end of stage 2 (Table 5 stops at "
             "a fixed iteration); --select val would pick among stage-1 rounds too: drop it"),
            *((getattr(args, k) <= 0, f"--{k.replace('_', '-')} must be positive, got "
               f"{getattr(args, k)}") for k in ("stage2_lr", "meta_lr")),
            *((getattr(args, k) < 0, f"--{k.replace('_', '-')} must be >= 0, got "
               f"{getattr(args, k)}") for k in ("stage2_wd", "dg_lambda", "server_steps"))]:
        if bad:
            raise common.UserError(message)


METHOD = common.Method("fedloe", __doc__, fedloe_round, init_state=init_state, evaluate=evaluate,
                       add_args=add_args, defaults=DEFAULTS, derive=derive, check=check,
                       clients=lambda args: (stage1_update, head_update, tuning_predictions)
                       if args.stage2_comms else (stage1_update,), parallel=True)


def main(argv=None):                  # the program: the command line, checkpoints, results
    if importlib.util.find_spec("harness") is None:   # copied without harness/: common.program
        return common.program(METHOD, argv)
    return importlib.import_module("harness").main(METHOD, argv)


if __name__ == "__main__":
    main()
