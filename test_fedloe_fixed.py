"""FedLOE on the fixed-client datasets: both stages with the split's clients as the
environments of Eq. 11, scored on the clients' own test sets as FedAvg is. Stage 1 is checked against
FedAvg run with Adam, bit for bit; the final scores against the final model evaluated here."""
import copy
import types

import torch

from test_methods import fails, rows, run, strip_times

import common
import data
import fedavg
import fedloe
import fedloe_spawn

RC = ["--dataset", "rcmnist", "--eval-every", "1"]
TINY = ["--stage1-epochs", "2", "--stage1-comms", "1", "--stage2-epochs", "2", "--stage2-comms", "2",
        "--server-steps", "3"]


def keep_checkpoints(monkeypatch):
    blobs, save = {}, common.save_checkpoint

    def keep(path, blob):
        blobs[blob["round"]] = copy.deepcopy({k: v for k, v in blob.items() if k in ("model", "state")})
        save(path, blob)
    monkeypatch.setattr(common, "save_checkpoint", keep)
    return blobs


def scored_by_hand(ds, model_kind, state_dict):
    """The final model's accuracy on each client's own test set and on the whole validation hold-out
    of common.federate_fixed (seed 0), computed here."""
    model = common.build_model(types.SimpleNamespace(model=model_kind, head="linear", no_pretrained=True), ds)
    model.load_state_dict(state_dict)
    model.eval()
    prep = common.make_prep(ds.name, "cpu")
    with torch.no_grad():
        per = {d.name: (model(prep(d.x_test)).argmax(1) == d.y_test).float().mean().item() for d in ds.domains}
        fed = common.federate_fixed(ds, 0, "cpu")
        val = (model(prep(fed.val_x)).argmax(1) == fed.val_y).float().mean().item()
    return per, val


def test_fedloe_stage1_on_fixed_clients_is_fedavg_with_adam(tmp_path, monkeypatch):
    """--stage2-comms 0, one local epoch per communication: FedAvg with every client in every round
    (in their order), a fresh Adam per client and round, on the same 90% of each client's training split,
    gives the same history, per-client test accuracies and model, bit for bit."""
    argv = RC + ["--batch-size", "512", "--parallel-clients", "off"]
    blobs = keep_checkpoints(monkeypatch)
    loe, _ = run(fedloe.main, argv + ["--stage1-epochs", "3", "--stage1-comms", "3", "--stage2-comms", "0"],
                 tmp_path, "loe.json")
    theta_loe = blobs[3]["model"]
    blobs.clear()
    federate_fixed, train_clients = common.federate_fixed, common.train_clients

    def split(ds, seed, device, **kw):                        # FedAvg trains on FedLOE's training split
        fed = federate_fixed(ds, seed, device, **kw)
        fedloe.split_appendix_d2(fed, seed, lodo=False)
        return fed

    def with_adam(model, theta, clients, args, ctx, make_opt=None, **kw):
        adam = lambda params: torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
        return train_clients(model, theta, clients, args, ctx, adam, **kw)
    monkeypatch.setattr(common, "federate_fixed", split)
    monkeypatch.setattr(common, "train_clients", with_adam)
    monkeypatch.setattr(common, "sample_clients", lambda ctx, P, C: list(range(C)))
    avg, _ = run(fedavg.main, argv + ["--rounds", "3", "--local-epochs", "1", "--sample", "4", "--lr", "1e-3",
                                      "--weight-decay", "2.2e-3"], tmp_path, "avg.json")
    assert list(loe["domains"]) == list(avg["domains"]) == ["clients"]
    a, b = strip_times(loe)["domains"]["clients"], strip_times(avg)["domains"]["clients"]
    assert a.keys() == b.keys() and a == b                    # history, per_client_test_acc, ... equal
    assert len(a["per_client_test_acc"]) == 4 and a["history"][0]["loss"] != a["history"][-1]["loss"]
    assert all(torch.equal(theta_loe[k], blobs[3]["model"][k]) for k in theta_loe)


def test_fedloe_both_stages_on_rcmnist_scored_on_the_clients_test_sets(tmp_path, monkeypatch):
    """Stage 1 and stage 2 (Fish) with the 4 clients as the environments: stage 2 moves the head and
    leaves the featurizer; the last round's scores are the final model's on each client's own test set
    and on the whole validation hold-out (not halved: no held-out domain), computed here."""
    blobs = keep_checkpoints(monkeypatch)
    r, _ = run(fedloe.main, RC + TINY + ["--dg", "fish"], tmp_path)
    assert list(r["domains"]) == ["clients"] and r["protocol"] == "clients"
    d = r["domains"]["clients"]
    assert [h["round"] for h in d["history"]] == [1, 2, 3] and d["best_round"] == 3
    assert all(set(h) == {"round", "val_acc", "test_acc", "loss", "seconds"} for h in d["history"])  # no in-domain
    part = lambda t, name: [v for k, v in blobs[t]["model"].items() if k.startswith(name)]
    assert all(torch.equal(x, y) for x, y in zip(part(3, "featurizer"), part(1, "featurizer")))
    assert not torch.equal(part(3, "classifier")[0], part(2, "classifier")[0])
    assert blobs[3]["state"]["phi"].shape == (4,)              # one weight per client (environment)
    ds = data.load("rcmnist", None, 0, p_test=0.1)
    per, val = scored_by_hand(ds, "mlp", blobs[3]["model"])
    assert d["per_client_test_acc"] == per
    assert abs(d["val_acc"] - val) < 1e-6
    assert abs(d["test_acc"] - sum(per.values()) / 4) < 1e-6  # the 4 test sets are of equal size


def test_fedloe_on_mnist_label_skew(tmp_path):
    """The label-skew split (3 clients here): both stages run (IRM), every client takes part, and the
    per-client test accuracies are the final model's on each client's own test set."""
    argv = ["--dataset", "mnist", "--clients", "3", "--batch-size", "256", "--stage1-epochs", "1", "--stage1-comms",
            "1", "--stage2-epochs", "1", "--stage2-comms", "1", "--server-steps", "3"]
    r, out = run(fedloe.main, argv, tmp_path)
    d = r["domains"]["clients"]
    assert r["args"]["sample"] == 3 and r["args"]["rounds"] == 2 and r["args"]["lr"] == 1e-3
    assert len(d["history"]) == 2 and d["last_test_acc"] == d["test_acc"]
    blob = torch.load(str(tmp_path / "r.ckpt"), map_location="cpu", weights_only=True)
    per, val = scored_by_hand(data.load("mnist", None, 0, clients=3, alpha=0.1), "cnn", blob["model"])
    assert d["per_client_test_acc"] == per and abs(d["val_acc"] - val) < 1e-6


def test_fixed_clients_keep_their_validation_split_whole():
    """The 10% tuning split of each client's training split (Appendix D.2) on fixed clients; the
    validation hold-out is neither halved nor moved."""
    ds = data.load("rcmnist", None, 0)
    fed = common.federate_fixed(ds, 0, "cpu")
    before = [(rows(c.x), rows(c.val_x)) for c in fed.clients]
    val_x = fed.val_x.clone()
    fedloe.split_appendix_d2(fed, 0, lodo=False)
    for c, (train, val) in zip(fed.clients, before):
        assert len(c.tune_y) == int(0.1 * len(train)) and rows(c.x) | rows(c.tune_x) == train
        assert not rows(c.x) & rows(c.tune_x) and rows(c.val_x) == val and not hasattr(c, "id_x")
    assert torch.equal(fed.val_x, val_x) and not hasattr(fed, "id_x")


def test_fixed_client_refusals_are_one_line(tmp_path, capsys):
    """What still refuses on fixed clients, each in one line: a --sample below P, a client too small for a
    train/tune split, and the spawn diagnostic (it needs a held-out domain)."""
    out = ["--out", str(tmp_path / "x.json")]
    assert "fedloe uses every client" in fails(fedloe.main, ["--dataset", "mnist", "--sample", "20"] + out, capsys)
    assert "too few for a train/tune split" in fails(fedloe.main, ["--dataset", "mnist"] + out, capsys)
    assert "leave-one-domain-out datasets only, not rcmnist" in fails(fedloe_spawn.main, RC + out, capsys)


def resolved(module, name, defaults, tmp_path):
    p = common.make_parser(module.__name__, module.__doc__)
    module.add_args(p)
    args = common.resolve(p.parse_args(["--dataset", name, "--out", str(tmp_path / f"{name}.json")]), module.__name__,
                          defaults)
    return args


def test_fixed_client_defaults_follow_fedavgs_default_run(tmp_path):
    """The docstring's rule on every fixed-client dataset: E1 = 32·K1 (Table 5's 256 / 8 epochs between
    averages), K1 the whole number nearest to 1/32 of the local epochs a client trains in FedAvg's default
    run (rounds × local epochs × sample / clients); model, batch, weight decay and clients as FedAvg's."""
    for name in data.FL + data.FIXED:
        fa, loe = resolved(fedavg, name, None, tmp_path), resolved(fedloe, name, fedloe.DEFAULTS, tmp_path)
        fedloe.check(loe)
        per_client = fa.rounds * fa.local_epochs * fa.sample / fa.clients
        assert loe.stage1_comms == round(per_client / 32) and loe.stage1_epochs == 32 * loe.stage1_comms, name
        assert [getattr(loe, k) for k in ("model", "batch_size", "weight_decay", "clients")] == \
            [getattr(fa, k) for k in ("model", "batch_size", "weight_decay", "clients")], name
        assert loe.sample == loe.clients and loe.local_epochs == 32
