"""Which penalties learn invariance at all: every invariance penalty of the project in one and the
same federated optimisation, on federated ColoredMNIST (rcmnist --no-rotation), only the penalty
swapped.

The optimisation is PerInvFL's global model ν (perinvfl.py, R = S = 1, `--opt adam`), which is IRM's
ColoredMNIST recipe (Arjovsky et al., github.com/facebookresearch/InvariantRiskMinimization,
colored_mnist/main.py) federated: in round t every client i computes, on its whole training split,

    g_i = ∇_ν [R_i(ν) + l2 ||ν||² + w_t P_i(ν)] / (w_t if w_t > 1 else 1)

and uploads Δ_i = −γ g_i (line 9: one plain step of γ = lr); the server takes one Adam step of lr γ
on −mean_i Δ_i / γ = mean_i g_i (line 10 with Adam). Both are perinvfl.py's own functions (l_inv,
rescale, server_adam), so the irm row is ν bit for bit when the clients are averaged in the same
order (tested; perinvfl.py draws their order every round, which changes only the rounding).
The recipe is perinvfl.RC's: Adam lr 4.898e-4, l2 1.10794568e-3 on every parameter, w_t = 1 for the
first 190 rounds, then 91257.186 with the whole loss divided by it, 500 rounds; IRM's MLP
392 → 390 → 390 with a 2-logit linear head, initialised as IRM's code (common.build_model); the
data, split and seeds as perinvfl.py's. The penalties P_i, each the method file's own function:

    irm     IRMv1, perinvfl.irm_penalty: (∂/∂s R_i(s · logits) at s = 1)²
    fediir  FedIIR's gradient alignment, fediir.iir_penalty: ||∇_ω R_i(ν) − g̃||² on the classifier
            ω, g̃ the server's EMA (fediir.gbar_update, v = --ema, 0.95 as FedIIR's Appendix C,
            g̃^0 = 0) of the mean over all clients of ∇_ω R_i at the round's ν
            (fediir.classifier_grads, full batch); g̃ is a constant in P_i. --ema 0: no EMA
            (g̃ = the mean).
    fedipg  FedIPG's Eq. 9, d² with d = ⟨∇R_i(ν), ν⟩ over every parameter (fedipg.risk_and_d, exact)
    vrex    V-REx as fedloe.py's (its base code's): the variance of the per-example losses within
            the client (fedloe.rex_penalty on one client's logits); the mean over the clients of g_i
            makes it fedloe's mean over the clients
    none    ERM: no penalty term and no division in any round, the same l2 and Adam
The weight schedule w_t is IRM's for every penalty (everything but the penalty held equal), not each
method's own λ (FedIIR γ 1e-2, FedIPG λ 1e-3, FedLOE λ 100, applied there to other parameters).

Scoring, as fedavg.py scores rcmnist: ν after the last round on the clients' own test sets (p_test
0.1), pooled; train accuracy on the clients' training splits, pooled (each client's 10% validation
hold-out is in neither: data.federate_fixed, as for ν). The history, at rounds 0, 50, ..., the
last: train and test accuracy, the mean over the clients of R_i and of P_i at that ν (fediir: with
the g̃ its last round aligned to, 0 at round 0).

    python benchmark/diagnostics/penalty_swap.py --data-root data \\
        --penalties irm fediir fedipg vrex none --seeds 0 1 2 \\
        --out benchmark/results/penalty-swap/swap.json
    # two at once, one file
    python benchmark/diagnostics/penalty_swap.py --data-root data --penalties irm fedipg none &
    python benchmark/diagnostics/penalty_swap.py --data-root data --penalties fediir vrex
    python benchmark/diagnostics/penalty_swap.py --report benchmark/results/penalty-swap/swap.json

--out is resumable: a finished (penalty, seed) is skipped; each run is added to the file when it
ends (under a lock on its folder, to the file as it is then), so that two processes with different
--penalties or --seeds can share one --out.
`--report FILE`: the markdown table of FILE beside the committed centralised IRM / ERM
(benchmark/diagnostics/irm_central.py) and ν (perinvfl.py) on the same data.

Cost on the CPU (AMD EPYC, one thread, 2026-11-23, full MNIST, a machine shared with other jobs): a
round takes 1.4 to 2.5 s (none, irm, vrex, fedipg) and 2.7 to 3.4 s (fediir: a pass for g̃ first),
so a run of 500 rounds 12 to 21 minutes (fediir 22 to 29).
"""
import argparse
import fcntl
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import common  # noqa: E402
import data  # noqa: E402
import fediir  # noqa: E402
import fedipg  # noqa: E402
import fedloe  # noqa: E402
import perinvfl  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser  # noqa: E402

PENALTIES = ("irm", "fediir", "fedipg", "vrex", "none")
# WD / 2: IRM's l2
LR, WD, LAM, ANNEAL = (perinvfl.RC[k] for k in ("lr", "weight_decay", "lam", "anneal"))
ROUNDS = common.PROTOCOL["rcmnist"]["rounds"]
EVERY = 50
CENTRAL = ROOT / "benchmark/results/irm-central/rc-norot.json"      # irm_central.py --data rc-norot
# ν, perinvfl.py --no-rotation
NU = ROOT / "benchmark/results/rcmnist-full-norot/perinvfl-seed{}.json"


# ---------------------------------------------------------------------------------- the penalties

def objective(name, model, x, y, aux=None):
    """Client i's L_INV without its invariance term, R_i + l2 ||ν||² (perinvfl.l_inv, lam 0), R_i
    and P_i (None for none) at the model's parameters, all with their graphs, each example weighted
    1/n as perinvfl.py's clients weigh them. aux: fediir's g̃."""
    params, w = list(model.parameters()), torch.full((len(y),), 1 / len(y), device=y.device)
    if name == "fedipg":           # risk_and_d's forward carries d beside the logits: no second one
        risk, d = fedipg.risk_and_d(model, x, y, w, fedipg.chain(model))
        return risk + WD / 2 * sum(p.pow(2).sum() for p in params), risk, d * d  # l_inv's l2; Eq. 9
    logits = model(x)
    risk = (torch.nn.functional.cross_entropy(logits, y, reduction="none") * w).sum()
    # perinvfl.l_inv without its IRMv1 term
    loss = risk + WD / 2 * sum(p.pow(2).sum() for p in params)
    if name == "irm":
        P = perinvfl.irm_penalty(logits, y, w)
    elif name == "fediir":
        # ∇_ω R_i
        g = torch.autograd.grad(risk, list(model.classifier.parameters()), create_graph=True)
        P = fediir.iir_penalty(g, aux)
    elif name == "vrex":                               # the client's logits as one "head" of fedloe
        T = fedloe.Tuning(logits[:, None, :], y, [len(y)])
        P = fedloe.rex_penalty(torch.ones(1, dtype=logits.dtype, device=logits.device), T)
    else:
        P = None
    return loss, risk, P


def weight(name, t, anneal, lam=LAM):
    """w_t of round t (1-based): IRM's schedule; None for ERM (no penalty term, no division)."""
    return None if name == "none" else (lam if t > anneal else 1.0)


def global_gradient(model, clients):
    """FedIIR's g_bar: the mean over the clients of ∇_ω R_i at the current ν, full batch (flat)."""
    grads = []
    for x, y in clients:
        with torch.no_grad():
            z = model.featurizer(x)
        grads.append(fediir.classifier_grads(model.classifier, z, y)[0])   # one full batch each
    return sum(grads) / len(grads)


def swap_round(t, name, model, clients, state, args):
    """One round of ν (perinvfl.py, R = 1): every client uploads Δ_i = −γ g_i, one plain step of γ =
    lr on its L_INV divided by perinvfl.rescale (line 9); the server's Adam steps on −mean_i Δ_i / γ
    = mean_i g_i (perinvfl.server_adam, line 10, α = 1)."""
    w = weight(name, t, args.anneal)
    if name == "fediir":
        state["g_tilde"] = fediir.gbar_update(state["g_tilde"], global_gradient(model, clients),
                                              args.ema)
    nu, deltas = common.get_flat(model), []
    for x, y in clients:             # one plain SGD step of γ from ν, as perinvfl.py's line 9 steps
        common.set_flat(model, nu)
        opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
        if name == "irm":                 # perinvfl.py's own line-9 loss, the same operations
            params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
            uniform = torch.full((len(y),), 1 / len(y), device=y.device)
            loss = perinvfl.line9_loss(model, params, buffers, x, y, uniform, w, WD)
        else:
            loss, _, P = objective(name, model, x, y, state.get("g_tilde"))
            loss = loss if w is None else (loss + w * P) / perinvfl.rescale(w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        deltas.append(common.get_flat(model) - nu)                          # Δ_i = ν_{i,1} − ν^t
    mean = torch.stack(deltas).mean(0)                                      # mean_i Δ_i
    nu, state["adam"] = perinvfl.server_adam(nu, mean, 1.0, LR, state["adam"])
    common.set_flat(model, nu)


def measure(name, model, fed, clients, state, ctx):
    """Train / test accuracy (pooled) and the clients' mean R_i and P_i at the current ν."""
    R, P = [], []
    for x, y in clients:
        _, risk, pen = objective(name, model, x, y, state.get("g_tilde"))
        R.append(risk.item())
        P.append(None if pen is None else pen.item())
    train = torch.cat([common.correct(model, c.x, c.y, ctx)
                       for c in fed.clients]).float().mean().item()
    x, y, owner = fed.pooled("test")                            # the clients' own test contexts
    test = common.correct(model, x, y, ctx).float()
    return {"train_acc": train, "test_acc": test.mean().item(), "risk": sum(R) / len(R),
            "penalty": None if P[0] is None else sum(P) / len(P),
            "per_client_test_acc": [test[owner == i].mean().item() for i in range(len(P))]}


def train(name, seed, args, log=print):
    """One run: the data, split and initial ν exactly as perinvfl.py builds them for this seed."""
    device = torch.device(args.device)
    ds = data.load("rcmnist", args.data_root, seed, p_test=0.1, rotation=False)
    fed = data.federate_fixed(ds, seed, device)
    torch.manual_seed(seed)
    model = common.build_model(argparse.Namespace(model="mlp", head="linear", no_pretrained=True),
                               ds).to(device)
    ctx = common.Context(device, torch.Generator(), data.make_prep("rcmnist", device))
    clients = [(ctx.prep(c.x), c.y) for c in fed.clients]
    state = {"adam": None, "g_tilde": torch.zeros_like(common.get_flat(model.classifier))}
    history, t0 = [], time.perf_counter()
    for t in range(args.rounds + 1):
        if t:
            swap_round(t, name, model, clients, state, args)
        if t % EVERY == 0 or t == args.rounds:
            row = {"round": t, **measure(name, model, fed, clients, state, ctx),
                   "seconds": time.perf_counter() - t0}
            history.append(row)
            pen = "-" if row["penalty"] is None else f"{row['penalty']:.3g}"
            log(f"{name} seed {seed} round {t:4d}/{args.rounds} | train {row['train_acc']:.4f} "
                f"| test {row['test_acc']:.4f} | risk {row['risk']:.4f} | penalty {pen} | "
                f"{row['seconds'] / max(t, 1):.2f} s/round", flush=True)
    last = history[-1]
    return {"penalty": name, "seed": seed, "test_acc": last["test_acc"],
            "train_acc": last["train_acc"],
            "per_client_test_acc": dict(zip(fed.test_names, last["per_client_test_acc"])),
            "seconds": last["seconds"], "device": str(device), "source": ds.source,
            "history": history}, model


# ------------------------------------------------------------------------------------ the report

def mean_std(v):
    return f"{statistics.mean(v):.1f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.1f}"


def report(path):
    results = read(path)
    lines = ["| penalty (ν's federated optimisation) | test acc (%) | seeds | train acc (%) |",
             "|---|---|---|---|"]
    try:
        for name in PENALTIES:
            runs = [r for r in results["runs"].values() if r["penalty"] == name]
            if runs:
                lines.append(f"| {name} | {mean_std([100 * r['test_acc'] for r in runs])} "
                             f"| {len(runs)} | {mean_std([100 * r['train_acc'] for r in runs])} |")
    except (KeyError, TypeError):
        raise data.UserError(f"{path} is not a results file of penalty_swap.py")
    if CENTRAL.exists():
        central = json.loads(CENTRAL.read_text())["runs"]
        for m in ("irm", "erm"):
            runs = [r for r in central if r["method"] == m]
            lines.append(f"| centralised {m.upper()} (irm_central.py, rc-norot) | "
                         f"{mean_std([100 * r['test_acc'] for r in runs])} | {len(runs)} | "
                         f"{mean_std([100 * r['train_acc'] for r in runs])} |")
    nu = [json.loads(NU.with_name(NU.name.format(s)).read_text())
          ["domains"]["clients"]["global_test_acc"] * 100
          for s in range(3) if NU.with_name(NU.name.format(s)).exists()]
    if nu:
        lines.append(f"| federated IRM ν (perinvfl.py, rcmnist-full-norot) | {mean_std(nu)} "
                     f"| {len(nu)} | — |")
    text = "\n".join(lines)
    print(text)
    return text


# --------------------------------------------------------------------------------------- the CLI

def settings(args):
    return {"rounds": args.rounds, "anneal": args.anneal, "lam": LAM, "lr": LR, "l2": WD / 2,
            "ema": args.ema, "data_root": args.data_root, "dataset": "rcmnist --no-rotation",
            "p_test": 0.1}


def save(path, mine, key=None, record=None):
    """Under a lock on the folder: the results file as it is now (another process may have added
    runs meanwhile; new: no runs), refused if made with other settings than `mine`, with the run
    `record` added as `key`, written back."""
    folder = os.open(Path(path).parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        results = read(path) if Path(path).exists() else {"settings": mine, "runs": {}}
        if results.get("settings") != mine:
            was = results.get("settings") or {}
            diff = sorted(k for k, v in mine.items() if was.get(k) != v)
            raise data.UserError(f"{path} holds runs made with other settings ({', '.join(diff)}): "
                                 f"pass another --out")
        if key is not None:
            results["runs"][key] = record
        outputs.write_json(path, results)
        return results
    finally:
        os.close(folder)                                                     # (releases the lock)


def read(path):
    try:
        results = json.loads(Path(path).read_text())
    except OSError as e:
        raise data.UserError(f"cannot read {path}: {e.strerror or e}")
    except ValueError:
        results = None
    if not isinstance(results, dict) or not isinstance(results.get("runs"), dict):
        raise data.UserError(f"{path} is not a results file of penalty_swap.py")
    return results


def check(args):
    if args.rounds < 1:
        raise data.UserError(f"--rounds must be positive, got {args.rounds}")
    if args.anneal < 0:
        raise data.UserError(f"--anneal must be >= 0, got {args.anneal}")
    if not 0 <= args.ema < 1:
        raise data.UserError(f"--ema must be in [0, 1), got {args.ema}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise data.UserError("--device cuda: no CUDA device is visible")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None):
    p = Parser(prog="penalty_swap.py", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--data-root", default=None,
                   help="MNIST folder (none: the embedded 5,000 digits)")
    p.add_argument("--penalties", nargs="+", default=list(PENALTIES), choices=PENALTIES)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds (default {ROUNDS})")
    p.add_argument("--anneal", type=int, default=ANNEAL,
                   help="rounds with w_t = 1 first (IRM: 190)")
    p.add_argument("--ema", type=float, default=0.95, help="fediir: the EMA rate v of g̃ (0: none)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default="benchmark/results/penalty-swap/swap.json",
                   help="results JSON (resumable)")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="print the table of FILE and exit")
    args = p.parse_args(argv)
    try:
        if args.report:
            return report(args.report)
        check(args)
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            save(args.out, settings(args))                               # (also: --out is writable)
        except OSError as e:
            raise data.UserError(f"cannot write --out {args.out}: {e.strerror or e}")
        for name in dict.fromkeys(args.penalties):
            for seed in dict.fromkeys(args.seeds):
                if f"{name}/{seed}" in read(args.out)["runs"]:
                    print(f"{name} seed {seed}: done before, skipped")
                    continue
                save(args.out, settings(args), f"{name}/{seed}", train(name, seed, args)[0])
        return read(args.out)
    except data.UserError as e:
        print(f"penalty_swap.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
