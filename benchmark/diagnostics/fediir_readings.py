"""FedIIR's paper readings: fediir.py's round with one choice swapped, built from fediir's plain
functions and run through harness.main (the results JSON is fediir's; its args name the reading).
fediir.py runs the official code's forms, which Table 3's numbers come from; no committed result
uses these (docs/fediir.md, "Paper or official code").

--gbar clients        g_bar as the mean of the sampled clients' full-batch classifier gradients (the
                      paper's ∇_ω R), not of every minibatch's (the code's mean_grad: a client
                      weighs by its size; one client per domain on PACS, photo held out:
                      0.25 / 0.28 / 0.47).
--half                the paper's γ/2 in the local objective (a run with γ --half is the run with
                      γ/2).
--size-avg            the server weights the clients by data size (fedavg.py's default), not 1/C.
--gbar-inputs plain   the g_bar pass on the images without augmentation (the paper's R_c on the data
                      as it is); the code's loaders augment them on pacs / vlcs / officehome. The
                      digits are never augmented: unchanged there.

    python benchmark/diagnostics/fediir_readings.py --gbar clients --size-avg --half \\
        --rounds 20 --test-domain 0
    python benchmark/diagnostics/fediir_readings.py --gamma 0 --size-avg --rounds 4
        # = python fedavg.py --rounds 4 --parallel-clients off, bit for bit
"""
import dataclasses
import sys
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import torch  # noqa: E402

import common  # noqa: E402
import harness  # noqa: E402
import fediir  # noqa: E402


@common.replies(fediir.classifier_gradient.replies, **fediir.classifier_gradient.reduced)
def readings_gradient(site, sent):
    """fediir.classifier_gradient with the reading's g_bar: over the client's minibatches (the code)
    or its one full-batch gradient (--gbar clients: count 1, the server's mean over clients),
    augmented or plain inputs."""
    model, client, args = site.model, site.client, site.args
    common.set_flat(model, sent["theta"])
    model.train()
    with torch.no_grad(), site.autocast():
        z = torch.cat([model.featurizer(site.prep(client.x[i:i + 256],
                                                  train=args.gbar_inputs == "augmented",
                                                  gen=site.gen))
                       for i in range(0, client.n, 256)])
    grad, count = fediir.classifier_grads(model.classifier, z.to(sent["theta"].dtype), client.y,
                                          None if args.gbar == "clients" else args.batch_size)
    return {"grad": grad, "count": count}


def readings_round(t, model, fed, args, state, ctx):
    """fediir_round's steps 1 to 4 with the reading's g_bar, γ and client weights."""
    theta = common.get_flat(model)                                                # θ^{t-1}
    S = common.sample_clients(ctx, len(fed.clients), args.sample)                 # step 1
    if args.gamma > 0:                                                            # step 2 (+ EMA)
        up = common.on_clients(readings_gradient, S, {"theta": theta}, t, ctx,
                               phase="classifier_gradient")
        g_bar = up["grad"] / up["count"]
        state["g_tilde"] = fediir.gbar_update(state["g_tilde"], g_bar, args.ema)
    gamma = args.gamma / 2 if args.half else args.gamma
    up = common.on_clients(sized_update if args.size_avg else fediir.client_update, S,  # step 3
                           {"theta": theta, "g_tilde": state["g_tilde"], "gamma": gamma}, t, ctx,
                           phase="client_update")
    p = sum(float(fed.clients[c].n) if args.size_avg else 1.0 for c in S)
    common.set_flat(model, fediir.server_update(theta, up["delta"], p, args.global_lr))  # step 4
    return {tuple(S): up["loss"]}


@common.stackable
@common.replies(fediir.client_update.replies, **fediir.client_update.reduced)
def sized_update(site, sent):
    """fediir.client_update weighted by data size (--size-avg): n_c Δ_c, as fedavg.py's."""
    up = fediir.client_update(site, sent)
    return {**up, "delta": common.sizes(site, up["delta"].device) * up["delta"]}


def add_args(p):
    fediir.add_args(p)
    p.add_argument("--gbar", default="batches", choices=["batches", "clients"],
                   help="g_bar as the mean over minibatches (official code, fediir.py) "
                        "or over clients (paper)")
    p.add_argument("--gbar-inputs", default="augmented", choices=["augmented", "plain"],
                   help="the g_bar pass on the photo datasets: augmented inputs "
                        "(official code, fediir.py) or the images without augmentation")
    p.add_argument("--half", action="store_true", help="the paper's γ/2 instead of the code's γ")
    p.add_argument("--size-avg", action="store_true",
                   help="weight the clients by data size instead of Algorithm 1's "
                        "and the code's 1/C")


METHOD = dataclasses.replace(fediir.METHOD, doc=__doc__, round=readings_round, add_args=add_args,
                             clients=(readings_gradient, fediir.client_update, sized_update))


def main(argv=None):
    return harness.main(METHOD, argv)


if __name__ == "__main__":
    main()
