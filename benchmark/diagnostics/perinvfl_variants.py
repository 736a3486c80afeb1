"""PerInvFL's ablations, its other reading of line 8 and the Eq. 4 check: perinvfl.py's round with
its client function swapped for `variant_update` (perinvfl.client_update with line 8's start,
optimiser and loss and line 9's loss swappable), through harness.main, so that the results are
perinvfl.py's (method "perinvfl") with these flags in their args (docs/perinvfl.md).

    --theta kept        θ_i stays on its client across rounds (Ditto's reading; perinvfl.py: reset,
                        pFedMe's code)
    --theta-opt adam    line 8 by IRM's Adam at --lr, its state kept on the client, new when λ
                        changes
    --personalize l2    IRM-L2 (Table 5): line 8 on ERM + β ||θ_i − ν_{i,r}||² (J_i without IRMv1)
    --personalize ft    IRM-FT (Table 5): θ_i = ν fine-tuned when scored, --ft-epochs of ERM
                        (+ IRM's L2) in minibatches of --ft-batch with a fresh optimiser (--opt's,
                        at --lr); no line 8
    --inv groupdro      GroupDRO as L_INV: client i's ν-loss N q_i R_i (+ IRM's L2),
                        q_i ∝ q_i exp(η_q R_i) on the server from the risks of ν^t uploaded this
                        round; θ_i's line 8 on ERM + β ||θ_i − ν||²

Every evaluated round (but under ft) records the Eq. 4 check: J_i at θ_i and at ν_{i,R−1} on client
i's whole training split (`eq4_theta`, `eq4_nu`, None for a client that sat the round out) and the
share of the clients that took part where J_i(θ_i) ≤ J_i(ν) (`eq4_holds`). With the defaults it is
perinvfl.py's run (the same histories) plus the check.

    python benchmark/diagnostics/perinvfl_variants.py --dataset rcmnist --data-root DIR --theta kept
    python benchmark/diagnostics/perinvfl_variants.py --dataset rcmnist --data-root DIR \\
        --personalize ft
"""
import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import common  # noqa: E402
import harness  # noqa: E402
import data  # noqa: E402
import perinvfl  # noqa: E402


def q_update(q, ids, risks, eta_q):
    """GroupDRO's server step (Sagawa et al.): q_i ∝ q_i exp(η_q R_i) for the clients `ids` that
    uploaded their risks R_i (a tensor in the order of ids), renormalised over all clients."""
    q = q.clone()
    q[ids] = q[ids] * torch.exp(eta_q * risks)
    return q / q.sum()


def groupdro_loss(model, params, buffers, x, y, w, nq, weight_decay):
    """Line 9's loss under GroupDRO: N q_i R(f_ν; D_i) + IRM's L2 (no IRMv1 term, nothing to
    rescale)."""
    return nq * perinvfl.l_inv(model, params, buffers, x, y, w, 0.0, weight_decay)


def line8_loss(args, nu_ir, lam):
    """Line 8's objective: perinvfl.J_i, without its IRMv1 term under IRM-L2 and GroupDRO."""
    erm = args.personalize == "l2" or args.inv == "groupdro"
    return functools.partial(perinvfl.J_i, nu=nu_ir, lam=0.0 if erm else lam,
                             weight_decay=args.weight_decay, beta=args.beta)


def params_at(model, flat):
    """The model's parameters and buffers as dicts, its parameters set to the flat vector `flat`."""
    sizes = [p.numel() for p in model.parameters()]
    return ({k: v.view_as(p) for (k, p), v in zip(model.named_parameters(), flat.split(sizes))},
            dict(model.named_buffers()))


def replies(site, sent):
    """What variant_update replies (the Eq. 4 check's two numbers when scored, but under ft)."""
    checked = sent["scored"] and site.args.personalize != "ft"
    return {"delta": sent["nu"], "loss": common.SCALAR, "risk": common.SCALAR,
            **({"eq4": torch.empty(2, device="meta")} if checked else {})}


@common.replies(replies)
def variant_update(site, sent):
    """perinvfl.client_update (lines 5-9 on client i) with the variant's line 8 (its start θ_i: ν^t,
    or kept on the client; plain steps of η, or Adam at --lr with its state kept on the client, new
    when λ changes; J_i, or ERM + β||θ_i − ν||²; none under ft) and line 9 (L_INV, or GroupDRO's
    N q_i R). Replies as client_update (θ_i kept on the client), plus the risk R(f_ν^t; D_i) on the
    whole split and, when scored, J_i at θ_i and at ν_{i,R−1} (the Eq. 4 check)."""
    args, nu, lam, model, client = site.args, sent["nu"], sent["lam"], site.model, site.client
    kept = site.state
    theta_i = nu if args.theta == "reset" else kept.get("theta", nu)          # θ_i's start
    made = []

    def line8_opt(params):           # one for the round's R line-8 phases (site.model's parameters)
        if made:
            return made[0]
        opt = torch.optim.Adam(params, lr=args.lr) if args.theta_opt == "adam" else \
            torch.optim.SGD(params, lr=args.eta or args.lr, foreach=True)
        if kept.get("opt_lam") == lam and "opt" in kept:      # the client's optimiser state, same λ
            opt.load_state_dict(kept["opt"])
        made.append(opt)
        return opt
    line9 = functools.partial(groupdro_loss, nq=sent["nq"], weight_decay=args.weight_decay) \
        if args.inv == "groupdro" else \
        functools.partial(perinvfl.line9_loss, lam=lam, weight_decay=args.weight_decay)
    plain = lambda params: torch.optim.SGD(params, lr=args.lr, foreach=True)
    S = 0 if args.personalize == "ft" else args.S
    nu_ir = last = nu
    total = 0.0
    for r in range(perinvfl.local_steps(client, args)):
        if S:                                                                 # line 8
            theta_i, _ = common.local_train(site, theta_i, line8_loss(args, nu_ir, lam), line8_opt,
                                            steps=S)
        last = nu_ir
        nu_ir, loss = common.local_train(site, nu_ir, line9, plain, steps=1)  # line 9
        total = total + loss
    if made and args.theta_opt == "adam":
        kept.update(opt=made[0].state_dict(), opt_lam=lam)
    common.keep(site, "theta", theta_i)     # scored there; the next start under --theta kept
    w = torch.full((client.n,), 1.0 / client.n, device=nu.device)
    x = site.prep(client.x)
    with torch.no_grad():
        out = {"delta": nu_ir - nu, "loss": total / perinvfl.local_steps(client, args),
               "risk": common.cross_entropy(model, *params_at(model, nu), x, client.y, w)}
        if sent["scored"] and args.personalize != "ft":                 # J_i(θ_i) vs J_i(ν_{i,R−1})
            J = line8_loss(args, last, lam)
            out["eq4"] = torch.stack([J(model, *params_at(model, v), x, client.y, w)
                                      for v in (theta_i, last)])
    return out


@common.replies(lambda site, sent: {})
def fine_tuned(site, sent):
    """IRM-FT's θ_i on client i, kept there to be scored: ν fine-tuned (fine_tune) from its stream
    of the exchange "fine_tune"."""
    common.set_flat(site.model, sent["theta"])
    common.keep(site, "theta", fine_tune(site.model, site.client, site.args, site.gen, site.prep))
    return {}


def fine_tune(net, client, args, gen, prep):
    """IRM-FT's θ_i: ν (in `net`) after --ft-epochs epochs of ERM (+ IRM's L2) on the client's
    training split in minibatches of --ft-batch, with a fresh optimiser (--opt's, at --lr), drawn
    from `gen`."""
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=args.lr) if args.opt == "adam" else \
        torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    for idx in common.batches(client.n, args.ft_batch, gen, client.x.device, epochs=args.ft_epochs):
        x, y = client.x[idx], client.y[idx]
        w = torch.full((len(idx),), 1.0 / len(idx), device=x.device)
        loss = perinvfl.l_inv(net, dict(net.named_parameters()), dict(net.named_buffers()),
                              prep(x, train=True, gen=gen), y, w, 0.0, args.weight_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return common.get_flat(net)


def init_state(model, fed, args, ctx):
    N = len(fed.clients)
    return dict(perinvfl.init_state(model, fed, args, ctx),
                q=torch.full((N,), 1.0 / N, device=ctx.device),      # GroupDRO's q, uniform
                eq4=torch.zeros(2, N, device=ctx.device),            # the check: J_i(θ_i), J_i(ν)
                # clients checked this round
                took=torch.zeros(N, dtype=torch.bool, device=ctx.device),
                scored=0)                                    # evaluations so far (IRM-FT's streams)


def variant_round(t, model, fed, args, state, ctx):
    nu, lam, N = common.get_flat(model), args.lam if t > args.anneal else 1.0, len(fed.clients)
    scored = t % args.eval_every == 0 or t == args.rounds
    ids = common.sample_clients(ctx, N, args.sample)
    sent = [{"nu": nu, "lam": lam, "nq": N * state["q"][i], "scored": scored} for i in ids]
    up = common.on_clients(variant_update, ids, sent, t, ctx, phase="client_update")
    if scored:
        state["took"].zero_()
    for i, r in zip(ids, up):
        if "eq4" in r:
            state["eq4"][:, i], state["took"][i] = r["eq4"], True
    mean = torch.stack([r["delta"] for r in up]).mean(0)                     # mean_i Δ_i
    common.set_flat(model, perinvfl.line10(nu, mean, args, state))
    if args.inv == "groupdro":                                # q from the risks uploaded this round
        state["q"] = q_update(state["q"], ids, torch.stack([r["risk"] for r in up]), args.eta_q)
    return {i: r["loss"] for i, r in zip(ids, up)}


def evaluate(t, model, fed, args, state, ctx):
    """perinvfl.evaluate, with IRM-FT's θ_i fine-tuned first on each client (its stream: the
    exchange "fine_tune" of the evaluation's number), and the Eq. 4 check's numbers."""
    if args.personalize == "ft":
        state["scored"] += 1
        common.on_clients(fine_tuned, range(len(fed.clients)), {"theta": common.get_flat(model)},
                          state["scored"], ctx, phase="fine_tune")
    *scores, extra = perinvfl.evaluate(t, model, fed, args, state, ctx)
    if args.personalize != "ft":
        (j_theta, j_nu), took = state["eq4"], state["took"]
        extra.update(eq4_holds=((j_theta <= j_nu) & took).sum().item() / max(took.sum().item(), 1),
                     **{k: [v if ok else None for v, ok in zip(j.tolist(), took.tolist())]
                        for k, j in (("eq4_theta", j_theta), ("eq4_nu", j_nu))})
    return (*scores, extra)


def add_args(p):
    perinvfl.add_args(p)
    a = p.add_argument
    a("--theta", default="reset", choices=["reset", "kept"],
      help="line 8's start: reset: theta_i <- nu^t every round (perinvfl.py); "
           "kept: theta_i stays on its client (Ditto)")
    a("--theta-opt", default="sgd", choices=["sgd", "adam"],
      help="line 8's optimiser: sgd: plain steps of eta (perinvfl.py); "
           "adam: Adam at --lr, its state on the client")
    a("--personalize", default="dual", choices=["dual", "l2", "ft"],
      help="dual: Eq. 4 (perinvfl.py); l2: ERM + beta||theta - nu||^2 (IRM-L2); "
           "ft: fine-tune nu locally (IRM-FT)")
    a("--ft-epochs", type=int, default=1, help="IRM-FT: local epochs of fine-tuning of nu")
    a("--ft-batch", type=int, default=64, help="IRM-FT: minibatch size of the fine-tuning")
    a("--inv", default="irm", choices=["irm", "groupdro"],
      help="L_INV: IRMv1 (perinvfl.py) or GroupDRO")
    a("--eta-q", type=float, default=0.01, help="GroupDRO step size for q (DomainBed's)")


def check(args, given):
    perinvfl.check(args, given)
    for k in ("ft_epochs", "ft_batch"):
        if getattr(args, k) < 1:
            raise data.UserError(f"--{k.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(args, k)}")
    if not args.eta_q >= 0:   # also catches nan
        raise data.UserError(f"--eta-q must be >= 0, got {args.eta_q}")


def parallel_reason(args):
    return ("trains its clients one after another "
            "(its variants keep each client's line-8 optimiser and θ_i)")


METHOD = dataclasses.replace(perinvfl.METHOD, doc=__doc__, round=variant_round,
                             clients=(variant_update, fine_tuned), init_state=init_state,
                             evaluate=evaluate, add_args=add_args, check=check,
                             parallel=parallel_reason)


def main(argv=None):
    return harness.main(METHOD, argv)


if __name__ == "__main__":
    main()
