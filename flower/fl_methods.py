"""Each method on Flower: the server's round (ROUNDS: what common.run calls) and the clients' message
handlers (HANDLERS: message type -> fn(node, request, context) -> reply). Both call the method
file's plain functions; the order of the operations is the method file's round's, so the numbers are
its own bit for bit (flower/test_flower.py). What each message carries: docs/flower.md."""
import copy

import torch

import common
from fl_adapter import load_state, save_state

import fedavg
import fediir
import fedomg
import fedipg
import fedloe
import perinvfl

ROUNDS, HANDLERS = {}, {}


def theta_of(node, req):
    """The node's model at the broadcast θ."""
    common.set_flat(node.model, req["theta"])
    return req["theta"]


# ---------------------------------------------------------------------------------------- FedAvg

def fedavg_round(link, t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                             # θ^{t-1}
    S = common.sample_clients(ctx, len(fed.clients), args.sample)             # step 1
    up = link.ask(t, "train.fedavg", [(c, {"theta": theta}) for c in S], fed, ctx.gen)   # step 2 on the nodes
    n = [1.0 if args.uniform_avg else float(fed.clients[c].n) for c in S]
    common.set_flat(model, fedavg.server_update(theta, (r["theta"] for r in up), n, args.global_lr))   # step 3
    return {c: r["loss"] for c, r in zip(S, up)}


def fedavg_train(node, req, context):
    theta_c, loss = next(common.train_clients(node.model, req["theta"], [node.client], node.args, node.ctx))
    return {"theta": theta_c, "loss": loss}


ROUNDS["fedavg"], HANDLERS["train.fedavg"] = fedavg_round, fedavg_train


# ---------------------------------------------------------------------------------------- FedIIR

def fediir_round(link, t, model, fed, args, state, ctx):
    theta = common.get_flat(model)
    S = common.sample_clients(ctx, len(fed.clients), args.sample)
    if args.gamma > 0:                       # step 2: the classifier gradients up, g_bar and the EMA here
        draws = args.dataset in common.data.PHOTOS                          # augmented inputs: the shared stream
        up = link.ask(t, "query.fediir", [(c, {"theta": theta}) for c in S], fed, ctx.gen if draws else None)
        state["g_tilde"] = fediir.gbar_update(state["g_tilde"], fediir.gbar_mean(g for r in up for g in r["grads"]),
                                              args.ema)
    up = link.ask(t, "train.fediir", [(c, {"theta": theta, "g_tilde": state["g_tilde"], "gamma": args.gamma})
                                      for c in S], fed, ctx.gen)              # step 3, g̃ down with θ
    common.set_flat(model, fediir.server_update(theta, (r["theta"] for r in up), [1.0] * len(S), args.global_lr))
    return {c: r["loss"] for c, r in zip(S, up)}


def fediir_query(node, req, context):
    """Step 2 on the client: ∇_ω R_c at θ^{t-1}, one per minibatch, on augmented inputs (fediir.py's)."""
    theta_of(node, req)
    node.model.train()
    z = fediir.client_features(node.model, node.client, node.ctx, True)
    grads = fediir.classifier_grads(node.model.classifier, z, node.client.y, node.args.batch_size)
    return {"grads": [list(g) for g in grads]}


def fediir_train(node, req, context):
    g_tilde, gamma = req["g_tilde"], req["gamma"]
    theta_c, loss = next(common.train_clients(node.model, req["theta"], [node.client], node.args, node.ctx,
                                              loss_fn=fediir.iir_loss(g_tilde, gamma)))
    return {"theta": theta_c, "loss": loss}


ROUNDS["fediir"] = fediir_round
HANDLERS.update({"query.fediir": fediir_query, "train.fediir": fediir_train})


# ---------------------------------------------------------------------------------------- FedOMG

def fedomg_round(link, t, model, fed, args, state, ctx):
    theta = common.get_flat(model)
    S = common.sample_clients(ctx, len(fed.clients), args.sample)
    lr = fedomg.local_lr(t, args)                                              # the DG code's StepLR
    keep = args.momentum > 0                                                   # momentum kept on the node
    up = link.ask(t, "train.fedomg", [(c, {"theta": theta, "lr": lr, "keep": keep}) for c in S], fed, ctx.gen)
    N = [float(fed.clients[c].n) for c in S]
    common.set_flat(model, fedomg.server_update(theta, [r["theta"] for r in up], N, fedomg.eta_g(args, len(S)),
                                                args.kappa, weighted=args.dataset not in common.data.FL))   # all at once
    return {c: r["loss"] for c, r in zip(S, up)}


def fedomg_train(node, req, context):
    args, lr = node.args, req["lr"]
    kept = load_state(context, node) if req["keep"] else None                 # {client id: momentum}
    client_sgd = lambda params: torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    theta_c, loss = next(common.train_clients(node.model, req["theta"], [node.client], args, node.ctx, client_sgd,
                                              momentum=kept))
    if kept is not None:
        save_state(context, node, kept)
    return {"theta": theta_c, "loss": loss}


ROUNDS["fedomg"], HANDLERS["train.fedomg"] = fedomg_round, fedomg_train


# ---------------------------------------------------------------------------------------- FedIPG
# The server keeps I_ID and the contributions (fedipg.arrivals: which updates arrive this round and from
# which w^{t−τ_i}); the nodes take Eq. 9's step from the model sent, and send g_i in a warm-up round.

def fedipg_round(link, t, model, fed, args, state, ctx, warmup=None):
    W = args.exit_warmup if args.exit == "auto" else 0
    if warmup is None and getattr(args, "warmup", None) == "rounds":        # benchmark/fedipg_aberrant.py's
        warmup = t <= W
    if warmup is None and W and t == 1:                                     # Algorithm 1 line 1, before t = 1
        w_1 = common.get_flat(model)
        for s in range(1, W + 1):                                           # (its messages: group -s)
            fedipg_round(link, -s, model, fed, args, state, ctx, warmup=True)
        common.set_flat(model, w_1)                                         # lines 2-4: w^1 to all
    warmup = bool(warmup)
    w_t = common.get_flat(model)
    ID = [i for i in range(len(fed.clients)) if i not in state["exited"]]  # I_ID
    S = [ID[k] for k in common.sample_clients(ctx, len(ID), len(ID) if warmup else min(args.sample, len(ID)))]
    arrived = fedipg.arrivals(abs(t), S, w_t, args, state, ctx, warmup)    # (i, w^{t−τ_i}, τ_i)
    up = link.ask(t, "train.fedipg", [(i, {"w": start, "warmup": warmup}) for i, start, _ in arrived], fed, ctx.gen)
    n = [float(fed.clients[i].n) for i, _, _ in arrived]
    common.set_flat(model, fedipg.aggregate(w_t, (r["delta"] for r in up), n, args.global_lr))   # Eq. 3
    if warmup:                                                              # Eq. 13 from the uploaded g_i
        fedipg.exit_strategy(fed, args, state, [i for i, _, _ in arrived], [r["g"] for r in up],
                             [tau == 0 for _, _, tau in arrived], abs(t) == W)
    return {i: r["loss"] for (i, _, _), r in zip(arrived, up)} or {ID[0]: torch.zeros((), device=w_t.device)}


def fedipg_train(node, req, context):
    """Step 2 on the client: g_i = ∇R_i(w) in a warm-up round, then the local step on f_i (Eq. 9) from w."""
    model, start = node.model, req["w"]
    common.set_flat(model, start)
    g = fedipg.full_gradient(model, fedipg.in_chunks(node.client, node.args.batch_size, node.ctx), node.client.n,
                             autocast=node.ctx.autocast)[0].float() if req["warmup"] else None
    loss = fedipg.local_step(model, node.client, node.args, node.ctx)
    return {"delta": common.get_flat(model) - start, "loss": loss, "g": g}


ROUNDS["fedipg"], HANDLERS["train.fedipg"] = fedipg_round, fedipg_train


# ---------------------------------------------------------------------------------------- FedLOE
# Stage 1: every client's Adam epochs from the broadcast (θ, ψ), averaged (Eq. 4). Stage 2: heads
# trained on the frozen features go up (Eq. 10), all heads come down with the model, the tuning
# predictions and labels go up, and the server solves Eq. 11 and ensembles the heads (Eq. 12).

def fedloe_round(link, t, model, fed, args, state, ctx):
    theta, P = common.get_flat(model), len(fed.clients)
    if t <= args.stage1_comms:
        up = link.ask(t, "train.fedloe", [(c, {"theta": theta}) for c in range(P)], fed, ctx.gen)
        common.set_flat(model, fedloe.average(theta, (r["theta"] for r in up), [c.n for c in fed.clients],
                                              args.global_lr))                                  # Eq. 4
    else:
        up = link.ask(t, "train.fedloe_head", [(c, {"theta": theta}) for c in range(P)], fed, ctx.gen)   # Eq. 10
        Ws, bs = torch.stack([r["W"] for r in up]).to(theta.device), torch.stack([r["b"] for r in up]).to(theta.device)
        preds = link.ask(t, "query.fedloe", [(c, {"theta": theta, "Ws": Ws, "bs": bs}) for c in range(P)], fed)
        T = fedloe.Tuning(torch.cat([r["Y"] for r in preds]).to(theta.device),
                          torch.cat([r["y"] for r in preds]).to(theta.device), [len(r["y"]) for r in preds])
        phi = fedloe.fit_phi(T, args.dg, args.dg_lambda, args.stage2_lr, args.stage2_wd, args.server_steps,
                             args.meta_lr)                                                      # Eq. 11
        if not bool(torch.isfinite(phi).all()):
            raise common.NonFinite(f"non-finite ensemble weights φ in round {t} (server, --dg {args.dg}, testing on "
                                   f"{fed.name}); lower --dg-lambda or --stage2-lr")
        W, b = fedloe.ensemble(phi, Ws, bs)                                                     # Eq. 12
        with torch.no_grad():
            model.classifier.weight.copy_(W)
            model.classifier.bias.copy_(b)
        state["phi"] = phi
        print(f"round {t}: φ in [{phi.min():.4f}, {phi.max():.4f}], sum {phi.sum():.4f} (uniform: {1 / P:.4f})",
              flush=True)
    return {c: r["loss"] for c, r in enumerate(up)}


def fedloe_train(node, req, context):
    adam = lambda params: torch.optim.Adam(params, lr=node.args.lr, weight_decay=node.args.weight_decay)
    theta_c, loss = next(common.train_clients(node.model, req["theta"], [node.client], node.args, node.ctx, adam))
    return {"theta": theta_c, "loss": loss}


def fedloe_head(node, req, context):
    """Eq. 10 on the client: its head ψ̂_c from the broadcast ψ on the frozen features g_θ̂(x)."""
    args, client, head = node.args, node.client, node.model.classifier
    theta_of(node, req)
    z = fedloe.features(node.model, client.x, node.ctx)
    minibatches = common.batches(len(client.y), args.batch_size, args.stage2_epochs // args.stage2_comms, node.ctx)
    W, b, loss = fedloe.overfit_head(head.weight.detach(), head.bias.detach(), z, client.y, minibatches,
                                     args.stage2_lr, args.momentum, args.stage2_wd)
    return {"W": W, "b": b, "loss": loss}


def fedloe_predict(node, req, context):
    """2.2 on the client: every head's predictions on its tuning split, with the labels."""
    theta_of(node, req)
    z = fedloe.features(node.model, node.client.tune_x, node.ctx)
    return {"Y": fedloe.head_predictions(z, req["Ws"], req["bs"]), "y": node.client.tune_y}


ROUNDS["fedloe"] = fedloe_round
HANDLERS.update({"train.fedloe": fedloe_train, "train.fedloe_head": fedloe_head, "query.fedloe": fedloe_predict})


# -------------------------------------------------------------------------------------- PerInvFL
# ν and line 10 on the server; lines 5-9 on the node (perinvfl.client_update, θ_i ← ν^t every round).
# θ_i goes up with each update only so that the server can score the personalised models as
# perinvfl.evaluate does.

def perinvfl_round(link, t, model, fed, args, state, ctx):
    nu, lam = common.get_flat(model), args.lam if t > args.anneal else 1.0   # IRM's penalty schedule
    ids = common.sample_clients(ctx, len(fed.clients), args.sample)
    up = link.ask(t, "train.perinvfl", [(i, {"nu": nu, "lam": lam}) for i in ids], fed, ctx.gen)
    for i, r in zip(ids, up):
        state["theta"][i] = r["theta"]                                        # (the copy that is scored)
    common.set_flat(model, perinvfl.line10(nu, [r["delta"] for r in up], args, state))
    return {i: r["risk"] for i, r in zip(ids, up)}


def perinvfl_train(node, req, context):
    theta_net = copy.deepcopy(node.model)                                    # holds θ_i while it works
    delta, risk, theta_i = perinvfl.client_update(node.model, theta_net, req["nu"], node.client, node.args,
                                                  req["lam"], node.ctx)
    return {"delta": delta, "risk": risk, "theta": theta_i}


ROUNDS["perinvfl"], HANDLERS["train.perinvfl"] = perinvfl_round, perinvfl_train
