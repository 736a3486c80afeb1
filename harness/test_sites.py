"""A site's own data (harness/sites.py): the export holds each site exactly as the method files'
federation cuts it; a node reads its own folder (an export, or an institution's photos) and
refuses a bad one in one line naming it; the server's stand-ins have the sites' sizes and no
data."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import fedavg
import fedloe
import harness
from harness import datasets, sites
from data import UserError

HERE = Path(__file__).resolve().parent.parent


def resolved(argv, method=fedavg, tmp_path=Path("/nonexistent")):
    return harness.resolve(method.METHOD, argv + ["--out", str(tmp_path / "r.json")])


def fake_pacs(root, per_class=2):
    """A tiny PACS of random images (harness.datasets --make-fake) under root."""
    datasets.make_fake("pacs", root, per_class)
    return root


class ShimCtx:
    device = torch.device("cpu")


def same(a, b):
    return a is None and b is None or torch.equal(a, b)


@pytest.mark.parametrize("argv", [
    ["--dataset", "rmnist", "--clients", "7", "--test-domain", "30"],
    ["--dataset", "stained", "--clients", "4", "--client-size", "300", "--test-domain", "c3"],
    ["--dataset", "rcmnist"],                                       # fixed clients, own test sets
    ["--dataset", "synthetic", "--clients", "3", "--test-domain", "1"],
], ids=["rmnist", "stained", "rcmnist", "synthetic"])
def test_an_export_holds_each_site_as_the_method_files_federation_cuts_it(argv, tmp_path, capsys):
    """Every site read back from its folder holds the very tensors of data.federate's client
    (training, validation and own test split, in their order), and the held-out domain is an
    evaluation site after the P clients; site.json states its role, sizes and the split's flags."""
    args = resolved(argv, tmp_path=tmp_path)
    folders = sites.export(args, tmp_path / "out")
    ds = data.load(args.dataset, None, args.seed, p_test=args.p_test, stain=args.stain)
    names = [d.name for d in ds.domains]
    fed = data.federate_fixed(ds, args.seed, "cpu") if ds.protocol == "clients" else \
        data.federate(ds, names.index(args.test_domain), args.clients, args.seed, "cpu",
                      client_size=args.client_size)
    assert [f.name for f in folders] == [f"site-{k}" for k in range(len(fed.sites))]
    assert len(fed.evals) == (ds.protocol == "lodo")
    for s, folder in zip(fed.sites, folders):
        only = s.id >= len(fed.clients)
        client, report = sites.read(folder, args, s.id, only)
        for k in ("x", "y", "val_x", "val_y", "test_x", "test_y"):
            assert same(getattr(client, k), getattr(s, k)), (s.id, k)
        assert (client.domain, report["role"]) == (s.domain, "evaluate" if only else "train")
        assert report["roster"] == sites.roster_entry(s)
        m = json.loads((folder / "site.json").read_text())
        assert m["split"]["seed"] == args.seed and m["split"]["clients"] == args.clients
    capsys.readouterr()


def test_an_export_of_photos_copies_the_image_files_in_the_splits_order(tmp_path):
    """The photos travel as their own files (a site keeps images, not tensors), <class>/<image>,
    listed in site.json in the split's order; decoded on the node they are the method file's
    tensors bit for bit, cached in the site's own folder."""
    root = fake_pacs(tmp_path / "data", per_class=3)
    args = resolved(["--dataset", "pacs", "--data-root", str(root), "--clients", "4",
                     "--test-domain", "sketch", "--batch-size", "2"], tmp_path=tmp_path)
    folders = sites.export(args, tmp_path / "out")
    ds = data.load("pacs", str(root))
    fed = data.federate(ds, 3, 4, 0, "cpu")
    for s, folder in zip(fed.sites, folders):
        assert not (folder / "data.pt").exists()
        classes = {p.name for p in folder.iterdir() if p.is_dir()}
        assert classes and classes <= set(data.CLASSES["pacs"])
        client, _ = sites.read(folder, args, s.id, s.id >= 4)
        assert all(same(getattr(client, k), getattr(s, k)) for k in ("x", "y", "val_x", "val_y",
                                                                    "test_x", "test_y"))
        assert (folder / ".cache-224.pt").exists()                     # under its own folder
    assert fed.evals[0].domain == "sketch" and len(fed.evals[0].test_y) == 7 * 3


def test_an_institutions_own_photos_split_by_the_node_from_the_runs_seed(tmp_path, monkeypatch):
    """A folder of <class>/<image> that is no benchmark domain: the node labels by the class
    names, keeps VAL_FRAC for validation by the run's seed (the same split every message, another
    for another seed), an evaluation-only site all of it for test; the decoded photos are cached
    in the folder and read from there the next time (no decoding)."""
    root = fake_pacs(tmp_path / "data", per_class=4)
    site = tmp_path / "hospital-a"
    for c in ("dog", "horse"):
        shutil.copytree(root / "PACS" / "photo" / c, site / c)
    args = resolved(["--dataset", "pacs", "--seed", "3"])
    client, report = sites.read(site, args, 2, False)
    assert client.domain == "hospital-a" and client.id == 2 and report["classes"] == 7
    assert (client.n, len(client.val_y)) == (8 - data.val_count(8), data.val_count(8))
    assert sorted((client.y.tolist() + client.val_y.tolist())) == [0] * 4 + [4] * 4
    monkeypatch.setattr(data, "decode", lambda *a: pytest.fail("decoded again"))
    again, _ = sites.read(site, args, 2, False)
    assert torch.equal(again.val_x, client.val_x)                       # the cache, the same split
    other, _ = sites.read(site, resolved(["--dataset", "pacs", "--seed", "4"]), 2, False)
    assert not torch.equal(other.x, client.x)                           # another seed's order
    test, report = sites.read(site, args, 5, True)
    assert test.n == 0 and len(test.test_y) == 8 and report["role"] == "evaluate"


def refusal(folder, args, site=0, evaluate_only=False):
    with pytest.raises(UserError) as e:
        sites.read(folder, args, site, evaluate_only)
    assert str(e.value).startswith(f"node folder {folder}: ") and "\n" not in str(e.value)
    return str(e.value)[len(f"node folder {folder}: "):]


def test_a_bad_folder_is_refused_in_one_line_naming_it(tmp_path, monkeypatch):
    """Missing, a file, unreadable, empty, class folders not the dataset's, an image that does not
    decode, another dataset's export, another run's export (another seed, held-out domain or
    number of clients), another site's, an evaluation site's for a training node and the other
    way round, a data.pt changed since the export: each one line naming the folder."""
    pacs = resolved(["--dataset", "pacs"])
    assert refusal(tmp_path / "nope", pacs) == "not found (node config data)"
    (tmp_path / "file").write_text("x")
    assert refusal(tmp_path / "file", pacs) == "not a folder"
    (tmp_path / "empty").mkdir()
    assert refusal(tmp_path / "empty", pacs).startswith("no images in <class>/ folders of pacs's")
    locked = tmp_path / "locked"
    locked.mkdir()
    real = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda p: (_ for _ in ()).throw(PermissionError(13, ""))
                        if p == locked else real(p))
    assert refusal(locked, pacs) == "cannot be read (permission denied)"
    monkeypatch.undo()
    odd = tmp_path / "odd"
    (odd / "hund").mkdir(parents=True)
    assert refusal(odd, pacs).startswith("class folders named as none of pacs's classes (dog, ")
    broken = tmp_path / "broken"
    (broken / "dog").mkdir(parents=True)
    (broken / "dog" / "1.jpg").write_bytes(b"not a jpeg")
    assert refusal(broken, pacs).startswith(f"cannot decode image {broken / 'dog' / '1.jpg'}")
    args = resolved(["--dataset", "synthetic", "--clients", "3", "--test-domain", "0"])
    out = tmp_path / "export"
    sites.export(args, out)
    assert refusal(out / "site-1", pacs) == "holds an export of synthetic; this run is of pacs"
    for flags, what in ((["--seed", "1"], "--seed 0 there, 1 here"),
                        (["--test-domain", "1"], "--test-domain style0 there, style1 here"),
                        (["--clients", "4"], "--clients 3 there, 4 here")):
        other = resolved(["--dataset", "synthetic", "--clients", "3", "--test-domain", "0", *flags])
        assert refusal(out / "site-1", other, 1) == f"another run's export: {what}"
    assert refusal(out / "site-1", args, 2) == "holds site 1 of an export; this node is partition 2"
    assert refusal(out / "site-3", args, 3).startswith("holds an evaluation site (the held-out")
    assert refusal(out / "site-1", args, 1, True) == ("holds a training site and its node config "
                                                      "says evaluate-only=true")
    blob = torch.load(out / "site-1" / "data.pt", weights_only=True)
    blob["x_y"][0] = 1 - blob["x_y"][0]
    torch.save(blob, out / "site-1" / "data.pt")
    assert refusal(out / "site-1", args, 1).startswith("data.pt is not the file site.json names")
    (out / "site-2" / "site.json").write_text("{")
    assert refusal(out / "site-2", args, 2).startswith("site.json is not one of this project's")
    assert refusal(tmp_path / "empty", args).startswith("holds no site.json: the synthetic data "
                                                        "reach a node as an export")


def test_the_servers_federation_holds_the_sites_sizes_and_no_data():
    """sites.federation of a roster: stand-ins of the sizes (no pixel), the evaluation sites after
    the P clients, the held-out domain's name; a node's own site in its place; the fixed clients'
    test sets their own. FedLOE's init_state on the stand-ins splits them as on the real data
    (its tuning split follows the sizes)."""
    roster = [["15", 751, 83, None], ["30", 750, 83, None], ["0", 0, 0, 834]]
    fed = sites.federation(roster, 2)
    assert fed.name == "0" and fed.test_names == ["0"] and len(fed.evals) == 1
    assert [sites.roster_entry(s) for s in fed.sites] == roster
    assert all(s.x.numel() == 0 for s in fed.sites)
    fixed = sites.federation([["a", 5, 1, 2], ["b", 6, 1, 3]], 2)
    assert fixed.name == "clients" and fixed.test_names == ["a", "b"] and not fixed.evals
    ds = data.load("rmnist")
    real = data.federate(ds, 0, 5, 0, "cpu")
    fed = sites.federation([sites.roster_entry(s) for s in real.sites], 5, own=real.clients[3])
    assert fed.clients[3] is real.clients[3]
    args, ctx = resolved(["--dataset", "rmnist", "--clients", "5"], fedloe), ShimCtx()
    fedloe.init_state(None, real, args, ctx)
    fedloe.init_state(None, fed, args, ctx)
    for a, b in zip(real.clients, fed.clients):
        assert (a.n, len(a.tune_y), len(a.val_y), len(a.id_y)) == \
            (b.n, len(b.tune_y), len(b.val_y), len(b.id_y))
    assert torch.equal(fed.clients[3].tune_x, real.clients[3].tune_x)


def test_the_export_command_and_its_refusals(tmp_path):
    """python -m harness.datasets --export OUT (the method's flags after it): a line a site; over a
    folder that is not empty, --test-domain all, a bad flag: one line, exit 2, nothing written."""
    cmd = [sys.executable, "-m", "harness.datasets"]
    run = lambda *a: subprocess.run(cmd + list(a), capture_output=True, text=True, cwd=HERE)
    r = run("--export", str(tmp_path / "sites"), "--dataset", "synthetic", "--clients", "3",
            "--test-domain", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[3].endswith("site 3 (evaluate-only=true): 0 training, 0 "
                                             "validation, 240 test examples")
    for argv, line in (
            (["--export", str(tmp_path / "sites"), "--dataset", "synthetic", "--clients", "3"],
             "exists and is not an empty folder"),
            (["--export", str(tmp_path / "x"), "--dataset", "synthetic"],
             "--test-domain all: an export holds one split"),
            (["--export", str(tmp_path / "y"), "--dataset", "synthetic", "--clients", "0"],
             "--clients must be positive, got 0"),
            (["--export", str(tmp_path / "z"), "--method", "fedx"], "--method fedx: choose from"),
            (["--export", ""], "--export is empty")):
        r = run(*argv)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(err) == 1 and line in err[0], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sites"]
