"""PerInvFL — Exploiting Personalized Invariance for Better Out-of-distribution Generalization in
Federated Learning (Tang, Guo, Zhang). No public code exists: the paper is the specification.

Every client i has a personalised θ_i; the server keeps a global invariant model ν (Eq. 2-5):
  min_θi J_i(θ_i; ν*) = L_INV(θ_i; D_i) + β ||θ_i − ν*||²,  ν* ∈ argmin_ν Σ_i L_INV(ν; D_i)
  L_INV(θ; D_i) = R(f_θ; D_i) + λ ||∇_{s|s=1} R(s·f_θ; D_i)||²  (IRMv1; `l_inv`, IRM's L2 in it)
Algorithm 1, round t (every client takes part, each one environment: one context, Table 6):
  send ν^t; on client i: θ_i ← ν^t; ν_{i,0} ← ν^t             (pFedMe's code: `client_update`)
  for r = 0..R−1:
      for s = 0..S−1:  θ_i ← θ_i − η ∇J_i(θ_i; ν_{i,r})        (line 8, Eq. 4: `J_i`)
      ν_{i,r+1} ← ν_{i,r} − γ ∇L_INV(ν_{i,r}; D_i)             (line 9, Eq. 5: `line9_loss`)
  server: ν^{t+1} ← ν^t − α (ν^t − mean_i ν_{i,R}) = ν^t + α mean_i Δ_i  (line 10: `line10`)
Clients upload Δ_i = ν_{i,R} − ν^t; θ_i stays with its client and never feeds back into ν.
Defaults (the paper gives none; none is tuned on test accuracy). RC-MNIST / RC-FMNIST: IRM's
published ColoredMNIST recipe (Arjovsky et al.) mapped so that ν is centralised full-batch IRM
step for step: lr γ 4.898e-4, L2 1.10794568e-3, λ = 1 for 190 rounds then 91257.186 with the loss
divided by λ (`rescale`), 500 rounds, R = S = 1, α = 1, IRM's MLP; line 10 with Adam on the
server (`--opt adam`, `server_adam`: FedOpt on −mean_i Δ_i / γ, which is IRM's Adam); line 8
plain steps of η = 0.1 (fedavg.py's full-batch step there); β = 1. Leave-one-domain-out datasets
(`LODO_DEFAULTS`): the dataset's common settings, R = one local epoch of minibatches (`--R
epoch`), plain steps γ = η = --lr, λ = 1, β = 1; the held-out domain has no client, so its test
accuracy is ν's (`test_model` "nu"). Fixed-client datasets: each θ_i on its own test context, ν
as `global_*`. --parallel-clients (--R 1): lines 8 and 9 of every client at once (common.at_once
with the same objectives). docs/perinvfl.md: the paper against this code, the readings, the
measurements, the "Copy it" loop; the ablations (kept θ_i, Adam on line 8, IRM-L2, IRM-FT,
GroupDRO) and the Eq. 4 check: benchmark/diagnostics/perinvfl_variants.py.
"""
import importlib.util
if __name__ == "__main__" and importlib.util.find_spec("harness"):  # the harness first: a Ctrl-C
    import harness  # noqa: F401   while torch loads is one line, exit 130 (harness/__init__.py)
import functools
import math

import torch
import torch.nn.functional as F

import common
import data

RC = dict(opt="adam", lr=4.898e-4, weight_decay=2 * 1.10794568e-3, lam=91257.186, anneal=190,
          beta=1.0, eta=0.1)
LODO_DEFAULTS = dict(opt="sgd", lam=1.0, anneal=0, beta=1.0, momentum=0.0, R="epoch")  # docstring
DEFAULTS = {"rcmnist": RC, "rcfmnist": RC, **{name: LODO_DEFAULTS for name in data.LODO},
            "*": dict(opt="sgd", lam=1.0, anneal=0, beta=1.0, momentum=0.0, R=1, S=1)}


# ---------------- the method as plain functions. The objectives take (model, params, buffers, x,
# y, w): the scratch model's own parameters one client after another, a client's slice under
# common.at_once's vmap; w_j = 1/b on a minibatch of b (0 on padding). ν is a flat vector.

def risk_of_scale(logits, y, w=None):
    """R(s·f) of a scale s on the logits: the batch's mean CE (w None), or Σ_j w_j CE_j."""
    if w is None:
        return lambda s: F.cross_entropy(logits * s, y)
    return lambda s: (F.cross_entropy(logits * s, y, reduction="none") * w).sum()


def irm_penalty(logits, y, w=None):
    """IRMv1: (d/ds R(s·f)|_{s=1})², a nested torch.func.grad keeping its graph (double
    backward; vmap)."""
    return torch.func.grad(risk_of_scale(logits, y, w))(logits.new_ones(())).pow(2)


def l_inv(model, params, buffers, x, y, w, lam, weight_decay):
    """L_INV(θ; D_i) of one environment (Eq. 3 / 5) with IRM's L2 term, not yet divided by λ
    (`rescale`): R + wd/2 ||θ||² + λ·IRMv1 (lam 0: no IRMv1 term). params, buffers: by name."""
    logits = torch.func.functional_call(model, (params, buffers), (x,))
    loss = risk_of_scale(logits, y, w)(1.0) + \
        weight_decay / 2 * sum(p.pow(2).sum() for p in params.values())
    if lam:
        loss = loss + lam * irm_penalty(logits, y, w)               # Eq. 5 (IRMv1)
    return loss


def rescale(lam):
    """IRM's code divides the whole loss by λ once λ > 1 (to keep the gradients in range)."""
    return lam if lam > 1 else 1.0


def line9_loss(model, params, buffers, x, y, w, lam, weight_decay):
    """Line 9's objective: L_INV(ν_{i,r}; D_i) / rescale(λ)."""
    return l_inv(model, params, buffers, x, y, w, lam, weight_decay) / rescale(lam)


def J_i(model, params, buffers, x, y, w, nu, lam, weight_decay, beta):
    """Line 8's objective, Eq. 4 at nu = ν_{i,r}: (L_INV(θ_i; D_i) + β ||θ_i − ν_{i,r}||²) /
    rescale(λ)."""
    theta = torch.cat([p.reshape(-1) for p in params.values()])
    return (l_inv(model, params, buffers, x, y, w, lam, weight_decay)
            + beta * (theta - nu).pow(2).sum()) / rescale(lam)


def server_update(nu, delta_mean, alpha):
    """Line 10: ν^{t+1} = ν^t − α (ν^t − (1/N) Σ_i ν_{i,R}) = ν^t + α mean_i Δ_i, from the clients'
    mean Δ_i (what on_clients returns). ValueError unless it has ν's shape."""
    if delta_mean.shape != nu.shape:
        raise ValueError(f"server_update: mean Δ_i of shape {tuple(delta_mean.shape)} for ν of "
                         f"shape {tuple(nu.shape)}")
    return nu + alpha * delta_mean


def server_adam(nu, delta_mean, alpha, gamma, adam_state=None):
    """Line 10 with Adam on the server (FedOpt; IRM's optimiser): one Adam step at lr α·γ on
    −mean_i Δ_i / γ (= mean_i ∇L_INV(ν^t; D_i) / rescale when R = 1: centralised IRM). Returns
    (ν^{t+1}, Adam's state). ValueError unless the clients' mean Δ_i has ν's shape."""
    if delta_mean.shape != nu.shape:
        raise ValueError(f"server_adam: mean Δ_i of shape {tuple(delta_mean.shape)} for ν of "
                         f"shape {tuple(nu.shape)}")
    nu_p = nu.clone().requires_grad_()
    opt = torch.optim.Adam([nu_p], lr=alpha * gamma)
    if adam_state:
        opt.load_state_dict(adam_state)
    nu_p.grad = -delta_mean / gamma
    opt.step()
    return nu_p.detach(), opt.state_dict()


# ------------------------------------------------------------------------------- Algorithm 1

@common.stackable            # with --parallel-clients on (--R 1): every client at once
@common.replies(lambda site, sent: {"delta": sent["nu"], "loss": common.SCALAR},
                delta="mean", loss="mean")         # the server needs mean_i Δ_i, no client's own
def client_update(site, sent):
    """Lines 5-9 on client i (pFedMe's code): θ_i ← ν^t, ν_{i,0} ← ν^t, then R times S plain steps
    of line 8 on θ_i and one of line 9 on ν_{i,r}, each minibatch drawn afresh from its own
    stream (the whole split when --batch-size covers it). Replies Δ_i = ν_{i,R} − ν^t and line
    9's mean loss; θ_i stays with the client (its state), which scores it (`score`)."""
    args, nu, lam = site.args, sent["nu"], sent["lam"]
    plain = lambda lr: lambda params: torch.optim.SGD(params, lr=lr, foreach=True)
    theta_i = nu_ir = nu                                          # θ_i ← ν^t; ν_{i,0} ← ν^t
    total = 0.0
    R = local_steps(site.client, args)
    for r in range(R):
        line8 = functools.partial(J_i, nu=nu_ir, lam=lam, weight_decay=args.weight_decay,
                                  beta=args.beta)
        theta_i, _ = common.local_train(site, theta_i, line8, plain(args.eta),
                                        steps=args.S)                              # line 8: η
        line9 = functools.partial(line9_loss, lam=lam, weight_decay=args.weight_decay)
        nu_ir, loss = common.local_train(site, nu_ir, line9, plain(args.lr), steps=1)  # line 9: γ
        total = total + loss
    common.keep(site, "theta", theta_i)                           # θ_i: the client's own
    return {"delta": nu_ir - nu, "loss": total / R}


def perinvfl_round(t, model, fed, args, state, ctx):
    nu = common.get_flat(model)
    lam = args.lam if t > args.anneal else 1.0                               # IRM's λ schedule
    ids = common.sample_clients(ctx, len(fed.clients), args.sample)
    up = common.on_clients(client_update, ids, {"nu": nu, "lam": lam}, t, ctx)   # mean Δ_i back
    common.set_flat(model, line10(nu, up["delta"], args, state))
    return {tuple(ids): up["loss"]}                                        # their mean loss


def line10(nu, delta_mean, args, state):
    """Line 10 by the server's Adam (`--opt adam`, FedOpt at lr α·γ) or Algorithm 1's plain step."""
    if args.opt == "adam":
        nu, state["server_opt"] = server_adam(nu, delta_mean, args.global_lr, args.lr,
                                              state["server_opt"])
        return nu
    return server_update(nu, delta_mean, args.global_lr)         # ν^t − α (ν^t − mean_i ν_{i,R})


def local_steps(client, args):
    """Algorithm 1's R on this client: --R, or (`--R epoch`) the steps of --local-epochs in
    minibatches."""
    if args.R != "epoch":
        return args.R
    return args.local_epochs * math.ceil(client.n / args.batch_size)


def init_state(model, fed, args, ctx):
    """The server's Adam for ν (line 10)."""
    return {"server_opt": None}


def parallel_reason(args):
    """The record's `parallel` (METHOD below): None where every client runs lines 5-9 at once,
    else why not."""
    return None if args.R == 1 else ("trains its clients one after another unless --R 1 (line 8 "
                                     "reads each client's own ν_{i,r} between line 9's steps)")


@common.replies(lambda site, sent: {who + k: n for k, n in common.score.replies(site, sent).items()
                                    for who in ("", "own_")}, every="sum")
def score(site, sent):
    """On a site: ν's right answers (common.score), and its own θ_i's (`own_`; ν where it has not
    trained yet, as an evaluation site)."""
    own = common.score(site, {**sent, "theta": site.state.get("theta", sent["theta"])})
    return {**common.score(site, sent), **{f"own_{k}": v for k, v in own.items()}}


def evaluate(t, model, fed, args, state, ctx):
    """Fixed clients: θ_i on its client's validation split and test context, ν on all
    (`global_*`). Leave-one-domain-out: ν on the held-out domain; θ_i on its own validation split
    (`personal_*`). Every site scores its own (`score`), the server sums."""
    lodo = args.dataset in data.LODO
    P = len(fed.clients)
    alone = [[i] for i in range(P)] if lodo else ()                    # each θ_i on its own
    sums = common.scores(t, model, fed, ctx, subsets=alone, fn=score)
    nu_val, nu_test, nu_per = common.accuracies(sums)
    theta_val, theta_test, per_test = common.accuracies(sums, keys=("own_val", "own_test"))
    extra = {"test_model": "nu" if lodo else "theta",
             "global_val_acc": nu_val, "global_test_acc": nu_test, "global_per_test": nu_per}
    if lodo:
        own = sums["own_val"][:, :P].sum(0).cpu().float()           # [client, (right, examples)]
        per_val = own[:, 0] / own[:, 1]
        extra.update(personal_val_acc=theta_val, personal_per_val=per_val.tolist())
        return nu_val, nu_test, nu_per, extra
    return theta_val, theta_test, per_test, extra


def add_args(p):
    a = p.add_argument
    a("--beta", type=float, help="weight of ||theta_i - nu||^2 in Eq. 4 (default 1)")
    a("--lam", type=float, help="IRMv1 penalty weight lambda after annealing (rcmnist: 91257)")
    a("--anneal", type=int, help="rounds with lambda = 1 first (rcmnist: 190)")
    a("--eta", type=float, help="line 8's step size eta (rcmnist: 0.1; else --lr)")
    a("--R", type=lambda s: s if s == "epoch" else int(s),
      help="local steps of nu per round (Algorithm 1's R); epoch: --local-epochs in minibatches")
    a("--S", type=int, help="steps of theta_i per step of nu (Algorithm 1's S)")
    a("--opt", choices=["adam", "sgd"],
      help="line 10: adam: the server's Adam (rcmnist); sgd: plain")


def derive(args):
    """Line 8's η: --lr where the table gives none."""
    return dict(eta=args.lr) if args.eta is None else {}


def check(args, given):
    if args.R != "epoch" and args.R < 1:
        raise data.UserError(f"--R must be at least 1 or 'epoch', got {args.R}")
    if args.S < 1:
        raise data.UserError(f"--S must be at least 1, got {args.S}")
    if not args.eta > 0:
        raise data.UserError(f"--eta must be positive, got {args.eta}")
    for k in ("beta", "lam", "anneal"):
        if not getattr(args, k) >= 0:   # also catches nan
            raise data.UserError(f"--{k} must be >= 0, got {getattr(args, k)}")
    if args.momentum:
        raise data.UserError("perinvfl takes Algorithm 1's plain steps: --momentum must be 0, "
                             f"got {args.momentum}")


METHOD = common.Method("perinvfl", __doc__, perinvfl_round, clients=(client_update,),
                       init_state=init_state, evaluate=evaluate, evaluations=(score,),
                       add_args=add_args, defaults=DEFAULTS, derive=derive, check=check,
                       parallel=parallel_reason)


def main(argv=None):                  # the program: the command line, checkpoints, results
    if importlib.util.find_spec("harness") is None:   # copied without harness/: common.program
        return common.program(METHOD, argv)
    return importlib.import_module("harness").main(METHOD, argv)


if __name__ == "__main__":
    main()
