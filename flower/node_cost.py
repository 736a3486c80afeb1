"""What a node costs a message, and a round on Flower against the method file's own, measured side
by side on this machine (docs/flower.md: Overhead). FedAvg and FedIIR on RotatedMNIST (5 clients,
one SuperNode each, and the held-out domain's evaluation node), as three measurements:

  setup    a node's setup per message: a fresh process, as Flower starts one per message, from
           its start to the moment its client function can run (Python, the imports, then the
           node: fl_adapter.Node), median of --repeat; this checkout's node (its own exported
           folder) and, with --before, an earlier checkout's (it loaded the whole dataset and
           rebuilt the federation); with the embedded digits and with full MNIST (--data-root)
  rounds   a round's wall-clock seconds (rounds 2.. of --rounds; an evaluation every --eval-every
           rounds and at the last) on Flower (run_local.py --secure: TLS, the proxy; from the end
           of one round's last reply to the end of the next's) and the method file's in process
           (one thread; from one round's end to the next's)
  cpu      a round's CPU-seconds: on Flower, every process of the deployment (the SuperLink, the
           proxy, the SuperNodes and the processes they start: /proc sampled every 50 ms; the
           whole run's also by kind of process), in process the one's (time.process_time)

    python flower/node_cost.py --data-root DIR --before ../old-checkout --out results/cost.json
    python flower/node_cost.py --only setup --data-root DIR
    python flower/node_cost.py --only rounds --data full --data-root DIR --rounds 2

Bad input: one line, exit 2, before anything runs. Every deployment is stopped however it ends.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

METHODS = ("fedavg", "fediir")
ARGV = ["--dataset", "rmnist", "--clients", "5", "--test-domain", "0"]
TICK = os.sysconf("SC_CLK_TCK")
BOOT = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))


def started(pid="self"):
    """When a process started (epoch seconds, 1/TICK resolution): /proc/PID/stat's starttime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return BOOT + int(fields[19]) / TICK


# A fresh process of a checkout (its flower/ first on the path), building the node of site 1 as a
# message would: this checkout's from its exported folder, an earlier one's from the dataset.
NODE = """
import json, time
from pathlib import Path
start = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / {tick} + {boot}
import argparse, fl_adapter
imported = time.time()
args = argparse.Namespace(**json.loads({args!r}))
if {roster!r}:
    fl_adapter.Node({init!r}, args, json.loads({roster!r}), 1, {folder!r}, False)
else:
    fl_adapter.Node({init!r}, args, "0", 1)
print(json.dumps({{"imports": imported - start, "ready": time.time() - start}}))
"""


def node_setup(root, method, data_root, repeat, new=True):
    """{"imports": s, "ready": s}: medians over `repeat` fresh processes of `root`'s node setup."""
    import harness
    from harness import sites
    record = harness.method(method)
    flags = ARGV + ["--rounds", "1"] + (["--data-root", data_root] if data_root else [])
    with tempfile.TemporaryDirectory() as tmp:
        args = harness.resolve(record, flags + ["--out", f"{tmp}/r.json"])
        roster = folder = ""
        if new:
            folders = sites.export(args, Path(tmp) / "sites")
            folder = str(folders[1])
            roster = json.dumps([sites.roster_entry(sites.read(f, args, k, k >= 5)[0])
                                 for k, f in enumerate(folders)])
        else:
            args.sample, args.client_size = 5, None
        init = f"{method}:init_state" if record.init_state else None
        code = NODE.format(root=str(root), tick=TICK, boot=BOOT, args=json.dumps(vars(args)),
                           roster=roster, init=init, folder=folder)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{root}:{root}/flower")
        runs = []
        for _ in range(repeat):
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=env, cwd=tmp)
            if p.returncode:
                raise RuntimeError(f"the node of {root} failed: {p.stderr.strip()[-500:]}")
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in ("imports", "ready")}


KINDS = ("flwr-clientapp", "flwr-serverapp", "flower-superexec", "flower-supernode",
         "flower-superlink", "nginx", "flwr")          # what a process of a deployment is


def kind(pid):
    """Which of KINDS the process is ("other": run_local.py itself and the rest)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "other"
    return next((k for k in KINDS if k in cmd), "other")


class Sampler(threading.Thread):
    """The CPU-seconds of a process and all its descendants, sampled from /proc every 50 ms: a
    series of (time, total) (a process that has exited counts with its last sample), and each
    process's kind (KINDS)."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.last, self.series, self.done, self.kinds = pid, {}, [], False, {}

    def run(self):
        while not self.done:
            parent = {}
            for d in Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                        parent[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / TICK)
                    except (OSError, IndexError, ValueError):
                        pass
            mine, todo = {self.pid}, [self.pid]
            while todo:
                p = todo.pop()
                kids = [c for c, (pp, _) in parent.items() if pp == p and c not in mine]
                mine.update(kids)
                todo += kids
            for p in mine:
                if p in parent:
                    self.last[p] = parent[p][1]
                    if p not in self.kinds:
                        self.kinds[p] = kind(p)
            self.series.append((time.time(), sum(self.last.values())))
            time.sleep(0.05)

    def by_kind(self):
        """{kind: CPU-seconds of its processes over the whole run}."""
        out = {}
        for p, v in self.last.items():
            out[self.kinds.get(p, "other")] = out.get(self.kinds.get(p, "other"), 0.0) + v
        return out

    def at(self, when):
        """The total CPU-seconds at time `when` (the last sample before it)."""
        return max([v for t, v in self.series if t <= when] or [0.0])


def on_flower(root, method, rounds, data_root, every=1):
    """run_local.py --secure of `root` (5 SuperNodes): {round: (seconds, CPU-seconds)} for rounds
    2..rounds (a round: from the end of the one before to its own end, as its replies' spans say),
    and the node setup of each message where the replies say when their node was ready."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(Path(root) / "flower" / "run_local.py"), "--method", method,
               "--nodes", "5", "--dataset", "rmnist", "--rounds", str(rounds), "--secure",
               "--out", str(out), "--timeout", "3600", "--", "--eval-every", str(every)]
        cmd += ["--data-root", data_root] if data_root else []
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp)
        cpu = Sampler(p.pid)
        cpu.start()
        stdout, stderr = p.communicate()
        cpu.done = True
        cpu.join()
        if p.returncode:
            raise RuntimeError(f"run_local.py of {root} failed: {stderr.strip()[-500:]}")
        res = json.loads(out.read_text())
    ends = {int(t): max(e for *_, e in r["spans"]) for t, r in res["flower"]["rounds"].items()
            if r["spans"]}
    seconds = {t: ends[t] - ends[t - 1] for t in ends if t - 1 in ends}
    setup = [s for t, r in res["flower"]["rounds"].items() if int(t) > 0
             for *_, s in r.get("setup", [])]
    return ({t: (seconds[t], cpu.at(ends[t]) - cpu.at(ends[t - 1]))
             for t in range(2, rounds + 1)}, setup, cpu.by_kind())


IN_PROCESS = """
import time, json
import torch
torch.set_num_threads(1)
import harness
marks = [(time.time(), time.process_time())]
harness.main(harness.method({method!r}), {argv!r},
             after_round=lambda *a: marks.append((time.time(), time.process_time())))
print(json.dumps(marks))
"""


def in_process(method, rounds, data_root, every=1):
    """The method file's run in process (one thread): {round: (seconds, CPU-seconds)}, 2.."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ARGV + ["--rounds", str(rounds), "--out", f"{tmp}/r.json", "--eval-every",
                       str(every)] + (["--data-root", data_root] if data_root else [])
        code = IN_PROCESS.format(method=method, argv=argv)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                           cwd=tmp)
        if p.returncode:
            raise RuntimeError(f"{method} in process failed: {p.stderr.strip()[-500:]}")
        marks = json.loads(p.stdout.strip().splitlines()[-1])
    return {t: (marks[t][0] - marks[t - 1][0], marks[t][1] - marks[t - 1][1])
            for t in range(2, rounds + 1)}


def main(argv=None):
    from harness.config import Parser
    p = Parser(prog="node_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", help="full MNIST (torchvision's layout: DIR/MNIST/raw)")
    p.add_argument("--before", help="an earlier checkout of this project, to measure beside")
    p.add_argument("--only", choices=["setup", "rounds"], help="one measurement (default: both)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of a run (2.. are measured)")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per setup measurement")
    p.add_argument("--eval-every", type=int, default=1,
                   help="the runs' evaluation period (default 1: every round evaluated)")
    p.add_argument("--data", choices=["embedded", "full", "both"], default="both",
                   help="which digits (full: --data-root's; default both, with --data-root)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--out", help="the figures as JSON")
    a = p.parse_args(argv)
    full = a.data_root and Path(a.data_root, "MNIST", "raw", "train-images-idx3-ubyte")
    for bad, line in ((a.data_root is not None and not full.is_file(),
                       f"--data-root {a.data_root} holds no MNIST/raw/train-images-idx3-ubyte"),
                      (a.before is not None and not Path(a.before, "flower",
                                                         "fl_adapter.py").is_file(),
                       f"--before {a.before} is no checkout of this project"),
                      (a.data == "full" and not a.data_root, "--data full needs --data-root"),
                      (a.rounds < 2, f"--rounds must be at least 2, got {a.rounds}"),
                      (a.repeat < 1, f"--repeat must be positive, got {a.repeat}"),
                      (a.out is not None and Path(a.out).exists(), f"--out {a.out} exists")):
        if bad:
            p.error(line)
    figures = {"machine": os.uname().machine, "cores": os.cpu_count(), "rows": []}
    checkouts = [("this", ROOT)] + ([("before", Path(a.before).resolve())] if a.before else [])
    roots = [("embedded", None)] + ([("full", a.data_root)] if a.data_root else [])
    roots = [r for r in roots if a.data in ("both", r[0])]
    for method in a.methods:
        for data, root in roots:
            for name, checkout in checkouts if a.only in (None, "setup") else ():
                s = node_setup(checkout, method, root, a.repeat, new=name == "this")
                row = dict(what="setup", method=method, data=data, code=name, **s)
                print(f"{method} {data} {name}: a node's setup {s['ready']:.2f} s from its "
                      f"process's start ({s['imports']:.2f} s of them Python and the imports)",
                      flush=True)
                figures["rows"].append(row)
            for name, checkout in checkouts if a.only in (None, "rounds") else ():
                if name == "before" and data == "full":
                    continue                           # (every message: the whole dataset)
                fl, setup, kinds = on_flower(checkout, method, a.rounds, root, a.eval_every)
                own = in_process(method, a.rounds, root, a.eval_every)
                for t in fl:
                    row = dict(what="round", method=method, data=data, code=name, round=t,
                               eval_every=a.eval_every,
                               flower_seconds=fl[t][0], flower_cpu=fl[t][1],
                               own_seconds=own[t][0], own_cpu=own[t][1])
                    figures["rows"].append(row)
                    print(f"{method} {data} {name} round {t}: Flower {fl[t][0]:.1f} s, "
                          f"{fl[t][1]:.1f} CPU-s; in process {own[t][0]:.1f} s, {own[t][1]:.1f} "
                          f"CPU-s; CPU ratio {fl[t][1] / own[t][1]:.2f}", flush=True)
                figures["rows"].append(dict(what="CPU by process", method=method, data=data,
                                            code=name, seconds=kinds))
                print(f"{method} {data} {name}: the whole run's CPU-seconds by process: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items())), flush=True)
                if setup:
                    figures["rows"].append(dict(what="setup in the deployment", method=method,
                                                data=data, code=name, seconds=setup))
                    print(f"{method} {data} {name}: each message's setup on its node, from the "
                          f"message to its first step: median {statistics.median(setup):.2f} s "
                          f"(after the process's start and imports)", flush=True)
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
