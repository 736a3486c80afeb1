"""The Flower App (docs/flower.md): every method through Flower's message round trip equals the method
file's own run, bit for bit; run_local.py's real processes (FLOWER_DEPLOY=1) and its bad input."""
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="flwr not installed: pip install -r flower/requirements.txt")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import fake_grid  # noqa: E402
import fl_adapter  # noqa: E402
import fl_methods  # noqa: E402

# Tiny runs: the synthetic dataset (720 images, 3 domains), 2 rounds, evaluated after each; 3 clients
# of which 2 take part per round where the method samples, so that the sampling, the order of the
# replies and the chained minibatch stream all matter.
BASE = ["--dataset", "synthetic", "--rounds", "2", "--eval-every", "1", "--test-domain", "0"]
ARGV = {
    "fedavg": BASE + ["--clients", "3", "--sample", "2"],
    "fediir": BASE + ["--clients", "3", "--sample", "2"],
    "fedomg": BASE + ["--clients", "3", "--sample", "2"],   # momentum 0.9: kept in each node's state
}


def run_both(method, tmp_path, argv=None):
    """The method file's own run and the same run through the fake grid: (results, checkpoint) each."""
    argv = argv or ARGV[method]
    mod = importlib.import_module(method)
    mod.main(argv + ["--out", str(tmp_path / "own.json")])
    n = int(argv[argv.index("--clients") + 1])
    grid = fake_grid.FakeGrid(fl_adapter.client_app(fl_methods.HANDLERS), n)
    fl_adapter.serve(grid, method, argv + ["--out", str(tmp_path / "flower.json")], fl_methods.ROUNDS[method])
    load = lambda name: (json.loads((tmp_path / f"{name}.json").read_text()),
                         torch.load(tmp_path / f"{name}.ckpt", weights_only=True))
    return load("own"), load("flower")


def history(res):
    return [{k: v for k, v in row.items() if k != "seconds"} for d in res["domains"].values() for row in d["history"]]


@pytest.mark.parametrize("method", list(ARGV))
def test_flower_equals_the_method_file(method, tmp_path):
    """torch.equal: the same operations in the same order (the method's client functions on the node,
    its server functions on the server, the minibatch stream handed from node to node)."""
    (own, own_ckpt), (fl, fl_ckpt) = run_both(method, tmp_path)
    for k, v in own_ckpt["model"].items():
        assert torch.equal(v, fl_ckpt["model"][k]), f"{method}: {k} differs"
    assert history(own) == history(fl)
    assert own_ckpt["gen"].equal(fl_ckpt["gen"]) and own_ckpt["sampler"].equal(fl_ckpt["sampler"])
