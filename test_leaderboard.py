import json
import subprocess
import sys

import pytest

from test_methods import HERE

sys.path.insert(0, str(HERE / "benchmark"))
import gpu_session  # noqa: E402
import leaderboard  # noqa: E402

# ------------------------------------------------------------------------------------ leaderboard

TINY = ["--rounds", "2", "--eval-every", "1", "--clients", "2"]


@pytest.fixture
def tiny_board(monkeypatch, tmp_path):
    """The leaderboard on two synthetic benchmarks and three rows: one reused from a committed-style
    folder, one refused, one run."""
    monkeypatch.setattr(leaderboard, "BENCHMARKS", {
        "syn-0": ("Synthetic, domain 0", "synthetic", TINY + ["--test-domain", "0"], "cpu"),
        "syn-1": ("Synthetic, domain 1", "synthetic", TINY + ["--test-domain", "1"], "gpu")})
    monkeypatch.setattr(leaderboard, "ROWS", {"fedavg": ("fedavg", []), "fediir": ("fediir", ["--gamma", "0.1"])})
    reused = tmp_path / "results"
    (reused / "old").mkdir(parents=True)
    for s, acc in ((0, 0.5), (1, 0.7)):
        (reused / "old" / f"fedavg-seed{s}.json").write_text(json.dumps(
            {"complete": True, "domains": {"d0": {"test_acc": acc}}}))
    monkeypatch.setattr(leaderboard, "RESULTS", reused)
    monkeypatch.setattr(leaderboard, "REUSE", {("syn-0", "fedavg"): "old/fedavg"})
    monkeypatch.setattr(leaderboard, "REFUSED", {("syn-1", "fediir"): "a reason"})
    monkeypatch.setattr(leaderboard, "CENTRAL", {})
    monkeypatch.setattr(leaderboard, "PAPER", {("syn-0", "fedavg"): (12.5, "Tab. 0")})
    return ["--out-dir", str(tmp_path / "board"), "--seeds", "0", "1", "--jobs", "2", "--no-figure"]


def test_leaderboard_runs_the_missing_cells_once_then_writes_the_table(tiny_board, tmp_path, capsys):
    todo = leaderboard.main(tiny_board + ["--dry-run"])
    assert todo == {"syn-0": ["fediir"], "syn-1": ["fedavg"]}           # reused / refused: none
    out = capsys.readouterr().out
    assert "2 missing cell(s) in 2 benchmark(s)" in out
    assert "'fediir=fediir --rounds 2 --eval-every 1 --clients 2 --test-domain 0 --gamma 0.1'" in out
    assert leaderboard.main(tiny_board + ["--dry-run", "--only", "syn-1"]) == {"syn-1": ["fedavg"]}
    assert list(leaderboard.main(tiny_board + ["--dry-run", "--where", "gpu"])) == ["syn-1"]
    text = leaderboard.main(tiny_board)
    board = tmp_path / "board"
    assert sorted(p.name for p in (board / "syn-0").glob("*.json")) == ["fediir-seed0.json", "fediir-seed1.json"]
    assert json.loads((board / "syn-0" / "fediir-seed1.json").read_text())["args"]["gamma"] == 0.1
    assert not (board / "syn-0" / "fedavg-seed0.json").exists()          # reused, not rerun
    assert leaderboard.main(tiny_board + ["--dry-run"]) == {}            # resumable: nothing left
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert "60.0 ± 14.1 (2) [paper 12.5]" in rows["fedavg"]             # the reused runs: 50 and 70
    assert "refused" in rows["fediir"].split(" | ")[2]
    readme = (board / "README.md").read_text()
    assert "refused — a reason" in readme and "reused from `benchmark/results/old/fedavg-seed*.json`" in readme
    acc = [100 * json.loads((board / "syn-0" / f"fediir-seed{s}.json").read_text())["mean_test_acc"] for s in (0, 1)]
    assert f"{sum(acc) / 2:.1f} ±" in rows["fediir"].split(" | ")[1]


def test_leaderboard_never_marks_a_centralised_reference_row_best(monkeypatch, tmp_path):
    f = tmp_path / "central.json"
    f.write_text(json.dumps({"runs": [{"method": "irm", "test_acc": a} for a in (0.9, 0.91, 0.92)]}))
    monkeypatch.setattr(leaderboard, "RESULTS", tmp_path)
    monkeypatch.setattr(leaderboard, "BENCHMARKS", {"b": ("B", "synthetic", [], "cpu")})
    (tmp_path / "old").mkdir()
    for s, acc in ((0, 0.1), (1, 0.11)):
        (tmp_path / "old" / f"fedavg-seed{s}.json").write_text(json.dumps({"complete": True, "domains": {"d": {"test_acc": acc}}}))
    monkeypatch.setattr(leaderboard, "ROWS", {"fedavg": ("fedavg", [])})
    monkeypatch.setattr(leaderboard, "REUSE", {("b", "fedavg"): "old/fedavg"})
    monkeypatch.setattr(leaderboard, "CENTRAL", {"central IRM": ("irm", {"b": "central.json"})})
    text, c = leaderboard.table(["b"], tmp_path / "board", [0, 1])
    assert c[("b", "central IRM")] == [90.0, 91.0, 92.0] and c[("b", "fedavg")] == [10.0, 11.0]
    assert "**" not in text                      # the reference row far ahead, but never the federated best


def test_leaderboard_marks_best_only_beyond_two_seed_stds():
    assert leaderboard.best({"a": [90, 91, 92], "b": [80, 81, 82]}) == "a"
    assert leaderboard.best({"a": [90, 91, 92], "b": [89, 90, 91]}) is None     # 1 apart, 2 · std = 2
    assert leaderboard.best({"a": [90, 91, 92], "b": [87, 88, 89]}) == "a"      # 3 > 2 · 1
    assert leaderboard.best({"a": [90, 95, 100], "b": [86, 87, 88]}) is None    # 8 < 2 · 5
    assert leaderboard.best({"a": [90], "b": [10, 11]}) is None                 # one seed: no verdict
    assert leaderboard.best({"a": [90, 92], "b": [10, 11], "c": []}) == "a"


def test_leaderboard_leaves_the_round_count_to_methods_with_their_own_schedule():
    assert leaderboard.row_args("mnist-fl", "fedloe-fish") == ["--alpha", "0.1", "--dg", "fish"]
    assert leaderboard.row_args("mnist-fl", "fedomg") == ["--alpha", "0.1", "--rounds", "200", "--eval-every", "20"]


def test_leaderboard_needs_full_mnist_to_run(capsys):
    with pytest.raises(SystemExit) as e:
        leaderboard.main(["--only", "rcmnist-norot", "--out-dir", "/nonexistent/board"])
    assert "--data-root DIR" in str(e.value.code)


# ------------------------------------------------------------------------------------ gpu_session

def test_gpu_session_dry_run_lists_the_steps_within_the_budget(capsys, tmp_path):
    steps = gpu_session.main(["--data-root", "D", "--out-dir", str(tmp_path), "--minutes", "9", "--dry-run"])
    assert [s[0] for s in steps] == ["tests", "gpu_check", "speed-fl", "speed-rmnist", "tf32-off", "leaderboard"]
    lines = capsys.readouterr().out.splitlines()
    fits = {line.split()[0]: "skipped" not in line for line in lines}
    # 8 minutes after packing: tests (4) run, gpu_check (6) does not fit, then speed-fl (2), speed-rmnist (2)
    assert fits == {"tests": True, "gpu_check": False, "speed-fl": True, "speed-rmnist": True, "tf32-off": False,
                    "leaderboard": True}
    assert "NVIDIA_TF32_OVERRIDE=0" in next(line for line in lines if line.startswith("tf32-off"))
    assert "--where gpu" in next(line for line in lines if line.startswith("leaderboard"))


def test_gpu_session_refuses_without_cuda_in_one_line(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is visible")
    r = subprocess.run([sys.executable, "benchmark/gpu_session.py", "--data-root", str(tmp_path), "--out-dir",
                        str(tmp_path / "o")], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr


def test_gpu_session_packs_parts_and_unpacks_them(tmp_path, monkeypatch):
    board = tmp_path / "repo" / "benchmark" / "results" / "leaderboard" / "b"
    board.mkdir(parents=True)
    monkeypatch.setattr(gpu_session, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(gpu_session, "LEADERBOARD", board.parent)
    monkeypatch.setattr(gpu_session, "PART", 1000)
    for k in range(5):
        (board / f"r-seed{k}.json").write_bytes(bytes(400))
    (board / "big.ckpt").write_bytes(bytes(1001))                       # over a part: left out
    out = tmp_path / "out"
    out.mkdir()
    (out / "tests.log").write_text("5 passed")
    assert gpu_session.pack(out) == 3                                   # by size: 8 + 400 + 400 | 400 + 400 | 400
    import shutil
    shutil.rmtree(board)
    gpu_session.unpack(out)
    assert sorted(p.name for p in board.iterdir()) == [f"r-seed{k}.json" for k in range(5)]
    assert (tmp_path / "repo" / "gpu-session" / "tests.log").read_text() == "5 passed"
