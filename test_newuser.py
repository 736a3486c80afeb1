"""What a new user meets first: refusals that come at once and say why, --help, the first lines of a
run, the progress line, data.py's download and fake tree."""
import io
import json
import os
import re
import time
import urllib.error
import urllib.request
import warnings
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch

import common
import data
import fedavg
import fediir
import fedipg
import fedloe
import fedomg
import perinvfl
from test_methods import QUICK, fails, run

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")  # torchvision 0.29
MAINS = {"fedavg": fedavg.main, "fediir": fediir.main, "fedomg": fedomg.main, "fedloe": fedloe.main,
         "perinvfl": perinvfl.main, "fedipg": fedipg.main}
FEW = "leaves clients without a training and a validation example"


def fake_pacs(root, per_class=1, odd=None):
    """data.py --make-fake pacs under root; odd: a further class folder with one image, e.g. 'sketch/Dogs'
    (not 'sketch/Dog': a case-insensitive file system has it already as 'dog')."""
    data.make_fake("pacs", str(root), per_class)
    if odd:
        folder = Path(root, "PACS", odd)
        folder.mkdir()
        any_image = next(Path(root, "PACS", "photo", "dog").iterdir())
        (folder / any_image.name).write_bytes(any_image.read_bytes())
    return str(root)


# Bad input a new user meets, refused in one line within a bound on the CPU time of the refusal
# (loading the data included: process time, so that a loaded machine does not fail the bound).
# argv may hold "{tree}": a fake PACS tree (make-fake), "{odd}": one with a stray class folder sketch/Dogs.
NEW_USER_BAD = [
    ("fediir", ["--clients", "5000", "--rounds", "1", "--test-domain", "0"],
     f"--clients 5000 {FEW}: testing on 0, the 5 training domains of rmnist hold 4,166 examples, enough for at most 2,081", 1),
    ("fedavg", ["--clients", "5000", "--rounds", "1"], f"--clients 5000 {FEW}", 1),
    ("fedavg", ["--clients", "100000"], f"--clients 100000 {FEW}", 1),
    ("fedavg", ["--clients", "2082", "--test-domain", "0"], "enough for at most 2,081 clients", 1),  # the exact edge
    ("fedipg", ["--clients", "5000"], f"--clients 5000 {FEW}", 1),
    ("fedloe", ["--clients", "5000"], f"--clients 5000 {FEW}", 1),
    ("fedomg", ["--dataset", "synthetic", "--clients", "400"], "--clients 400 " + FEW, 1),
    ("fedavg", ["--dataset", "pacs", "--data-root", "{tree}", "--clients", "10", "--no-pretrained"],
     f"--clients 10 {FEW}: testing on art_painting, the 3 training domains of pacs hold 21 examples, enough for at most 9", 1),
    ("fedomg", ["--dataset", "mnist", "--clients", "100000"],
     "--clients 100000: 5,000 examples cannot give every client 3 (a training, a validation and a test example at "
     "least); use at most 1,666 clients", 1),
    ("fedomg", ["--dataset", "mnist", "--clients", "6000"], "use at most 1,666 clients", 1),
    ("perinvfl", ["--dataset", "mnist", "--clients", "100000"], "use at most 1,666 clients", 1),
    ("fedavg", ["--dataset", "mnist", "--clients", "-3"], "--clients must be positive, got -3", 1),
    ("fedavg", ["--clients", "0"], "--clients must be positive, got 0", 1),
    ("fedavg", ["--dataset", "mnist", "--alpha", "0.0001"],
     "no Dirichlet(0.0001) split of 5000 examples over 100 clients gives every client 3 examples", 10),   # 1,000 draws
    ("fedavg", ["--dataset", "pacs", "--data-root", "{odd}", "--no-pretrained", "--rounds", "1", "--test-domain", "0"],
     "PACS/sketch/Dogs: a class folder that art_painting, cartoon, photo lack; every domain needs the same class "
     "folders", 1),
]


@pytest.mark.parametrize("method,argv,message,cpu_seconds", NEW_USER_BAD, ids=[
    "fediir-5000", "fedavg-5000", "fedavg-100000", "fedavg-2082-edge", "fedipg-5000", "fedloe-5000", "synthetic-400",
    "pacs-fake-10", "mnist-100000", "mnist-6000", "perinvfl-mnist-100000", "mnist-negative", "zero", "mnist-alpha-tiny",
    "pacs-stray-class"])
def test_new_user_bad_input_is_one_line_at_once(method, argv, message, cpu_seconds, tmp_path, capsys):
    trees = {"{tree}": lambda: fake_pacs(tmp_path / "t"), "{odd}": lambda: fake_pacs(tmp_path / "o", odd="sketch/Dogs")}
    argv = [trees[a]() if a in trees else a for a in argv] + ["--out", str(tmp_path / "r.json")]
    capsys.readouterr()
    t = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # numpy's warnings would be a second line on stderr
        line = fails(MAINS[method], argv, capsys)
    assert time.process_time() - t < cpu_seconds
    assert message in line and line.startswith(f"{method}.py: error: ")
    assert not (tmp_path / "r.ckpt").exists()


def test_a_missing_class_folder_is_named(tmp_path):
    fake_pacs(tmp_path)
    for f in (tmp_path / "PACS" / "photo" / "horse").iterdir():
        f.unlink()
    (tmp_path / "PACS" / "photo" / "horse").rmdir()
    with pytest.raises(data.UserError) as e:
        data.load("pacs", str(tmp_path), size=16)
    assert str(e.value) == (f"{tmp_path}/PACS/photo lacks the class folder 'horse' that art_painting, cartoon, sketch "
                            f"hold; every domain needs the same class folders")


@pytest.mark.parametrize("poison_at,named,how", [
    (("style0", 1), (), "loss"),                                # before any checkpoint: none is named
    (("style0", 3), ("checkpoint",), "loss"),                   # after the round-2 checkpoint
    (("style1", 1), ("checkpoint", "results"), "loss"),         # style0 finished: both
    (("style0", 3), ("checkpoint",), "raise"),                  # a method's own check (FedLOE's φ) in round 3
])
def test_non_finite_names_only_the_files_this_run_wrote(poison_at, named, how, tmp_path, capsys):
    out = tmp_path / "r.json"
    out.with_suffix(".ckpt").write_bytes(b"left by an earlier, different run")
    out.write_text("{}")

    def poisoned(t, model, fed, args, state, ctx):
        if how == "raise" and (fed.name, t) == poison_at:
            raise common.NonFinite(f"non-finite server weights in round {t}")
        losses = fedavg.fedavg_round(t, model, fed, args, state, ctx)
        if (fed.name, t) == poison_at:
            c = next(iter(losses))
            losses[c] = torch.full_like(losses[c], float("nan"))
        return losses
    line = fails(lambda a: common.main("fedavg", fedavg.__doc__, poisoned, a, fedavg.add_args),
                 QUICK + ["--out", str(out)], capsys, code=1)
    assert f"non-finite {'loss' if how == 'loss' else 'server weights'} in round {poison_at[1]}" in line
    assert (f"the last good checkpoint ({out.with_suffix('.ckpt')})" in line) == ("checkpoint" in named)
    assert (f"the results of the finished test domains ({out})" in line) == ("results" in named)
    assert ("nothing of this run was saved" in line) == (not named)


def help_text(method, argv, capsys):
    with pytest.raises(SystemExit) as e, mock.patch.dict(os.environ, COLUMNS="2000"):   # no wrapping
        MAINS[method](argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def flag_blocks(text):
    """--help's options as {flag: its help, one line}."""
    blocks, name = {}, None
    for line in text.split("\noptions:\n")[1].split("\n\n")[0].splitlines():
        m = re.match(r"  (--[\w-]+|-h)", line)
        if m:
            name = m.group(1)
            blocks[name] = ""
        blocks[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in blocks.items()}


@pytest.mark.parametrize("method,dataset", [("fedavg", "rmnist"), ("fediir", "pacs"), ("fedomg", "pacs"),
                                            ("fedomg", "mnist"), ("fedloe", "rmnist"), ("perinvfl", "rcmnist"),
                                            ("fedipg", "stained")])
def test_help_gives_each_default_once(method, dataset, capsys):
    text = help_text(method, ["--dataset", dataset], capsys)
    blocks = flag_blocks(text)
    assert "(default: None)" not in text and "(default: False)" not in text
    for flag, help_ in blocks.items():
        assert help_.lower().count("default") <= 1, help_
        assert flag == "-h" or len(help_) > len(flag) + 12, f"{flag} has no help"
    title = "".join(MAINS[method].__globals__["__doc__"].strip().split("\n\n")[0].split())
    assert "".join(text.split()).count(title) == 1                          # the whole first paragraph
    assert f"for --dataset {dataset};" in " ".join(text.split())


def test_help_shows_the_methods_defaults_for_the_dataset_given(capsys):
    pacs = flag_blocks(help_text("fedomg", ["--dataset", "pacs"], capsys))
    assert pacs["--lr"].endswith("(default for pacs: 0.001)")               # FedOMG's, not FedIIR's 2.5e-3
    assert pacs["--local-epochs"].endswith("(default for pacs: 5)")
    assert pacs["--global-lr"].endswith("(default for pacs: 0.5)") and pacs["--rounds"].endswith("(default: 100)")
    rmnist = flag_blocks(help_text("fedomg", [], capsys))
    assert rmnist["--lr"].endswith("(default for rmnist: 0.01)") and rmnist["--local-epochs"].endswith("(default: 1)")
    assert "FedIIR Table 3" not in rmnist["--lr"]
    assert rmnist["--seed"].startswith("--seed SEED seeds the data split") and rmnist["--seed"].endswith("(default: 0)")
    assert rmnist["--device"].endswith("auto: cuda if one is visible, else cpu (default: auto)")
    assert rmnist["--out"].endswith("(default: results/fedomg-rmnist-seed<seed>.json)")
    loe = flag_blocks(help_text("fedloe", [], capsys))
    assert loe["--rounds"].endswith("(default: 12, set from fedloe's own flags)")     # K1 + K2 = 8 + 4
    assert loe["--sample"].endswith("(default: every client (P))") and loe["--clients"].endswith("(default: 20)")
    assert flag_blocks(help_text("fedavg", [], capsys))["--sample"].endswith("(default: min(P, training domains))")
    mnist = flag_blocks(help_text("fedavg", ["--dataset", "mnist"], capsys))
    assert mnist["--clients"].endswith("(default for mnist: 100)") and mnist["--sample"].endswith("(default for mnist: 20)")


def test_help_says_when_the_method_refuses_the_dataset_shown(capsys):
    def refuse(args):
        raise common.UserError(f"toy runs no {args.dataset}")
    with pytest.raises(SystemExit) as e, mock.patch.dict(os.environ, COLUMNS="2000"):
        common.main("toy", fedavg.__doc__, fedavg.fedavg_round, ["--help"], fedavg.add_args, check=refuse)
    assert e.value.code == 0
    assert capsys.readouterr().out.endswith("Note: toy refuses --dataset rmnist (toy runs no rmnist).\n")


def test_data_py_help_and_its_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e, mock.patch.dict(os.environ, COLUMNS="2000"):
        data.main(["--help"])
    assert e.value.code == 0
    blocks = flag_blocks(capsys.readouterr().out)
    assert set(blocks) == {"-h", "--download", "--make-fake", "--data-root", "--per-class"}
    assert "DomainBed's archives" in blocks["--download"] and "random images" in blocks["--make-fake"]
    assert "the folder to write into" in blocks["--data-root"]
    for argv, message in ((["--data-root", str(tmp_path)], "one of the arguments --download --make-fake is required"),
                          (["--download", "nope", "--data-root", str(tmp_path)], "argument --download: invalid choice"),
                          (["--download", "pacs", "--make-fake", "pacs", "--data-root", str(tmp_path)], "not allowed with"),
                          (["--download", "pacs", "--per-class", "3", "--data-root", str(tmp_path)],
                           "--per-class applies to --make-fake only")):
        assert message in fails(data.main, argv, capsys)
    assert os.listdir(tmp_path) == []
    (tmp_path / "a-file").write_text("")
    for what in ("--download", "--make-fake"):
        line = fails(data.main, [what, "pacs", "--data-root", str(tmp_path / "a-file")], capsys)
        assert line.startswith(f"data.py: error: cannot write under --data-root {tmp_path}/a-file (")
    assert os.listdir(tmp_path) == ["a-file"] and (tmp_path / "a-file").read_text() == ""


def offline(*a, **k):
    raise urllib.error.URLError("offline")


def serving(payload):
    def urlopen(url, timeout=None):
        return io.BytesIO(payload)
    return urlopen


@pytest.mark.parametrize("urlopen,why", [(offline, "URLError"), (serving(b"<html>quota exceeded</html>"), "BadZipFile")])
@pytest.mark.parametrize("root", ["new/d", "."])
def test_a_failed_download_leaves_the_folder_as_it_was(urlopen, why, root, tmp_path, monkeypatch, capsys):
    (tmp_path / "mine.txt").write_text("kept")
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    line = fails(data.main, ["--download", "pacs", "--data-root", str(tmp_path / root)], capsys)
    assert line.startswith(f"data.py: error: could not download pacs ({why}") and "nothing was written" in line
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]                 # no new/, no archive, no temporary folder


def test_a_download_lays_the_archive_out(tmp_path, monkeypatch, capsys):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("kfold/photo/dog/1.jpg", b"jpeg")
    monkeypatch.setattr(urllib.request, "urlopen", serving(buf.getvalue()))
    data.main(["--download", "pacs", "--data-root", str(tmp_path / "d")])
    assert os.listdir(tmp_path / "d") == ["PACS"] and (tmp_path / "d/PACS/photo/dog/1.jpg").read_bytes() == b"jpeg"
    assert capsys.readouterr().out == f"pacs is ready under {tmp_path}/d/PACS\n"
    data.main(["--download", "pacs", "--data-root", str(tmp_path / "d")])      # there already: nothing is touched
    assert "exists already; nothing to do" in capsys.readouterr().out


def test_make_fake_then_a_photo_run_that_says_what_it_read(tmp_path, capsys):
    data.main(["--make-fake", "pacs", "--data-root", str(tmp_path)])
    assert "try it with: python fedomg.py --dataset pacs --data-root" in capsys.readouterr().out
    base = tmp_path / "PACS"
    assert sorted(os.listdir(base)) == ["FAKE.txt", "art_painting", "cartoon", "photo", "sketch"]
    assert sorted(os.listdir(base / "sketch")) == sorted(data.FAKE_LAYOUT["pacs"][1])
    before = sorted(str(p) for p in base.rglob("*"))
    line = fails(data.main, ["--make-fake", "pacs", "--data-root", str(tmp_path)], capsys)
    assert "PACS exists already; --make-fake writes only a new folder" in line
    assert sorted(str(p) for p in base.rglob("*")) == before
    res, _ = run(fedomg.main, ["--dataset", "pacs", "--data-root", str(tmp_path), "--no-pretrained", "--rounds", "1",
                               "--local-epochs", "1", "--test-domain", "sketch"], tmp_path)
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert first[0].startswith(f"data: {base} (28 images, cached at 224px); FAKE: random images")
    assert first[1] == "data: 4 domains (art_painting, cartoon, photo, sketch), 7 classes, 28 images"
    assert res["domains"]["sketch"]["train_examples"] == 18 and "FAKE" in res["source"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_line_every_round_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    argv = QUICK[:2] + ["--rounds", "5", "--eval-every", "5", "--test-domain", "0"]
    run(fedavg.main, argv, tmp_path, "plain.json")
    plain = capsys.readouterr().out
    assert "\r" not in plain and "\x1b" not in plain                       # a log file gets the lines it had
    assert re.search(r"\nround    5/5 \| val [\d.]+ \| test [\d.]+ \| loss [\d.]+ \| [\d.]+ s/round \| ETA 0m00s\n", plain)
    screen = Terminal()
    monkeypatch.setattr("sys.stdout", screen)
    run(fedavg.main, argv, tmp_path, "tty.json")
    text = screen.getvalue()
    for t in range(1, 5):                                                # rounds without evaluation: one line each
        assert re.search(rf"\r\x1b\[Kround    {t}/5 \| loss [\d.]+ \| [\d.]+ s/round \| ETA \dm\d\ds", text)
    assert re.search(r"ETA \dm\d\ds\r\x1b\[Kround    5/5 \| val", text)   # the evaluation line erases it first
    assert text.replace("\r\x1b[K", "").count("\n") == plain.count("\n")  # no other line added
    assert json.loads((tmp_path / "tty.json").read_text())["domains"]["style0"]["test_acc"] == \
        json.loads((tmp_path / "plain.json").read_text())["domains"]["style0"]["test_acc"]
