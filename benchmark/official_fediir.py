"""The official FedIIR code, from a local clone, on this project's RotatedMNIST-50 protocol.

Its result is written as this project's results JSON (docs/results-format.md), beside the project's
own runs, so that benchmark/report.py and benchmark/leaderboard.py read it as they read those.

The official code: github.com/YamingGuo98/FedIIR (Guo et al., ICML 2023), a small fork of DomainBed,
pinned at COMMIT below (2023-10-31, "Update the FedIIR", its newest). This script never copies nor
edits that code: it runs the clone's `main.py` as a subprocess, as its README says, and reads what
it writes. Its dependencies are torch, torchvision, numpy and Pillow (its requirements.txt pins
torch 1.10.0 / torchvision 0.11.1 for Python 3.8; it also runs under this project's torch 2.x);
`--python` names the interpreter that has them (default: the one running this script).

The protocol (the project's rmnist, 50 clients, 5 sampled; the paper's Table 3 settings) as
`main.py`'s arguments:

    --dataset RotatedMNIST        domains 0°, 15°, ..., 75° (its ENVIRONMENTS; index =
                                  --test-domain)
    --algorithm FedAvg | FedIIR
    --num_clients 50 --sample_num 5   (main.py forces 5 sampled for RotatedMNIST anyway)
    --global_rounds 100 --local_epochs 1 --checkpoint_freq 10 --holdout_fraction 0.1
    --seed S --trial_seed S       (seed: everything else; trial_seed: the split, DomainBed's names)
    --hparams '{"lr": 0.01, "batch_size": 64}'  FedIIR adds '"penalty": 0.01, "ema": 0.95'
                                  (γ, Table 3; EMA, Appendix C): the defaults of its
                                  hparams_registry.py, pinned
    --hparams_seed 0 --skip_model_save --data_dir DATA --output_dir <out>.official
    --train_index seedS
    --device_name cpu | cuda:0    (only with --device cpu/cuda, or auto under CUDA_VISIBLE_DEVICES;
                                  else main.py picks the GPU with the least memory used by
                                  nvidia-smi)

`main.py` has no test-domain argument: it holds out every domain in turn (0° first, 75° last), from
one random state seeded once. This script stops it (its process group) once the requested domain's
result row is written, so a 0° run trains one domain, not six, with the numbers the full run gives
for 0°; a 75° run trains all six.

What it writes, under <out>.official/RotatedMNIST/<algorithm>/: `seedS_stdout` (a table per held-out
domain: a row per evaluation, at the 0-based `epoch` e after that round's update, i.e. after
round e + 1: rounds 1, 11, ..., 91, 100; columns epoch, mem_gb, epoch_time (mean training seconds
per round since the last evaluation), loss, FedIIR's penalty, train_acc (the mean accuracy on the
10% held out of each training domain: the validation accuracy), and the test domain's accuracy),
then `best_train_acc:` / `best_test_acc:`; and `RotatedMNIST_<algorithm>_results.csv`, a row per
held-out domain (Test_env, Train_acc, Test_acc). Its model selection: the test accuracy at the
evaluation whose validation accuracy is strictly higher than every earlier one (the first of equal
maxima). `test_acc` here is that row's Test_acc; this script checks it against the table (the same
rule over the printed rows) and stops with an error if the two disagree. `history` is the table:
`round` = epoch + 1, `val_acc` = train_acc, `seconds` = cumulative training seconds (epoch_time ×
rounds; the official code does not time its evaluations), `loss` (and `penalty`). `train_examples`
counts the clients' training splits as main.py cuts them (each training domain less its int(0.1 n)
held out).

The subprocess's stdout and stderr go to <out>.log. The data: DATA/MNIST/raw holding the four
uncompressed MNIST files, as torchvision's MNIST reads them (`python -m harness.datasets --download
mnist --data-root DATA` lays them out so). `--loader-workers N` sets the official DataLoaders'
worker count (8 each, 56 loaders: 448 processes) before main.py runs; the data and selection are
unchanged, but each loader then draws its next shuffle from torch's generator at other moments, so
the numbers differ from the default's as another seed's would: for machines where 448 processes do
not fit.

    git clone https://github.com/YamingGuo98/FedIIR ../FedIIR && git -C ../FedIIR checkout COMMIT
    for a in FedAvg FedIIR; do for s in 0 1; do
      python benchmark/official_fediir.py --clone ../FedIIR --data-root data --algorithm $a \\
          --test-domain 0 --seed $s --out benchmark/results/official-fediir/${a,,}-seed$s.json
    done; done

Checked on 2026-11-23, pinned commit, 2-core CPU, one thread, Python 3.11 with torch 2.14.1 /
torchvision 0.29.1 / numpy 2.4.6: `--algorithm FedIIR --rounds 1 --device cpu --loader-workers 0`
ran main.py with the arguments above (its printed Args and HParams: lr 0.01, batch 64, penalty 0.01,
ema 0.95, sample_num 5), stopped it after the 0° domain, and wrote the JSON (154 s; one evaluation,
after round 1: validation 18.9%, test 16.1%; 52,503 training examples). The 100-round runs need a
GPU.
"""
import csv
import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
from data import UserError  # noqa: E402
from harness.config import finite, Parser, help_text  # noqa: E402

REPOSITORY = "https://github.com/YamingGuo98/FedIIR"
COMMIT = "3e7a785e30002ac75d9b3575e3e9062d8e22ea42"
ENTRY = "main.py"
DOMAINS = ["0", "15", "30", "45", "60", "75"]        # RotatedMNIST.ENVIRONMENTS, datasets.py
ALGORITHMS = ("FedAvg", "FedIIR")
SAMPLE = 5                                          # main.py: sample_num = 5 for RotatedMNIST
LR, BATCH, GAMMA, EMA = 1e-2, 64, 1e-2, 0.95        # Table 3 (RotatedMNIST); EMA: Appendix C
EVAL_EVERY, HOLDOUT = 10, 0.1                       # main.py's checkpoint_freq and holdout_fraction
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
POLL = 0.5                                          # seconds between looks at the official output
# run main.py with the DataLoaders' worker count set first (--loader-workers); argv[1] is the count
LAUNCHER = ("import runpy, sys; from domainbed import datasets; "
            "datasets.MultipleDomainDataset.N_WORKERS = int(sys.argv.pop(1)); "
            "sys.argv[0] = 'main.py'; runpy.run_path('main.py', run_name='__main__')")


class Failed(Exception):
    """The official run failed or its output cannot be read: one line on stderr, exit 1 (bad input:
    UserError, exit 2)."""


def parse(argv):
    p = Parser(prog="official_fediir.py", description=help_text(__doc__))
    p.add_argument("--clone", required=True, help=f"a local clone of {REPOSITORY} at {COMMIT[:7]}")
    p.add_argument("--data-root", required=True,
                   help="the folder holding MNIST/raw (torchvision's layout)")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--test-domain", default="0",
                   help="held-out angle: " + ", ".join(DOMAINS) + " (default 0)")
    p.add_argument("--clients", type=int, default=50,
                   help="clients in all (default 50; 5 sampled a round)")
    p.add_argument("--rounds", type=int, default=100, help="communication rounds (default 100)")
    p.add_argument("--gamma", type=finite, default=None,
                   help=f"FedIIR's penalty weight (default {GAMMA}, Table 3)")
    p.add_argument("--seed", type=int, default=0, help="the official --seed (default 0)")
    p.add_argument("--trial-seed", type=int, default=None,
                   help="the official --trial_seed (default: --seed)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: the official code's own choice (cuda:0 under CUDA_VISIBLE_DEVICES)")
    p.add_argument("--loader-workers", type=int, default=None,
                   help="the official DataLoaders' workers (default: its own 8; see the docstring)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter with the official code's dependencies (default: this one)")
    p.add_argument("--out", default=None,
                   help="results JSON (default results/official-<algorithm>-seed<S>.json)")
    a = p.parse_args(argv)
    a.trial_seed = a.seed if a.trial_seed is None else a.trial_seed
    a.out = a.out or f"results/official-{a.algorithm.lower()}-seed{a.seed}.json"
    return a


def check(a):
    """Every input problem as one UserError, before anything runs."""
    if a.test_domain not in DOMAINS:
        raise UserError(f"unknown --test-domain {a.test_domain!r}; "
                        f"choose from {', '.join(DOMAINS)}")
    if a.clients < SAMPLE:
        raise UserError(f"--clients must be at least {SAMPLE} "
                        f"(one per training domain, {SAMPLE} sampled a round), got {a.clients}")
    if a.rounds < 1:
        raise UserError(f"--rounds must be positive, got {a.rounds}")
    for flag, seed in (("--seed", a.seed), ("--trial-seed", a.trial_seed)):
        if not 0 <= seed < 2 ** 31:            # numpy's seeds are non-negative; the project's range
            raise UserError(f"{flag} must be in [0, 2**31), got {seed}")
    if a.gamma is not None and a.algorithm != "FedIIR":
        raise UserError("--gamma applies to --algorithm FedIIR only")
    if a.gamma is not None and a.gamma < 0:
        raise UserError(f"--gamma must be >= 0, got {a.gamma}")
    if a.loader_workers is not None and a.loader_workers < 0:
        raise UserError(f"--loader-workers must be >= 0, got {a.loader_workers}")
    if shutil.which(a.python) is None:
        raise UserError(f"--python {a.python} is not an executable")
    if not a.out.endswith(".json"):
        raise UserError(f"--out must end with .json, got {a.out}")
    clone = Path(a.clone)
    if not (clone / ENTRY).is_file() or not (clone / "domainbed").is_dir():
        raise UserError(f"--clone {a.clone}: no clone of the official FedIIR code there; "
                        f"get it with: git clone {REPOSITORY} {a.clone} "
                        f"&& git -C {a.clone} checkout {COMMIT}")
    a.images = mnist_count(Path(a.data_root))
    try:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write --out {a.out}: {e.strerror or e}")


def mnist_count(root):
    """The number of MNIST images under root/MNIST/raw (train + test), from the label files'
    headers."""
    raw = root / "MNIST" / "raw"
    missing = [f for f in MNIST_FILES if not (raw / f).is_file()]
    if missing:
        raise UserError(f"--data-root {root}: {raw} lacks {', '.join(missing)} "
                        f"(uncompressed, as torchvision's MNIST reads them: "
                        f"python -m harness.datasets --download mnist --data-root {root})")
    n = 0
    for f in ("train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"):
        magic, count = struct.unpack(">II", (raw / f).read_bytes()[:8])
        if magic != 2049:
            raise UserError(f"--data-root {root}: {raw / f} is not an MNIST label file")
        n += count
    return n


def commit_of(clone):
    """The clone's HEAD commit, or None where git cannot tell (not a git checkout, no git)."""
    try:
        r = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True,
                           text=True)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def device_name(a):
    """main.py's --device_name, or None to leave it its own choice."""
    if a.device == "cpu":
        return "cpu"
    if a.device == "cuda":
        return "cuda:0"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None                          # main.py: the free-est GPU by nvidia-smi, else the CPU
    # nvidia-smi's indices ignore the mask
    return "cpu" if visible.strip() in ("", "-1") else "cuda:0"


def hparams(a):
    h = {"lr": LR, "batch_size": BATCH}
    if a.algorithm == "FedIIR":
        h.update(penalty=GAMMA if a.gamma is None else a.gamma, ema=EMA)
    return h


def official_argv(a, output_dir):
    """main.py's arguments for the protocol (the module docstring lists them)."""
    argv = ["--dataset", "RotatedMNIST", "--algorithm", a.algorithm,
            "--data_dir", str(Path(a.data_root).resolve()), "--output_dir", str(output_dir),
            "--train_index", f"seed{a.seed}", "--num_clients", str(a.clients),
            "--sample_num", str(SAMPLE), "--global_rounds", str(a.rounds), "--local_epochs", "1",
            "--checkpoint_freq", str(EVAL_EVERY), "--holdout_fraction", str(HOLDOUT),
            "--seed", str(a.seed), "--trial_seed", str(a.trial_seed),
            "--hparams_seed", "0", "--hparams", json.dumps(hparams(a)), "--skip_model_save"]
    dev = device_name(a)
    return argv + (["--device_name", dev] if dev else [])


def command(a, output_dir):
    head = [a.python, "-u", ENTRY] if a.loader_workers is None else \
        [a.python, "-u", "-c", LAUNCHER, str(a.loader_workers)]
    return head + official_argv(a, output_dir)


def result_rows(csv_path, domain, seed):
    """The official results CSV's rows for one held-out domain and seed (it appends a row per
    domain)."""
    try:
        with open(csv_path, newline="") as f:
            return [r for r in csv.DictReader(f)
                    if r.get("Test_env") == domain and r.get("Seed") == str(seed)]
    except OSError:
        return []


def stop(proc):
    """End the official run's process group (main.py and its DataLoader workers)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def train(a, cmd, files, log):
    """Run main.py until the requested domain's result row is written; the wall-clock seconds."""
    start = time.monotonic()
    with open(log, "w") as f:
        f.write("$ (cd " + shlex.quote(str(Path(a.clone).resolve())) + " && " + shlex.join(cmd)
                + ")\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=a.clone, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while not result_rows(files["csv"], a.test_domain, a.seed):
                if proc.poll() is not None:
                    if result_rows(files["csv"], a.test_domain, a.seed):
                        break
                    raise Failed(f"the official run exited with {proc.returncode} "
                                 f"before test domain {a.test_domain} was done; see {log}")
                time.sleep(POLL)
        finally:
            stop(proc)
    return time.monotonic() - start


def number(text):
    try:
        return float(text)
    except ValueError:
        raise Failed(f"cannot read the official output: {text!r} is not a number") from None


def read_section(stdout_path, index):
    """The official stdout's part for the index-th held-out domain: (device, [rows as dicts])."""
    try:
        lines = Path(stdout_path).read_text().splitlines()
    except OSError as e:
        raise Failed(f"cannot read the official output {stdout_path}: {e.strerror or e}")
    section, device, header, rows = 0, None, None, []
    for line in lines:
        if line.startswith("best_test_acc:"):
            section += 1
            continue
        if section != index:
            continue
        tokens = line.split()
        if line.startswith("\tdevice:"):
            device = tokens[1]
        elif tokens[:1] == ["epoch"] and "train_acc" in tokens:
            header = tokens
        elif header and len(tokens) == len(header) and tokens[0].isdigit():
            rows.append(dict(zip(header, tokens)))
    if not rows:
        raise Failed(f"no evaluation rows for test domain {DOMAINS[index]} in {stdout_path}")
    return device, rows


def history(rows, domain):
    """The project's history rows from the official table (round = epoch + 1; cumulative training
    seconds)."""
    out, seconds, last = [], 0.0, 0
    for r in rows:
        rnd = int(r["epoch"]) + 1
        seconds += number(r["epoch_time"]) * (rnd - last)
        last = rnd
        row = {"round": rnd, "val_acc": number(r["train_acc"]), "test_acc": number(r[domain]),
               "loss": number(r["loss"]), "seconds": seconds}
        if "penalty" in r:
            row["penalty"] = number(r["penalty"])
        out.append(row)
    return out


def select(hist):
    """The official rule: the first evaluation whose validation accuracy beats every earlier
    one's."""
    best = hist[0]
    for row in hist[1:]:
        if row["val_acc"] > best["val_acc"]:
            best = row
    return best


def train_examples(images, test):
    """The clients' training examples: every training domain (images[i::6]) less its int(0.1 n)
    held out."""
    sizes = [len(range(i, images, len(DOMAINS))) for i in range(len(DOMAINS)) if i != test]
    return sum(n - int(n * HOLDOUT) for n in sizes)


def results(a, cmd, files, commit, wall):
    index = DOMAINS.index(a.test_domain)
    device, rows = read_section(files["stdout"], index)
    hist = history(rows, a.test_domain)
    best = select(hist)
    row = result_rows(files["csv"], a.test_domain, a.seed)[-1]
    test_acc, val_acc = number(row["Test_acc"]), number(row["Train_acc"])
    if abs(test_acc - best["test_acc"]) > 1e-9 or abs(val_acc - best["val_acc"]) > 1e-9:
        raise Failed(f"the official output disagrees with itself: {files['csv']} gives test "
                     f"{test_acc} at validation {val_acc}, its table selects {best['test_acc']} "
                     f"at {best['val_acc']}")
    args = {"dataset": "rmnist", "data_root": a.data_root, "test_domain": a.test_domain,
            "clients": a.clients, "sample": SAMPLE, "rounds": a.rounds, "local_epochs": 1,
            "batch_size": BATCH, "lr": LR,
            "momentum": 0.9, "weight_decay": 0.0, **({"gamma": hparams(a)["penalty"], "ema": EMA}
                                                     if a.algorithm == "FedIIR" else {}),
            "eval_every": EVAL_EVERY, "select": "val", "seed": a.seed, "trial_seed": a.trial_seed,
            "device": "cuda" if (device or "").startswith("cuda") else "cpu", "device_name": device,
            "loader_workers": a.loader_workers, "algorithm": a.algorithm, "repository": REPOSITORY,
            "commit": commit, "command": shlex.join(cmd), "wall_seconds": round(wall, 1),
            "out": a.out}
    domain = {"test_acc": test_acc, "val_acc": val_acc, "best_round": best["round"],
              "last_test_acc": hist[-1]["test_acc"],
              "train_examples": train_examples(a.images, index),
              "history": hist}
    return {"method": f"official-{a.algorithm.lower()}", "dataset": "rmnist", "seed": a.seed,
            "args": args,
            "source": f"torchvision MNIST under {a.data_root} "
                      f"({a.images:,} images, train+test pooled), loaded by the official code "
                      f"({REPOSITORY} at {(commit or 'an unknown commit')[:7]})",
            "protocol": "lodo", "domains": {a.test_domain: domain}, "mean_test_acc": test_acc,
            "complete": True}


def write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    try:
        a = parse(argv)
        check(a)
        commit = commit_of(a.clone)
        if commit != COMMIT:
            print(f"official_fediir.py: warning: {a.clone} is at "
                  f"{commit or 'an unknown commit (not a git checkout)'}"
                  f", not the pinned {COMMIT}; running it anyway", file=sys.stderr)
        stem = a.out[:-len(".json")]
        output_dir = Path(f"{stem}.official").resolve()
        where = output_dir / "RotatedMNIST" / a.algorithm
        files = {"stdout": where / f"seed{a.seed}_stdout",
                 "csv": where / f"RotatedMNIST_{a.algorithm}_results.csv"}
        for f in files.values():               # main.py appends to its CSV: start this run's afresh
            f.unlink(missing_ok=True)
        cmd = command(a, output_dir)
        print(f"official {a.algorithm} ({REPOSITORY} at {(commit or '?')[:7]}): RotatedMNIST, "
              f"{a.clients} clients, {SAMPLE} sampled, {a.rounds} rounds, "
              f"test domain {a.test_domain}, seed {a.seed}; log {stem}.log",
              flush=True)
        wall = train(a, cmd, files, f"{stem}.log")
        res = results(a, cmd, files, commit, wall)
    except UserError as e:
        print(f"official_fediir.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Failed as e:
        print(f"official_fediir.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    write_json(a.out, res)
    d = res["domains"][a.test_domain]
    print(f"test {100 * d['test_acc']:.2f} at round {d['best_round']} "
          f"(validation {100 * d['val_acc']:.2f}), "
          f"last round {100 * d['last_test_acc']:.2f}; {wall:.0f} s; results: {a.out}")
    return res


if __name__ == "__main__":
    main()
