"""PerInvFL — Exploiting Personalized Invariance for Better Out-of-distribution Generalization in
Federated Learning (Tang, Guo, Zhang). No public code exists: the paper is the specification.

Every client i has a personalised θ_i; the server keeps a global invariant model ν:
    min_θi J_i(θ_i; ν*) = L_INV(θ_i; D_i) + β ||θ_i − ν*||²,  ν* ∈ argmin_ν Σ_i L_INV(ν; D_i)  (Eq. 2-5)
    L_INV(θ; D_i) = R(f_θ; D_i) + λ ||∇_{s|s=1} R(s·f_θ; D_i)||²  (IRMv1; `l_inv`, IRM's L2 included)
Algorithm 1, round t (every client takes part, each one environment: one context per client, Table 6):
    send ν^t; on client i: θ_i ← ν^t; ν_{i,0} ← ν^t                        (pFedMe's code: `client_update`)
    for r = 0..R−1:
        for s = 0..S−1:  θ_i ← θ_i − η ∇J_i(θ_i; ν_{i,r})                   (line 8, Eq. 4: `J_i`)
        ν_{i,r+1} ← ν_{i,r} − γ ∇L_INV(ν_{i,r}; D_i)                        (line 9, Eq. 5: `l_inv`)
    server: ν^{t+1} ← ν^t − α (ν^t − mean_i ν_{i,R}) = ν^t + α mean_i Δ_i    (line 10: `server_update`)
Clients upload Δ_i = ν_{i,R} − ν^t; θ_i never leaves its client and never feeds back into ν.
Defaults (the paper gives none; none is tuned on test accuracy). RC-MNIST / RC-FMNIST: IRM's published
ColoredMNIST recipe (Arjovsky et al.) mapped so that ν is centralised full-batch IRM step for step:
lr γ 4.898e-4, L2 1.10794568e-3, λ = 1 for 190 rounds then 91257.186 with the loss divided by λ
(`rescale`), 500 rounds, R = S = 1, α = 1, IRM's MLP; line 10 with Adam on the server (`--opt adam`,
`server_adam`: FedOpt on −mean_i Δ_i / γ, which is IRM's Adam); line 8 plain steps of η = 0.1
(fedavg.py's full-batch step there); β = 1. Leave-one-domain-out datasets (`LODO_DEFAULTS`): the
dataset's common settings, R = one local epoch of minibatches (`--R epoch`), plain steps γ = η = --lr,
λ = 1, β = 1; the held-out domain has no client, so its test accuracy is ν's (`test_model` "nu").
Fixed-client datasets: each θ_i on its own test context, ν as `global_*`. --parallel-clients: line 9
of every client at once (common.at_once with the same `l_inv`). docs/perinvfl.md: the paper against
this code, the readings, the measurements, the "Copy it" loop; the ablations (kept θ_i, Adam on line 8,
IRM-L2, IRM-FT, GroupDRO) and the Eq. 4 check: benchmark/diagnostics/perinvfl_variants.py.
"""
import argparse
import copy
import math

import torch
import torch.nn.functional as F

import common
import data

RC = dict(opt="adam", lr=4.898e-4, weight_decay=2 * 1.10794568e-3, lam=91257.186, anneal=190, beta=1.0, eta=0.1)
LODO_DEFAULTS = dict(opt="sgd", lam=1.0, anneal=0, beta=1.0, momentum=0.0, R="epoch")   # (docstring)
DEFAULTS = {"rcmnist": RC, "rcfmnist": RC, **{name: LODO_DEFAULTS for name in data.LODO},
            "*": dict(opt="sgd", lam=1.0, anneal=0, beta=1.0, momentum=0.0, R=1)}


# ---------------- the method as plain functions. The objectives take (model, params, buffers, x, y, w): the
# module's own parameters client by client (`own`), a client's slice under common.at_once's vmap. ν is flat.

def risk_of_scale(logits, y, w=None):
    """R(s·f) of a scale s on the logits: the batch's mean CE (w None), or Σ_j w_j CE_j (at_once's w)."""
    if w is None:
        return lambda s: F.cross_entropy(logits * s, y)
    return lambda s: (F.cross_entropy(logits * s, y, reduction="none") * w).sum()


def irm_penalty(logits, y, w=None):
    """IRMv1: (d/ds R(s·f)|_{s=1})², a nested torch.func.grad keeping its graph (double backward; vmap)."""
    return torch.func.grad(risk_of_scale(logits, y, w))(logits.new_ones(())).pow(2)


def l_inv(model, params, buffers, x, y, w, lam, weight_decay):
    """L_INV(θ; D_i) of one environment (Eq. 3 / 5) with IRM's L2 term, not yet divided by λ (`rescale`):
    R + wd/2 ||θ||² + λ·IRMv1 (lam 0: no IRMv1 term). params, buffers: dicts by name."""
    logits = torch.func.functional_call(model, (params, buffers), (x,))
    loss = risk_of_scale(logits, y, w)(1.0) + weight_decay / 2 * sum(p.pow(2).sum() for p in params.values())
    if lam:
        loss = loss + lam * irm_penalty(logits, y, w)               # Eq. 5 (IRMv1)
    return loss


def rescale(lam):
    """IRM's code divides the whole loss by λ once λ > 1 (to keep the gradients in range)."""
    return lam if lam > 1 else 1.0


def J_i(model, params, buffers, x, y, nu, lam, weight_decay, beta):
    """Line 8's objective, Eq. 4 at nu = ν_{i,r}: (L_INV(θ_i; D_i) + β ||θ_i − ν_{i,r}||²) / rescale(λ)."""
    theta = torch.cat([p.reshape(-1) for p in params.values()])
    return (l_inv(model, params, buffers, x, y, None, lam, weight_decay)
            + beta * (theta - nu).pow(2).sum()) / rescale(lam)


def server_update(nu, deltas, alpha):
    """Line 10: ν^{t+1} = ν^t − α (ν^t − (1/N) Σ_i ν_{i,R}) = ν^t + α mean_i Δ_i (a list or iterable)."""
    return nu + alpha * torch.stack(list(deltas)).mean(0)


def server_adam(nu, deltas, alpha, gamma, adam_state=None):
    """Line 10 with Adam on the server (FedOpt; IRM's optimiser): one Adam step at lr α·γ on −mean_i Δ_i / γ
    (= mean_i ∇L_INV(ν^t; D_i) / rescale when R = 1: centralised IRM). Returns (ν^{t+1}, Adam's state)."""
    nu_p = nu.clone().requires_grad_()
    opt = torch.optim.Adam([nu_p], lr=alpha * gamma)
    if adam_state:
        opt.load_state_dict(adam_state)
    nu_p.grad = -torch.stack(list(deltas)).mean(0) / gamma
    opt.step()
    return nu_p.detach(), opt.state_dict()


# ------------------------------------------------------------------------------- Algorithm 1

def perinvfl_round(t, model, fed, args, state, ctx):
    nu, lam = common.get_flat(model), args.lam if t > args.anneal else 1.0   # ν^t; IRM's penalty schedule
    theta_net, deltas, risks = copy.deepcopy(model), [], {}          # θ_net holds θ_i while client i works
    ids = common.sample_clients(ctx, len(fed.clients), args.sample)
    on = args.parallel_clients == "on"                               # line 9 of every client at once (R = 1):
    ahead = line9_at_once(model, nu, [fed.clients[i] for i in ids], args, lam, ctx) if on else {}
    for i in ids:                                                    # lines 5-9 on client i
        delta, risks[i], state["theta"][i] = client_update(model, theta_net, nu, fed.clients[i], args, lam, ctx,
                                                           ahead.get(i))
        deltas.append(delta)                                         # Δ_i = ν_{i,R} − ν^t, uploaded
    common.set_flat(model, line10(nu, deltas, args, state))
    return risks


def line10(nu, deltas, args, state):
    """Line 10 by the server's Adam (`--opt adam`, FedOpt at lr α·γ) or Algorithm 1's plain step."""
    if args.opt == "adam":
        nu, state["server_opt"] = server_adam(nu, deltas, args.global_lr, args.lr, state["server_opt"])
        return nu
    return server_update(nu, deltas, args.global_lr)                 # ν^t − α (ν^t − mean_i ν_{i,R})


def client_update(model, theta_net, nu, client, args, lam, ctx, ahead=None, opt=None, line8=None, line9=None):
    """Lines 5-9 on client i: θ_i ← ν^t, then R times: S plain steps of line 8 on θ_i, one of line 9 on ν_{i,r}
    (`ahead`: taken at once beforehand, R = 1). Returns Δ_i, R(f_ν^t; D_i) (both uploaded) and θ_i; `model`
    holds ν_{i,R−1}. benchmark/diagnostics/perinvfl_variants.py swaps θ_i's start and optimiser (`opt`, over the
    θ_i it loaded in theta_net), line 8's loss (`line8`, default theta_loss) and line 9's (default inv_loss)."""
    model.train(), theta_net.train()
    delta, risk = torch.zeros_like(nu), None                         # ν_{i,r} − ν^t; ν_{i,0} ← ν^t (line 5)
    if opt is None:
        common.set_flat(theta_net, nu)                               # θ_i ← ν^t (pFedMe's code)
        opt = torch.optim.SGD(theta_net.parameters(), lr=args.eta if args.eta is not None else args.lr)   # η
    for r in range(local_steps(client, args)):
        nu_ir = nu + delta                                           # ν_{i,r}
        common.set_flat(model, nu_ir)
        for s in range(args.S):                                      # line 8: a step on J_i(θ_i; ν_{i,r})
            x, y = batch(client, args, ctx)
            opt.zero_grad(set_to_none=True)
            (line8 or theta_loss)(theta_net, nu_ir, x, y, args, lam).backward()
            opt.step()
        x, y = batch(client, args, ctx)                              # line 9: ν_{i,r} − γ ∇L_INV(ν_{i,r}; D_i)
        with torch.no_grad():
            risk = F.cross_entropy(model(x), y) if r == 0 else risk  # R(f_ν^t; D_i), uploaded
        if ahead is not None:                                        # (taken at once before; R = 1)
            delta = ahead
            continue
        grad = torch.autograd.grad((line9 or inv_loss)(model, x, y, args, lam), list(model.parameters()))
        delta -= args.lr * torch.cat([g.reshape(-1) for g in grad])  # γ = --lr
    return delta, risk, common.get_flat(theta_net)


def own(net):
    """A module's own parameters and buffers, as the objectives take them."""
    return dict(net.named_parameters()), dict(net.named_buffers())


def inv_loss(net, x, y, args, lam):
    """Line 9's loss, L_INV / rescale(λ), of the model in `net` on a batch."""
    return l_inv(net, *own(net), x, y, None, lam, args.weight_decay) / rescale(lam)


def theta_loss(net, nu_ir, x, y, args, lam):
    """Line 8's loss, J_i(θ_i; ν_{i,r}), of the θ_i in `net` on a batch."""
    return J_i(net, *own(net), x, y, nu_ir, lam, args.weight_decay, args.beta)


def local_steps(client, args):
    """Algorithm 1's R on this client: --R, or (`--R epoch`) the steps of --local-epochs in minibatches."""
    return args.R if args.R != "epoch" else args.local_epochs * math.ceil(client.n / args.batch_size)


def batch(client, args, ctx):
    """The client's training split (full batch, the default) or a random minibatch of it."""
    if args.batch_size >= client.n:
        return ctx.prep(client.x, train=True, gen=ctx.gen), client.y   # (augmented: photos only)
    idx = torch.randperm(client.n, generator=ctx.gen, device=ctx.device)[:args.batch_size]
    return ctx.prep(client.x[idx], train=True, gen=ctx.gen), client.y[idx]


def init_state(model, fed, args, ctx):
    return {"theta": [common.get_flat(model) for _ in fed.clients], "server_opt": None}   # θ_i^0 = ν^0; ν's Adam


def parallel_reason(args):
    """common.check_parallel's `supported`: None where line 9 runs for every client at once, else why not."""
    return None if args.R == 1 else ("trains its clients one after another unless --R 1 (line 8 reads every "
                                     "ν_{i,r} between line 9's steps, and --R epoch draws each minibatch afresh)")


def line9_at_once(model, nu, clients, args, lam, ctx):
    """Line 9 of every client at once (common.at_once with `l_inv`): {client id: Δ_i}, to float tolerance."""
    if (most := max(c.n for c in clients)) > args.batch_size:    # data.py: a batch no training domain fills is full
        raise common.UserError("--parallel-clients on: perinvfl takes line 9 at once at full batch only (--batch-size "
                               f">= {most}; leaving a domain out, >= the largest training domain); use off")
    plain = lambda params: torch.optim.SGD(params, lr=args.lr)      # γ (R = 1, full batch); IRM's L2 in the loss
    full = argparse.Namespace(**dict(vars(args), batch_size=max(c.n for c in clients)))   # one batch each, padded
    objective = lambda *a: l_inv(*a, lam, args.weight_decay) / rescale(lam)
    done = common.at_once(model, nu, clients, full, ctx, plain, epochs=1, objective=objective)
    return {c.id: nu_1 - nu for c, (nu_1, _) in zip(clients, done)}


def evaluate(model, fed, args, state, ctx):
    """Fixed clients: θ_i on its client's validation split and test context, ν on all (`global_*`).
    Leave-one-domain-out: ν on the held-out domain; θ_i on its own validation split (`personal_*`)."""
    lodo, net, val, hit = args.dataset in data.LODO, copy.deepcopy(model), [], []
    for c in fed.clients:
        common.set_flat(net, state["theta"][c.id])
        val.append(common.correct(net, c.val_x, c.val_y, ctx))
        hit += [] if lodo else [common.correct(net, c.test_x, c.test_y, ctx).float()]
    nu_val, nu_test, nu_per = common.evaluate_global(model, fed, args, state, ctx)
    extra = {"test_model": "nu" if lodo else "theta",
             "global_val_acc": nu_val, "global_test_acc": nu_test, "global_per_test": nu_per}
    theta_val = torch.cat(val).float().mean().item()
    if lodo:
        extra.update(personal_val_acc=theta_val, personal_per_val=torch.stack([v.float().mean() for v in val]).tolist())
        return nu_val, nu_test, nu_per, extra
    return theta_val, torch.cat(hit).mean().item(), torch.stack([h.mean() for h in hit]).tolist(), extra


def add_args(p):
    a = p.add_argument
    a("--beta", type=float, default=None, help="weight of ||theta_i - nu||^2 in Eq. 4 (default 1)")
    a("--lam", type=float, default=None, help="IRMv1 penalty weight lambda after annealing (rcmnist: 91257)")
    a("--anneal", type=int, default=None, help="rounds with lambda = 1 first (rcmnist: 190)")
    a("--eta", type=float, default=None, help="line 8's step size eta (rcmnist: 0.1; else --lr)")
    a("--R", type=lambda s: s if s == "epoch" else int(s), default=None,
      help="local steps of nu per round (Algorithm 1's R); epoch: those of --local-epochs in minibatches")
    a("--S", type=int, default=1, help="steps of theta_i per step of nu (Algorithm 1's S)")
    a("--opt", default=None, choices=["adam", "sgd"], help="line 10: adam: the server's Adam (rcmnist); sgd: plain")


def check(args):
    if args.R != "epoch" and args.R < 1:
        raise data.UserError(f"--R must be at least 1 or 'epoch', got {args.R}")
    if args.S < 1:
        raise data.UserError(f"--S must be at least 1, got {args.S}")
    if args.eta is not None and not args.eta > 0:
        raise data.UserError(f"--eta must be positive, got {args.eta}")
    for k in ("beta", "lam", "anneal"):
        if not getattr(args, k) >= 0:   # also catches nan
            raise data.UserError(f"--{k} must be >= 0, got {getattr(args, k)}")
    if args.momentum:
        raise data.UserError(f"perinvfl takes Algorithm 1's plain steps: --momentum must be 0, got {args.momentum}")


def main(argv=None):
    return common.main("perinvfl", __doc__, perinvfl_round, argv, add_args, DEFAULTS, init_state,
                       evaluate, check, parallel_clients=parallel_reason)


if __name__ == "__main__":
    main()
