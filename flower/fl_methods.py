"""Each method on Flower: the server's round (ROUNDS: what common.run calls) and the clients' message
handlers (HANDLERS: message type -> fn(node, request, context) -> reply). Both call the method
file's plain functions; the order of the operations is the method file's round's, so the numbers are
its own bit for bit (flower/test_flower.py). What each message carries: docs/flower.md."""
import torch

import common
from fl_adapter import load_state, save_state

import fedavg
import fediir
import fedomg

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
        draws = args.gbar_inputs == "augmented" and args.dataset in common.PHOTOS    # augmented: the shared stream
        up = link.ask(t, "query.fediir", [(c, {"theta": theta}) for c in S], fed, ctx.gen if draws else None)
        state["g_tilde"] = fediir.gbar_update(state["g_tilde"], fediir.gbar_mean(g for r in up for g in r["grads"]),
                                              args.ema)
    gamma = args.gamma / 2 if args.half else args.gamma
    up = link.ask(t, "train.fediir", [(c, {"theta": theta, "g_tilde": state["g_tilde"], "gamma": gamma}) for c in S],
                  fed, ctx.gen)                                                # step 3, g̃ down with θ
    p = [float(fed.clients[c].n) if args.size_avg else 1.0 for c in S]
    common.set_flat(model, fediir.server_update(theta, (r["theta"] for r in up), p, args.global_lr))   # step 4
    return {c: r["loss"] for c, r in zip(S, up)}


def fediir_query(node, req, context):
    """Step 2 on the client: ∇_ω R_c at θ^{t-1}, one per minibatch (--gbar batches) or one (clients)."""
    theta_of(node, req)
    node.model.train()
    args = node.args
    z = fediir.client_features(node.model, node.client, node.ctx, args.gbar_inputs == "augmented")
    b = args.batch_size if args.gbar == "batches" else None
    return {"grads": [list(g) for g in fediir.classifier_grads(node.model.classifier, z, node.client.y, b)]}


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
    lr = args.lr * (0.1 if t > args.lr_step * args.rounds else 1.0)           # the DG code's StepLR
    keep = not args.fresh_opt and args.momentum > 0                            # momentum kept on the node
    up = link.ask(t, "train.fedomg", [(c, {"theta": theta, "lr": lr, "keep": keep}) for c in S], fed, ctx.gen)
    N = [float(fed.clients[c].n) for c in S]
    common.set_flat(model, fedomg.server_update(theta, [r["theta"] for r in up], N, fedomg.eta_g(args, len(S)),
                                                args.kappa, args.server_rule, weighted=args.dataset not in common.data.FL,
                                                solver=args.solver, evaluations=args.solver_evals))   # all at once
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
