"""One-shot averaging from a trained start: why FedLOE's Figure 1a needs one (a diagnostic).

FedLOE's Figure 1a (PACS, clients starting from an ImageNet ResNet-50) finds that few stage-1
communications beat many; from a random ConvNet on RotatedMNIST the README finds the opposite, and
one communication (one-shot averaging, Eq. 4 with K1 = 1) near chance. The question this script
answers: is it the random start? It runs FedLOE's stage 1 with fedloe.py's own functions and flags,
communicating every epoch (the trunk), and at each epoch k of --spawn it branches off:

    every client c trains --spawn-epochs L epochs alone from the trunk's model θ_k (stage 1's
    local step: a fresh Adam, the flags' lr and batch), then
      clients   the mean over the clients of each θ_c's accuracy (held-out domain; in-domain test)
      ensemble  the accuracy of the clients' mean softmax output (an ensemble of the P models)
      average   the accuracy of Σ_c p(c) θ_c, p(c) ∝ n_c: Eq. 4 with one communication (one-shot)
    and the branch is undone (model and minibatch generator restored), so the trunk is exactly a
    fedloe run with K1 = E1 (one epoch between averages; tested), and the trunk at epoch k + L is
    the same start continued for L epochs with every-epoch communication.

If one-shot averaging fails from θ_0 (random) but matches the trunk from a trained θ_k, the start is
what Figure 1a's regime needs; the published result behind that reading is that models trained apart
from one shared start can be averaged only while they stay in one basin (McMahan et al. 2017,
Figure 1, reproduced by benchmark/diagnostics/mcmahan_fig1.py; Frankle et al. 2020). The branch at
k = 0 is fedloe.py with --stage1-comms 1 --stage1-epochs L bit for bit (tested).

    python benchmark/diagnostics/fedloe_spawn.py --dataset rmnist --clients 20 --data-root data \\
        --test-domain 0 --model smallconv --lr 1e-2 --spawn 0 1 4 16 --spawn-epochs 16 --seed 0 \\
        --out results/spawn-seed0.json

--stage1-epochs / --stage1-comms / --stage2-comms are set from --spawn and --spawn-epochs (the trunk
runs max(spawn) + L epochs, one communication each, no stage 2). Results: the fedloe JSON; the
history row of round k + 1 carries the branch spawned at epoch k under "spawn". --resume continues.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line)
import common  # noqa: E402
import fedloe  # noqa: E402


def add_args(p):
    fedloe.add_args(p)
    p.add_argument("--spawn", type=int, nargs="+", default=[0, 1, 4, 16],
                   help="trunk epochs k after which the clients branch off (0: the random start)")
    p.add_argument("--spawn-epochs", type=int, default=16,
                   help="L: epochs each client trains alone in a branch")


def derive(args):
    """The trunk: max(--spawn) + --spawn-epochs epochs, one communication each, no stage 2; then
    fedloe's rounds and local epochs of that."""
    n = max(args.spawn) + args.spawn_epochs
    stages = dict(stage1_epochs=n, stage1_comms=n, stage2_comms=0)
    return dict(stages, **fedloe.derive(argparse.Namespace(**{**vars(args), **stages})))


def check(args, given):
    if args.dataset not in common.data.LODO:
        raise common.UserError(f"fedloe_spawn compares a held-out domain with the in-domain test: "
                               f"leave-one-domain-out datasets only, not {args.dataset}")
    if given & {"stage1_epochs", "stage1_comms", "stage2_comms"}:
        raise common.UserError("--stage1-epochs, --stage1-comms and --stage2-comms are set by "
                               "--spawn and --spawn-epochs here: drop them")
    if args.eval_every != 1:
        raise common.UserError("the trunk is evaluated after every epoch (a branch is reported in "
                               "the next row): drop --eval-every")
    if min(args.spawn) < 0 or args.spawn_epochs < 1:
        raise common.UserError(f"--spawn must be >= 0 and --spawn-epochs >= 1, "
                               f"got {args.spawn} and {args.spawn_epochs}")
    fedloe.check(args, given)


# fedloe's defaults, less the stage-1 budget, which --spawn and --spawn-epochs set here
DEFAULTS = {k: {f: v for f, v in t.items()
                if f not in ("stage1_epochs", "stage1_comms", "stage2_comms")}
            for k, t in fedloe.DEFAULTS.items()}


def probabilities(model, x, ctx, batch_size=512):
    model.eval()
    with torch.no_grad():
        return torch.cat([model(ctx.prep(x[i:i + batch_size])).float().softmax(1)
                          for i in range(0, len(x), batch_size)])


def accuracy(model, x, y, ctx):
    return common.correct(model, x, y, ctx).float().mean().item()


@common.stackable
@common.replies(fedloe.stage1_update.replies)
def branch_update(site, sent):
    """A branch on client c: --spawn-epochs epochs of stage 1's Adam alone from the trunk's
    model."""
    adam = lambda params: torch.optim.Adam(params, lr=site.args.lr,
                                           weight_decay=site.args.weight_decay, foreach=True)
    theta_c, loss = common.local_train(site, sent["theta"], make_opt=adam,
                                       epochs=site.args.spawn_epochs)
    return {"theta": theta_c, "loss": loss}


def branch(t, model, fed, args, ctx):
    """Every client L epochs alone from the current model; the three accuracies; then undone. The
    branch's draws are its own exchange's (phase "branch"): the trunk draws as if there were
    none."""
    theta, every = common.get_flat(model), list(range(len(fed.clients)))
    delta_sum, weight_sum, alone_test, alone_in_domain = torch.zeros_like(theta), 0.0, [], []
    p_test, p_id = 0, 0                                       # the ensemble: summed softmax outputs
    test_x, test_y, _ = fed.pooled("test")                    # (in process: the held-out domain)
    id_x, id_y = (torch.cat([getattr(c, k) for c in fed.clients]) for k in ("id_x", "id_y"))
    trained = common.on_clients(branch_update, every, {"theta": theta}, t, ctx, phase="branch")
    for client, r in zip(fed.clients, trained):
        common.set_flat(model, r["theta"])
        alone_test.append(accuracy(model, test_x, test_y, ctx))
        alone_in_domain.append(accuracy(model, id_x, id_y, ctx))
        p_test = p_test + probabilities(model, test_x, ctx)
        p_id = p_id + probabilities(model, id_x, ctx)
        delta_sum += client.n * (r["theta"] - theta)                   # as fedloe's stage 1 (Eq. 4)
        weight_sum += client.n
    common.set_flat(model, theta + args.global_lr * delta_sum / weight_sum)
    out = {"average_test": accuracy(model, test_x, test_y, ctx),
           "average_in_domain": accuracy(model, id_x, id_y, ctx),
           "clients_test": sum(alone_test) / len(alone_test),
           "clients_in_domain": sum(alone_in_domain) / len(alone_in_domain),
           "ensemble_test": (p_test.argmax(1) == test_y).float().mean().item(),
           "ensemble_in_domain": (p_id.argmax(1) == id_y).float().mean().item()}
    common.set_flat(model, theta)
    return out


def spawn_round(t, model, fed, args, state, ctx):
    if t - 1 in args.spawn:                                     # the trunk has run k = t - 1 epochs
        state["branch"] = dict(k=t - 1, **branch(t, model, fed, args, ctx))
    return fedloe.fedloe_round(t, model, fed, args, state, ctx)       # stage 1 (--stage2-comms 0)


def init_state(model, fed, args, ctx):
    return dict(fedloe.init_state(model, fed, args, ctx), branch=None)


def evaluate(t, model, fed, args, state, ctx):
    """fedloe's evaluation of the trunk; the round's branch, if any, goes into the same history
    row."""
    val, test, per, extra = fedloe.evaluate(t, model, fed, args, state, ctx)
    extra["spawn"], state["branch"] = state["branch"], None
    return val, test, per, extra


METHOD = dataclasses.replace(fedloe.METHOD, name="fedloe_spawn", doc=__doc__, round=spawn_round,
                             clients=lambda args: fedloe.METHOD.clients(args) + (branch_update,),
                             init_state=init_state, evaluate=evaluate, add_args=add_args,
                             defaults=DEFAULTS, derive=derive, check=check)


def main(argv=None):
    return harness.main(METHOD, argv)


if __name__ == "__main__":
    main()
