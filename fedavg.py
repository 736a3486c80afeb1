"""FedAvg — Communication-Efficient Learning of Deep Networks from Decentralized Data (McMahan et
al., AISTATS 2017), as Algorithm 1 of the FedIIR paper (Guo et al., ICML 2023) with γ = 0.

Objective (ERM over the participating clients):  min_θ  Σ_c p_c R_c(θ),  p_c ∝ n_c.

Algorithm (one communication round t = 1..T):
    1. sample a subset S of C clients out of P, uniformly without replacement
    2. send θ^{t-1} to S; on every client c ∈ S (each with its own random stream):
         θ_c ← θ^{t-1}; E epochs of minibatch SGD on the cross-entropy R_c(θ_c; ζ); send n_c Δ_c
         back, Δ_c = θ_c − θ^{t-1} (the server uses only their sum: secure aggregation can hide
         each one, docs/flower.md)
    3. server: θ^t = θ^{t-1} + η_g Σ_{c∈S} n_c Δ_c / Σ_{c∈S} n_c

The FedIIR code (and Algorithm 1 as printed) averages the sampled clients uniformly (1/C)
instead of by data size: `--uniform-avg` does that. With the Algorithm 2 split of FedIIR the
clients hold nearly equal amounts of data, so the two agree closely on the leave-one-domain-out
benchmarks.

Defaults (the protocol's, common.PROTOCOL): FedIIR's Table 3 per dataset (RotatedMNIST: lr
1e-2, batch 64; VLCS 1e-3 / 32; PACS 2.5e-3 / 32; OfficeHome 1e-3 / 32), 100 rounds, 1 local
epoch, SGD with momentum 0.9 and a fresh optimiser on every client in every round, η_g = 1,
evaluation every 10 rounds; the reported test accuracy is the one at the round with the best
pooled validation accuracy. Figure 1's two claims, the results and the readings: docs/fedavg.md.

    python fedavg.py                                  # RotatedMNIST, embedded digits, all domains
    python fedavg.py --rounds 20 --test-domain 0      # a quick look
    python fedavg.py --dataset pacs --data-root ./data --clients 50
"""
import importlib.util
if __name__ == "__main__" and importlib.util.find_spec("harness"):  # the harness first: a Ctrl-C
    import harness  # noqa: F401   while torch loads is one line, exit 130 (harness/__init__.py)

import common

# ---------------------------------------------------------------- the method as plain functions
# What a client computes from what the server sent (step 2), and the server's step 3. The
# client's work is plain local SGD on the cross-entropy (common.local_train draws its minibatches
# from the client's own random stream); what is FedAvg's own is the server's step.

@common.stackable                       # with --parallel-clients on, every sampled client at once
@common.replies(lambda site, sent: {"delta": sent["theta"], "loss": common.SCALAR},
                delta="sum", loss="mean")         # the server needs Σ_c n_c Δ_c, no client's own
def client_update(site, sent):
    """Step 2 on client c: θ_c ← θ^{t-1}, E epochs of minibatch SGD on R_c; n_c Δ_c and the loss
    (n_c = 1 with --uniform-avg)."""
    theta_c, loss = common.local_train(site, sent["theta"])
    n_c = 1.0 if site.args.uniform_avg else common.sizes(site, theta_c.device)
    return {"delta": n_c * (theta_c - sent["theta"]), "loss": loss}


def server_update(theta, delta_sum, weight_sum, global_lr=1.0):
    """Step 3: θ^t = θ^{t-1} + η_g Σ_c n_c Δ_c / Σ_c n_c. theta: θ^{t-1} as a flat vector;
    delta_sum: Σ_c n_c Δ_c over the sampled clients (what on_clients returns); weight_sum: Σ_c n_c;
    global_lr: η_g (1: the weighted mean of the θ_c). ValueError unless the sum has θ's shape and
    the weights a positive sum."""
    if delta_sum.shape != theta.shape or not weight_sum > 0:
        raise ValueError(f"server_update: a sum of shape {tuple(delta_sum.shape)} and weights "
                         f"{weight_sum} for θ of shape {tuple(theta.shape)}")
    return theta + global_lr * (delta_sum / weight_sum)


# ------------------------------------------------------------------------------------ one round

def fedavg_round(t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                      # θ^{t-1}
    S = common.sample_clients(ctx, len(fed.clients), args.sample)      # step 1
    up = common.on_clients(client_update, S, {"theta": theta}, t, ctx)  # step 2: Σ_c n_c Δ_c back
    n = sum(1.0 if args.uniform_avg else float(fed.clients[c].n) for c in S)      # Σ_c n_c
    common.set_flat(model, server_update(theta, up["delta"], n, args.global_lr))   # step 3
    return {tuple(S): up["loss"]}                                      # their mean loss


def add_args(p):
    p.add_argument("--uniform-avg", action="store_true", help="average the sampled clients "
                   "uniformly (the FedIIR code) instead of by data size")


METHOD = common.Method("fedavg", __doc__, fedavg_round, clients=(client_update,), add_args=add_args,
                       parallel=True)


def main(argv=None):                  # the program: the command line, checkpoints, results
    if importlib.util.find_spec("harness") is None:   # copied without harness/: common.program
        return common.program(METHOD, argv)
    return importlib.import_module("harness").main(METHOD, argv)


if __name__ == "__main__":
    main()
