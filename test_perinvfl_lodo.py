"""PerInvFL on leave-one-domain-out datasets (issue 29, section 1): the held-out domain has no client,
so the global invariant model ν is scored there and is the run's test accuracy (`test_model` "nu"),
selected on ν's pooled validation accuracy; the personalised θ_i are scored on their own clients'
validation splits; the defaults there; the refusal that remains is one line. And the row label of
benchmark/rcmnist_ptest.py, which names line 8's reading (issue 28)."""
import math
import types

import torch

from test_methods import run, fails
import common
import data
import perinvfl

LODO = ["--dataset", "synthetic", "--test-domain", "1", "--rounds", "3", "--eval-every", "1"]


def accuracy(model, x, y):
    """Independently of the method file: argmax of the model on pixels / 255, in eval mode."""
    model.eval()
    with torch.no_grad():
        return (model(x.float() / 255).argmax(1) == y).float()


def test_perinvfl_lodo_scores_nu_on_the_held_out_domain(tmp_path):
    """Synthetic, style1 held out, 2 clients (one per training domain), 3 rounds. From the final
    checkpoint, independently: ν's accuracy on the held-out domain is the last row's test_acc (and its
    global_test_acc), ν's accuracy on the clients' pooled validation split its val_acc, and θ_i's on
    client i's own validation split its personal_per_val (personal_val_acc: pooled). The reported
    test_acc is that of the round with ν's best validation accuracy (the first of equals)."""
    res, out = run(perinvfl.main, LODO, tmp_path)
    r = res["domains"]["style1"]
    assert res["protocol"] == "lodo" and r["test_model"] == "nu"
    hist = r["history"]
    assert [h["round"] for h in hist] == [1, 2, 3]

    args = types.SimpleNamespace(**res["args"])
    ds = data.load("synthetic", None, args.seed)
    fed = common.federate(ds, 1, args.clients, args.seed, "cpu")
    blob = torch.load(out.replace(".json", ".ckpt"), map_location="cpu", weights_only=True)
    assert blob["round"] == 3
    model = common.build_model(args, ds)
    model.load_state_dict(blob["model"])                                       # ν^T
    nu = common.get_flat(model)
    held_out = ds.domains[1]
    nu_test = accuracy(model, held_out.x, held_out.y).mean().item()
    nu_val = accuracy(model, fed.val_x, fed.val_y).mean().item()
    last = hist[-1]
    assert abs(last["test_acc"] - nu_test) < 1e-6 and abs(last["global_test_acc"] - nu_test) < 1e-6
    assert abs(last["val_acc"] - nu_val) < 1e-6 and last["test_model"] == "nu"

    hits = []
    for c, theta_i in zip(fed.clients, blob["state"]["theta"]):
        common.set_flat(model, theta_i)
        hits.append(accuracy(model, c.val_x, c.val_y))
    assert len(last["personal_per_val"]) == len(fed.clients) == 2
    assert all(abs(a - h.mean().item()) < 1e-6 for a, h in zip(last["personal_per_val"], hits))
    assert abs(last["personal_val_acc"] - torch.cat(hits).mean().item()) < 1e-6
    assert min((th - nu).abs().max() for th in blob["state"]["theta"]) > 1e-6   # the θ_i are not ν

    best = max(hist, key=lambda h: h["val_acc"])                               # the first of equals
    assert r["best_round"] == best["round"] and r["test_acc"] == best["test_acc"] == best["global_test_acc"]
    assert r["personal_val_acc"] == best["personal_val_acc"] and res["mean_test_acc"] == r["test_acc"]
    assert len(r["eq4_theta"]) == 2 and r["eq4_holds"] in (0.0, 0.5, 1.0)


def test_perinvfl_lodo_defaults_and_one_epoch_of_line_9(monkeypatch):
    """On a leave-one-domain-out dataset the defaults are the dataset's common ones (rmnist: ConvNet,
    FedIIR's Table 3 lr 1e-2 and batch 64, best validation), Algorithm 1's plain steps (momentum 0,
    λ = 1 throughout, R = one local epoch); rcmnist keeps IRM's recipe with R = 1. With `--R epoch`
    client i takes E·⌈n_i/B⌉ steps of line 9, each after S steps of line 8 (batches drawn counted)."""
    p = common.make_parser("perinvfl", perinvfl.__doc__)
    perinvfl.add_args(p)
    a = common.resolve(p.parse_args(["--dataset", "rmnist", "--out", "/tmp/perinvfl-lodo-defaults.json"]),
                       "perinvfl", perinvfl.DEFAULTS)
    assert (a.model, a.lr, a.batch_size, a.select, a.rounds, a.local_epochs) == ("convnet", 1e-2, 64, "val", 100, 1)
    assert (a.R, a.S, a.opt, a.theta_opt, a.momentum, a.lam, a.anneal, a.beta, a.theta) == \
        ("epoch", 1, "sgd", "sgd", 0.0, 1.0, 0, 1.0, "reset")
    rc = common.resolve(p.parse_args(["--dataset", "rcmnist", "--out", "/tmp/perinvfl-lodo-defaults.json"]),
                        "perinvfl", perinvfl.DEFAULTS)
    assert (rc.R, rc.opt, rc.lam, rc.anneal, rc.eta) == (1, "adam", 91257.186, 190, 0.1)

    from test_methods import tiny_model, tiny_federation, tiny_ctx, pinv_args
    model, fed, ctx = tiny_model(), tiny_federation(), tiny_ctx()
    args = pinv_args(R="epoch", S=2, batch_size=4, local_epochs=2)
    state = perinvfl.init_state(model, fed, args, ctx)
    drawn, batch = [], perinvfl.batch
    monkeypatch.setattr(perinvfl, "batch", lambda client, *a: drawn.append(client.id) or batch(client, *a))
    perinvfl.perinvfl_round(1, model, fed, args, state, ctx)
    for c in fed.clients:
        assert drawn.count(c.id) == (2 + 1) * 2 * math.ceil(c.n / 4), (c.n, drawn.count(c.id))


def test_perinvfl_refusal_that_remains_on_lodo_is_one_line(capsys):
    """Leave one domain out is no longer refused; what still is (the clients one after another) is one
    line with its reason."""
    line = fails(perinvfl.main, LODO + ["--parallel-clients", "on"], capsys)
    assert "--parallel-clients on: perinvfl trains its clients one after another" in line
    assert "fixed-clients dataset" not in line


def test_rcmnist_ptest_rows_name_line_8s_reading():
    """benchmark/rcmnist_ptest.py's row of a perinvfl run names --theta and --theta-opt, so that runs of
    the two readings never merge into one row; runs made before those flags say so."""
    import rcmnist_ptest                                  # (benchmark/ is on the path: test_methods)
    a = {"inv": "irm", "personalize": "dual", "theta": "reset", "theta_opt": "sgd"}
    runs = [{"method": "perinvfl", "args": dict(a, **kw)} for kw in
            ({}, {"theta": "kept"}, {"theta_opt": "adam"}, {"theta": "kept", "theta_opt": "adam"})]
    old = {"method": "perinvfl", "args": {"inv": "irm", "personalize": "dual"}}
    labels = [rcmnist_ptest.label(r) for r in runs + [old]]
    assert len(set(labels)) == 5
    assert labels[0] == "perinvfl irm dual, theta reset, line 8 sgd"
    assert labels[-1] == "perinvfl irm dual, before issue 28"
    assert rcmnist_ptest.label({"method": "fedavg", "args": {}}) == "fedavg"
