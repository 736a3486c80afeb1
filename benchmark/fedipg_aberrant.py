"""FedIPG's Section VI-A (Figure 3): one aberrant client among the regular ones, with or without the
exit strategy. fedipg.py's own round, through harness.main, given an arrivals function (its
`arrive` parameter) that delays or drops the aberrant client's updates; every fedipg.py flag
applies, and:

  --aberrant KIND:VALUE on client --aberrant-client (default 0; without it every client is regular):
    slow:K        its update takes K rounds: it receives w^t, its Δ is computed from w^t and
                  arrives in round t + K − 1 (τ = K − 1); then it receives the model of the next
                  round
    unreliable:P  each round its download and its upload each succeed with probability P; it
                  always trains from the last model it received, so its updates arrive late and
                  stale
    rotate:DEG    its images (training and validation) are turned by a further DEG degrees
  slow and unreliable need every client in every round (--sample = --clients, Algorithm 1's "for
  all clients"). After --exit auto's pre-training phase every client receives w^1 again (line 4):
  a slow client's unfinished update is dropped. The results add aberrant_acc and regular_acc
  (validation accuracy on the aberrant client / the others) to id_acc, ood_acc and the exited
  clients.
  --exit-clients 3,7  these clients exit from the start, named by hand (the committed exit-hand
                      runs)
  --warmup rounds     --exit auto's warm-up rounds are rounds 1..W of the T, their model kept (the
                      committed exit-auto runs; default pretraining: fedipg.py's, before round 1)

    python benchmark/fedipg_aberrant.py --clients 20 --test-domain 75 --aberrant rotate:180 \\
        --exit auto
    python benchmark/fedipg_aberrant.py --clients 20 --local-step sgd --aberrant slow:3 \\
        --exit-clients 0
"""
import argparse
import dataclasses
import sys
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line)
import torch  # noqa: E402

import common  # noqa: E402
import fedipg  # noqa: E402
from data import rotate  # noqa: E402


def fedipg_round(t, model, fed, args, state, ctx):
    """fedipg.fedipg_round with `arrivals`; --warmup rounds: rounds 1..W are the warm-up rounds
    (Eq. 13's estimates)."""
    W = args.exit_warmup if args.exit == "auto" else 0
    return fedipg.fedipg_round(t, model, fed, args, state, ctx, arrive=arrivals,
                               warmup=t <= W if args.warmup == "rounds" else None)


def arrivals(t, S, w_t, args, state, ctx, warmup):
    """fedipg.fedipg_round's `arrive` with the slow or unreliable client: (i, w^{t−τ_i}, τ_i) for
    the updates that arrive."""
    kind, value = args.aberrant or (None, None)
    if t == 1 and not warmup:                 # round 1: every client has received w^1 (line 4)
        state.update(start(w_t, args))
    arrived = []
    for i in S:
        start_i, tau = w_t, 0
        if i == args.aberrant_client and kind == "slow":
            if state["since"] is None:                 # idle: receives w^t, starts
                state["since"], state["received"] = t, w_t
            if t - state["since"] < value - 1:
                continue                               # still computing
            start_i, tau, state["since"] = \
                state["received"].to(w_t.device), t - state["since"], None    # τ = K − 1
        elif i == args.aberrant_client and kind == "unreliable":
            down, up = (torch.rand(2, generator=ctx.sampler) < value).tolist()
            if down:
                state["since"], state["received"] = t, w_t
            if not up:
                continue                               # upload lost
            start_i, tau = state["received"].to(w_t.device), t - state["since"]
            # (.to: a resume loads it on the CPU)
        arrived.append((i, start_i, tau))
    return arrived


def start(w, args):
    """A slow or unreliable client's state once the server has sent w to all: received w, in
    round 1."""
    kind = (args.aberrant or [None])[0]
    return {"since": 1 if kind == "unreliable" else None,
            "received": w if kind in ("slow", "unreliable") else None}


def init_state(model, fed, args, ctx):
    P, (kind, value) = len(fed.clients), args.aberrant or (None, None)
    for i in ([args.aberrant_client] if kind else []) + args.exit_clients:
        if not 0 <= i < P:
            raise common.UserError(f"client {i} does not exist: there are {P} clients "
                                   f"(0..{P - 1})")
    if len(args.exit_clients) >= P:
        raise common.UserError("--exit-clients names every client: nobody is left to train")
    if kind in ("slow", "unreliable") and args.sample != P:
        raise common.UserError(f"--aberrant {kind} needs every client in every round: --sample "
                               f"{P} (got {args.sample})")
    if kind == "rotate":                               # this client's images turn
        c = fed.clients[args.aberrant_client]
        c.x, c.val_x = (rotate(v.cpu(), value).to(v.device) for v in (c.x, c.val_x))
    state = {**fedipg.init_state(model, fed, args, ctx), **start(common.get_flat(model), args)}
    return {**state, "exited": list(args.exit_clients)}  # I_OOD from the start: --exit-clients


def evaluate(t, model, fed, args, state, ctx):
    """fedipg.evaluate, and the validation accuracy on the aberrant client and on the others (the
    sites scored again)."""
    val, test, per, *extra = fedipg.evaluate(t, model, fed, args, state, ctx)
    if args.aberrant is None:
        return (val, test, per, *extra)
    mine = args.aberrant_client
    rest = [i for i in range(len(fed.clients)) if i != mine]
    sums = common.scores(t, model, fed, ctx, subsets=[[mine], rest])   # (the evaluation sites)
    extra = extra[0] if extra else {"id_acc": val, "ood_acc": None, "exited": []}
    return val, test, per, {**extra, "aberrant_acc": common.accuracies(sums, 0)[0],
                            "regular_acc": common.accuracies(sums, 1)[0]}


def add_args(p):
    fedipg.add_args(p)
    p.add_argument("--aberrant", type=aberrant, help="slow:K, unreliable:P or rotate:DEG "
                   "(Section VI-A; default: none)")
    p.add_argument("--aberrant-client", type=int, default=0, help="which client is aberrant")
    p.add_argument("--exit-clients", default="", type=client_list,
                   help="clients that exit from the start, e.g. 3,7")
    p.add_argument("--warmup", default="pretraining", choices=["pretraining", "rounds"],
                   help="--exit auto's warm-up: before round 1 (Algorithm 1), or rounds 1..W, "
                        "their model kept")


def parse_aberrant(text):
    """([kind, value], None) for a good --aberrant, else (None, why not)."""
    kind, _, value = text.partition(":")
    try:
        value = {"slow": int, "unreliable": float, "rotate": float}[kind](value)
    except (KeyError, ValueError):
        return None, f"--aberrant takes slow:K, unreliable:P or rotate:DEG, got {text!r}"
    if (kind == "slow" and value < 1) or (kind == "unreliable" and not 0 < value <= 1):
        return None, f"--aberrant {text}: K must be >= 1 and P in (0, 1]"
    return [kind, value], None


def aberrant(text):
    """The type of --aberrant: [kind, value]; a bad value stays text, for check to refuse in one
    line."""
    return parse_aberrant(text)[0] or text


def check(args, given):
    fedipg.check(args, given)
    if isinstance(args.aberrant, str):
        raise common.UserError(parse_aberrant(args.aberrant)[1])
    if args.exit == "auto" and args.warmup == "rounds" and args.exit_warmup > args.rounds:
        raise common.UserError(f"--warmup rounds: --exit-warmup must be between 1 and --rounds "
                               f"({args.rounds}), got {args.exit_warmup}")


def client_list(text):
    try:
        return sorted({int(i) for i in text.split(",") if i.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--exit-clients takes client numbers like 3,7, got "
                                         f"{text!r}")


def parallel_reason(args):
    if (args.aberrant or [None])[0] in ("slow", "unreliable"):
        return f"--aberrant {args.aberrant[0]}: a stale client starts from an older model than " \
            f"the others"
    return fedipg.METHOD.parallel(args)


# fedipg.py's method with this round (its arrivals), state, evaluation and flags; the checkpoint
# names this file (harness.provenance.code_files: the round's)
METHOD = dataclasses.replace(fedipg.METHOD, doc=__doc__, round=fedipg_round, init_state=init_state,
                             evaluate=evaluate, add_args=add_args, check=check,
                             parallel=parallel_reason)


def main(argv=None):
    return harness.main(METHOD, argv)


if __name__ == "__main__":
    main()
