"""The Flower App (docs/flower.md): every method through Flower's message round trip, each node
reading its own folder alone and the server no data, equals the method file's own run, bit for
bit; what a node reads and refuses; run_local.py's bad input."""
import concurrent.futures
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="flwr not installed: pip install -r flower/requirements.txt")

HERE = Path(__file__).resolve().parent

import torch  # noqa: E402

import audit  # noqa: E402
import bad_node  # noqa: E402
import fake_grid  # noqa: E402
import fl_adapter  # noqa: E402  (puts the repository on the path)
import common  # noqa: E402
import data  # noqa: E402
import fedavg  # noqa: E402
import harness  # noqa: E402
from harness import outputs, runner, sites  # noqa: E402

FEDAVG_UPDATE = fedavg.client_update

# Tiny runs: the synthetic dataset (720 images, 3
# domains), 2 rounds, evaluated after each; 3 clients
# of which 2 take part per round where the method samples, so that the sampling, the order of the
# replies and each client's own stream all matter.
BASE = ["--dataset", "synthetic", "--rounds", "2", "--eval-every", "1", "--test-domain", "0"]
ARGV = {
    "fedavg": BASE + ["--clients", "3", "--sample", "2"],
    "fediir": BASE + ["--clients", "3", "--sample", "2"],
    "fedomg": BASE + ["--clients", "3", "--sample", "2"],  # momentum 0.9: kept in each node's state
    # stage 1 (one communication), then two of stage 2: heads, predictions, Eq. 11 on the server
    "fedloe": ["--dataset", "synthetic", "--test-domain", "0", "--clients", "3",
               "--stage1-epochs", "1",
               "--stage1-comms", "1", "--stage2-epochs", "2", "--stage2-comms", "2",
               "--batch-size", "64"],   # FedLOE's 128 is more than a 120-example
                                        # client holds (data.py refuses it)
    # R = S = 2 in minibatches: line 8 reads every ν_{i,r}; θ_i up to the server to be scored
    "perinvfl": BASE + ["--clients", "3", "--sample", "2", "--R", "2", "--S", "2",
                        "--batch-size", "32"],
    # the exit rule: a pre-training round with g_i up (Eq. 13)
    "fedipg": BASE + ["--clients", "3", "--exit", "auto", "--exit-warmup", "1"],
}


def exported(method, argv, tmp_path):
    """The split of the method file's run with argv written to tmp_path/sites (python -m
    harness.datasets --export): (its folders, the number of training sites)."""
    args = harness.resolve(importlib.import_module(method).METHOD,
                           argv + ["--out", str(tmp_path / "unused.json")])
    with contextlib.redirect_stdout(io.StringIO()):
        return sites.export(args, tmp_path / "sites"), args.clients


def grid_of(method, argv, tmp_path, app=None, kind=None, **kw):
    """A fake grid (`kind`, default FakeGrid) of one node per site of the run's exported split,
    each with its folder; the nodes of sites P and up evaluation-only."""
    folders, P = exported(method, argv, tmp_path)
    return (kind or fake_grid.FakeGrid)(app or fl_adapter.client_app(), folders, train=P, **kw)


@contextlib.contextmanager
def each_reads_its_own(grid, tmp_path, data_files=(data.EMBEDDED,)):
    """Within: a node may read its own folder and no other site's, the server (everything outside
    a node's work) no site's at all, nor the dataset's files (audit: a refusal is a
    PermissionError, and is logged); afterwards, no refusal was logged."""
    folders = [c.node_config["data"] for c in grid.contexts.values()]
    deny = [str(Path(folders[0]).parent), *map(str, data_files)]
    log = tmp_path / "reads.log"
    with audit.watching({"*": ([], deny), **{f: ([f], deny) for f in folders}}, log):
        yield
    assert audit.refusals(log) == []


def signed(grid, certs):
    """The grid's nodes with keys (flower/credentials.py in `certs`): each signs its replies with
    its site's key (node config key), which the grid's NodeInfo names as its registered one; the
    folder, for serve's `keys`."""
    import credentials
    credentials.make(certs, ["127.0.0.1"], len(grid.contexts))
    pem = {k: v for v, k in fl_adapter.node_keys(certs).items()}
    for node, context in grid.contexts.items():
        site = context.node_config["partition-id"]
        context.node_config["key"] = str(certs / f"node-{site}")
        grid.keys[node] = pem[site]
    return certs


def run_both(method, tmp_path, argv=None, also=()):
    """The method file's own run and the same run through the fake grid, whose nodes hold the
    export of its split (and run `also` too), each reading only its own folder and the server no
    data (each_reads_its_own), each signing its replies, the server checking every signature
    (`keys`): (results, checkpoint, the grid) each."""
    argv = argv or ARGV[method]
    mod = importlib.import_module(method)
    mod.main(argv + ["--out", str(tmp_path / "own.json")])
    grid = grid_of(method, argv, tmp_path, fl_adapter.client_app(also))
    keys = signed(grid, tmp_path / "certs")
    with each_reads_its_own(grid, tmp_path):
        fl_adapter.serve(grid, method, argv + ["--out", str(tmp_path / "flower.json")], keys=keys)
    load = lambda name: (json.loads((tmp_path / f"{name}.json").read_text()),
                         torch.load(tmp_path / f"{name}.json.ckpt", weights_only=True))
    return load("own"), load("flower"), grid


def kept_on_nodes(grid, key):
    """{site: what its node keeps under `key` in its own state (Flower's Context.state)}."""
    out = {}
    for context in grid.contexts.values():
        record = context.state.get("fedood")
        for blob in (record.values() if record is not None else []):
            kept = torch.load(io.BytesIO(blob), weights_only=True)
            if key in kept:
                out[context.node_config["partition-id"]] = kept[key]
    return out


def history(res):
    return [{k: v for k, v in row.items() if k != "seconds"} for d in res["domains"].values()
            for row in d["history"]]


def test_flower_takes_auto_as_one_client_per_node_on_a_gpu_too(tmp_path, monkeypatch, capsys):
    """--parallel-clients auto is on for CUDA in the method files; on Flower every client trains on
    its own node, so there auto is off whatever the device, and on (or --compile, which needs it) is
    refused."""
    seen = {}
    gpu = lambda mode: types.SimpleNamespace(parallel_clients=mode, device="cuda",
                                             dataset="synthetic", model="cnn", compile=False)
    monkeypatch.setattr(harness, "main", lambda method, argv,
                        **hooks: seen.update(method=method, **hooks))
    fl_adapter.serve(None, "fedavg", [])
    args = gpu("auto")
    common.check_parallel(args, seen["method"])                      # the run's own rule, on Flower
    assert args.parallel_clients == "off" and isinstance(seen["engine"], fl_adapter.Link)
    assert common.parallel(gpu("auto"))                         # the method file's own: on for CUDA
    monkeypatch.undo()
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path)
    for extra, expect in ((["--parallel-clients", "on"],
                           "--parallel-clients on: fedavg trains every client on "
                                                          "its own node on Flower; use off"),
                          (["--compile"],
                           "--compile: fedavg trains every client on its own node on Flower")):
        capsys.readouterr()
        with pytest.raises(fl_adapter.RunFailed) as e:
            fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + extra
                             + ["--out", str(tmp_path / "r.json")])
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [str(e.value)] and expect in err[0]


@pytest.mark.parametrize("method", list(ARGV))
def test_flower_equals_the_method_file(method, tmp_path):
    """torch.equal: the same operations in the same order (the method's client functions on the
    node, its server functions on the server, each client's own stream), every evaluation the same
    (each site scores its own data, the server sums), with each node reading only the exported
    folder of its site (the held-out domain: an evaluation-only node) and the server no data
    (each_reads_its_own). PerInvFL's θ_i never leaves its node: the server's checkpoint holds
    none, and each node's own equals the in-process run's."""
    (own, own_ckpt), (fl, fl_ckpt), grid = run_both(method, tmp_path)
    assert own["complete"] and fl["complete"]
    for k, v in own_ckpt["model"].items():
        assert torch.equal(v, fl_ckpt["model"][k]), f"{method}: {k} differs"
    assert history(own) == history(fl)
    assert own_ckpt["sampler"].equal(fl_ckpt["sampler"])
    on_nodes = kept_on_nodes(grid, "theta")
    if method == "perinvfl":                     # the personalised models: each on its node only
        mine = {i: s["theta"] for i, s in own_ckpt["state"]["clients"].items() if "theta" in s}
        assert sorted(on_nodes) == sorted(mine) == [0, 1, 2]
        assert all(torch.equal(mine[i], on_nodes[i]) for i in mine)
    assert not on_nodes or method == "perinvfl"
    assert not any(fl_ckpt["state"].get("clients", {}).values())       # nothing of a node's own


def test_flower_equals_fedipg_with_a_slow_client(tmp_path, monkeypatch):
    """benchmark/fedipg_aberrant.py's slow client (stale w^{t-τ}, fedipg.arrivals swapped) on Flower
    too."""
    import fedipg
    import fedipg_aberrant
    monkeypatch.setattr(fedipg, "main", fedipg_aberrant.main)
    monkeypatch.setattr(fedipg, "METHOD", fedipg_aberrant.METHOD)      # (what the ServerApp runs)
    (own, own_ckpt), (fl, fl_ckpt), _ = run_both("fedipg", tmp_path, ARGV["fedipg"]
                                                 + ["--aberrant", "slow:2"],
                                                 also=[fedipg_aberrant.init_state])
    assert all(torch.equal(v, fl_ckpt["model"][k]) for k, v in own_ckpt["model"].items())
    assert history(own) == history(fl) and "aberrant_acc" in own["domains"]["style0"]["history"][0]


def slow_client_update(site, sent):
    """fedavg.client_update, 0.3 s slower (a module-level function: the nodes find it by its
    name)."""
    time.sleep(0.3)
    return FEDAVG_UPDATE(site, sent)


slow_client_update.replies = FEDAVG_UPDATE.replies          # (what the server checks it against)
slow_client_update.reduced = FEDAVG_UPDATE.reduced          # (what the round reads: the sums)


def overlap(spans, phase="client_update"):
    """Whether the nodes' working spans [(phase, client, began, ended)] in exchange `phase` all
    overlap: one instant in all of them."""
    mine = [(b, e) for p, _, b, e in spans if p == phase]
    return len(mine) > 1 and max(b for b, _ in mine) < min(e for _, e in mine)


def test_the_nodes_of_an_exchange_work_at_the_same_time(tmp_path, monkeypatch):
    """One message to every sampled node at once: with nodes that answer in parallel (threads here,
    as SuperNodes would), every client's work in a round overlaps the others' (each client function
    made to take 0.3 s more, so that the check does not hang on scheduling), and the run is still
    the method file's own run bit for bit."""
    import fedavg
    monkeypatch.setattr(fedavg, "client_update", slow_client_update)
    argv = BASE + ["--clients", "3", "--sample", "3", "--rounds", "2"]
    fedavg.main(argv + ["--out", str(tmp_path / "own.json")])
    grid = grid_of("fedavg", argv, tmp_path, fl_adapter.client_app([slow_client_update]),
                   fake_grid.ThreadGrid)
    _, link = fl_adapter.serve(grid, "fedavg", argv + ["--out", str(tmp_path / "flower.json")])
    for t in (1, 2):
        trained = [c for phase, c, _, _ in link.spans[t] if phase == "slow_client_update"]
        scored = [c for phase, c, _, _ in link.spans[t] if phase == "score"]
        assert (trained == [0, 1, 2] and scored == [0, 1, 2, 3]             # 3: the held-out domain
                and overlap(link.spans[t], "slow_client_update")), link.spans[t]
    own, fl = (torch.load(tmp_path / f"{k}.json.ckpt", weights_only=True)["model"]
               for k in ("own", "flower"))
    assert all(torch.equal(v, fl[k]) for k, v in own.items())


def test_nodes_in_threads_of_one_process_make_their_clients_one_at_a_time(monkeypatch):
    """Nodes that answer in threads of one process (as a simulation engine's do) share its table of
    clients: making a client (its seeded model) and dropping another run's are one at a time, so
    that no two threads drop the same stale client (a KeyError once seen in CI) nor seed the one
    global generator at once; each node still gets its own client, made once."""
    inside, most, made = [0], [0], []

    class Slow:
        def __init__(self, init, args, roster, site, folder, evaluate_only):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            made.append(site)
            inside[0] -= 1
    monkeypatch.setattr(fl_adapter, "Node", Slow)
    monkeypatch.setattr(fl_adapter, "_NODES", {("an earlier run", None, "[]", 0, "/x", False):
                                               object()})
    req = {"args": json.dumps({"seed": 0}), "init": None, "domain": "0", "roster": "[]"}
    ctx = lambda p: types.SimpleNamespace(node_config={"partition-id": p, "data": f"/site-{p}"})
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        nodes = list(pool.map(lambda p: fl_adapter.node_for(req, ctx(p % 3)), range(6)))
    assert most[0] == 1 and sorted(made) == [0, 1, 2] and len(fl_adapter._NODES) == 3
    assert all(nodes[p] is nodes[p + 3] for p in range(3))


# ------------------------------------------------------------------------------- run_local.py

RUN_LOCAL = [sys.executable, str(HERE / "run_local.py")]


def flower_processes():
    """Pids of running SuperLinks, SuperNodes, their Flower children and nginx (from /proc, no
    psutil)."""
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((l for l in (d / "status").read_text().splitlines()
                              if l.startswith("State:")), "")
            except OSError:
                continue
            ours = ("flower-super", "flwr-serverapp", "flwr-clientapp", "nginx: ")
            if any(name in cmd for name in ours) and "zombie" not in state:
                pids.add(int(d.name))
    return pids


def none_left(before, seconds=30):
    """No Flower process beyond `before` is running: one that another test (another xdist worker)
    started meanwhile ends within `seconds`; one left by this test never does."""
    end = time.time() + seconds
    while (extra := flower_processes() - before) and time.time() < end:
        time.sleep(0.5)
    return not extra


def refused(argv, expect, process=False):
    """run_local.py refuses argv in one line on stderr, starting nothing: its main in this process,
    or (process) the script as a user runs it."""
    import run_local
    before = flower_processes()
    if process:
        r = subprocess.run(RUN_LOCAL + argv, capture_output=True, text=True, timeout=120,
                           cwd=os.getcwd())
    else:
        err, code = io.StringIO(), None
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = run_local.main(argv)
            except SystemExit as e:                  # argparse's refusals (config.Parser: one line)
                code = e.code
        r = types.SimpleNamespace(returncode=code, stderr=err.getvalue())
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("run_local.py: error: ") and expect
            in lines[0]), r.stderr
    assert none_left(before)          # nothing of this run left running


def test_run_local_unknown_method():
    refused(["--method", "fedsgd"], "unknown method 'fedsgd'", process=True)


def test_run_local_bad_node_count():
    refused(["--method", "fedavg", "--nodes", "1"], "--nodes 1 is below the 2 training domains")
    # of one minibatch (32) each
    refused(["--method", "fediir", "--nodes", "500"], "enough for at most 12 clients")


def test_run_local_fedloe_rounds_from_its_stages():
    refused(["--method", "fedloe", "--rounds", "2"], "fedloe counts its rounds from its stages")


@pytest.mark.parametrize("argv,expect", [
    (["--nodes", "two"], "argument --nodes: invalid int value: 'two'"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["--port", "70000"], "--port must be in 1..65535, got 70000"),
    (["--port", "-1"], "--port must be in 1..65535, got -1"),
    (["--rounds", "0"], "--rounds must be positive, got 0"),
    (["--secagg-clip", "5"], "--secagg-clip must be a positive number, with --secagg, got 5 "
     "without --secagg"),
    (["--secagg", "--secagg-clip", "0"], "--secagg-clip must be a positive number, with --secagg, "
     "got 0"),
    (["--secagg", "--secagg-clip", "inf"], "--secagg-clip must be a positive number, with "
     "--secagg, got inf"),
    (["--out", "/proc/version/x.json"], "/proc/version is not a folder"),
    (["--out", "r.ckpt"], "a results file may not end in .ckpt"),
    (["--out", "somewhere/"], "--out somewhere/ ends in a separator: give a file name"),
    (["--", "--resume"],
     "--resume after --: give run_local.py's own --out, --overwrite and --resume, before --"),
    (["--", "--out", "x.json"], "--out after --: give run_local.py's own --out"),
    (["--", "--parallel-clients", "on"],                   # the ServerApp's refusal, before a start
     "--parallel-clients on: fedavg trains every client on its own node on Flower; use off"),
    (["--", "--compile"], "--compile: fedavg trains every client on its own node on Flower"),
])
def test_run_local_bad_flags_one_line(argv, expect):
    refused(["--method", "fedavg", "--nodes", "2"] + argv, expect)


def test_run_local_refusals_are_the_same_with_a_full_results_folder():
    """A complete result and checkpoint at every default --out of the refusals above change none of
    them."""
    import run_local
    cases = [(["--method", "fedavg", "--nodes", "1"], "--nodes 1 is below the 2 training domains"),
             (["--method", "fedavg", "--nodes", "2", "--port", "70000"],
              "--port must be in 1..65535"),
             (["--method", "fedloe", "--rounds", "2"], "fedloe counts its rounds from its stages")]
    outs = [run_local.parse(argv).out for argv, _ in cases]
    done = {"method": "fedavg", "args": {}, "domains": {}, "complete": True}
    for out in outs:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(done))
        Path(f"{out}.ckpt").write_bytes(b"PK\x03\x04")
    assert all(Path(o).parent == Path.cwd() / "results" for o in outs)
    before = {p: p.read_bytes() for p in Path("results").iterdir()}
    for argv, expect in cases:
        refused(argv, expect)
    assert {p: p.read_bytes() for p in Path("results").iterdir()} == before


def test_run_local_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        refused(["--method", "fedavg", "--nodes", "2", "--port", str(port)],
                f"port {port} on 127.0.0.1 is in use")


def test_run_local_keeps_an_older_result_until_the_new_one_is_complete(tmp_path):
    """A complete result at --out is refused without --overwrite, and so are an interrupted run's
    checkpoint, another run's lock and a user's file; with --overwrite, a run that fails (here: no
    result within --timeout 1 s) leaves that result as it was, says so in one line, and leaves no
    Flower process running (the new run writes beside its logs, and replaces --out only once
    complete)."""
    before = flower_processes()
    out = tmp_path / "r.json"
    fedavg.main(["--dataset", "synthetic", "--rounds", "1", "--test-domain", "0",
                 "--out", str(out)])
    older = out.read_bytes(), Path(f"{out}.ckpt").read_bytes()
    refused(["--method", "fedavg", "--nodes", "2", "--out", str(out)],
            f"{out} holds a complete result; give another --out, or --overwrite to replace it")
    lone = tmp_path / "cut.json"
    Path(f"{lone}.ckpt").write_bytes(older[1])               # an interrupted run's checkpoint alone
    refused(["--method", "fedavg", "--nodes", "2", "--out", str(lone)],
            f"{lone} holds an interrupted run")
    Path(f"{lone}.lock").write_text(f"{os.getpid()}@{os.uname().nodename}")    # a live run holds it
    refused(["--method", "fedavg", "--nodes", "2", "--out", str(lone), "--overwrite"],
            "is in use by another run")
    (tmp_path / "notes.txt").write_text("mine")
    refused(["--method", "fedavg", "--nodes", "2", "--out", str(tmp_path / "notes.txt"),
             "--overwrite"],
            "is not a results file of this project, which no run replaces")
    r = subprocess.run(RUN_LOCAL + ["--method", "fedavg", "--nodes", "2", "--rounds", "1",
                                    "--out", str(out),
                                    "--timeout", "1", "--overwrite"], capture_output=True,
                                    text=True, timeout=300,
                       cwd=os.getcwd())
    assert r.returncode == 1 and r.stderr.startswith("run_local.py: error: no result in 1 s; "
                                                     "stopped"), r.stderr
    assert (out.read_bytes(), Path(f"{out}.ckpt").read_bytes()) == older
    assert not Path(f"{out}.lock").exists() and (tmp_path / "notes.txt").read_text() == "mine"
    assert none_left(before)


def test_run_local_resume_of_a_complete_result_starts_nothing_and_keeps_it(tmp_path, capsys):
    """--resume where --out holds a complete result made with these arguments: the method scripts'
    line ("nothing to continue"), exit 0, no deployment, the result byte for byte as it was (its
    `flower` entry kept); with other arguments, the checkpoint's refusal in one line."""
    import run_local
    out = tmp_path / "r.json"
    fedavg.main(["--dataset", "synthetic", "--clients", "2", "--rounds", "2", "--eval-every", "1",
                 "--test-domain", "0", "--seed", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    res["flower"] = {"rounds": {"1": {"seconds": 1.0}}}
    out.write_text(json.dumps(res))
    before, running = out.read_bytes(), flower_processes()
    capsys.readouterr()
    rc = run_local.main(["--method", "fedavg", "--nodes", "2", "--out", str(out), "--resume"])
    said = capsys.readouterr()
    assert rc == 0 and said.out.strip() == (f"{out} is complete, and its checkpoint was made with "
                                            f"these arguments: nothing to continue (nothing "
                                            f"started)"), said
    assert out.read_bytes() == before and flower_processes() <= running
    refused(["--method", "fedavg", "--nodes", "2", "--rounds", "3", "--out", str(out),
             "--resume"], "was made with other arguments")
    assert out.read_bytes() == before


def test_run_local_prints_a_runs_last_line_without_the_terminals_escape_codes(tmp_path):
    """Where the run wrote no error line of its own, run_local.py names its last line, without the
    colour codes of Flower's log."""
    import run_local
    run = types.SimpleNamespace(stdout="\x1b[92mINFO \x1b[0m:      Starting logstream\n",
                                stderr="")
    line = run_local.failure(run, tmp_path / "r.json", tmp_path, [])
    assert line.startswith("the run did not finish (INFO :      Starting logstream); stopped;")


def test_run_local_settles_a_complete_run_at_out_whatever_its_name(tmp_path):
    """What run_local.py does with a complete run in its log folder: the results at --out (a name
    not ending in .json too), recording --out and the command that names it and the per-round
    timing, the checkpoint at <out>.ckpt; over an older result (--overwrite) both are replaced only
    now."""
    import run_local
    logs = tmp_path / "logs"
    logs.mkdir()
    fresh = logs / "run.txt"
    fedavg.main(["--dataset", "synthetic", "--rounds", "1", "--test-domain", "0",
                 "--out", str(fresh)])
    Path(f"{fresh}.flower.json").write_text(
        json.dumps({"rounds": {"1": {"seconds": 1.0, "down": 1, "up": 2,
                                     "spans": [["train", 0, 5.0, 6.5]]}}}))
    out = tmp_path / "final" / "result.txt"
    ckpt = Path(f"{fresh}.ckpt").read_bytes()
    for overwrite in (False, True):
        Path(f"{fresh}.ckpt").write_bytes(ckpt)
        with outputs.claim(out, overwrite=overwrite) as plan:
            assert plan.replacing == overwrite
            res = run_local.settle(fresh, plan)
        saved = json.loads(out.read_text())
        assert (saved == res and saved["args"]["out"] == str(out)
                and saved["flower"]["rounds"]["1"]["up"] == 2)
        assert (f"--out {out}" in saved["provenance"]["command"] and str(fresh) not
                in saved["provenance"]["command"])
        assert Path(f"{out}.ckpt").read_bytes() == ckpt and not Path(f"{fresh}.ckpt").exists()
        assert sorted(p.name for p in out.parent.iterdir()) == ["result.txt", "result.txt.ckpt"]
    assert (run_local.spans_line(saved["flower"]["rounds"]["1"])
            == "; spans (s): train client 0 0.0-1.5")


# ----------------------------------------------------
# what a node runs, and what the server takes from it

def message(fn, method="fedavg", init=None, node=1000):
    """A train.client message as the server sends it, naming `fn` (and the init_state `init`)."""
    from flwr.app import Message
    args = json.dumps({"dataset": "synthetic"})
    return Message(fl_adapter.pack({"fn": fn, "phase": "client_update", "round": 1,
                                    "domain": "style0", "roster": "[]",
                                    "args": args, "init": init, "method": method}), node,
                   "train.client")


@pytest.mark.parametrize("fn,init,method", [
    ("os:getcwd", None, "fedavg"),                          # not a method's at all
    ("fediir:client_update", None, "fedavg"),               # another method's client function
    ("fedavg:server_update", None, "fedavg"),               # the method's own, but the server's
    ("fedavg:client_update", "os:system", "fedavg"),        # a declared function, an
                                                            # undeclared init_state
    ("fedavg:client_update", None, "os"),                   # no method of this project
])
def test_a_node_runs_only_the_method_files_client_functions(fn, init, method, monkeypatch,
                                                           tmp_path):
    """A message naming anything but a client function (or init_state) that the run's method file
    declares (passes to common.on_clients, or to common.main as init_state) gets an error reply
    naming it; nothing runs. The run's method comes from the run config where Flower gives one
    (here: fedavg, whatever the message says)."""
    monkeypatch.setattr(fl_adapter, "node_for",
                        lambda *a: pytest.fail("a node was set up to run it"))
    config = {"method": "fedavg"} if method == "fedavg" else {}
    grid = fake_grid.FakeGrid(fl_adapter.client_app(), [tmp_path], run_config=config)
    monkeypatch.setattr(os, "getcwd", lambda: pytest.fail("os.getcwd ran"))
    reply = grid.send_and_receive([message(fn, method, init, node=next(iter(grid.contexts)))])[0]
    monkeypatch.undo()
    named = init if fn.startswith("fedavg:client") and init else fn
    assert fl_adapter.unpack(reply.content)["_error"] == \
        f"{named} is not a client function of {method}.py; nothing was run"
    assert fl_adapter.declared("fedavg") == {"fedavg:client_update", "common:score"}
    assert fl_adapter.declared("fediir") == {"fediir:classifier_gradient", "fediir:client_update",
                                             "fediir:init_state", "common:score"}
    # fedipg_round's step 2 is `client or client_update`: its own function, not the parameter;
    # Eq. 13's risk_gradient only in a run with exits (its run arguments, as each message has them)
    assert fl_adapter.declared("fedipg", args={"exit": "auto"}) == {
        "fedipg:risk_gradient", "fedipg:client_update", "fedipg:init_state", "common:score"}
    assert fl_adapter.declared("fedipg", args={"exit": "off"}) == {
        "fedipg:client_update", "fedipg:init_state", "common:score"}
    assert fl_adapter.declared("fedipg", args={"seed": 0}) == {     # (no --exit: none of them)
        "fedipg:init_state", "common:score"}


def test_an_evaluation_only_node_never_trains(tmp_path, monkeypatch):
    """A node whose config says evaluate-only=true (the held-out domain's) runs the method's
    evaluations and nothing that trains: a message naming a client function gets an error reply,
    nothing set up; declared() says what each may run."""
    monkeypatch.setattr(fl_adapter, "node_for",
                        lambda *a: pytest.fail("a node was set up to run it"))
    grid = fake_grid.FakeGrid(fl_adapter.client_app(), [tmp_path], {"method": "fedavg"}, train=0)
    reply = grid.send_and_receive([message("fedavg:client_update",
                                           node=next(iter(grid.contexts)))])[0]
    assert fl_adapter.unpack(reply.content)["_error"] == \
        "fedavg:client_update is not an evaluation of fedavg.py; nothing was run"
    assert fl_adapter.declared("fedavg", evaluate_only=True) == {"common:score"}
    assert fl_adapter.declared("perinvfl", True) == {"perinvfl:score", "perinvfl:init_state"}


def test_an_evaluations_counts_are_checked_against_their_declaration():
    """what_is_wrong on common.score's reply (right answers and examples in the group's row of a
    [groups, 2] count, common.Count(most, shape)): the honest reply passes; a count above the
    site's examples or below 0, another shape, another dtype are each named in the line."""
    want = fl_adapter.schema({"val": common.Count(12, (3, 2))})
    span = {"_began": 1.0, "_ready": 1.0, "_ended": 2.0, "_round": 1, "_phase": "score"}
    ok = torch.tensor([[0, 0], [5, 12], [0, 0]])
    wrong = lambda v: fl_adapter.what_is_wrong({"val": v, **span}, want, 1, "score")
    assert wrong(ok) is None
    assert wrong(ok + torch.tensor([[0, 0], [0, 1], [0, 0]])) == \
        "val counts [[0, 0], [5, 13], [0, 0]] of 12 examples"
    assert wrong(ok - torch.tensor([[1, 0], [0, 0], [0, 0]])) == \
        "val counts [[-1, 0], [5, 12], [0, 0]] of 12 examples"
    assert wrong(ok[:2]) == "val is ('tensor', (2, 2), 'torch.int64'), where the client " \
        "function declares ('count', 12, (3, 2))"
    assert wrong(ok.float()).startswith("val is ('tensor', (3, 2), 'torch.float32')")


@pytest.mark.parametrize("how,what", [
    ("nan", "non-finite delta"),
    ("shape",
     "delta is ('tensor', ({n},), 'torch.float32'), where the client function declares "
     "('tensor', ({N},)"),
    ("dtype", "delta is ('tensor', ({N},), 'torch.float64'), where the client function declares"),
    ("missing", "missing loss"),
    ("extra", "extra note"),
    ("began", "missing _began"),
    ("oversized", "bytes, the most this exchange takes is"),
    ("zeros", "bytes, the most this exchange takes is"),     # 64 MiB, not its few wire chunks
    ("round", "it answers round 1 (client_update), not round 2 (client_update)"),
])
def test_the_server_checks_every_reply_before_the_round_sees_it(how, what, tmp_path, capsys):
    """A bad reply in round 2 ends the run in one line naming the node, its partition and what was
    wrong (RunFailed, which the ServerApp raises so that Flower marks the run failed; the line in
    <out>.flower.json too); the global model never takes a value from it (the checkpoint is round
    1's, as the method file's own run has it), and the same command with --resume, once the node
    is honest, ends with the method file's numbers."""
    argv = ARGV["fedavg"] + ["--sample", "3"]
    fedavg.main(argv + ["--rounds", "1", "--out", str(tmp_path / "one.json")])
    capsys.readouterr()
    out = tmp_path / "flower.json"
    grid = grid_of("fedavg", argv, tmp_path, bad_node.tampered(fl_adapter.client_app(), how))
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", argv + ["--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    n = sum(v.numel() for v in torch.load(tmp_path / "one.json.ckpt",
                                          weights_only=True)["model"].values())
    node = next(i for i, c in grid.contexts.items() if c.node_config["partition-id"] == 0)
    assert len(err) == 1 and err[0] == str(e.value), err
    assert err[0] == json.loads(Path(f"{out}.flower.json").read_text())["error"]
    assert err[0].startswith(f"fedavg.py: error: a bad reply in round 2 from node {node} "
                             "(partition 0): "), err
    assert what.format(n=n - 1, N=n) in err[0] and err[0].endswith("the last good checkpoint "
                                                                   f"({out}.ckpt) is kept")
    one, kept = (torch.load(p, weights_only=True) for p in (tmp_path / "one.json.ckpt",
                                                            f"{out}.ckpt"))
    assert kept["round"] == 1 and all(torch.equal(v, kept["model"][k])
                                      for k, v in one["model"].items())
    if how == "nan":
        folders = [c.node_config["data"] for c in grid.contexts.values()]
        fl_adapter.serve(fake_grid.FakeGrid(fl_adapter.client_app(), sorted(folders), train=3),
                         "fedavg", argv + ["--out", str(out), "--resume"])
        fedavg.main(argv + ["--out", str(tmp_path / "own.json")])
        own, fl = (torch.load(p, weights_only=True)["model"]
                   for p in (tmp_path / "own.json.ckpt", f"{out}.ckpt"))
        assert all(torch.equal(v, fl[k]) for k, v in own.items())


def test_no_method_bounds_a_nodes_finite_update(tmp_path, capsys):
    """What the checks do not catch: a node whose update is its honest one times 1e30, finite and
    of the right shape, passes every check, and the global model takes it (docs/flower.md: what a
    user who needs a bound adds)."""
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path,
                   bad_node.tampered(fl_adapter.client_app(), "huge"))
    results, _ = fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + ["--sample", "3", "--out",
                                                                    str(tmp_path / "r.json")])
    model = torch.load(tmp_path / "r.json.ckpt", weights_only=True)["model"]
    assert results["complete"] and max(v.abs().max().item() for v in model.values()) > 1e20


@pytest.mark.parametrize("late", [0, 1])
def test_a_second_node_claiming_a_taken_partition_id_is_named(late, tmp_path, capsys):
    """Two nodes claim one partition id: the one that came online later is named (whichever sorts
    first by node id), never the one that held it."""
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path)
    honest, liar = sorted(grid.contexts)[:2][::1 if late else -1]
    for key in ("partition-id", "data", "evaluate-only"):      # a copy of its data, its partition
        grid.contexts[liar].node_config[key] = grid.contexts[honest].node_config[key]
    grid.activated[liar] = "2026-01-01T00:01:00+00:00"                   # after every other node
    with pytest.raises(fl_adapter.RunFailed):
        fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + ["--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    taken = grid.contexts[honest].node_config["partition-id"]
    assert err == [f"fedavg.py: error: a bad reply from node {liar}: it claims partition id "
                   f"{taken}, which node {honest} has held since before it connected; this run "
                   f"needs 0..3, one node each; stopped; nothing of this run was saved"], err


def test_with_the_nodes_keys_a_node_holds_the_partition_its_key_was_made_for(tmp_path, capsys):
    """Run config `keys` (credentials.py's folder): a node that claims a partition whose key it
    does not hold (its registered key and the key it signs with, partition 0's) is named at its
    report, whenever it came online: its signature is not that partition's key's; without a
    signature, it is named too; with the right keys the run is the method file's."""
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path)
    certs = signed(grid, tmp_path / "certs")                      # 3 clients, the held-out domain
    pem = {k: v for v, k in fl_adapter.node_keys(certs).items()}   # partition: key
    ids = sorted(grid.contexts, key=lambda i: grid.contexts[i].node_config["partition-id"])
    grid.keys[ids[2]] = pem[0]                                   # node of partition 2, key 0's
    grid.contexts[ids[2]].node_config["key"] = str(certs / "node-0")
    argv = ARGV["fedavg"] + ["--out", str(tmp_path / "r.json")]
    tail = ("; nothing of it was used (another registered device may have pushed it in that "
            "node's name: the SuperLink does not check a reply's source); stopped; nothing of "
            "this run was saved")
    for key, why in ((str(certs / "node-0"), "its signature is not site 2's key's over it"),
                     ("", "it is not signed")):
        grid.contexts[ids[2]].node_config["key"] = key
        with pytest.raises(fl_adapter.RunFailed):
            fl_adapter.serve(grid, "fedavg", argv, keys=certs)
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"fedavg.py: error: a reply in round 0 in the name of node {ids[2]} "
                       f"(partition 2) failed its signature: {why}{tail}"], err
    grid.keys[ids[2]] = pem[2]
    grid.contexts[ids[2]].node_config["key"] = str(certs / "node-2")
    results, _ = fl_adapter.serve(grid, "fedavg", argv, keys=certs)
    assert results["complete"]


def test_the_size_of_a_reply_is_what_unpacking_it_takes():
    """64 MiB of zeros travels as a few equal 5 MiB chunks (one object on the wire); the check
    counts the bytes unpacking it takes."""
    rd = fl_adapter.pack({"theta": torch.zeros(2 ** 24)})
    assert fl_adapter.unpacked_bytes(rd) > 2 ** 26 > 4 * fl_adapter.nbytes(rd)


# ------------------------------------------ what each
# method shows the server (docs/flower.md's table)

# (method, its flags, the exchange, the reply keys the
# server adds up, their weights, "sum" / "individual"):
# "sum" where the server's step needs only Σ_c w_c r_c
# of those keys (secure aggregation could hide the
# rest), "individual" where it needs each reply. Reasoned
# from each method file's round and server function.
SHOWN = [
    ("fedavg", [], "client_update", ["delta"], "ones", "sum"),      # server_update: Σ n_c Δ_c
    ("fediir", [], "classifier_gradient", ["grad"], "ones", "sum"),           # ḡ = Σ grad / Σ count
    ("fediir", [], "client_update", ["delta"], "ones", "sum"),          # server_update: Σ_c Δ_c / C
    ("fedomg", [], "client_update", ["theta"], "n", "individual"),      # the Gram matrix of the g_u
    ("fedloe", LOE_1 := ["--stage1-epochs", "8", "--stage1-comms", "1", "--batch-size", "64"],
     "stage1_update", ["delta"], "ones", "sum"),
    # every head kept, sent down
    ("fedloe", LOE_1, "head_update", ["W", "b"], "ones", "individual"),
    ("fedloe", LOE_1, "tuning_predictions", ["Y"], "ones", "individual"),       # φ fitted on each ŷ
    # line 10: mean Δ_i
    ("perinvfl", ["--R", "2", "--S", "2"], "client_update", ["delta"], "ones", "sum"),
    ("fedipg", ["--exit", "auto", "--exit-warmup", "1"], "risk_gradient", ["g"], "ones",
     "individual"),
    ("fedipg", [], "client_update", ["delta"], "ones", "sum"),            # Eq. 3: Σ n_i Δ_i / Σ n_i
]


def setting(method, flags):
    """(module, args, federation, model, state, ctx) of `method` on the synthetic data, 3 clients,
    all sampled."""
    import data
    mod = importlib.import_module(method)
    argv = ["--dataset", "synthetic", "--clients", "3", "--test-domain", "0"] + \
        ([] if method == "fedloe" else ["--sample", "3"]) + flags + ["--out", "r.json"]
    args = harness.resolve(mod.METHOD, argv)
    ds = data.load(args.dataset, None, args.seed, clients=args.clients)
    common.after_load(args, ds)
    fed = data.federate(ds, 0, args.clients, args.seed, torch.device("cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        model, state, ctx = runner.start_domain(args, ds, fed, getattr(mod, "init_state", None))
    return mod, args, fed, model, state, ctx


def one_round(mod, args, fed, model, state, ctx, t, engine):
    """The method's round t from (model, state) with `engine` for on_clients: (its model, its
    state)."""
    import copy
    import dataclasses
    model, state = copy.deepcopy(model), copy.deepcopy(state)
    drawn, rng = ctx.sampler.get_state(), torch.get_rng_state()
    ctx = dataclasses.replace(ctx, engine=engine, clients=state.setdefault("clients", {}))
    with contextlib.redirect_stdout(io.StringIO()):
        getattr(mod, f"{mod.__name__}_round")(t, model, fed, args, state, ctx)
    ctx.sampler.set_state(drawn)
    torch.set_rng_state(rng)
    return model, state


def numbers_of(model, state):
    """Every number the round left, flat: (the model's parameters, the state's: tensors, floats,
    lists)."""
    def walk(x):
        if torch.is_tensor(x):
            return [x.detach().double().flatten()] if x.is_floating_point() else []
        if isinstance(x, float):
            return [torch.tensor([x], dtype=torch.float64)]
        if isinstance(x, dict):
            return [v for k in sorted(x, key=str) if not str(k).startswith("_") for v in walk(x[k])]
        return [v for y in x for v in walk(y)] if isinstance(x, (list, tuple)) else []
    kept = walk({k: v for k, v in state.items() if k != "clients"})
    return torch.cat(walk(dict(model.state_dict()))), torch.cat(kept) if kept else torch.zeros(0)


@pytest.mark.parametrize("method,flags,exchange,keys,weights,needs", SHOWN,
                         ids=[f"{m}-{e}" for m, _, e, *_ in SHOWN])
def test_what_the_server_needs_of_each_exchange(method, flags, exchange, keys, weights, needs):
    """docs/flower.md's table, row by row: the method's own round, its replies replaced by others
    with the same weighted sums Σ_c w_c r_c of `keys` (client 0's + ε/w_0, client 1's − ε/w_1).
    Where the table says "sum", the round ends with the same model and state (float32 rounding:
    below 2e-5 of the round's step, 10x the largest seen, 1.8e-6); where it says "individual", they
    differ (by 1e-2 at least; the least seen, 0.07)."""
    import common
    mod, args, fed, model, state, ctx = setting(method, flags)
    t = args.stage1_comms + 1 if method == "fedloe" and exchange != "stage1_update" else 1
    seen = {}

    def record(fn, S, sents, t, phase, ctx):               # (FedIPG's warm-up: rounds -1, ...)
        seen[t, phase] = (list(S), common.one_by_one(fn, S, sents, t, phase, ctx))
        return seen[t, phase][1]
    before = one_round(mod, args, fed, model, state, ctx, t, record)
    swap = max(k for k in seen if k[1] == exchange) if any(k[1] == exchange for k in seen) else None
    assert swap is not None, sorted(seen)
    S, replies = seen[swap]
    w = [float(fed.clients[c].n) if weights == "n" else 1.0 for c in S]
    swapped = [dict(r) for r in replies]
    for k in keys:                        # ε: 4 times the two replies' difference: they conflict
        eps = 4 * min(w) * (replies[0][k].double() - replies[1][k].double())
        swapped[0][k] = (replies[0][k].double() + eps / w[0]).to(replies[0][k].dtype)
        swapped[1][k] = (replies[1][k].double() - eps / w[1]).to(replies[1][k].dtype)
    def replay(fn, S, sents, t, phase, ctx):      # the recorded replies, where the clients are
        if (t, phase) == swap:                    # the same (else, as FedIPG's exits changed
            return swapped                        # them: the clients' own work again)
        S_was, replies_was = seen.get((t, phase), (None, None))
        return replies_was if S_was == list(S) else common.one_by_one(fn, S, sents, t, phase, ctx)
    after = one_round(mod, args, fed, model, state, ctx, t, replay)
    (a, sa), (b, sb), (a0, _) = numbers_of(*before), numbers_of(*after), numbers_of(model, state)
    gaps = [((a - b).abs().max() / (a - a0).abs().max()).item()]      # against the round's own step
    if len(sa):                                                           # the server's quantities
        gaps.append(((sa - sb).abs() / sa.abs().clamp(min=sa.abs().max() * 1e-3)).max().item())
    gap = max(gaps)
    assert (gap < 2e-5) if needs == "sum" else (gap > 1e-2), gap


# ----------------------------------------------------- the proxy's configuration (flower/proxy.py)

def test_the_proxy_forwards_exactly_the_fleet_api_of_the_installed_flower():
    """proxy.FLEET is every route of flwr's Fleet router, and nothing else: a Flower that adds a
    Fleet route (the nodes would be cut off) or moves one fails here first."""
    import proxy
    from flwr.superlink.routers.fleet.router import router
    assert sorted(f"/v1/fleet/{r}" for r in proxy.FLEET) == sorted(
        route.path for route in router.routes)
    assert all(route.methods == {"POST"} for route in router.routes)


@pytest.mark.parametrize("argv,expect", [
    (["--listen", "example.org:443"], "argument --listen: expects IP:PORT, got 'example.org:443'"),
    (["--listen", "0.0.0.0:70000"], "argument --listen: the port must be in 1..65535, got 70000"),
    (["--superlink-port", "0"], "argument --superlink-port: must be in 1..65535, got 0"),
    (["--max-body", "8m; allow all"], "--max-body '8m; allow all': give a size as nginx writes"),
    (["--workdir", "missing"], "--workdir missing is not a folder"),
    (["--certs", "nothing"], "--certs nothing lacks server.crt, server.key, ca.crt"),
    (["--certs", "c;d"], "nginx would not read it as one path"),
])
def test_proxy_refuses_bad_input_in_one_line(argv, expect, tmp_path):
    """Every flag checked before a line of configuration is written: one line, exit 2."""
    import credentials
    credentials.make(tmp_path / "certs", ["127.0.0.1"], 1)
    shutil.copytree(tmp_path / "certs", tmp_path / "c;d")
    (tmp_path / "work").mkdir()
    given = dict(zip(argv[::2], argv[1::2]))
    base = {"--certs": "certs", "--listen": "127.0.0.1:9092", "--superlink-port": "9091",
            "--workdir": "work", **given}
    r = subprocess.run([sys.executable, str(HERE / "proxy.py"), *[x for kv in base.items()
                                                                   for x in kv]],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("proxy.py: error: ") and expect in lines[0]


def test_the_proxy_configuration_names_the_routes_and_refuses_the_rest(tmp_path):
    import proxy
    text = proxy.config("0.0.0.0:9092", 9091, tmp_path, tmp_path)
    routes = re.search(r'"~\^/v1/fleet/\((.*)\)\$" 1;', text)[1].split("|")
    assert routes == list(proxy.FLEET)
    assert "map $request_uri $fleet_route" in text and "return 403;" in text
    assert "listen 0.0.0.0:9092 ssl;" in text and "proxy_pass https://127.0.0.1:9091;" in text
    assert "proxy_ssl_verify on;" in text and "client_max_body_size 8m;" in text


# ------------------------------------------- a node's own folder: what it refuses, what it costs

@pytest.mark.parametrize("spoil,what", [
    (lambda f: shutil.rmtree(f), "not found (node config data)"),
    (lambda f: (shutil.rmtree(f), f.mkdir()), "holds no site.json: the synthetic data reach a "
                                              "node as an export"),
    (lambda f: (f / "data.pt").write_bytes(b"0" * 10), "data.pt is not the file site.json names"),
    (lambda f: (f / "site.json").write_text((f / "site.json").read_text().replace(
        '"seed": 0', '"seed": 7')), "another run's export: --seed 7 there, 0 here"),
])
@pytest.mark.parametrize("when", ["at connection", "in round 2"])
def test_a_node_with_a_bad_folder_ends_the_run_naming_it(spoil, what, when, tmp_path, capsys,
                                                         monkeypatch):
    """A node whose folder is missing, empty, changed since the export or another run's refuses in
    one line naming its folder: at connection (its report) or when its folder goes bad during the
    run (its reply in round 2); the run ends in one line naming the node and its partition, as a
    bad reply does, and the last good checkpoint (round 1's) stays at <out>.ckpt."""
    argv, out = ARGV["fedavg"] + ["--sample", "3"], tmp_path / "flower.json"
    grid = grid_of("fedavg", argv, tmp_path)
    node, context = next((i, c) for i, c in grid.contexts.items()
                         if c.node_config["partition-id"] == 1)
    folder = Path(context.node_config["data"])
    if when == "at connection":
        spoil(folder)
    else:
        monkeypatch.setattr(fl_adapter, "_NODES", {})                  # a process per message
        real = fl_adapter.node_for

        def node_for(req, context):          # its folder goes bad before its work of round 2
            if context.node_config["partition-id"] == 1 and req["round"] == 2 and \
                    (folder / "site.json").exists():
                spoil(folder)
            fl_adapter._NODES.clear()                   # (a process a message, as on Flower)
            return real(req, context)
        monkeypatch.setattr(fl_adapter, "node_for", node_for)
    capsys.readouterr()
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", argv + ["--out", str(out)])
    line = str(e.value)
    assert capsys.readouterr().err.strip().splitlines() == [line]
    where = "a bad reply from" if when == "at connection" else "a bad reply in round 2 from"
    assert line.startswith(f"fedavg.py: error: {where} node {node} (partition 1): node folder "
                           f"{folder}: {what}"), line
    if when == "in round 2":
        kept = torch.load(f"{out}.ckpt", weights_only=True)
        assert kept["round"] == 1 and line.endswith(f"the last good checkpoint ({out}.ckpt) is "
                                                    "kept")
    else:
        assert line.endswith("nothing of this run was saved") and not Path(f"{out}.ckpt").exists()


def test_an_evaluation_node_that_never_connects_is_waited_for_then_named(tmp_path, capsys):
    """The server waits `wait` seconds for a node of every site, then says in one line which sites
    no node holds (here the held-out domain's evaluation site), nothing of the run saved."""
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path)
    del grid.contexts[next(i for i, c in grid.contexts.items()
                           if c.node_config["evaluate-only"])]
    start = time.time()
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + ["--out", str(tmp_path / "r.json")],
                         wait=2)
    assert 2 <= time.time() - start < 30
    assert str(e.value) == ("fedavg.py: error: 3 node(s) connected within 2 s, and none holds "
                            "evaluation site(s) 3 (evaluate-only=true: the held-out domain): "
                            "start one node per site (node config partition-id, data)")
    assert capsys.readouterr().err.strip().splitlines() == [str(e.value)]


class SilentGrid(fake_grid.FakeGrid):
    """FakeGrid with one more connected node, `silent`, that never answers a message (a registered
    device of no site, or one stuck): its messages stay unanswered."""

    silent = 99

    def get_node_ids(self):
        return [self.silent, *self.contexts]

    def push_messages(self, messages):
        messages = list(messages)
        mine = [m for m in messages if m.metadata.dst_node_id == self.silent]
        for m in mine:
            m.metadata.__dict__["_message_id"] = f"unanswered-{id(m)}"
        ids = iter(super().push_messages([m for m in messages if m not in mine]))
        return [m.metadata.message_id if m in mine else next(ids) for m in messages]


def test_a_node_that_never_answers_holds_no_site_and_stops_nothing(tmp_path, capsys):
    """A connected node that never answers its query.hello: the run goes on with the sites' nodes
    and ends with the method file's model (before, the server waited for its answer for ever),
    after waiting for its report as long as the nodes may take to connect (`wait`, 3 s here, at
    most HELLO_GRACE); with an evaluation site missing too, the one line counts it apart from the
    nodes that answered."""
    own = tmp_path / "own.json"
    fedavg.main(ARGV["fedavg"] + ["--out", str(own)])
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path, kind=SilentGrid)
    out = tmp_path / "r.json"
    start = time.time()
    fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + ["--out", str(out)], wait=3)
    assert time.time() - start < 3 + 15                             # (not HELLO_GRACE's 30 s)
    fl, mine = (torch.load(f"{f}.ckpt", weights_only=True)["model"] for f in (out, own))
    assert all(torch.equal(v, fl[k]) for k, v in mine.items())
    del grid.contexts[next(i for i, c in grid.contexts.items()
                           if c.node_config["evaluate-only"])]
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + ["--out", str(tmp_path / "b.json")],
                         wait=2)
    assert str(e.value).startswith("fedavg.py: error: 3 node(s) connected within 2 s (1 more "
                                   "never answered), and none holds evaluation site(s) 3"), e.value


def test_a_node_whose_role_or_data_is_not_its_sites_is_named(tmp_path, capsys):
    """A training site's node configured evaluate-only (its folder says otherwise: it refuses), an
    evaluation-only node claiming a training site, a node of another dataset: named at connection
    with its partition."""
    grid = grid_of("fedavg", ARGV["fedavg"], tmp_path)
    first = next(i for i, c in grid.contexts.items() if c.node_config["partition-id"] == 0)
    grid.contexts[first].node_config["evaluate-only"] = True
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", ARGV["fedavg"] + ["--out", str(tmp_path / "r.json")])
    assert f"from node {first} (partition 0): node folder " in str(e.value) and str(
        e.value).endswith("holds a training site and its node config says evaluate-only=true; "
                          "stopped; nothing of this run was saved")


@pytest.mark.parametrize("method,argv", [
    ("fedavg", ["--dataset", "rcmnist", "--rounds", "2", "--eval-every", "1"]),   # fixed clients
    ("perinvfl", ["--dataset", "rcmnist", "--rounds", "2", "--eval-every", "1"]),
])
def test_fixed_clients_on_flower_keep_their_test_sets_and_equal_the_method_file(method, argv,
                                                                                tmp_path):
    """Fixed clients (RC-MNIST): no evaluation site, each client's own test set in its own folder,
    scored there (PerInvFL: by its θ_i, which never leaves the node): the method file's run bit
    for bit, per-client test accuracies included."""
    (own, own_ckpt), (fl, fl_ckpt), grid = run_both(method, tmp_path, argv)
    assert len(grid.contexts) == 4 and not any(c.node_config["evaluate-only"]
                                               for c in grid.contexts.values())
    assert all(torch.equal(v, fl_ckpt["model"][k]) for k, v in own_ckpt["model"].items())
    assert history(own) == history(fl)
    assert own["domains"]["clients"]["per_client_test_acc"] == \
        fl["domains"]["clients"]["per_client_test_acc"]


def test_the_photos_on_flower_equal_the_method_file(tmp_path):
    """A photo dataset (a fake PACS: random images, as harness.datasets --make-fake writes them)
    exported as image files, each node decoding its own (cached in its folder), the server reading
    none of them nor the dataset: the method file's run bit for bit (FedIIR, its ResNet-18 from
    random weights, augmentation from each client's stream)."""
    from harness import datasets
    root = tmp_path / "data"
    with contextlib.redirect_stdout(io.StringIO()):
        datasets.make_fake("pacs", root, 2)
    argv = ["--dataset", "pacs", "--data-root", str(root), "--clients", "3", "--rounds", "1",
            "--test-domain", "sketch", "--no-pretrained", "--batch-size", "4", "--model",
            "resnet18"]
    fediir = importlib.import_module("fediir")
    fediir.main(argv + ["--out", str(tmp_path / "own.json")])
    grid = grid_of("fediir", argv, tmp_path)
    served = argv[:2] + argv[4:]                        # (no --data-root: the server reads none)
    with each_reads_its_own(grid, tmp_path, [root]):
        fl_adapter.serve(grid, "fediir", served + ["--out", str(tmp_path / "flower.json")])
    with pytest.raises(fl_adapter.RunFailed, match="--data-root: on Flower the server reads no"):
        fl_adapter.serve(grid, "fediir", argv + ["--out", str(tmp_path / "again.json")])
    own, fl = (torch.load(tmp_path / f"{k}.json.ckpt", weights_only=True)["model"]
               for k in ("own", "flower"))
    assert all(torch.equal(v, fl[k]) for k, v in own.items())
    assert all((Path(c.node_config["data"]) / ".cache-224.pt").exists()
               for c in grid.contexts.values())


def test_the_audit_refuses_a_read_of_another_sites_folder(tmp_path):
    """The check of each_reads_its_own can fail: a node reading another site's file, or the server
    reading a site's or the dataset's, is refused (PermissionError) and logged."""
    a, b = tmp_path / "sites" / "site-0", tmp_path / "sites" / "site-1"
    for f in (a, b):
        f.mkdir(parents=True)
        (f / "site.json").write_text("{}")
    log = tmp_path / "reads.log"
    deny = [str(tmp_path / "sites"), str(data.EMBEDDED)]
    with audit.watching({"*": ([], deny), str(a): ([str(a)], deny)}, log):
        with audit.acting(str(a)):
            assert (a / "site.json").read_text() == "{}"
            with pytest.raises(PermissionError):
                (b / "site.json").read_text()
        with pytest.raises(PermissionError):
            os.listdir(a)
        with pytest.raises(PermissionError):
            data.mnist_arrays()                                   # the embedded digits
    refused = audit.refusals(log)
    assert len(refused) == 3 and f"{a} open {b / 'site.json'}" in refused[0]
    assert "* os.listdir" in refused[1] and str(data.EMBEDDED) in refused[2]


def test_every_run_local_line_of_the_docs_runs_as_written(tmp_path, monkeypatch):
    """Each `python flower/run_local.py` command of docs/flower.md's code blocks, its continuation
    lines joined, passes run_local.py's checks as written (what it refuses, it refuses before
    anything starts), and the commands of one block, run in order, write to different --out (a
    second line would otherwise be refused by the first's complete result)."""
    import run_local
    import shlex
    page = (HERE.parent / "docs" / "flower.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    monkeypatch.chdir(tmp_path)
    seen = 0
    for block in blocks:
        lines = block.replace("\\\n", " ").splitlines()
        commands = [shlex.split(line.split("#")[0])[2:] for line in lines
                    if line.startswith("python flower/run_local.py")]
        outs = [run_local.parse(argv).out for argv in commands]
        assert len(set(outs)) == len(outs), outs
        for argv in commands:
            with contextlib.redirect_stdout(io.StringIO()):
                assert run_local.check(run_local.parse(argv)) is not None, argv
            seen += 1
    assert seen >= 6


# ----------------------------------------------------- every reply is its node's (signing.py)

def forged(app, how, certs, kept):
    """The ClientApp `app` as the nodes' grid runs it, but the reply to partition 0's round-2
    update is not its own: another registered device's in its name ("another key": signed with
    partition 1's key), an unsigned one ("unsigned"), its own with a value changed after signing
    ("altered"), or its own signed reply of round 1 replayed ("replayed"); every other reply as
    it was. kept: the replies of partition 0 so far."""
    import signing

    def answer(msg, context):
        reply = app(msg, context)
        if context.node_config["partition-id"] != 0 or msg.metadata.message_type != "train.client":
            return reply
        r = fl_adapter.unpack(reply.content)
        kept.append(reply)
        if r.get("_round") != 2 or "delta" not in r:
            return reply
        bad = dict(r, delta=r["delta"] * 0.5)
        bad.pop(signing.RECORD, None)
        content = fl_adapter.pack(bad)
        if how == "another key":
            key = signing.private_key(certs / "node-1")
            signing.sign(content, key, 1, 2, r["_phase"], msg.metadata.message_id, 0)
        elif how == "altered":
            content[signing.RECORD] = reply.content[signing.RECORD]
        elif how == "replayed":
            return flwr_message(kept[0].content, msg)
        return flwr_message(content, msg)
    return answer


def flwr_message(content, msg):
    from flwr.app import Message
    return Message(content, reply_to=msg)


@pytest.mark.parametrize("how,why", [
    ("another key", "its signature is not site 0's key's over it"),
    ("unsigned", "it is not signed"),
    ("altered", "its signature is not site 0's key's over it"),
    ("replayed", "its signature is not site 0's key's over it"),
])
def test_a_reply_in_another_nodes_name_is_refused_never_blaming_that_node(how, why, tmp_path,
                                                                          capsys):
    """With `keys`, every reply must carry its site's signature over the run, the round, the
    exchange, the message it answers and its content (flower/signing.py), checked before anything
    else: a reply in partition 0's name that another device signed, an unsigned one, one changed
    after signing, one replayed from an earlier round: the run ends in one line saying that the
    reply in that node's name failed its signature (never that the node sent a bad reply), nothing
    of it used: the checkpoint of round 1 kept."""
    argv, out = ARGV["fedavg"] + ["--sample", "3"], tmp_path / "flower.json"
    grid = grid_of("fedavg", argv, tmp_path)
    certs = signed(grid, tmp_path / "certs")
    grid.app = forged(grid.app, how, certs, [])
    node = next(i for i, c in grid.contexts.items() if c.node_config["partition-id"] == 0)
    capsys.readouterr()
    with pytest.raises(fl_adapter.RunFailed) as e:
        fl_adapter.serve(grid, "fedavg", argv + ["--out", str(out)], keys=certs)
    assert str(e.value) == (f"fedavg.py: error: a reply in round 2 in the name of node {node} "
                            f"(partition 0) failed its signature: {why}; nothing of it was used "
                            f"(another registered device may have pushed it in that node's "
                            f"name: the SuperLink does not check a reply's source); stopped; "
                            f"the last good checkpoint ({out}.ckpt) is kept")
    assert torch.load(f"{out}.ckpt", weights_only=True)["round"] == 1


NODE_COST_BAD = [
    (["--data-root", "nowhere"], "--data-root nowhere holds no MNIST/raw/train-images-idx3-ubyte"),
    (["--before", "."], "--before . is no checkout of this project"),
    (["--data", "full"], "--data full needs --data-root"),
    (["--rounds", "1"], "--rounds must be at least 2, got 1"),
    (["--repeat", "0"], "--repeat must be positive, got 0"),
    (["--out", "taken.json"], "--out taken.json exists"),
    (["--only", "cpu"], "argument --only: invalid choice: 'cpu'"),
]


@pytest.mark.parametrize("argv,line", NODE_COST_BAD)
def test_node_cost_refuses_bad_input_in_one_line(argv, line, tmp_path, capsys):
    """flower/node_cost.py's bad input: one line naming it, exit 2, before anything is measured
    (nothing started, nothing written)."""
    import node_cost
    (tmp_path / "taken.json").write_text("a user's file\n")
    before = sorted(tmp_path.iterdir())
    start = time.time()
    with pytest.raises(SystemExit) as e:
        node_cost.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and line in err[0], err
    assert err[0].startswith("node_cost.py: error: ") and time.time() - start < 10
    assert sorted(tmp_path.iterdir()) == before


def test_overhead_measures_and_both_runs_end_equal(capsys):
    """flower/overhead.py, as docs/flower.md runs it (here one method, 2 rounds): the method file's
    own run and the run through the fake grid, bytes per round counted, the two models equal."""
    import overhead
    overhead.main(["--methods", "fedavg", "--rounds", "2"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(figures) == ["fedavg"] and figures["fedavg"]["equal"] is True
    assert 0 < figures["fedavg"]["up"] < figures["fedavg"]["down"]


@pytest.mark.parametrize("argv,line", [(["--rounds", "1"], "--rounds at least 2"),
                                       (["--methods", "fedx"], "invalid choice: 'fedx'"),
                                       (["--secagg-clip", "-1"], "--secagg-clip must be a "
                                        "positive number, got -1.0")])
def test_overhead_refuses_bad_input_in_one_line(argv, line, capsys):
    import overhead
    with pytest.raises(SystemExit) as e:
        overhead.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("overhead.py: error: ")
    assert line in err[0], err
