"""PerInvFL — Exploiting Personalized Invariance for Better Out-of-distribution Generalization in
Federated Learning (Tang, Guo, Zhang). No public code exists: the paper is the specification.

Every client i keeps a personalised model θ_i; the server keeps a global invariant model ν. The
client's objective is regularised twice, by its own invariance and by the global invariant model:

    min_θi  L_INV(θ_i; E_train^i) + β ||θ_i − ν*||²                                  (Eq. 2, 4)
    s.t.    ν* ∈ argmin_ν Σ_i L_INV(ν; D_i)          (federated IRM / GroupDRO)      (Eq. 3, 5)

    L_IRM(θ; e)      = R(f_θ; e) + λ ||∇_{w|w=1} R(w·f_θ; e)||²                      (IRMv1)
    L_GroupDRO^i(ν)  = q_i R(f_ν; D_i),  q updated on the server from the uploaded risks

Algorithm 1 (one round t; all N clients take part, as in the paper):
    send ν^t; on every client i: ν_{i,0} ← ν^t; for r = 0..R−1:
        for s = 0..S−1:  θ_i ← θ_i − η (∇L_INV(θ_i; E_train^i) + 2β (θ_i − ν_{i,r}))   (line 8)
        ν_{i,r+1} ← ν_{i,r} − γ ∇L_INV(ν_{i,r}; D_i)                                    (line 9)
    server: ν^{t+1} ← ν^t − α (ν^t − (1/N) Σ_i ν_{i,R})                                   (line 10)
θ_i lives on its client across rounds. Every client holds one training context (Table 6), so
E_train^i = D_i is one environment and each client is one environment of the federated IRM.
Clients upload Δ_i = ν_{i,R} − ν^t (the same information as ν_{i,R}); line 10 is ν^t + α mean_i Δ_i.

`--personalize` gives Table 5's ablations: `dual` (Eq. 4, line 8 as above), `l2` (IRM-L2: plain ERM
+ β ||θ_i − ν_{i,r}||²), `ft` (IRM-FT, local fine-tuning as Cheng et al.'s FTFA: θ_i = ν fine-tuned
on D_i by `--ft-epochs` epochs of plain ERM in minibatches of `--ft-batch`, with a fresh optimiser
and no regulariser). θ_i never feeds back into ν under `ft`, so it is computed when it is scored
(at each evaluation), which gives the numbers that fine-tuning at every round would give.
Evaluation: each personalised θ_i on its own test context (per client and pooled, the reported
test accuracy), and ν on every client's test context (`global_*` in the results: the "IRM" row).

Hyperparameters. The paper gives none. They are not tuned on test accuracy here; on RC-MNIST /
RC-FMNIST they are the IRM paper's published ColoredMNIST settings (Arjovsky et al., the law this
benchmark uses), mapped onto Algorithm 1 so that ν follows centralised IRM step for step:
- full-batch steps, Adam lr 4.898e-4, L2 1.10794568e-3 on all parameters, λ = 1 for the first 190
  rounds, then 91257.186 with the whole loss divided by λ (IRM's code); 500 rounds; R = S = 1;
  IRM's MLP initialisation (Xavier-uniform weights, zero biases: common.build_model).
- `--opt adam` (rcmnist default) is Algorithm 1 with Adam in place of the plain steps: ν's Adam
  runs on the server (FedOpt, Reddi et al. 2021) on the pseudo-gradient −mean_i Δ_i / γ, with
  lr α·η; each client takes its R plain steps of line 9 with γ = --lr. With R = 1 the
  pseudo-gradient is mean_i ∇L_INV(ν^t; D_i), the gradient of IRM's objective (mean over the
  environments), so ν is centralised full-batch IRM exactly (a test checks it). Adam moments kept
  per client and averaged models would not be: they converge to a median-like point, not to
  argmin Σ_i L_INV. θ_i never leaves its client, so its Adam (line 8) is an ordinary local Adam
  whose moments stay on the client. `--opt sgd`: Algorithm 1's plain steps with γ = η = --lr.
- IRM's rescaling divides L_INV by λ once λ > 1. Line 8's objective is Eq. 4 as a whole, divided by
  λ: (L_IRM(θ_i) + β ||θ_i − ν||²) / λ, so that β keeps the paper's balance against the invariance
  loss at every round (dividing L_IRM alone would make the pull λ·β and pin θ_i to ν).
- α = 1 (line 10 becomes the plain average, Algorithm 1's mean of ν_{i,R}).
- β = 1. Not from test accuracy and not from the validation split either: the validation split is
  drawn like the training context, where the spurious colour is predictive, so it would always
  pick the smallest β. Remark 1 only says that β must be "appropriately chosen" and that fewer
  training contexts call for a smaller β; here every client has one context. β = 1 weighs
  ||θ_i − ν||² like the risk, as Eq. 4 is printed. Measured on full RC-MNIST without rotation
  (README, PerInvFL): θ_i does not inherit ν's invariance for any β from 10 to 1e8 — after the
  switch to the large λ its single-context IRMv1 penalty rules line 8, and a β that outweighs it
  pins θ_i during the warm-up, after which its Adam moments hold it there.
- IRM-FT: 1 epoch in minibatches of 64 (FTFA fine-tunes for a few local epochs), Adam at --lr.
- GroupDRO: η_q = 0.01 (DomainBed's default); client i's ν-loss is N q_i R_i, so that uniform q is
  ERM; q is updated from the risks uploaded at the end of a round (the risk of ν^t on D_i), which
  the next round uses — Sagawa et al.'s update order with one round of lag, needing no extra
  communication. With one context per client, GroupDRO's local objective for θ_i is its risk.
- The model: IRM's MLP 392 → 390 → 390 (ReLU) with a linear head to 2 logits and the cross-entropy.
  IRM uses one logit and the binary cross-entropy: CE of logits (a, b) is BCE of a − b, and the
  dummy scale multiplies both, so the loss and the penalty are the same functions of a − b.
- Model selection: the last round (common's `--select last` for RC-MNIST): see common.py.

Communication per round: ν down and Δ_i up (|θ| floats each); θ_i never leaves the client.

    python perinvfl.py --dataset rcmnist --data-root DIR --p-test 0.1
    python perinvfl.py --dataset rcmnist --data-root DIR --no-rotation
    python perinvfl.py --dataset rcmnist --data-root DIR --personalize ft
    python perinvfl.py --dataset rcfmnist --data-root DIR --inv groupdro
"""
import copy

import torch
import torch.nn.functional as F

import common
import data

RC = dict(opt="adam", lr=4.898e-4, weight_decay=2 * 1.10794568e-3, lam=91257.186, anneal=190, beta=1.0)
DEFAULTS = {"rcmnist": RC, "rcfmnist": RC, "*": dict(opt="sgd", lam=1.0, anneal=0, beta=1.0)}


# ---------------------------------------------------------------------------------- L_INV

def irm_penalty(logits, y):
    """IRMv1: ||∇_{w|w=1} R(w·f)||², the squared derivative of the risk w.r.t. a dummy scale on the
    logits, kept in the graph (double backward) so that its gradient reaches θ."""
    w = torch.ones((), dtype=logits.dtype, device=logits.device, requires_grad=True)
    g, = torch.autograd.grad(F.cross_entropy(logits * w, y), w, create_graph=True)
    return g.pow(2)


def inv_loss(net, x, y, args, lam, weight=1.0, erm=False):
    """L_INV of one environment with IRM's L2 term (not yet divided by λ). Returns (loss, risk).
    `weight` is GroupDRO's N q_i; `erm` drops the invariance term."""
    logits = net(x)
    risk = F.cross_entropy(logits, y)
    loss = weight * risk if args.inv == "groupdro" else risk
    loss = loss + args.weight_decay / 2 * sum(p.pow(2).sum() for p in net.parameters())
    if args.inv == "irm" and not erm:
        loss = loss + lam * irm_penalty(logits, y)                       # Eq. 4 / 5
    return loss, risk


def rescale(args, lam, erm=False):
    """IRM's code divides the whole loss by λ once λ > 1 (to keep the gradients in range)."""
    return lam if args.inv == "irm" and not erm and lam > 1 else 1.0


def theta_loss(net, nu_ir, x, y, args, lam):
    """Line 8's objective for θ_i: Eq. 4 (`dual`) or IRM-L2's ERM, plus β ||θ_i − ν_{i,r}||²."""
    erm = args.personalize == "l2"
    loss, _ = inv_loss(net, x, y, args, lam, erm=erm)
    theta = torch.cat([p.reshape(-1) for p in net.parameters()])
    return (loss + args.beta * (theta - nu_ir).pow(2).sum()) / rescale(args, lam, erm)


def make_opt(params, args, saved=None, lr=None):
    lr = lr or args.lr
    opt = torch.optim.Adam(params, lr=lr) if args.opt == "adam" else \
        torch.optim.SGD(params, lr=lr, momentum=args.momentum)
    if saved:
        opt.load_state_dict(saved)
    return opt


def batch(client, args, ctx):
    """The client's training split (full batch, the default) or a random minibatch of it."""
    if args.batch_size >= client.n:
        return ctx.prep(client.x, train=True, gen=ctx.gen), client.y   # (augmented: photos only)
    idx = torch.randperm(client.n, generator=ctx.gen, device=ctx.device)[:args.batch_size]
    return ctx.prep(client.x[idx], train=True, gen=ctx.gen), client.y[idx]


# ------------------------------------------------------------------------------- Algorithm 1

def init_state(model, fed, args, ctx):
    nu0 = common.get_flat(model)
    N = len(fed.clients)
    return {"theta": [nu0.clone() for _ in range(N)],               # θ_i^0 = ν^0
            "opt_theta": [None] * N, "server_opt": None,              # θ_i's optimiser, ν's (server)
            "q": torch.full((N,), 1.0 / N, device=nu0.device)}       # GroupDRO's q, uniform


def perinvfl_round(t, model, fed, args, state, ctx):
    nu = common.get_flat(model)                                      # ν^t
    lam = args.lam if t > args.anneal else 1.0                       # IRM's penalty schedule
    N = len(fed.clients)
    theta_net = copy.deepcopy(model)                                 # holds θ_i while client i works
    deltas, risks = [], {}
    for i in common.sample_clients(ctx, N, args.sample):
        client, nq = fed.clients[i], N * state["q"][i]
        model.train()
        theta_net.train()
        delta = torch.zeros_like(nu)                                 # ν_{i,r} − ν^t; ν_{i,0} ← ν^t (line 5)
        common.set_flat(theta_net, state["theta"][i])
        opt_th = make_opt(theta_net.parameters(), args, state["opt_theta"][i])
        for r in range(args.R):
            nu_ir = nu + delta                                       # ν_{i,r}
            common.set_flat(model, nu_ir)
            steps = 0 if args.personalize == "ft" else args.S        # (IRM-FT: θ_i at evaluation)
            for s in range(steps):                                   # line 8
                x, y = batch(client, args, ctx)
                loss = theta_loss(theta_net, nu_ir, x, y, args, lam)
                opt_th.zero_grad(set_to_none=True)
                loss.backward()
                opt_th.step()
            x, y = batch(client, args, ctx)                          # line 9
            loss, risk = inv_loss(model, x, y, args, lam, weight=nq)
            if r == 0:
                risks[i] = risk.detach()                             # R(f_ν^t; D_i), uploaded
            grad = torch.autograd.grad(loss / rescale(args, lam), list(model.parameters()))
            delta -= args.lr * torch.cat([g.reshape(-1) for g in grad])   # γ = --lr
        deltas.append(delta)                                         # Δ_i = ν_{i,R} − ν^t, uploaded
        state["theta"][i] = common.get_flat(theta_net)               # θ_i stays on client i
        state["opt_theta"][i] = opt_th.state_dict()
    mean_delta = torch.stack(deltas).mean(0)
    if args.opt == "adam":                                           # line 10 with Adam (FedOpt)
        nu_p = nu.clone().requires_grad_()
        opt = make_opt([nu_p], args, state["server_opt"], lr=args.global_lr * args.lr)
        nu_p.grad = -mean_delta / args.lr                            # = mean_i ∇L_INV(ν^t; D_i) if R = 1
        opt.step()
        state["server_opt"] = opt.state_dict()
        common.set_flat(model, nu_p.detach())
    else:
        common.set_flat(model, nu + args.global_lr * mean_delta)     # line 10: ν − α(ν − mean ν_{i,R})
    if args.inv == "groupdro":                                       # Sagawa et al.: q ∝ q exp(η_q R)
        ids = list(risks)
        q = state["q"].clone()
        q[ids] = q[ids] * torch.exp(args.eta_q * torch.stack([risks[i] for i in ids]))
        state["q"] = q / q.sum()
    return risks


def fine_tune(net, client, args, ctx):
    """IRM-FT's θ_i: ν (in `net`) after --ft-epochs epochs of ERM (+ IRM's L2) on the client's
    training split in minibatches of --ft-batch, with a fresh optimiser."""
    net.train()
    opt = make_opt(net.parameters(), args)
    for idx in common.batches(client.n, args.ft_batch, args.ft_epochs, ctx):
        loss, _ = inv_loss(net, ctx.prep(client.x[idx], train=True, gen=ctx.gen), client.y[idx], args, 1.0, erm=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return common.get_flat(net)


# ---------------------------------------------------------------------------------- evaluation

def evaluate(model, fed, args, state, ctx):
    """θ_i on client i's validation split and test context (pooled and per client); ν as the
    global model on all of them (`global_*`, the paper's "IRM" row)."""
    net = copy.deepcopy(model)
    val, hit, per = [], [], []
    for c in fed.clients:
        if args.personalize == "ft":                                 # θ_i = ν fine-tuned on D_i
            common.set_flat(net, common.get_flat(model))
            state["theta"][c.id] = fine_tune(net, c, args, ctx)
        common.set_flat(net, state["theta"][c.id])
        val.append(common.correct(net, c.val_x, c.val_y, ctx))
        h = common.correct(net, c.test_x, c.test_y, ctx).float()
        hit.append(h)
        per.append(h.mean())
    nu_val, nu_test, nu_per = common.evaluate_global(model, fed, args, state, ctx)
    return (torch.cat(val).float().mean().item(), torch.cat(hit).mean().item(), torch.stack(per).tolist(),
            {"global_val_acc": nu_val, "global_test_acc": nu_test, "global_per_test": nu_per})


def add_args(p):
    a = p.add_argument
    a("--inv", default="irm", choices=["irm", "groupdro"], help="L_INV: IRMv1 or GroupDRO")
    a("--personalize", default="dual", choices=["dual", "l2", "ft"],
      help="dual: Eq. 4; l2: ERM + beta||theta - nu||^2 (IRM-L2); ft: fine-tune nu locally (IRM-FT)")
    a("--ft-epochs", type=int, default=1, help="IRM-FT: local epochs of fine-tuning of nu")
    a("--ft-batch", type=int, default=64, help="IRM-FT: minibatch size of the fine-tuning")
    a("--beta", type=float, default=None, help="weight of ||theta_i - nu||^2 (default 1)")
    a("--lam", type=float, default=None, help="IRMv1 penalty weight lambda after annealing (rcmnist: 91257)")
    a("--anneal", type=int, default=None, help="rounds with lambda = 1 first (rcmnist: 190)")
    a("--R", type=int, default=1, help="local steps of nu per round (Algorithm 1's R)")
    a("--S", type=int, default=1, help="steps of theta_i per step of nu (Algorithm 1's S)")
    a("--opt", default=None, choices=["adam", "sgd"],
      help="adam: Adam for theta_i (line 8) and on the server for nu (line 10, FedOpt), as IRM (rcmnist); "
           "sgd: Algorithm 1's plain steps")
    a("--eta-q", type=float, default=0.01, help="GroupDRO step size for q")


def check(args):
    if args.dataset in data.LODO:
        raise data.UserError(f"perinvfl.py scores each client's own model on its own test set: use a "
                             f"fixed-clients dataset ({', '.join(data.FIXED + data.FL)}), not {args.dataset}")
    for k in ("R", "S", "ft_epochs", "ft_batch"):
        if getattr(args, k) < 1:
            raise data.UserError(f"--{k.replace('_', '-')} must be at least 1, got {getattr(args, k)}")
    for k in ("beta", "lam", "anneal", "eta_q"):
        if not getattr(args, k) >= 0:   # also catches nan
            raise data.UserError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k)}")


def main(argv=None):
    return common.main("perinvfl", __doc__, perinvfl_round, argv, add_args, DEFAULTS, init_state,
                       evaluate, check)


if __name__ == "__main__":
    main()
