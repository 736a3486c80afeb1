"""Run a method on a real Flower deployment on this machine: a SuperLink and one SuperNode per
client, all on 127.0.0.1 (free ports), then `flwr run` of the Flower App in flower/. Every process
it starts is stopped again, by its process group, on success, on failure and on Ctrl-C.

    python flower/run_local.py --method fediir --nodes 3 --rounds 2
    python flower/run_local.py --method fedomg --nodes 3 --rounds 2 --out results/omg.json
        -- --kappa 0.3
    python flower/run_local.py --method fediir --nodes 3 --rounds 2 --secure
        # TLS, registered nodes

--nodes is the number of clients (one SuperNode each). The dataset is the synthetic one unless
--dataset says otherwise (it needs no download; the digits' domains need --nodes >= 5). Flags
after `--` go to the method as they are (python <method>.py --help). --out follows the method
scripts' rules (docs/results-format.md, "What a run owns"): its lock is held for the whole run,
a complete result or an interrupted run there is refused unless --overwrite, and either stays
until the new run is complete (the run writes beside its logs, and its results and checkpoint
are moved to --out once complete).
"""
import hashlib
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line, exit 130)
from data import UserError  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import Parser  # noqa: E402  (bad input: one line, exit 2, not argparse's)

METHODS = ("fedavg", "fediir", "fedomg", "fedloe", "perinvfl", "fedipg")


Refused = UserError     # bad input or a failed start: one line on stderr, exit 2


def parse(argv):
    p = Parser(prog="run_local.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    p.add_argument("--nodes", type=int, default=3, help="SuperNodes = clients (default 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="communication rounds (default 2; fedloe: from its stage flags after --)")
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--test-domain", default="0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="results JSON (default results/flower-<method>-<dataset>-<test "
                        "domain>-seed<seed>-<digest of the other flags>.json)")
    p.add_argument("--port", type=int, default=None,
                   help="the SuperLink's port (default: a free one)")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the run is given up (default 3600)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a complete result at --out (once the new run is complete)")
    p.add_argument("--secure", action="store_true",
                   help="TLS (a CA and the SuperLink's certificate, made for this run) and "
                        "SuperNode authentication (each node's key registered), as across machines")
    p.add_argument("rest", nargs="*", help="further flags of the method, after --")
    args = p.parse_args(argv)
    rest = json.dumps([args.nodes, args.rounds, args.rest])
    name = f"flower-{args.method}-{args.dataset}-{args.test_domain}-seed{args.seed}-" \
        f"{hashlib.sha256(rest.encode()).hexdigest()[:8]}.json"
    args.out = str(Path(args.out or Path("results") / name.replace("/", "_")).resolve())
    return args


def method_argv(a):
    rounds = [] if a.method == "fedloe" else ["--rounds", str(a.rounds or 2), "--eval-every", "1"]
    return ["--dataset", a.dataset, "--clients", str(a.nodes), *rounds,
            "--test-domain", a.test_domain, "--seed", str(a.seed), "--out", a.out, *a.rest]


def check(a):
    """Refuse what the run would refuse, before any process starts: the
    method, the nodes, the flags."""
    if a.method not in METHODS:
        raise Refused(f"unknown method {a.method!r}; choose from {', '.join(METHODS)}")
    if a.method == "fedloe" and a.rounds is not None:
        raise Refused("fedloe counts its rounds from its stages: "
                      "give --stage1-comms, --stage1-epochs, "
                      "--stage2-comms, --stage2-epochs after --, not --rounds")
    if a.nodes < 1:
        raise Refused(f"--nodes must be positive, got {a.nodes}")
    if a.rounds is not None and a.rounds < 1:
        raise Refused(f"--rounds must be positive, got {a.rounds}")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise Refused(f"--timeout must be a positive number of seconds, got {a.timeout:g}")
    if a.port is not None and not 1 <= a.port <= 65535:
        raise Refused(f"--port must be in 1..65535, got {a.port}")
    for flag in ("--resume", "--overwrite", "--out"):
        if any(r == flag or r.startswith(flag + "=") for r in a.rest):
            raise Refused(f"{flag} after --: "
                          f"give run_local.py's own --out and --overwrite, before --; "
                          f"it does not continue a run (--resume)")
    import importlib

    outputs.check_out(a.out)
    from harness.config import after_load, load_data

    said, method = io.StringIO(), importlib.import_module(a.method).METHOD
    try:        # the run's arguments and clients, as it would resolve them (--out: checked above)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
            args = harness.resolve(method, method_argv(a))
            after_load(args, load_data(args))
    except (UserError, SystemExit) as e:   # its own refusal (one line), of --nodes, not --clients
        line = str(e) if isinstance(e, UserError) else \
            (said.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1].split("error: ", 1)[-1]
        raise Refused(line.replace(f"--clients {a.nodes}", f"--nodes {a.nodes}")) from None
    if args.clients != a.nodes:
        raise Refused(f"--nodes {a.nodes}: the run has {args.clients} clients (one SuperNode each)")


def free_port():
    return free_ports(1)[0]


def free_ports(k):
    """k distinct free ports: each socket held open until all are chosen, so
    that none is picked twice."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Processes:
    """The processes this script starts, each the leader of its own process group."""

    def __init__(self, env, logdir):
        self.env, self.logdir, self.procs = env, logdir, []

    def start(self, name, cmd):
        log = open(self.logdir / f"{name}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                             cwd=self.logdir, start_new_session=True)
        self.procs.append((name, p))
        return p

    def descendants(self):
        """Every process below the ones started here (from /proc): Flower starts some in sessions of
        their own."""
        parent = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        found, todo = set(), [p.pid for _, p in self.procs]
        while todo:
            pid = todo.pop()
            kids = [c for c, pp in parent.items() if pp == pid and c not in found]
            found.update(kids)
            todo += kids
        return found

    def stop(self):
        below = self.descendants()
        # by id: the ServerApp / ClientApp processes, wherever their group
        for pid in below:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.time() + 10
        for _, p in self.procs:
            try:
                p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                pass
        # the group too: the SuperNodes' ClientApp and the SuperLink's ServerApp
        for _, p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def last_line(path):
    """The last non-empty line of a log (what a process said before it stopped)."""
    try:
        lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines()
                 if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "an empty log"


def wait_port(port, proc, name, seconds=120, log=None):
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            raise Refused(f"the {name} exited at start "
                          f"(code {proc.returncode}: {last_line(log)}); log: {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise Refused(f"the {name} did not open port {port} in {seconds} s")


def security(a, logdir, intruders=()):
    """(the SuperLink's flags, SuperNode i's, the flwr CLI's connection line): --insecure on
    127.0.0.1 alone, or with --secure TLS and registered SuperNode keys (flower/credentials.py, made
    in the log folder for 127.0.0.1). intruders (the tests'): SuperNodes a.nodes, a.nodes + 1, ...
    that should get nothing: "unregistered" (the CA trusted, the key not registered), "untrusting"
    (another CA trusted, the key registered)."""
    if not a.secure:
        return ["--insecure"], lambda i: ["--insecure"], "insecure = true"
    import credentials
    certs = logdir / "certs"
    credentials.make(certs, ["127.0.0.1", "localhost"], a.nodes + len(intruders))
    if "untrusting" in intruders:
        credentials.make(logdir / "another-ca", ["127.0.0.1"], 1)
    link = ["--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.crt"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth"]
    kind = lambda i: intruders[i - a.nodes] if i >= a.nodes else "member"
    node = lambda i: ["--root-certificates",
                      str(logdir / ("another-ca" if kind(i) == "untrusting" else "certs")
                          / "ca.crt"),
                      "--auth-supernode-private-key", str(certs / f"node-{i}")]
    return link, node, f'root-certificates = "{certs / "ca.crt"}"'


def register(a, env, bindir, logdir, intruders=()):
    """flwr supernode register: each node's public key (and an untrusting intruder's), through the
    Control API (TLS)."""
    for i in [*range(a.nodes),
              *(a.nodes + j for j, k in enumerate(intruders) if k == "untrusting")]:
        r = subprocess.run([str(bindir / "flwr"), "supernode", "register",
                            str(logdir / "certs" / f"node-{i}.pub"), "fedood"],
                           env=env, cwd=logdir, capture_output=True, text=True, timeout=120)
        if r.returncode:
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["no output"]
            raise Refused(f"flwr supernode register of node {i} failed "
                          f"(exit {r.returncode}: {tail[0][:200]})")


def environment(port, logdir, connection):
    """The processes' environment: a private FLWR_HOME whose config.toml names the SuperLink
    (connection: its TLS or --insecure line), the repository on PYTHONPATH, telemetry off."""
    home = logdir / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "fedood"\n\n[superlink.fedood]\n'
                                      f'address = "127.0.0.1:{port}"\n{connection}\n')
    path = [str(ROOT), str(HERE)] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ
                                     else [])
    return dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0",
                FLWR_DISABLE_UPDATE_CHECK="1", PYTHONPATH=os.pathsep.join(path),
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def deploy(a, port, logdir, intruders=()):
    """The SuperLink, the SuperNodes (and the tests' intruders: security), then `flwr run`: (its
    process result, its seconds); every process stopped however it ends."""
    link_flags, node_flags, connection = security(a, logdir, intruders)
    env, bindir = environment(port, logdir, connection), Path(sys.executable).parent
    procs = Processes(env, logdir)
    try:
        link = procs.start("superlink", [str(bindir / "flower-superlink"), *link_flags,
                                         "--host", "127.0.0.1", "--port", str(port),
                                         "--disable-runtime-dependency-installation"])
        wait_port(port, link, "SuperLink", log=logdir / "superlink.log")
        if a.secure:
            register(a, env, bindir, logdir, intruders)
        nodes = [procs.start(f"supernode-{i}",
                             [str(bindir / "flower-supernode"), *node_flags(i),
                              "--superlink", f"127.0.0.1:{port}",
                              "--host", "127.0.0.1", "--port", str(q),
                              "--node-config", f"partition-id={i} num-partitions={a.nodes}"])
                 for i, q in enumerate(free_ports(a.nodes + len(intruders)))]
        # a SuperNode that cannot start says so at once
        time.sleep(3)
        for i, node in enumerate(nodes[:a.nodes]):         # (an intruder may well exit)
            if node.poll() is not None:
                log = logdir / f"supernode-{i}.log"
                raise Refused(f"SuperNode {i} exited at start "
                              f"(code {node.returncode}: {last_line(log)}); log: {log}")
        config = f'method="{a.method}" argv={json.dumps(shlex.join(method_argv(a)))}'
        print(f"SuperLink 127.0.0.1:{port}, {a.nodes} SuperNodes; logs in {logdir}", flush=True)
        t0 = time.time()
        run = subprocess.run([str(bindir / "flwr"), "run", str(HERE), "fedood",
                              "--run-config", config, "--stream"],
                             env=env, cwd=logdir, timeout=a.timeout, capture_output=True, text=True)
        (logdir / "flwr-run.log").write_text(run.stdout + run.stderr)
        return run, time.time() - t0
    finally:
        procs.stop()


def interrupted(*_):
    raise KeyboardInterrupt


def spans_line(r):
    """Each node's span in one round (seconds from the round's first start: exchange, client,
    start-end), and the exchanges whose nodes all worked at once."""
    spans = r.get("spans", [])
    if not spans:
        return ""
    t0 = min(b for _, _, b, _ in spans)
    each = ", ".join(f"{p} client {c} {b - t0:.1f}-{e - t0:.1f}" for p, c, b, e in spans)
    phases = {p: [(b, e) for q, _, b, e in spans if q == p] for p, *_ in spans}
    together = [f"{len(v)} nodes ({p})" for p, v in phases.items()
                if len(v) > 1 and max(b for b, _ in v) < min(e for _, e in v)]
    return f"; spans (s): {each}" + (f"; working at once: {', '.join(together)}" if together
                                      else "")


def settle(fresh, plan, logdir):
    """The complete run in the log folder -> --out: its results (recording --out and the command
    that names it, and the per-round timing of <out>.flower.json), then its checkpoint, by
    harness.outputs' rules (an older result and checkpoint are replaced only now)."""
    res = outputs.read_result(fresh)
    res["args"]["out"] = str(plan.files.out)
    prov = res.get("provenance", {})
    if "command" in prov:
        prov["command"] = prov["command"].replace(shlex.quote(str(fresh)),
                                                  shlex.quote(str(plan.files.out)))
    timing = Path(f"{fresh}.flower.json")
    if timing.exists():
        res["flower"] = json.loads(timing.read_text())
    ckpt = outputs.Files(fresh).ckpt
    # copied beside --out first: /tmp may be another disk
    if ckpt.exists():
        tmp = Path(f"{plan.write}.{os.getpid()}.tmp")
        shutil.copyfile(ckpt, tmp)
        os.replace(tmp, plan.write)
    outputs.finish(plan, res)
    return res


def main(argv=None, intruders=()):
    """The command line (intruders: the tests' SuperNodes that should get nothing, see security)."""
    try:
        a = parse(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("run_local.py: interrupted; nothing was started", file=sys.stderr)
        return 130
    try:
        import flwr  # noqa: F401
    except ImportError:
        print("run_local.py: error: Flower is not installed here: "
              "pip install -r flower/requirements.txt",
              file=sys.stderr)
        return 2
    # as Ctrl-C: unwind through the finally blocks
    before = {sig: signal.signal(sig, interrupted)
              for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run_and_settle(a, intruders)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def run_and_settle(a, intruders=()):
    """main's work once the flags are parsed: the checks, the deployment, the results at --out; the
    exit code."""
    logdir = None
    try:
        check(a)
        port = a.port or free_port()
        if not port_free(port):
            raise Refused(f"port {port} on 127.0.0.1 is in use; "
                          "pick another --port or leave it out")
        # held for the whole run
        with outputs.claim(a.out, resume=False, overwrite=a.overwrite) as plan:
            logdir = Path(tempfile.mkdtemp(prefix=f"flower-{a.method}-"))
            # the run writes beside its logs
            a.out = str(logdir / Path(a.out).name)
            run, seconds = deploy(a, port, logdir, intruders)
            fresh = Path(a.out)
            if not outputs.complete(fresh):
                tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or ["no output"]
                print(f"run_local.py: error: the run did not finish ({tail[0]}); "
                      f"logs and what it wrote: {logdir}", file=sys.stderr)
                return 1
            res = settle(fresh, plan, logdir)
            a.out = str(plan.files.out)
    except Refused as e:
        if str(e):
            print(f"run_local.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("run_local.py: interrupted; every process it started is stopped; --out is as it was",
              file=sys.stderr)
        return 130
    except subprocess.TimeoutExpired:
        print(f"run_local.py: error: no result in {a.timeout:.0f} s; stopped (logs: {logdir})",
              file=sys.stderr)
        return 1
    for line in (run.stdout + run.stderr).splitlines():
        if "| val " in line:
            print(line.strip())
    for t, r in sorted(res.get("flower", {}).get("rounds", {}).items(), key=lambda kv: int(kv[0])):
        if int(t) > 0:
            print(f"round {t}: {r['seconds']:.1f} s, {r['down'] / 2**20:.3f} MiB down, "
                  f"{r['up'] / 2**20:.3f} MiB up{spans_line(r)}")
    n = sum(len(d["history"]) for d in res["domains"].values())
    print(f"{n} evaluated round(s) in {seconds:.1f} s on {a.nodes} SuperNodes "
          "(start and stop included)")
    print(f"results: {a.out} (logs: {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
