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

`--personalize` gives Table 5's ablations: `dual` (Eq. 4, line 8 as above), `l2` (IRM-L2: plain ERM
+ β ||θ_i − ν_{i,r}||²), `ft` (IRM-FT: θ_i ← ν_{i,r}, then S steps of plain ERM, no regulariser).
Evaluation: each personalised θ_i on its own test context (per client and pooled, the reported
test accuracy), and ν on every client's test context (`global_*` in the results: the "IRM" row).

Hyperparameters. The paper gives none. They are not tuned on test accuracy here; on RC-MNIST /
RC-FMNIST they are the IRM paper's published ColoredMNIST settings (Arjovsky et al., the law this
benchmark uses, ANCHORS.md), mapped onto Algorithm 1 with one local step per round:
- full-batch steps with Adam, lr 4.9e-4 (γ = η), L2 1.1e-3 (weight decay 2.2e-3 in the loss);
  λ = 1 for the first 190 rounds, then 91257 with the whole loss divided by λ; 500 rounds.
  The Adam moments of ν_i and θ_i stay on client i across rounds (a fresh Adam would make every
  single local step a sign step); `--opt sgd` gives Algorithm 1's plain gradient steps.
- R = S = 1, α = 1 (line 10 becomes the plain average, Algorithm 1's mean of ν_{i,R}).
- β = 1. Not from test accuracy and not from the validation split either: the validation split is
  drawn like the training context, where the spurious colour is predictive, so it would always
  pick the smallest β. Remark 1 says a client with few training contexts needs β large enough to
  keep θ_i near ν* (Theorem 3, case 2: here one context per client): β = 1 makes the pull 2(θ − ν)
  as large as the annealed IRM gradient.
- GroupDRO: η_q = 0.01 (DomainBed's default); client i's ν-loss is N q_i R_i, so that uniform q is
  ERM; q is updated from the risks uploaded at the end of a round (the risk of ν^t on D_i), which
  the next round uses — Sagawa et al.'s update order with one round of lag, needing no extra
  communication. With one context per client, GroupDRO's local objective for θ_i is its risk.
- The model: IRM's MLP 392 → 390 → 390 (ReLU) with a linear head to 2 logits and the cross-entropy
  (IRM: one logit and the binary cross-entropy, the same model family and the same penalty form).
- Model selection: the last round (common's `--select last` for RC-MNIST): see common.py.

Communication per round: ν down and ν_{i,R} up (|θ| floats each); θ_i never leaves the client.

    python perinvfl.py --dataset rcmnist --p-test 0.1
    python perinvfl.py --dataset rcmnist --personalize ft
    python perinvfl.py --dataset rcfmnist --data-root ./data --inv groupdro
"""
import copy

import torch
import torch.nn.functional as F

import common
import data

RC = dict(opt="adam", lr=4.9e-4, lam=91257.0, anneal=190, beta=1.0)
DEFAULTS = {"rcmnist": RC, "rcfmnist": RC, "*": dict(opt="sgd", lam=1.0, anneal=0, beta=1.0)}


# ---------------------------------------------------------------------------------- L_INV

def irm_penalty(logits, y):
    """IRMv1: ||∇_{w|w=1} R(w·f)||², the squared derivative of the risk w.r.t. a dummy scale on the
    logits, kept in the graph (double backward) so that its gradient reaches θ."""
    w = torch.ones((), dtype=logits.dtype, device=logits.device, requires_grad=True)
    g, = torch.autograd.grad(F.cross_entropy(logits * w, y), w, create_graph=True)
    return g.pow(2)


def inv_loss(net, x, y, args, lam, weight=1.0, erm=False):
    """L_INV of one environment with IRM's L2 term, all divided by λ once λ > 1 (the IRM code).
    Returns (loss, risk). `weight` is GroupDRO's N q_i; `erm` drops the invariance term."""
    logits = net(x)
    risk = F.cross_entropy(logits, y)
    loss = weight * risk if args.inv == "groupdro" else risk
    loss = loss + args.weight_decay / 2 * sum(p.pow(2).sum() for p in net.parameters())
    if args.inv == "irm" and not erm:
        loss = loss + lam * irm_penalty(logits, y)                       # Eq. 4 / 5
        if lam > 1:
            loss = loss / lam
    return loss, risk


def make_opt(net, args, saved=None):
    opt = torch.optim.Adam(net.parameters(), lr=args.lr) if args.opt == "adam" else \
        torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
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
            "opt_theta": [None] * N, "opt_nu": [None] * N,
            "q": torch.full((N,), 1.0 / N, device=nu0.device)}       # GroupDRO's q, uniform


def perinvfl_round(t, model, fed, args, state, ctx):
    nu = common.get_flat(model)                                      # ν^t
    lam = args.lam if t > args.anneal else 1.0                       # IRM's penalty schedule
    N = len(fed.clients)
    theta_net = copy.deepcopy(model)                                 # holds θ_i while client i works
    nu_sum, risks = torch.zeros_like(nu), {}
    for i in common.sample_clients(ctx, N, args.sample):
        client, nq = fed.clients[i], N * state["q"][i]
        model.train()
        theta_net.train()
        common.set_flat(model, nu)                                   # ν_{i,0} ← ν^t (line 5)
        opt_nu = make_opt(model, args, state["opt_nu"][i])
        common.set_flat(theta_net, state["theta"][i])
        opt_th = make_opt(theta_net, args, state["opt_theta"][i])
        for r in range(args.R):
            nu_ir = common.get_flat(model)                           # ν_{i,r}
            if args.personalize == "ft":                             # IRM-FT: restart from ν_{i,r}
                common.set_flat(theta_net, nu_ir)
                opt_th = make_opt(theta_net, args)
            for s in range(args.S):                                  # line 8
                x, y = batch(client, args, ctx)
                loss, _ = inv_loss(theta_net, x, y, args, lam, erm=args.personalize != "dual")
                if args.personalize != "ft":                         # + β ||θ_i − ν_{i,r}||²
                    theta = torch.cat([p.reshape(-1) for p in theta_net.parameters()])
                    loss = loss + args.beta * (theta - nu_ir).pow(2).sum()
                opt_th.zero_grad(set_to_none=True)
                loss.backward()
                opt_th.step()
            x, y = batch(client, args, ctx)                          # line 9
            loss, risk = inv_loss(model, x, y, args, lam, weight=nq)
            if r == 0:
                risks[i] = risk.detach()                             # R(f_ν^t; D_i), uploaded
            opt_nu.zero_grad(set_to_none=True)
            loss.backward()
            opt_nu.step()
        nu_sum += common.get_flat(model)                             # ν_{i,R}, uploaded
        state["theta"][i] = common.get_flat(theta_net)               # θ_i stays on client i
        state["opt_theta"][i] = opt_th.state_dict() if args.personalize != "ft" else None
        state["opt_nu"][i] = opt_nu.state_dict()
    common.set_flat(model, nu - args.global_lr * (nu - nu_sum / len(risks)))   # line 10
    if args.inv == "groupdro":                                       # Sagawa et al.: q ∝ q exp(η_q R)
        ids = list(risks)
        q = state["q"].clone()
        q[ids] = q[ids] * torch.exp(args.eta_q * torch.stack([risks[i] for i in ids]))
        state["q"] = q / q.sum()
    return risks


# ---------------------------------------------------------------------------------- evaluation

def evaluate(model, fed, args, state, ctx):
    """θ_i on client i's validation split and test context (pooled and per client); ν as the
    global model on all of them (`global_*`, the paper's "IRM" row)."""
    net = copy.deepcopy(model)
    val, hit, per = [], [], []
    for c in fed.clients:
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
    a("--beta", type=float, default=None, help="weight of ||theta_i - nu||^2 (default 1)")
    a("--lam", type=float, default=None, help="IRMv1 penalty weight lambda after annealing (rcmnist: 91257)")
    a("--anneal", type=int, default=None, help="rounds with lambda = 1 first (rcmnist: 190)")
    a("--R", type=int, default=1, help="local steps of nu per round (Algorithm 1's R)")
    a("--S", type=int, default=1, help="steps of theta_i per step of nu (Algorithm 1's S)")
    a("--opt", default=None, choices=["adam", "sgd"],
      help="local update rule for lines 8-9 (rcmnist: adam, as IRM; else sgd: plain steps)")
    a("--eta-q", type=float, default=0.01, help="GroupDRO step size for q")


def check(args):
    if args.dataset in data.LODO:
        raise data.UserError(f"perinvfl.py scores each client's own model on its own test set: use a "
                             f"fixed-clients dataset ({', '.join(data.FIXED + data.FL)}), not {args.dataset}")
    for k in ("R", "S"):
        if getattr(args, k) < 1:
            raise data.UserError(f"--{k} must be at least 1, got {getattr(args, k)}")
    for k in ("beta", "lam", "anneal", "eta_q"):
        if not getattr(args, k) >= 0:   # also catches nan
            raise data.UserError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k)}")


def main(argv=None):
    return common.main("perinvfl", __doc__, perinvfl_round, argv, add_args, DEFAULTS, init_state,
                       evaluate, check)


if __name__ == "__main__":
    main()
