"""The numbers of fixed 2-round runs, as digests: each method and its main variants on the embedded
digits (RotatedMNIST, the small ConvNet) and on the synthetic dataset, through the method scripts'
command lines. A change that must not move the numbers prints the same lines before and after, on
the same machine.

    python benchmark/bit_identity.py > before.txt    # ... change ... (or: fediir fedloe ...)
    python benchmark/bit_identity.py > after.txt && diff before.txt after.txt

Each line: the run, a digest of its results (accuracies, losses, best rounds; not the seconds, the
arguments or the provenance) and a digest of its checkpoint's model and method state.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ["--model", "smallconv", "--test-domain", "30"]
SMALL_LOE = ["--stage1-epochs", "1", "--stage1-comms", "1", "--stage2-epochs", "1",
             "--stage2-comms", "1"]
RUNS = [(method, flags) for method, variants in [
    ("fedavg", [[], ["--uniform-avg"], ["--parallel-clients", "on"]]),
    ("fediir", [[], ["--gamma", "0"], ["--parallel-clients", "on"], ["--clients", "10"]]),
    ("fedomg", [[], ["--kappa", "0"], ["--parallel-clients", "on"]]),
    ("fedloe", [SMALL_LOE, SMALL_LOE + ["--dg", "rex"], SMALL_LOE + ["--dg", "fish"]]),
    ("perinvfl", [[], ["--R", "1"], ["--R", "1", "--parallel-clients", "on"]]),
    ("fedipg", [[], ["--local-step", "paper"], ["--exit", "auto", "--exit-warmup", "1"],
                ["--parallel-clients", "on"]]),
] for flags in variants]


def digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tensors(obj, name=""):
    import torch
    if torch.is_tensor(obj):
        yield name, obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from tensors(obj[k], f"{name}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{name}/{i}")


def one(run):
    dataset, method, flags = run
    argv = ["--dataset", dataset, "--rounds", "2", "--eval-every", "1", "--device", "cpu",
            *(DIGITS if dataset == "rmnist" else []), *flags]
    if method == "fedloe":              # its rounds follow from its stages; 20 clients by default
        argv.remove("--rounds"), argv.remove("2")
        argv += ["--clients", "4", "--batch-size", "32"] if dataset == "synthetic" else []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        p = subprocess.run([sys.executable, f"{method}.py", *argv, "--out", out], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        name = f"{method} {' '.join(argv)}"
        if p.returncode:
            return f"{name}  FAILED {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
        import torch
        res = json.load(open(out))
        keep = {d: {k: ([{j: w for j, w in row.items() if j != "seconds"} for row in v]
                        if k == "history" else v) for k, v in r.items()}
                for d, r in res["domains"].items()}
        blob = torch.load(out + ".ckpt", map_location="cpu", weights_only=True)
        h = hashlib.sha256()
        for k, t in tensors({"model": blob["model"], "state": blob["state"]}):
            h.update(k.encode() + t.contiguous().numpy().tobytes())
        return f"{name}  results {digest([keep, res['mean_test_acc']])}  model {h.hexdigest()[:16]}"


if __name__ == "__main__":
    runs = [(d, m, f) for d in ("rmnist", "synthetic") for m, f in RUNS
            if m in sys.argv[1:] or len(sys.argv) == 1]
    with ThreadPoolExecutor(int(os.environ.get("JOBS", "2"))) as pool:
        for line in pool.map(one, runs):
            print(line, flush=True)
