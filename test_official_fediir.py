"""benchmark/official_fediir.py against a stand-in for the official FedIIR code: a fake clone whose
main.py takes the official arguments (argparse, strictly), records how it was called, and writes its
output in the official format (a table per held-out domain, then a results CSV row) with made-up
numbers, holding out every domain in turn as the official main.py does."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from test_methods import fails, HERE

sys.path.insert(0, str(HERE / "benchmark"))
import leaderboard  # noqa: E402
import official_fediir as official  # noqa: E402
import report  # noqa: E402

# one row per evaluation (epochs 0, 10, ..., 90, 99): validation peaks first at epoch 30 (test 0.61),
# ties at epoch 50 (0.65); the best test (0.95), and the last (0.77), are elsewhere; domain i adds 0.01 i
VAL = [0.30, 0.50, 0.60, 0.90, 0.70, 0.90, 0.80, 0.85, 0.60, 0.70, 0.88]
TEST = [0.20, 0.40, 0.50, 0.61, 0.95, 0.65, 0.70, 0.72, 0.73, 0.74, 0.77]

FAKE_MAIN = textwrap.dedent('''
    import argparse, csv, json, os, sys, time
    from domainbed import datasets
    VAL, TEST = %r, %r
    p = argparse.ArgumentParser()
    for name in ("--device_name", "--hparams", "--train_index", "--output_dir", "--data_dir", "--dataset",
                 "--algorithm"):
        p.add_argument(name, type=str, default=None)
    for name in ("--hparams_seed", "--trial_seed", "--seed", "--checkpoint_freq", "--num_clients", "--sample_num",
                 "--global_rounds", "--local_epochs"):
        p.add_argument(name, type=int, default=0)
    p.add_argument("--holdout_fraction", type=float, default=0.1)
    p.add_argument("--skip_model_save", action="store_true")
    args = p.parse_args()
    where = os.path.join(args.output_dir, args.dataset, args.algorithm)
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(args.output_dir, "call.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "argv0": sys.argv[0], "cwd": os.getcwd(), "pid": os.getpid(),
                   "workers": datasets.MultipleDomainDataset.N_WORKERS}, f)
    if os.environ.get("FAKE_CRASH"):
        sys.exit(3)
    out = open(os.path.join(where, args.train_index + "_stdout"), "w")
    hp = json.loads(args.hparams)
    names = ["0", "15", "30", "45", "60", "75"]
    for i, name in enumerate(names):
        if i >= 2:
            time.sleep(10)                                # the domains after the one under test are slow
        out.write("Args:\\n\\tdevice: " + (args.device_name or "cuda:0") + "\\n\\tseed: %%d\\n" %% args.seed)
        keys = (["epoch", "mem_gb", "epoch_time", "loss"] + ["penalty"] * (args.algorithm == "FedIIR")
                + ["train_acc", name])
        out.write("  ".join(k.ljust(12)[:12] for k in keys) + "\\n")
        best_val, best_test, k = 0, 0, 0
        for epoch in range(args.global_rounds):
            if epoch %% args.checkpoint_freq and epoch != args.global_rounds - 1:
                continue
            val, test = VAL[k], TEST[k] + 0.01 * i
            values = [epoch, 0.0, 0.1 * (k + 1), 2.0 - val] + [0.5 * val] * (args.algorithm == "FedIIR") + [val, test]
            out.write("  ".join(("%%.10f" %% v if isinstance(v, float) else str(v)).ljust(12)[:12]
                                for v in values) + " \\n")
            if val > best_val:
                best_val, best_test = val, test
            k += 1
        if os.environ.get("FAKE_LIE"):
            best_test = max(TEST) + 0.01 * i
        out.write("best_train_acc: %%.10f\\nbest_test_acc: %%.10f\\n" %% (best_val, best_test))
        out.flush()
        path = os.path.join(where, args.dataset + "_" + args.algorithm + "_results.csv")
        row = {"Dataset": args.dataset, "Algorithm": args.algorithm, "Num_clients": args.num_clients,
               "Trial_seed": args.trial_seed, "Seed": args.seed, **hp,
               "Test_env": name, "Train_acc": best_val, "Test_acc": best_test}
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if f.tell() == 0:
                w.writeheader()
            w.writerow(row)
''') % (VAL, TEST)


@pytest.fixture
def fake(tmp_path):
    """A fake clone, a data root whose MNIST label headers say 60,000 + 10,000, and the results path."""
    clone = tmp_path / "FedIIR"
    (clone / "domainbed").mkdir(parents=True)
    (clone / "domainbed" / "__init__.py").write_text("")
    (clone / "domainbed" / "datasets.py").write_text("class MultipleDomainDataset:\n    N_WORKERS = 8\n")
    (clone / "main.py").write_text(FAKE_MAIN)
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, n in (("train", 60000), ("t10k", 10000)):
        (raw / f"{name}-labels-idx1-ubyte").write_bytes((2049).to_bytes(4, "big") + n.to_bytes(4, "big"))
        (raw / f"{name}-images-idx3-ubyte").write_bytes(b"")
    out = tmp_path / "res" / "fediir-seed1.json"
    return ["--clone", str(clone), "--data-root", str(tmp_path / "data"), "--device", "cpu",
            "--out", str(out)], tmp_path


def call_of(tmp_path, name="fediir-seed1"):
    return json.loads((tmp_path / "res" / f"{name}.official" / "call.json").read_text())


def test_official_fediir_runs_main_py_with_the_protocol_arguments(fake, capsys):
    argv, tmp = fake
    official.main(argv + ["--algorithm", "FedIIR", "--test-domain", "0", "--seed", "1"])
    call = call_of(tmp)
    assert call["cwd"] == str(tmp / "FedIIR") and call["argv0"] == "main.py" and call["workers"] == 8
    assert call["argv"] == [
        "--dataset", "RotatedMNIST", "--algorithm", "FedIIR", "--data_dir", str(tmp / "data"),
        "--output_dir", str(tmp / "res" / "fediir-seed1.official"), "--train_index", "seed1",
        "--num_clients", "50", "--sample_num", "5", "--global_rounds", "100", "--local_epochs", "1",
        "--checkpoint_freq", "10", "--holdout_fraction", "0.1", "--seed", "1", "--trial_seed", "1",
        "--hparams_seed", "0", "--hparams", '{"lr": 0.01, "batch_size": 64, "penalty": 0.01, "ema": 0.95}',
        "--skip_model_save", "--device_name", "cpu"]
    assert "--dataset RotatedMNIST" in (tmp / "res" / "fediir-seed1.log").read_text().splitlines()[0]
    out = argv[-1].replace("fediir-seed1", "fedavg-seed1")
    official.main(argv[:-1] + [out, "--algorithm", "FedAvg", "--seed", "1", "--trial-seed", "4",
                               "--loader-workers", "0", "--rounds", "20"])
    call = call_of(tmp, "fedavg-seed1")
    assert call["workers"] == 0 and call["cwd"] == str(tmp / "FedIIR")
    assert call["argv"][call["argv"].index("--hparams") + 1] == '{"lr": 0.01, "batch_size": 64}'
    assert call["argv"][call["argv"].index("--trial_seed") + 1] == "4"
    assert call["argv"][call["argv"].index("--global_rounds") + 1] == "20"


def test_official_fediir_converts_its_output_selecting_by_validation(fake, tmp_path):
    argv, tmp = fake
    start = time.monotonic()
    res = official.main(argv + ["--algorithm", "FedIIR", "--test-domain", "15", "--seed", "1"])
    assert time.monotonic() - start < 8                    # stopped after 15°, not after all six domains
    with pytest.raises(ProcessLookupError):
        os.kill(call_of(tmp)["pid"], 0)                     # and the official process is gone
    csv_rows = (tmp / "res" / "fediir-seed1.official" / "RotatedMNIST" / "FedIIR" /
                "RotatedMNIST_FedIIR_results.csv").read_text().splitlines()
    assert [r.split(",")[-3] for r in csv_rows[1:]] == ["0", "15"]
    assert json.loads((tmp / "res" / "fediir-seed1.json").read_text()) == res
    assert res["method"] == "official-fediir" and res["dataset"] == "rmnist" and res["protocol"] == "lodo"
    assert res["complete"] is True and list(res["domains"]) == ["15"]
    d = res["domains"]["15"]
    assert d["test_acc"] == pytest.approx(0.62) and res["mean_test_acc"] == d["test_acc"]   # the first best val
    assert d["val_acc"] == pytest.approx(0.90) and d["best_round"] == 31
    assert d["last_test_acc"] == pytest.approx(0.78)
    assert d["train_examples"] == 3 * (11667 - 1166) + 2 * (11666 - 1166)   # 0°, 30°, 45° hold 11,667 digits
    h = d["history"]
    assert [r["round"] for r in h] == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    assert [r["test_acc"] for r in h] == pytest.approx([t + 0.01 for t in TEST])
    assert [r["val_acc"] for r in h] == pytest.approx(VAL)
    assert h[0]["seconds"] == pytest.approx(0.1) and h[1]["seconds"] == pytest.approx(0.1 + 0.2 * 10)
    assert h[-1]["seconds"] == pytest.approx(0.1 + sum(0.1 * k * 10 for k in range(2, 11)) + 1.1 * 9)
    assert h[3]["loss"] == pytest.approx(1.1) and h[3]["penalty"] == pytest.approx(0.45)
    a = res["args"]
    assert (a["clients"], a["sample"], a["rounds"], a["lr"], a["batch_size"], a["gamma"], a["device"]) == \
        (50, 5, 100, 0.01, 64, 0.01, "cpu")
    assert a["repository"] == "https://github.com/YamingGuo98/FedIIR" and a["commit"] is None
    runs, skipped = report.load(tmp / "res")                   # benchmark/report.py and leaderboard.py read it
    assert not skipped and "| fediir | 62.0 ± 0.0 | 1 |" in report.accuracy_table(runs)
    assert leaderboard.accuracy(tmp / "res" / "fediir-seed1.json") == pytest.approx(62.0)


def test_official_fediir_refuses_bad_input_in_one_line(fake, capsys):
    argv, tmp = fake
    err = fails(official.main, argv[:1] + [str(tmp / "nowhere")] + argv[2:] + ["--algorithm", "FedAvg"], capsys)
    assert "no clone" in err and f"git clone {official.REPOSITORY}" in err and official.COMMIT in err
    assert "invalid choice" in fails(official.main, argv + ["--algorithm", "fedavg"], capsys)
    assert "unknown --test-domain '90'" in fails(official.main, argv + ["--algorithm", "FedAvg",
                                                                        "--test-domain", "90"], capsys)
    assert "FedIIR only" in fails(official.main, argv + ["--algorithm", "FedAvg", "--gamma", "0.1"], capsys)
    assert "at least 5" in fails(official.main, argv + ["--algorithm", "FedAvg", "--clients", "4"], capsys)
    os.remove(tmp / "data" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte")
    assert "lacks t10k-labels-idx1-ubyte" in fails(official.main, argv + ["--algorithm", "FedAvg"], capsys)
    assert not (tmp / "res").exists() or not list((tmp / "res").iterdir())   # nothing ran


def test_official_fediir_fails_in_one_line_when_the_official_run_does(fake, capsys, monkeypatch):
    argv, tmp = fake
    monkeypatch.setattr(official, "commit_of", lambda clone: official.COMMIT)   # no warning: the error alone
    monkeypatch.setenv("FAKE_CRASH", "1")
    err = fails(official.main, argv + ["--algorithm", "FedAvg"], capsys, code=1)
    assert "exited with 3 before test domain 0" in err and "fediir-seed1.log" in err
    monkeypatch.delenv("FAKE_CRASH")
    monkeypatch.setenv("FAKE_LIE", "1")                        # its CSV names another round than its table
    assert "disagrees with itself" in fails(official.main, argv + ["--algorithm", "FedAvg"], capsys, code=1)
    assert not (tmp / "res" / "fediir-seed1.json").exists()


def test_official_fediir_warns_once_when_the_clone_is_not_at_the_pinned_commit(fake, capsys, monkeypatch):
    argv, tmp = fake
    git = ["git", "-C", str(tmp / "FedIIR"), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "fake"]):
        subprocess.run(git + cmd, check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    official.main(argv + ["--algorithm", "FedAvg"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and head in err[0] and f"not the pinned {official.COMMIT}" in err[0]
    monkeypatch.setattr(official, "COMMIT", head)
    res = official.main(argv + ["--algorithm", "FedAvg"])
    assert capsys.readouterr().err == "" and res["args"]["commit"] == head
