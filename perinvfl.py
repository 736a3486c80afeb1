"""PerInvFL — Exploiting Personalized Invariance for Better Out-of-distribution Generalization in
Federated Learning (Tang, Guo, Zhang). No public code exists: the paper is the specification.

Every client i has a personalised model θ_i; the server keeps a global invariant model ν. The
client's objective is regularised twice, by its own invariance and by the global invariant model:

    min_θi  J_i(θ_i; ν*) = L_INV(θ_i; E_train^i) + β ||θ_i − ν*||²                    (Eq. 2, 4)
    s.t.    ν* ∈ argmin_ν Σ_i L_INV(ν; D_i)          (federated IRM / GroupDRO)      (Eq. 3, 5)

    L_IRM(θ; e)      = R(f_θ; e) + λ ||∇_{w|w=1} R(w·f_θ; e)||²                      (IRMv1)
    L_GroupDRO^i(ν)  = q_i R(f_ν; D_i),  q updated on the server from the uploaded risks

Algorithm 1 (one round t; all N clients take part, as in the paper):
    send ν^t; on every client i: θ_i ← ν^t (`--theta reset`, below); ν_{i,0} ← ν^t;
    for r = 0..R−1:
        for s = 0..S−1:  θ_i ← θ_i − η (∇L_INV(θ_i; E_train^i) + 2β (θ_i − ν_{i,r}))   (line 8)
        ν_{i,r+1} ← ν_{i,r} − γ ∇L_INV(ν_{i,r}; D_i)                                    (line 9)
    server: ν^{t+1} ← ν^t − α (ν^t − (1/N) Σ_i ν_{i,R})                                   (line 10)
Line 8 descends J_i(·; ν_{i,r}); line 9 never reads θ_i, so θ_i does not feed back into ν. Every
client holds one training context (Table 6), so E_train^i = D_i and each client is one environment
of the federated IRM. Clients upload Δ_i = ν_{i,R} − ν^t; line 10 is ν^t + α mean_i Δ_i.
The plain functions below are lines 8 to 10, to copy into another training loop
(docs/perinvfl.md, "Copy it"): `l_inv` (L_INV, with IRMv1's `irm_penalty`), `J_i` (Eq. 4), IRM's
`rescale`; on the server `server_update` (line 10), `server_adam` (line 10 with Adam) and GroupDRO's
`q_update`.

Where line 8 starts (`--theta`). Algorithm 1's index s restarts at 0 for every (t, r), and Theorem
2(2) bounds S steps from a start that depends on ν, by the proof of pFedMe's Theorem 2, whose code
copies the global model into the personalised one at every round (CharlieDinh/pFedMe: `set_parameters`
in FLAlgorithms/users/userbase.py, called by `send_parameters` at the start of each round of
FLAlgorithms/servers/serverpFedMe.py). So `reset` (default): θ_i ← ν^t every round, carried through
the round's R·S steps of line 8; `kept`: θ_i stays on its client across rounds (Ditto's form). At
every evaluated round each client records line 8's last objective at θ_i and at ν (`eq4_theta`,
`eq4_nu`) and the share of clients where J_i(θ_i) ≤ J_i(ν) (`eq4_holds`). With one context per
client Eq. 4 has no invariance of its own (one environment's IRMv1 derivative is ⟨∇_(W,b) R, (W,b)⟩,
zero wherever the risk is stationary in the head): θ_i keeps ν's invariance only by staying near ν.

Hyperparameters. The paper gives none; none is tuned on test accuracy. On RC-MNIST / RC-FMNIST they
are the IRM paper's published ColoredMNIST settings (Arjovsky et al.), mapped onto Algorithm 1 so
that ν follows centralised IRM step for step:
- full batch, lr 4.898e-4, L2 1.10794568e-3 on all parameters, λ = 1 for 190 rounds, then 91257.186
  with the whole loss divided by λ (IRM's code; `rescale`); 500 rounds; R = S = 1; α = 1; IRM's MLP
  392 → 390 → 390 with Xavier-uniform weights and zero biases, two logits and the cross-entropy
  (IRM: one logit and BCE, the same functions of a − b).
- `--opt adam` (RC-MNIST): ν's Adam runs on the server (FedOpt, Reddi et al. 2021) on the
  pseudo-gradient −mean_i Δ_i / γ with lr α·γ; with R = 1 that is the gradient of IRM's objective,
  so ν is centralised full-batch IRM with this file's two-logit head (tested). `--opt sgd`:
  Algorithm 1's plain steps.
- Line 8 (`--theta-opt sgd`): the paper's plain steps of size η = 0.1 on RC-MNIST, the full-batch
  step fedavg.py takes there (the paper gives no η), --lr elsewhere; `adam` is IRM's Adam at --lr.
  Its state stays on the client and restarts whenever λ changes. After the switch J_i is divided by
  λ as a whole, β's term included, so β keeps Eq. 4's balance against the invariance loss.
- β = 1, not tuned: the validation split is drawn like the training contexts, where the colour is
  predictive, so it would pick the most colour-dependent model. With `reset` and R = S = 1 β has
  no effect (the pull's gradient is zero at θ_i = ν^t).
- GroupDRO: η_q = 0.01 (DomainBed); client i's ν-loss is N q_i R_i, q updated from the risks
  uploaded at the end of a round (one round of lag, no extra communication).
- IRM-FT: 1 epoch of ERM in minibatches of 64, fresh Adam at --lr (FTFA fine-tunes a few epochs).
- Model selection: the last round on RC-MNIST (common's `--select last`).

`--personalize` gives Table 5's ablations: `dual` (Eq. 4), `l2` (IRM-L2: ERM + β ||θ_i − ν_{i,r}||²),
`ft` (IRM-FT: ν fine-tuned on D_i, computed when scored since θ_i never feeds back into ν).

Evaluation. Fixed-client datasets (rcmnist, rcfmnist, waterbird, label skew): each θ_i on its own
test context (`test_acc`, `test_model` "theta"), ν on every client's (`global_*`: the "IRM" row).
Leave-one-domain-out datasets: the held-out domain has no client, so the test accuracy is ν's
(`test_model` "nu"), selected on the pooled validation split; each θ_i is scored on its client's
validation split (`personal_val_acc`). IRM's recipe does not carry over there (full batch, and a λ
that presumes Adam's steps), so `LODO_DEFAULTS` below: the dataset's common settings, a local epoch
as R (`--R epoch`), plain steps (γ = η = --lr, momentum 0), λ = 1 from the first round, β = 1.

Communication per round: ν down and Δ_i up (|θ| floats each); θ_i never leaves the client.
--parallel-clients (auto on CUDA where it applies: IRMv1, --R 1, full batch; `parallel_reason`) takes
line 9 of every client at once (common.at_once with `l_inv_at`), to float tolerance against the
clients one after another; line 8 and the end-of-round check stay client by client.
Measurements, the readings' consequences and the paper's tables: docs/perinvfl.md.

    python perinvfl.py --dataset rcmnist --data-root DIR --p-test 0.1
    python perinvfl.py --dataset rcmnist --data-root DIR --no-rotation
    python perinvfl.py --dataset rcmnist --data-root DIR --no-rotation --theta kept
    python perinvfl.py --dataset rcmnist --data-root DIR --personalize ft
    python perinvfl.py --dataset rcfmnist --data-root DIR --inv groupdro
    python perinvfl.py --dataset rmnist --data-root DIR --test-domain 0        (ν scored on 0°)
"""
import copy
import math

import torch
import torch.nn.functional as F

import common
import data

RC = dict(opt="adam", lr=4.898e-4, weight_decay=2 * 1.10794568e-3, lam=91257.186, anneal=190, beta=1.0,
          theta_opt="sgd", eta=0.1)
LODO_DEFAULTS = dict(opt="sgd", lam=1.0, anneal=0, beta=1.0, theta_opt="sgd", momentum=0.0, R="epoch")   # (docstring)
DEFAULTS = {"rcmnist": RC, "rcfmnist": RC, **{name: LODO_DEFAULTS for name in data.LODO},
            "*": dict(opt="sgd", lam=1.0, anneal=0, beta=1.0, theta_opt="sgd", R=1)}


# ---------------------------------------------------------------- the method as plain functions
# Tensors, modules and numbers only (no args, no project objects): what a client computes and
# uploads, and what the server does with it. The objectives take a model's logits together with the
# parameters they came from (a list of tensors), so that the L2 and β terms read the same parameters
# as the forward pass; ν is a flat vector (the parameters concatenated in their order).

def irm_penalty(logits, y):
    """IRMv1: ||∇_{w|w=1} R(w·f)||², the squared derivative of the risk w.r.t. a dummy scale on the
    logits, kept in the graph (double backward) so that its gradient reaches θ."""
    w = torch.ones((), dtype=logits.dtype, device=logits.device, requires_grad=True)
    with torch.enable_grad():                                        # (also under the check's no_grad)
        g, = torch.autograd.grad(F.cross_entropy(logits * w, y), w, create_graph=True)
    return g.pow(2)


def l_inv(logits, y, params, lam, weight_decay, weight=None):
    """L_INV(θ; D_i) of one environment (Eq. 3 / 5) with IRM's L2 term, not yet divided by λ
    (`rescale`): R + λ·IRMv1 + wd/2 ||θ||². lam None: no IRMv1 term (GroupDRO, and the ERM of IRM-L2
    and IRM-FT); weight: GroupDRO's N q_i on the risk (None: 1). logits = f_θ(x), params: θ's
    parameters. Returns (loss, risk)."""
    risk = F.cross_entropy(logits, y)
    loss = risk if weight is None else weight * risk
    loss = loss + weight_decay / 2 * sum(p.pow(2).sum() for p in params)
    if lam is not None:
        loss = loss + lam * irm_penalty(logits, y)                   # Eq. 4 / 5 (IRMv1)
    return loss, risk


def rescale(lam):
    """IRM's code divides the whole loss by λ once λ > 1 (to keep the gradients in range); 1 without
    an IRMv1 term (lam None)."""
    return lam if lam is not None and lam > 1 else 1.0


def J_i(logits, y, params, nu, lam, weight_decay, beta):
    """Line 8's objective, Eq. 4 at the current global model: J_i(θ_i; ν_{i,r}) = L_INV(θ_i; E_train^i)
    + β ||θ_i − ν_{i,r}||², divided as a whole by λ once λ > 1 (IRM's rescaling, so that β keeps its
    balance against the invariance loss). logits = f_θi(x), params: θ_i's parameters, nu: ν_{i,r}
    (flat). lam None: the ERM of IRM-L2 (and GroupDRO's θ_i, whose local objective is its risk)."""
    loss, _ = l_inv(logits, y, params, lam, weight_decay)
    theta = torch.cat([p.reshape(-1) for p in params])
    return (loss + beta * (theta - nu).pow(2).sum()) / rescale(lam)


def server_update(nu, deltas, alpha):
    """Line 10: ν^{t+1} = ν^t − α (ν^t − (1/N) Σ_i ν_{i,R}) = ν^t + α mean_i Δ_i, from the uploaded
    Δ_i = ν_{i,R} − ν^t (flat; a list, or any iterable)."""
    return nu + alpha * torch.stack(list(deltas)).mean(0)


def server_adam(nu, deltas, alpha, gamma, adam_state=None):
    """Line 10 with Adam on the server (FedOpt, Reddi et al. 2021; IRM's optimiser): one Adam step at
    lr α·γ on the pseudo-gradient −mean_i Δ_i / γ, which is mean_i ∇L_INV(ν^t; D_i) (divided by λ
    as `rescale`) when every client took R = 1 plain step of size γ: then ν is centralised
    full-batch IRM over the environments, step for step. adam_state: the state_dict of the Adam of
    the round before (None: a new one). Returns (ν^{t+1}, the new state_dict)."""
    nu_p = nu.clone().requires_grad_()
    opt = torch.optim.Adam([nu_p], lr=alpha * gamma)
    if adam_state:
        opt.load_state_dict(adam_state)
    nu_p.grad = -torch.stack(list(deltas)).mean(0) / gamma
    opt.step()
    return nu_p.detach(), opt.state_dict()


def q_update(q, ids, risks, eta_q):
    """GroupDRO's server step (Sagawa et al.): q_i ∝ q_i exp(η_q R_i) for the clients `ids` that
    uploaded their risks R_i (a tensor in the order of ids), renormalised over all clients."""
    q = q.clone()
    q[ids] = q[ids] * torch.exp(eta_q * risks)
    return q / q.sum()


def l_inv_at(lam, weight_decay):
    """l_inv divided by rescale(lam) (line 9's loss) as common.at_once's objective(model, params, buffers, x,
    y, w), for --parallel-clients on: R = Σ_j w_j CE_j (w_j = 1/b on a batch's b real examples, 0 on
    padding), and IRMv1's derivative w.r.t. the dummy scale a nested torch.func.grad, which keeps its graph
    as irm_penalty's create_graph does (so it runs under torch.func.vmap over the clients)."""
    def objective(model, params, buffers, x, y, w):
        logits = torch.func.functional_call(model, (params, buffers), (x,))
        risk = lambda scale: (F.cross_entropy(logits * scale, y, reduction="none") * w).sum()   # R(w·f)
        loss = risk(1.0) + weight_decay / 2 * sum(p.pow(2).sum() for p in params.values())
        if lam is not None:
            one = torch.ones((), dtype=logits.dtype, device=logits.device)
            loss = loss + lam * torch.func.grad(risk)(one).pow(2)    # IRMv1: (d/dw R(w·f)|_{w=1})²
        return loss / rescale(lam)
    return objective


# ------------------------------------------------------------------- the project's plumbing

def penalised(args, lam, erm=False):
    """The λ of L_INV's IRMv1 term, or None where it has none (--inv groupdro; the ERM of IRM-L2, IRM-FT)."""
    return lam if args.inv == "irm" and not erm else None


def inv_loss(net, x, y, args, lam, weight=None, erm=False):
    """l_inv of the model in `net` on a batch, from the flags. `weight` is GroupDRO's N q_i; `erm`
    drops the invariance term. Returns (loss, risk)."""
    return l_inv(net(x), y, list(net.parameters()), penalised(args, lam, erm), args.weight_decay,
                 weight if args.inv == "groupdro" else None)


def theta_loss(net, nu_ir, x, y, args, lam):
    """J_i of the θ_i in `net` on a batch, from the flags: Eq. 4 (`dual`) or IRM-L2's ERM (`l2`)."""
    return J_i(net(x), y, list(net.parameters()), nu_ir, penalised(args, lam, args.personalize == "l2"),
               args.weight_decay, args.beta)


def make_opt(params, args, saved=None, lr=None, kind=None):
    """Adam (IRM's code) or SGD (--momentum; plain steps at 0) at `lr` (default --lr), with a saved state."""
    lr = lr or args.lr
    opt = torch.optim.Adam(params, lr=lr) if (kind or args.opt) == "adam" else \
        torch.optim.SGD(params, lr=lr, momentum=args.momentum)
    if saved:
        opt.load_state_dict(saved)
    return opt


def line8_opt(params, args, saved):
    """Line 8's optimiser: plain steps with η = --eta (the paper's; --lr where --eta is unset), or Adam at
    --lr as IRM's code (`--theta-opt adam`), with the state θ_i's client kept (None: a new one)."""
    if args.theta_opt == "adam":
        return make_opt(params, args, saved, kind="adam")
    return make_opt(params, args, saved, lr=args.eta if args.eta is not None else args.lr, kind="sgd")


def local_steps(client, args):
    """Algorithm 1's R on this client: --R, or with `--R epoch` as many steps as --local-epochs passes
    over its training split in minibatches of --batch-size have (1 at full batch)."""
    return args.R if args.R != "epoch" else args.local_epochs * math.ceil(client.n / args.batch_size)


def batch(client, args, ctx):
    """The client's training split (full batch, the default) or a random minibatch of it."""
    if args.batch_size >= client.n:
        return ctx.prep(client.x, train=True, gen=ctx.gen), client.y   # (augmented: photos only)
    idx = torch.randperm(client.n, generator=ctx.gen, device=ctx.device)[:args.batch_size]
    return ctx.prep(client.x[idx], train=True, gen=ctx.gen), client.y[idx]


def init_state(model, fed, args, ctx):
    nu0 = common.get_flat(model)
    N = len(fed.clients)
    return {"theta": [nu0.clone() for _ in range(N)],               # θ_i^0 = ν^0 (line 1)
            "opt_theta": [None] * N, "opt_lam": [None] * N,           # θ_i's optimiser state, its λ
            "server_opt": None,                                       # ν's Adam (line 10, FedOpt)
            "q": torch.full((N,), 1.0 / N, device=nu0.device),       # GroupDRO's q, uniform
            "_eq4": torch.full((2, N), float("nan"), device=nu0.device)}   # J_i(θ_i), J_i(ν): the check


def scored(t, args):
    """Rounds that common evaluates (every --eval-every and the last): the check runs on those."""
    return t % args.eval_every == 0 or t == args.rounds


def eq4(net, centre, client, args, lam, ctx):
    """J_i at the parameters in `net` (line 8's objective, `theta_loss`) on client i's whole training
    split, without augmentation: the end-of-round check's number (a device tensor)."""
    with torch.no_grad():
        return theta_loss(net, centre, ctx.prep(client.x), client.y, args, lam)


# ------------------------------------------------------------------------------- Algorithm 1

def parallel_reason(args):
    """common.check_parallel's `supported`: None where line 9 runs for every sampled client at once
    (common.at_once, l_inv_at): IRMv1 with R = 1 (rcmnist's and the fixed-client default) at full batch
    (checked in the round, where the clients' sizes are known). Else why not."""
    if args.inv != "irm":
        return "trains its clients one after another under --inv groupdro (its line 9 weighs each risk by N q_i)"
    if args.R != 1:
        return ("trains its clients one after another unless --R 1 (line 8 reads every ν_{i,r} between line 9's "
                "steps, and --R epoch draws each step's minibatch afresh)")
    return None


def line9_at_once(model, nu, clients, args, lam, ctx):
    """Line 9 (R = 1 full-batch plain step of size γ = --lr on L_INV / rescale) of every client in
    `clients` at once through common.at_once: {client id: Δ_i = ν_{i,1} − ν^t}. The same step as the
    sequential one to float tolerance (batched kernels; test_methods.py, test_parallel_perinvfl_*)."""
    if any(c.n > args.batch_size for c in clients):
        raise common.UserError("--parallel-clients on: perinvfl takes line 9 at once at full batch only "
                               f"(--batch-size >= {max(c.n for c in clients)}); use off")
    plain = lambda params: torch.optim.SGD(params, lr=args.lr)      # γ; IRM's L2 is in the loss
    full = copy.copy(args)
    full.batch_size = max(c.n for c in clients)                      # one batch each, padded to the largest
    done = common.at_once(model, nu, clients, full, ctx, plain, epochs=1,
                          objective=l_inv_at(penalised(args, lam), args.weight_decay))
    return {c.id: nu_1 - nu for c, (nu_1, _) in zip(clients, done)}


def client_update(model, theta_net, nu, client, args, lam, nq, theta_i, saved, ctx, ahead=None, score=False):
    """Lines 5-9 on client i (one sampled client of perinvfl_round): R local steps, each S steps of
    line 8 on θ_i and one of line 9 on ν_{i,r} (`ahead`: line 9 taken at once beforehand, R = 1).
    model: works on ν (left holding ν_{i,R−1}); theta_net: on θ_i; nu: ν^t; nq: N q_i (GroupDRO's
    weight); theta_i: the kept θ_i (unused with --theta reset); saved: its optimiser's state or None.
    Returns Δ_i = ν_{i,R} − ν^t, R(f_ν^t; D_i) (both uploaded), the end-of-round check (J_i(θ_i),
    J_i(ν_{i,R−1})) if `score` (else None), θ_i^S and its optimiser's state (both stay on client i)."""
    model.train()
    theta_net.train()
    delta, risk = torch.zeros_like(nu), None                         # ν_{i,r} − ν^t; ν_{i,0} ← ν^t (line 5)
    common.set_flat(theta_net, nu if args.theta == "reset" else theta_i)   # θ_i^0: ν^t or kept
    opt_th = line8_opt(theta_net.parameters(), args, saved)
    for r in range(local_steps(client, args)):
        nu_ir = nu + delta                                           # ν_{i,r}
        common.set_flat(model, nu_ir)
        steps = 0 if args.personalize == "ft" else args.S            # (IRM-FT: θ_i at evaluation)
        for s in range(steps):                                       # line 8: a step on J_i(θ_i; ν_{i,r})
            x, y = batch(client, args, ctx)
            loss = theta_loss(theta_net, nu_ir, x, y, args, lam)
            opt_th.zero_grad(set_to_none=True)
            loss.backward()
            opt_th.step()
        x, y = batch(client, args, ctx)                              # line 9: ν_{i,r} − γ ∇L_INV(ν_{i,r}; D_i)
        if ahead is not None:                                        # (taken at once before; R = 1)
            with torch.no_grad():
                risk = F.cross_entropy(model(x), y)                  # R(f_ν^t; D_i), uploaded
            delta = ahead
            continue
        loss, r_risk = inv_loss(model, x, y, args, lam, weight=nq)
        if r == 0:
            risk = r_risk.detach()                                   # R(f_ν^t; D_i), uploaded
        grad = torch.autograd.grad(loss / rescale(penalised(args, lam)), list(model.parameters()))
        delta -= args.lr * torch.cat([g.reshape(-1) for g in grad])  # γ = --lr
    checks = None
    if args.personalize != "ft" and score:                           # the check: J_i(θ_i) vs J_i(ν_{i,R−1})
        checks = (eq4(theta_net, nu_ir, client, args, lam, ctx), eq4(model, nu_ir, client, args, lam, ctx))
    return delta, risk, checks, common.get_flat(theta_net), opt_th.state_dict()


def perinvfl_round(t, model, fed, args, state, ctx):
    nu = common.get_flat(model)                                      # ν^t
    lam = args.lam if t > args.anneal else 1.0                       # IRM's penalty schedule
    N = len(fed.clients)
    theta_net = copy.deepcopy(model)                                 # holds θ_i while client i works
    deltas, risks = [], {}
    if scored(t, args):
        state["_eq4"].fill_(float("nan"))                             # (clients left out of the round: nan)
    ids = common.sample_clients(ctx, N, args.sample)
    ahead = line9_at_once(model, nu, [fed.clients[i] for i in ids], args, lam, ctx) \
        if args.parallel_clients == "on" else {}  # line 9 of every client at once (R = 1)
    for i in ids:
        saved = state["opt_theta"][i] if state["opt_lam"][i] == lam else None   # θ_i's optimiser; new λ: new
        delta, risks[i], checks, state["theta"][i], state["opt_theta"][i] = client_update(   # lines 5-9 on client i
            model, theta_net, nu, fed.clients[i], args, lam, N * state["q"][i], state["theta"][i], saved, ctx,
            ahead.get(i), scored(t, args))
        state["opt_lam"][i] = lam
        deltas.append(delta)                                         # Δ_i = ν_{i,R} − ν^t, uploaded
        if checks is not None:                                       # the check: J_i(θ_i) vs J_i(ν_{i,R−1})
            state["_eq4"][0, i], state["_eq4"][1, i] = checks
    if args.opt == "adam":                                           # line 10 with Adam (FedOpt), α·γ
        nu_next, state["server_opt"] = server_adam(nu, deltas, args.global_lr, args.lr, state["server_opt"])
    else:
        nu_next = server_update(nu, deltas, args.global_lr)          # line 10: ν − α(ν − mean ν_{i,R})
    common.set_flat(model, nu_next)
    if args.inv == "groupdro":                                       # q from the risks uploaded this round
        ids = list(risks)
        state["q"] = q_update(state["q"], ids, torch.stack([risks[i] for i in ids]), args.eta_q)
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
    """Fixed clients: θ_i on client i's validation split and test context (pooled and per client: the
    test accuracy, `test_model` "theta"), ν as the global model on all of them (`global_*`, the
    paper's "IRM" row). Leave-one-domain-out: the held-out domain has no client, so ν is scored there
    and selected on the pooled validation split (the test accuracy, `test_model` "nu", also under
    `global_*`); θ_i on its own client's validation split (`personal_val_acc` pooled,
    `personal_per_val` per client). Both: the end-of-round check of line 8 (`eq4_theta`, `eq4_nu`
    per client, `eq4_holds`: the share of clients with J_i(θ_i) ≤ J_i(ν))."""
    lodo = args.dataset in data.LODO
    net = copy.deepcopy(model)
    val, hit, per = [], [], []
    for c in fed.clients:
        if args.personalize == "ft":                                 # θ_i = ν fine-tuned on D_i
            common.set_flat(net, common.get_flat(model))
            state["theta"][c.id] = fine_tune(net, c, args, ctx)
        common.set_flat(net, state["theta"][c.id])
        val.append(common.correct(net, c.val_x, c.val_y, ctx))
        if not lodo:
            h = common.correct(net, c.test_x, c.test_y, ctx).float()
            hit.append(h)
            per.append(h.mean())
    nu_val, nu_test, nu_per = common.evaluate_global(model, fed, args, state, ctx)
    extra = {"test_model": "nu" if lodo else "theta",
             "global_val_acc": nu_val, "global_test_acc": nu_test, "global_per_test": nu_per}
    if args.personalize != "ft":                                     # the end-of-round check (line 8)
        j_theta, j_nu = state["_eq4"]
        took = j_nu.isfinite()                                       # (None: the client sat the round out)
        extra.update(eq4_holds=((j_theta <= j_nu) & took).sum().item() / max(took.sum().item(), 1),
                     **{k: [v if ok else None for v, ok in zip(j.tolist(), took.tolist())]
                        for k, j in (("eq4_theta", j_theta), ("eq4_nu", j_nu))})
    theta_val = torch.cat(val).float().mean().item()
    if lodo:
        extra.update(personal_val_acc=theta_val, personal_per_val=torch.stack([v.float().mean() for v in val]).tolist())
        return nu_val, nu_test, nu_per, extra
    return theta_val, torch.cat(hit).mean().item(), torch.stack(per).tolist(), extra


def add_args(p):
    a = p.add_argument
    a("--inv", default="irm", choices=["irm", "groupdro"], help="L_INV: IRMv1 or GroupDRO")
    a("--personalize", default="dual", choices=["dual", "l2", "ft"],
      help="dual: Eq. 4; l2: ERM + beta||theta - nu||^2 (IRM-L2); ft: fine-tune nu locally (IRM-FT)")
    a("--theta", default="reset", choices=["reset", "kept"],
      help="line 8's start: reset: theta_i <- nu^t every round (pFedMe's code, the default); "
           "kept: theta_i stays on its client across rounds (Ditto)")
    a("--theta-opt", default=None, choices=["sgd", "adam"],
      help="line 8's optimiser: sgd: the paper's plain steps with eta (default); adam: Adam at --lr as IRM's "
           "code; its state stays on the client, restarted when lambda changes")
    a("--eta", type=float, default=None, help="line 8's step size eta under --theta-opt sgd (rcmnist: 0.1; else --lr)")
    a("--ft-epochs", type=int, default=1, help="IRM-FT: local epochs of fine-tuning of nu")
    a("--ft-batch", type=int, default=64, help="IRM-FT: minibatch size of the fine-tuning")
    a("--beta", type=float, default=None, help="weight of ||theta_i - nu||^2 (default 1)")
    a("--lam", type=float, default=None, help="IRMv1 penalty weight lambda after annealing (rcmnist: 91257)")
    a("--anneal", type=int, default=None, help="rounds with lambda = 1 first (rcmnist: 190)")
    a("--R", type=steps_or_epoch, default=None,
      help="local steps of nu per round (Algorithm 1's R); epoch: as many as --local-epochs passes over the "
           "client's data in minibatches of --batch-size have")
    a("--S", type=int, default=1, help="steps of theta_i per step of nu (Algorithm 1's S)")
    a("--opt", default=None, choices=["adam", "sgd"],
      help="nu's optimiser (and IRM-FT's): adam: Adam on the server for nu (line 10, FedOpt), as IRM (rcmnist); "
           "sgd: Algorithm 1's plain steps (line 8's: --theta-opt)")
    a("--eta-q", type=float, default=0.01, help="GroupDRO step size for q")


def steps_or_epoch(text):
    """--R: a number of steps, or 'epoch'."""
    return text if text == "epoch" else int(text)


def check(args):
    if args.R != "epoch" and args.R < 1:
        raise data.UserError(f"--R must be at least 1 or 'epoch', got {args.R}")
    for k in ("S", "ft_epochs", "ft_batch"):
        if getattr(args, k) < 1:
            raise data.UserError(f"--{k.replace('_', '-')} must be at least 1, got {getattr(args, k)}")
    if args.eta is not None and not args.eta > 0:
        raise data.UserError(f"--eta must be positive, got {args.eta}")
    for k in ("beta", "lam", "anneal", "eta_q"):
        if not getattr(args, k) >= 0:   # also catches nan
            raise data.UserError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k)}")


def main(argv=None):
    return common.main("perinvfl", __doc__, perinvfl_round, argv, add_args, DEFAULTS, init_state,
                       evaluate, check, parallel_clients=parallel_reason)


if __name__ == "__main__":
    main()
