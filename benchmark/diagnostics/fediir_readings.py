"""FedIIR's paper readings: fediir.py's round with one choice swapped, built from fediir's plain
functions and run through common.main (the results JSON is fediir's; its args name the reading).
fediir.py runs the official code's forms, which Table 3's numbers come from; no committed result uses
these (docs/fediir.md, "Paper or official code").

--gbar clients        g_bar as the mean of the sampled clients' full-batch classifier gradients (the
                      paper's ∇_ω R), not of every minibatch's (the code's mean_grad: a client weighs
                      by its size; one client per domain on PACS, photo held out: 0.25 / 0.28 / 0.47).
--half                the paper's γ/2 in the local objective (a run with γ --half is the run with γ/2).
--size-avg            the server weights the clients by data size (fedavg.py's default), not 1/C.
--gbar-inputs plain   the g_bar pass on the images without augmentation (the paper's R_c on the data
                      as it is); the code's loaders augment them on pacs / vlcs / officehome. The
                      digits are never augmented: unchanged there.

    python benchmark/diagnostics/fediir_readings.py --gbar clients --size-avg --half --rounds 20 --test-domain 0
    python benchmark/diagnostics/fediir_readings.py --gamma 0 --size-avg --rounds 4
        # = python fedavg.py --rounds 4 --parallel-clients off, bit for bit
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import fediir  # noqa: E402


def readings_round(t, model, fed, args, state, ctx):
    """fediir_round's steps 1 to 4 with the reading's g_bar, γ and client weights."""
    theta = common.get_flat(model)                                                # θ^{t-1}
    S = common.sample_clients(ctx, len(fed.clients), args.sample)                 # step 1
    if args.gamma > 0:                                                            # step 2 (+ EMA)
        g_bar = fediir.global_gradient(model, fed, S, ctx, None if args.gbar == "clients" else args.batch_size,
                                       args.gbar_inputs == "augmented")
        state["g_tilde"] = fediir.gbar_update(state["g_tilde"], g_bar, args.ema)
    gamma = args.gamma / 2 if args.half else args.gamma
    trained = list(common.train_clients(model, theta, [fed.clients[c] for c in S], args, ctx,   # step 3
                                        loss_fn=fediir.iir_loss(state["g_tilde"], gamma),
                                        objective=fediir.iir_loss_at(state["g_tilde"], gamma)))
    p = [float(fed.clients[c].n) if args.size_avg else 1.0 for c in S]
    common.set_flat(model, fediir.server_update(theta, [th for th, _ in trained], p, args.global_lr))   # step 4
    return {c: loss for c, (_, loss) in zip(S, trained)}


def add_args(p):
    fediir.add_args(p)
    p.add_argument("--gbar", default="batches", choices=["batches", "clients"],
                   help="g_bar as the mean over minibatches (official code, fediir.py) or over clients (paper)")
    p.add_argument("--gbar-inputs", default="augmented", choices=["augmented", "plain"],
                   help="the g_bar pass on the photo datasets: augmented inputs (official code, fediir.py) "
                        "or the images without augmentation")
    p.add_argument("--half", action="store_true", help="the paper's γ/2 instead of the code's γ")
    p.add_argument("--size-avg", action="store_true",
                   help="weight the clients by data size instead of Algorithm 1's and the code's 1/C")


def main(argv=None):
    return common.main("fediir", __doc__, readings_round, argv, add_args, init_state=fediir.init_state,
                       check=fediir.check, parallel_clients=True)


if __name__ == "__main__":
    main()
