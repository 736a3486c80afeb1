"""PerInvFL's ablations, its other reading of line 8 and the Eq. 4 check: perinvfl.py's round with one
piece swapped (perinvfl.client_update's `opt`, `line8`, `line9`), through common.main, so that the
results are perinvfl.py's (method "perinvfl") with these flags in their args (docs/perinvfl.md).

    --theta kept        θ_i stays on its client across rounds (Ditto's reading; perinvfl.py: reset, pFedMe's code)
    --theta-opt adam    line 8 by IRM's Adam at --lr, its state kept on the client, new when λ changes
    --personalize l2    IRM-L2 (Table 5): line 8 on ERM + β ||θ_i − ν_{i,r}||² (J_i without IRMv1)
    --personalize ft    IRM-FT (Table 5): θ_i = ν fine-tuned when scored, --ft-epochs of ERM (+ IRM's L2) in
                        minibatches of --ft-batch with a fresh optimiser (--opt's, at --lr); no line 8
    --inv groupdro      GroupDRO as L_INV: client i's ν-loss N q_i R_i (+ IRM's L2), q_i ∝ q_i exp(η_q R_i) on
                        the server from the risks of ν^t uploaded this round; θ_i's line 8 on ERM + β ||θ_i − ν||²

Every evaluated round (but under ft) records the Eq. 4 check: J_i at θ_i and at ν_{i,R−1} on client i's
whole training split (`eq4_theta`, `eq4_nu`, None for a client that sat the round out) and the share of
the clients that took part where J_i(θ_i) ≤ J_i(ν) (`eq4_holds`). With the defaults it is perinvfl.py's
run (the same histories) plus the check.

    python benchmark/diagnostics/perinvfl_variants.py --dataset rcmnist --data-root DIR --theta kept
    python benchmark/diagnostics/perinvfl_variants.py --dataset rcmnist --data-root DIR --personalize ft
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import data  # noqa: E402
import perinvfl  # noqa: E402


def q_update(q, ids, risks, eta_q):
    """GroupDRO's server step (Sagawa et al.): q_i ∝ q_i exp(η_q R_i) for the clients `ids` that
    uploaded their risks R_i (a tensor in the order of ids), renormalised over all clients."""
    q = q.clone()
    q[ids] = q[ids] * torch.exp(eta_q * risks)
    return q / q.sum()


def groupdro_loss(nq):
    """Line 9's loss under GroupDRO: N q_i R(f_ν; D_i) + IRM's L2 (no IRMv1 term, nothing to rescale)."""
    def loss(net, x, y, args, lam):
        return nq * F.cross_entropy(net(x), y) + args.weight_decay / 2 * sum(p.pow(2).sum() for p in net.parameters())
    return loss


def line8_loss(net, nu_ir, x, y, args, lam):
    """Line 8's loss: perinvfl.theta_loss (J_i), without its IRMv1 term under IRM-L2 and GroupDRO."""
    erm = args.personalize == "l2" or args.inv == "groupdro"
    return perinvfl.theta_loss(net, nu_ir, x, y, args, 0.0 if erm else lam)


def line8_opt(params, args, saved):
    """Line 8's optimiser: perinvfl.py's plain steps of η, or IRM's Adam at --lr; with the client's state."""
    opt = torch.optim.Adam(params, lr=args.lr) if args.theta_opt == "adam" else \
        torch.optim.SGD(params, lr=args.eta if args.eta is not None else args.lr)
    if saved:
        opt.load_state_dict(saved)
    return opt


def fine_tune(net, client, args, ctx):
    """IRM-FT's θ_i: ν (in `net`) after --ft-epochs epochs of ERM (+ IRM's L2) on the client's training
    split in minibatches of --ft-batch, with a fresh optimiser (--opt's, at --lr)."""
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=args.lr) if args.opt == "adam" else \
        torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    for idx in common.batches(client.n, args.ft_batch, args.ft_epochs, ctx):
        x = ctx.prep(client.x[idx], train=True, gen=ctx.gen)
        loss = perinvfl.l_inv(net, *perinvfl.own(net), x, client.y[idx], None, 0.0, args.weight_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return common.get_flat(net)


def init_state(model, fed, args, ctx):
    N = len(fed.clients)
    return dict(perinvfl.init_state(model, fed, args, ctx),
                opt_theta=[None] * N, opt_lam=[None] * N,            # θ_i's optimiser state, its λ
                q=torch.full((N,), 1.0 / N, device=ctx.device),      # GroupDRO's q, uniform
                eq4=torch.zeros(2, N, device=ctx.device),            # the check: J_i(θ_i), J_i(ν)
                took=torch.zeros(N, dtype=torch.bool, device=ctx.device))   # clients checked this round


def variant_round(t, model, fed, args, state, ctx):
    nu, lam = common.get_flat(model), args.lam if t > args.anneal else 1.0
    theta_net, deltas, risks, N = copy.deepcopy(model), [], {}, len(fed.clients)
    scored = t % args.eval_every == 0 or t == args.rounds
    if scored:
        state["took"].zero_()
    ids = common.sample_clients(ctx, N, args.sample)
    on = args.parallel_clients == "on"
    ahead = perinvfl.line9_at_once(model, nu, [fed.clients[i] for i in ids], args, lam, ctx) if on else {}
    run = argparse.Namespace(**dict(vars(args), S=0)) if args.personalize == "ft" else args   # (ft: no line 8)
    for i in ids:
        common.set_flat(theta_net, nu if args.theta == "reset" else state["theta"][i])   # θ_i's start
        saved = state["opt_theta"][i] if state["opt_lam"][i] == lam else None             # new λ: new state
        opt = line8_opt(theta_net.parameters(), args, saved)
        line9 = groupdro_loss(N * state["q"][i]) if args.inv == "groupdro" else None
        delta, risks[i], state["theta"][i] = perinvfl.client_update(model, theta_net, nu, fed.clients[i], run, lam,
                                                                    ctx, ahead.get(i), opt, line8_loss, line9)
        state["opt_theta"][i], state["opt_lam"][i] = opt.state_dict(), lam
        deltas.append(delta)
        if scored and args.personalize != "ft":                      # J_i(θ_i) vs J_i(ν_{i,R−1})
            c, centre = fed.clients[i], common.get_flat(model)
            with torch.no_grad():
                for k, net in enumerate((theta_net, model)):
                    state["eq4"][k, i] = line8_loss(net, centre, ctx.prep(c.x), c.y, args, lam)
            state["took"][i] = True
    common.set_flat(model, perinvfl.line10(nu, deltas, args, state))
    if args.inv == "groupdro":                                       # q from the risks uploaded this round
        state["q"] = q_update(state["q"], ids, torch.stack([risks[i] for i in ids]), args.eta_q)
    return risks


def evaluate(model, fed, args, state, ctx):
    """perinvfl.evaluate, with IRM-FT's θ_i fine-tuned first, and the Eq. 4 check's numbers."""
    if args.personalize == "ft":
        net = copy.deepcopy(model)
        for c in fed.clients:
            common.set_flat(net, common.get_flat(model))
            state["theta"][c.id] = fine_tune(net, c, args, ctx)
    *scores, extra = perinvfl.evaluate(model, fed, args, state, ctx)
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
      help="line 8's start: reset: theta_i <- nu^t every round (perinvfl.py); kept: theta_i stays on its client (Ditto)")
    a("--theta-opt", default="sgd", choices=["sgd", "adam"],
      help="line 8's optimiser: sgd: plain steps of eta (perinvfl.py); adam: Adam at --lr, its state on the client")
    a("--personalize", default="dual", choices=["dual", "l2", "ft"],
      help="dual: Eq. 4 (perinvfl.py); l2: ERM + beta||theta - nu||^2 (IRM-L2); ft: fine-tune nu locally (IRM-FT)")
    a("--ft-epochs", type=int, default=1, help="IRM-FT: local epochs of fine-tuning of nu")
    a("--ft-batch", type=int, default=64, help="IRM-FT: minibatch size of the fine-tuning")
    a("--inv", default="irm", choices=["irm", "groupdro"], help="L_INV: IRMv1 (perinvfl.py) or GroupDRO")
    a("--eta-q", type=float, default=0.01, help="GroupDRO step size for q (DomainBed's)")


def check(args):
    perinvfl.check(args)
    for k in ("ft_epochs", "ft_batch"):
        if getattr(args, k) < 1:
            raise data.UserError(f"--{k.replace('_', '-')} must be at least 1, got {getattr(args, k)}")
    if not args.eta_q >= 0:   # also catches nan
        raise data.UserError(f"--eta-q must be >= 0, got {args.eta_q}")


def parallel_reason(args):
    if args.inv == "groupdro":
        return "trains its clients one after another under --inv groupdro (its line 9 weighs each risk by N q_i)"
    return perinvfl.parallel_reason(args)


def main(argv=None):
    return common.main("perinvfl", __doc__, variant_round, argv, add_args, perinvfl.DEFAULTS, init_state,
                       evaluate, check, parallel_clients=parallel_reason)


if __name__ == "__main__":
    main()
