"""PerInvFL's Tables 2 / 3 / 5 layout from finished runs: test accuracy at p_test = 0.1 ... 0.5.

The training contexts of rcmnist / rcfmnist do not depend on --p-test (data.rcmnist draws the test
colours last; a test checks that the training data are bit-identical across p_test), so one run
trained with --p-test 0.1 is scored here on the test contexts of every p_test: the final global
model (`<out>.ckpt`, written at the last round) and, for perinvfl.py, each client's θ_i on its own
test context, and both on the clients' training splits (p_e = 0.95 ... 0.80: the shape alone gives
at most 75% there, so more means the colour or memorised noise is used). The p_test of the run
itself is re-scored too and must equal the run's own number. Std over seeds with n − 1.

    python fedavg.py --dataset rcmnist --seed 0 --out results/rc/fedavg-s0.json
    python perinvfl.py --dataset rcmnist --seed 0 --out results/rc/perinvfl-dual-s0.json
    python benchmark/diagnostics/rcmnist_ptest.py results/rc/*.json

Bad input (no file, a file that is not a complete rcmnist / rcfmnist run, a missing or cut
checkpoint) ends with one line on stderr and exit code 2, before anything is scored or printed.
"""
import json
import sys
from argparse import Namespace
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import common  # noqa: E402
import data  # noqa: E402
from harness.config import Parser, help_text  # noqa: E402

P_TEST = (0.1, 0.2, 0.3, 0.4, 0.5)


def label(res):
    """A run's row: the method; for perinvfl.py also L_INV, the personalisation and line 8's reading
    (--theta, --theta-opt of benchmark/diagnostics/perinvfl_variants.py; perinvfl.py's runs have its
    defaults), so that runs of the two readings never share a row. Runs whose args predate those
    flags (they kept θ_i across rounds and used Adam for line 8) say so."""
    a = res["args"]
    if res["method"] != "perinvfl":
        return res["method"]
    if "personalize" in a and "theta" not in a:
        return f"perinvfl {a['inv']} {a['personalize']}, theta kept, line 8 adam (unflagged)"
    # perinvfl.py's own
    a = dict(dict(inv="irm", personalize="dual", theta="reset", theta_opt="sgd"), **a)
    return f"perinvfl {a['inv']} {a['personalize']}, theta {a['theta']}, line 8 {a['theta_opt']}"


def score(path):
    """{row label: [acc at each p_test..., acc on the training contexts]} for one results file: the
    global model, and for perinvfl.py also each client's θ_i on its own data."""
    res = json.loads(Path(path).read_text())
    args = Namespace(**res["args"])
    blob = checkpoint(path, args)
    ctx = common.Context(torch.device("cpu"), None, data.make_prep(args.dataset, "cpu"))
    name = label(res)
    load = {name: lambda model, c: model.load_state_dict(blob["model"])}          # the global model
    if res["method"] == "perinvfl":
        load = {name + " (global ν)": load[name],
                name: lambda model, c: common.set_flat(model, blob["state"]["theta"][c.id])}  # θ_i
    rows, train = defaultdict(list), {}
    for p in P_TEST:
        ds = data.load(args.dataset, args.data_root, args.seed, p_test=p,
                       rotation=not getattr(args, "no_rotation", False))
        fed, model = data.federate_fixed(ds, args.seed, "cpu"), common.build_model(args, ds)
        for row, put in load.items():
            rows[row].append(accuracy(model, put, fed, ctx, "test"))
            if p == P_TEST[0]:            # the training contexts are the same for every p_test
                train[row] = accuracy(model, put, fed, ctx, "train")
        if abs(p - args.p_test) < 1e-9:   # must reproduce the run's own number
            own = res["domains"]["clients"]["test_acc"]
            assert abs(rows[name][-1] - own) < 1e-6, (path, rows[name][-1], own)
    for row, acc in train.items():
        rows[row].append(acc)
    return rows


def accuracy(model, put, fed, ctx, split):
    """Pooled accuracy over every client's test context (or training split), each client scored with
    the weights put(model, client) gives it."""
    hits = []
    for c in fed.clients:
        put(model, c)
        x, y = (c.test_x, c.test_y) if split == "test" else (c.x, c.y)
        hits.append(common.correct(model, x, y, ctx))
    return torch.cat(hits).float().mean().item()


def table(paths):
    """{row label: [[acc at each p_test..., acc on the training contexts] for each run]} (also drawn
    by benchmark/report.py)."""
    rows = defaultdict(list)
    for path in paths:
        for name, accs in score(path).items():
            rows[name].append(accs)
    return rows


def run_of(path):
    """A results file's JSON, or UserError: it must be a complete rcmnist / rcfmnist run of a method
    script."""
    try:
        res = json.loads(Path(path).read_text())
        # args and method are read only to check that they are there (KeyError, TypeError)
        dataset, _, _ = res["dataset"], res["args"], res["method"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise data.UserError(f"{path} is not a method script's results file "
                             f"({type(e).__name__}: {e})") from None
    if dataset not in ("rcmnist", "rcfmnist"):
        raise data.UserError(f"{path}: a {dataset} run; "
                             f"the p_test table is for rcmnist and rcfmnist runs")
    if not res.get("complete"):
        raise data.UserError(f"{path}: an incomplete run (finish it with --resume)")
    return res


def checkpoint(path, args):
    """The final checkpoint beside a results file (<out>.ckpt), or UserError where it is missing or
    not the last round's (a cut or continued run)."""
    ckpt = Path(f"{path}.ckpt")
    try:
        blob = torch.load(ckpt, map_location="cpu", weights_only=True)     # written beside it
        last = blob["round"] == args.rounds and blob["finished"] == {}
    except (OSError, RuntimeError, KeyError, TypeError) as e:
        raise data.UserError(f"{path}: no readable checkpoint {ckpt.name} beside it "
                             f"({type(e).__name__})") from None
    if not last:
        raise data.UserError(f"{path}: its checkpoint {ckpt.name} is not the last round's")
    return blob


def main(argv=None):
    p = Parser(prog="rcmnist_ptest.py", description=help_text(__doc__))
    p.add_argument("paths", nargs="+", metavar="RESULTS.json",
                   help="results of rcmnist / rcfmnist runs, each with its .ckpt beside it")
    a = p.parse_args(argv)
    try:
        for path in a.paths:                         # every file checked before the first is scored
            checkpoint(path, Namespace(**run_of(path)["args"]))
        rows = table(a.paths)
    except data.UserError as e:
        p.error(str(e))
    print("| method | " + " | ".join(f"p_test {p}" for p in P_TEST)
          + " | mean | training contexts | seeds |")
    print("|---" * (len(P_TEST) + 4) + "|")
    for name, runs in sorted(rows.items()):
        t = 100 * torch.tensor(runs)
        std = t.std(0) if len(runs) > 1 else torch.zeros(t.shape[1])
        cells = [f"{m:.1f} ± {s:.1f}" for m, s in zip(t.mean(0), std)]
        print(f"| {name} | " + " | ".join(cells[:-1])
              + f" | {t[:, :-1].mean():.1f} | {cells[-1]} | {len(runs)} |")
    return rows


if __name__ == "__main__":
    main()
