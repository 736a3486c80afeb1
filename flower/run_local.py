"""Run a method on a real Flower deployment on this machine: the run's split exported into one
folder per site (harness.sites), a SuperLink and one SuperNode per site, each given its own folder
alone (the held-out domain's node evaluation-only), all on 127.0.0.1 (free ports), then `flwr run`
of the Flower App in flower/, whose server reads no data. Every process it starts is stopped
again, by its process group, on success, on failure and on Ctrl-C.

    python flower/run_local.py --method fediir --nodes 3 --rounds 2
    python flower/run_local.py --method fedomg --nodes 3 --rounds 2 --out results/omg.json
        -- --kappa 0.3
    python flower/run_local.py --method fediir --nodes 3 --rounds 2 --secure
        # as across machines: TLS, registered node keys, the nodes through the proxy

--nodes is the number of clients (one SuperNode each; the held-out domain's site one more). The
dataset is the synthetic one unless
--dataset says otherwise (it needs no download; the digits' domains need --nodes >= 5). Flags
after `--` go to the method as they are (python <method>.py --help). --out follows the method
scripts' rules (docs/results-format.md, "What a run owns"): its lock is held for the whole run,
a complete result or an interrupted run there is refused unless --overwrite or --resume, and
either stays until the new run is complete (the run writes beside its logs; its results and
checkpoint are moved to --out once complete). A run that fails (a bad reply, a node's error)
says why in one line, exit 1, and leaves its last good checkpoint at <out>.ckpt, which --resume
continues. --secure: the SuperLink on 127.0.0.1 with TLS and SuperNode authentication, and in
front of it, for the nodes, nginx forwarding the Fleet API alone (flower/proxy.py).
"""
import contextlib
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
import harness  # noqa: E402  (first: a Ctrl-C while torch loads is one line, exit 130)
from data import UserError  # noqa: E402
from harness import outputs, sites  # noqa: E402
from harness.config import Parser  # noqa: E402  (bad input: one line, exit 2, not argparse's)
from harness.methods import METHODS  # noqa: E402
from harness.provenance import code_files  # noqa: E402


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
                   help="the SuperLink's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the run is given up (default 3600)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a complete result at --out (once the new run is complete)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted or failed run at --out from <out>.ckpt (with "
                        "--overwrite: an interrupted replacement, <out>.next.ckpt)")
    p.add_argument("--secure", action="store_true",
                   help="as across machines: TLS (a CA and certificates made for this run), each "
                        "node's key registered, the nodes through nginx (the Fleet API alone)")
    p.add_argument("--secagg", action="store_true",
                   help="secure aggregation: the server receives every summed exchange as its sum "
                        "alone (run config secagg; docs/flower.md)")
    p.add_argument("--secagg-clip", type=float, default=None,
                   help="no summed value may lie outside this (run config secagg-clip, 1024)")
    p.add_argument("rest", nargs="*", help="further flags of the method, after --")
    args = p.parse_args(argv)
    rest = json.dumps([args.nodes, args.rounds, args.rest])
    name = f"flower-{args.method}-{args.dataset}-{args.test_domain}-seed{args.seed}-" \
        f"{hashlib.sha256(rest.encode()).hexdigest()[:8]}.json"
    args.given_out = args.out                # as typed: a trailing separator is refused (check)
    args.out = str(Path(args.out or Path("results") / name.replace("/", "_")).resolve())
    return args


def method_argv(a, resume=False, server=False):
    """The method's flags of this run; the server's (server=True) without --data-root: the
    export reads the data, the server none."""
    rounds = [] if a.method == "fedloe" else ["--rounds", str(a.rounds or 2), "--eval-every", "1"]
    rest = list(a.rest)
    if server and "--data-root" in rest:
        del rest[rest.index("--data-root"):rest.index("--data-root") + 2]
    rest = [r for r in rest if not (server and r.startswith("--data-root="))]
    return ["--dataset", a.dataset, "--clients", str(a.nodes), *rounds,
            "--test-domain", a.test_domain, "--seed", str(a.seed), "--out", a.out, *rest,
            *(["--resume"] if resume else [])]


def check(a):
    """Refuse what the run would refuse, before any process starts: the method, the nodes, the
    flags (those the ServerApp refuses too: fl_adapter.on_nodes). Returns the run's arguments,
    resolved, and its data settled; an --resume of a complete result: None (nothing to do)."""
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
    if a.secagg_clip is not None and not (a.secagg and 0 < a.secagg_clip < math.inf):
        raise Refused(f"--secagg-clip must be a positive number, with --secagg, got "
                      f"{a.secagg_clip:g}" + ("" if a.secagg else " without --secagg"))
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise Refused(f"--timeout must be a positive number of seconds, got {a.timeout:g}")
    if a.port is not None and not 1 <= a.port <= 65535:
        raise Refused(f"--port must be in 1..65535, got {a.port}")
    for flag in ("--resume", "--overwrite", "--out"):
        if any(r == flag or r.startswith(flag + "=") for r in a.rest):
            raise Refused(f"{flag} after --: give run_local.py's own --out, --overwrite and "
                          f"--resume, before --")
    if a.given_out and a.given_out.endswith(("/", os.sep)):
        raise Refused(f"--out {a.given_out} ends in a separator: give a file name, e.g. "
                      f"{a.given_out}results.json")
    if a.secure and shutil.which("nginx") is None:
        raise Refused("--secure puts nginx in front of the SuperLink, and there is no nginx "
                      "here: install it (Debian: apt-get install nginx-light)")
    import importlib

    outputs.check_out(a.out)
    from common import after_load, load_data

    import fl_adapter
    said, method = io.StringIO(), fl_adapter.on_nodes(importlib.import_module(a.method).METHOD)
    try:        # the run's arguments and clients, as it would resolve them (--out: checked above)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
            args = harness.resolve(method, method_argv(a))
            ds = load_data(args)
            after_load(args, ds)
            if a.resume and outputs.complete(a.out) and not a.overwrite:     # as harness.run
                outputs.load_checkpoint(outputs.Files(a.out).ckpt, args, a.method,
                                        code_files(method.round))
                return None
    except (UserError, SystemExit) as e:   # its own refusal (one line), of --nodes, not --clients
        line = str(e) if isinstance(e, UserError) else \
            (said.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1].split("error: ", 1)[-1]
        raise Refused(line.replace(f"--clients {a.nodes}", f"--nodes {a.nodes}")) from None
    if args.clients != a.nodes:
        raise Refused(f"--nodes {a.nodes}: the run has {args.clients} clients (one SuperNode each)")
    return args


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

    def start(self, name, cmd, env=None):
        """Process `name` (its log: <name>.log); env: more of its environment (a PYTHONPATH
        there goes first on the deployment's)."""
        log = open(self.logdir / f"{name}.log", "w")
        env = {**self.env, **(env or {})}
        if env["PYTHONPATH"] != self.env["PYTHONPATH"]:
            env["PYTHONPATH"] += os.pathsep + self.env["PYTHONPATH"]
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
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
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:       # (a process that SIGKILL cannot end yet)
                pass
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


class Deployment:
    """A SuperLink and its SuperNodes on 127.0.0.1, each process in a group of its own, and the
    operator's `flwr` (its own FLWR_HOME). Insecure: every API on the SuperLink's port, for this
    machine alone. secure: the SuperLink with TLS and SuperNode authentication (credentials.py's
    files in logdir/certs, `keys` node key pairs), and nginx (proxy.py) on its own port serving
    the nodes the Fleet API alone; the operator's `flwr` talks to the SuperLink directly, on
    127.0.0.1 (proxy=False: the nodes too, as before the proxy; flower/overhead.py compares).
    stop() ends every process, however the run ended."""

    def __init__(self, logdir, port, secure=False, keys=0, proxy=True, env=None):
        self.logdir, self.port, self.secure, self.proxy = Path(logdir), port, secure, proxy
        self.certs, self.proxy_port = self.logdir / "certs", None
        if secure:
            import credentials
            credentials.make(self.certs, ["127.0.0.1", "localhost"], keys)
        connection = f'root-certificates = "{self.certs / "ca.crt"}"' if secure else \
            "insecure = true"
        self.env, self.bin = environment(port, self.logdir, connection), \
            Path(sys.executable).parent
        self.procs = Processes(self.env, self.logdir)
        self.server_env = env                # (the tests': the SuperLink's and its ServerApp's)

    def start(self):
        """The SuperLink (and with secure, the proxy in front of it)."""
        flags = ["--ssl-ca-certfile", str(self.certs / "ca.crt"),
                 "--ssl-certfile", str(self.certs / "server.crt"),
                 "--ssl-keyfile", str(self.certs / "server.key"),
                 "--enable-supernode-auth"] if self.secure else ["--insecure"]
        link = self.procs.start("superlink", [str(self.bin / "flower-superlink"), *flags,
                                              "--host", "127.0.0.1", "--port", str(self.port),
                                              "--disable-runtime-dependency-installation"],
                                self.server_env)
        wait_port(self.port, link, "SuperLink", log=self.logdir / "superlink.log")
        if self.secure and self.proxy:
            import proxy
            self.proxy_port = free_port()
            work = self.logdir / "proxy"
            work.mkdir(mode=0o700)
            conf = self.logdir / "proxy.conf"
            conf.write_text(proxy.config(f"127.0.0.1:{self.proxy_port}", self.port, self.certs,
                                         work))
            nginx = self.procs.start("proxy", ["nginx", "-e", "stderr", "-c", str(conf)])
            wait_port(self.proxy_port, nginx, "proxy (nginx)", log=self.logdir / "proxy.log")
        return self

    @property
    def address(self):
        """The address the nodes reach: the proxy's, or with insecure the SuperLink's."""
        return f"127.0.0.1:{self.proxy_port or self.port}"

    def flwr(self, *args, timeout=120):
        """The operator's `flwr` command (this FLWR_HOME: the SuperLink at 127.0.0.1)."""
        return subprocess.run([str(self.bin / "flwr"), *args], env=self.env, cwd=self.logdir,
                              capture_output=True, text=True, timeout=timeout)

    def register(self, k):
        """flwr supernode register: node key k's public key, through the Control API."""
        r = self.flwr("supernode", "register", str(self.certs / f"node-{k}.pub"), "fedood")
        if r.returncode:
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["no output"]
            raise Refused(f"flwr supernode register of node {k} failed "
                          f"(exit {r.returncode}: {tail[0][:200]})")

    def node(self, name, partition, nodes, key=None, ca=None, config="", flags=(), env=None):
        """A SuperNode with this partition id (secure: with node key `key` and trusting the CA of
        folder `ca`, default this run's); config: further node config (its folder: data=...);
        flags: further flags; env: further environment (the tests')."""
        flags = [*flags, *(["--insecure"] if not self.secure else
                           ["--root-certificates", str((ca or self.certs) / "ca.crt"),
                            "--auth-supernode-private-key", str(self.certs / f"node-{key}")])]
        if self.secure:                     # its replies signed by its key (flower/signing.py)
            config = f'{config} key="{self.certs / f"node-{key}"}"'.strip()
        return self.procs.start(name, [str(self.bin / "flower-supernode"), *flags,
                                       "--superlink", self.address, "--host", "127.0.0.1",
                                       "--port", str(free_port()), "--node-config",
                                       f"partition-id={partition} num-partitions={nodes} "
                                       f"{config}".strip()], env)

    def run(self, config, app=HERE, timeout=3600):
        """`flwr run` of the App in `app` with this run config, its logs streamed: the completed
        process (stdout holds the stream)."""
        return self.flwr("run", str(app), "fedood", "--run-config", config, "--stream",
                         timeout=timeout)

    def stop(self):
        self.procs.stop()


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


def site_config(folders, P, k):
    """Node config of the node of site k: its folder alone, evaluation-only from site P on."""
    return f'data="{folders[k]}"' + (" evaluate-only=true" if k >= P else "")


def deploy(a, port, logdir, folders, intruders=(), app=HERE, node_config=None, env=None):
    """The deployment (Deployment: with --secure, each node's key registered), a SuperNode per site
    of `folders` (the exported split: the first a.nodes train, the others evaluate), each given
    its own folder alone (and the tests' intruders, which should get nothing: "unregistered", the
    CA trusted but the key not registered; "untrusting", the key registered but another CA
    trusted), then `flwr run` of the App in `app`: (its completed process, its seconds); every
    process stopped however it ends. node_config: {partition: further node config}; env(folders)
    -> {"server": further environment of the SuperLink (and its ServerApp), partition: of that
    node} (the tests')."""
    n, P, env = len(folders), a.nodes, env(folders) if env else {}
    d = Deployment(logdir, port, a.secure, n + len(intruders), env=env.get("server"))
    try:
        d.start()
        members = [*range(n), *(n + j for j, k in enumerate(intruders) if k == "untrusting")]
        for k in members if a.secure else []:
            d.register(k)
        if "untrusting" in intruders:
            import credentials
            credentials.make(logdir / "another-ca", ["127.0.0.1"], 1)
        more = lambda k: (node_config or {}).get(k, "")
        nodes = [d.node(f"supernode-{k}", k, n, key=k, config=f"{site_config(folders, P, k)} "
                        f"{more(k)}".strip(), env=env.get(k))
                 for k in range(n)]
        for j, kind in enumerate(intruders):
            d.node(f"supernode-{n + j}", j % P, n, key=n + j, config=site_config(folders, P, j % P),
                   ca=logdir / "another-ca" if kind == "untrusting" else None)
        time.sleep(3)                                # a SuperNode that cannot start says so at once
        for i, node in enumerate(nodes):
            if node.poll() is not None:
                log = logdir / f"supernode-{i}.log"
                raise Refused(f"SuperNode {i} exited at start "
                              f"(code {node.returncode}: {last_line(log)}); log: {log}")
        config = f'method="{a.method}" ' \
            f'argv={json.dumps(shlex.join(method_argv(a, a.resume, server=True)))}'
        config += f" evaluators={n - P}"
        if a.secure:                # each node holds the partition its key was made for
            config += f' keys="{d.certs}"'
        if a.secagg:
            config += " secagg=true" + (f" secagg-clip={a.secagg_clip!r}"
                                        if a.secagg_clip is not None else "")
        print(f"SuperLink 127.0.0.1:{port}" + (f", proxy {d.address}" if a.secure else "")
              + f", {P} SuperNodes" + (f" and {n - P} evaluation-only" if n > P else "")
              + f", each with its own folder of {logdir / 'sites'}; logs in {logdir}", flush=True)
        t0 = time.time()
        run = d.run(config, app, a.timeout)
        (logdir / "flwr-run.log").write_text(run.stdout + run.stderr)
        return run, time.time() - t0
    finally:
        d.stop()


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


def move(src, dst):
    """src to dst, replacing it, leaving no copy: a rename, or across file systems (the log folder
    is in /tmp) a copy beside dst renamed into place, then src removed."""
    try:
        os.replace(src, dst)
    except OSError:
        tmp = Path(f"{dst}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        os.unlink(src)


def settle(fresh, plan):
    """The complete run in the log folder -> --out: its checkpoint, then its results (recording
    --out and the command that names it, and the per-round timing of <out>.flower.json), by
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
    if ckpt.exists():
        move(ckpt, plan.write)
    outputs.finish(plan, res)
    return res


def keep(fresh, plan):
    """A run that did not complete: its last good checkpoint to where --resume reads it (<out>.ckpt;
    an --overwrite's <out>.next.ckpt), and the results of its finished held-out domains to --out
    (not an --overwrite's: the older result stays): what is kept, a list of phrases."""
    ckpt, kept = outputs.Files(fresh).ckpt, []
    if ckpt.exists():
        move(ckpt, plan.write)
        kept.append(f"the last good checkpoint ({plan.write})")
    if not plan.replacing and outputs.read_result(fresh) is not None:
        move(fresh, plan.files.out)
        kept.append(f"the results of the finished test domains ({plan.files.out})")
    return kept


ESCAPES = r"\x1b\[[0-9;?]*[A-Za-z]"           # a terminal's colours and cursor moves


def failure(run, fresh, logdir, kept):
    """The one line that says why the run failed: the run's own error line (<out>.flower.json,
    written by the ServerApp: fl_adapter.serve), its paths in the log folder put as --out's."""
    timing = Path(f"{fresh}.flower.json")
    error = json.loads(timing.read_text()).get("error") if timing.exists() else None
    if error is None:
        tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or ["no output"]
        error = f"the run did not finish ({re.sub(ESCAPES, '', tail[0])})"
    error = error.split(": error: ", 1)[-1].split("; stopped; ")[0]
    return f"{error}; stopped; {saved(kept)}; logs: {logdir}"


def saved(kept):
    """What a run that did not complete left, in words (keep's list)."""
    if not kept:
        return "nothing of this run was saved"
    return " and ".join(kept) + (" are" if len(kept) > 1 else " is") + " kept: --resume goes on"


def main(argv=None, intruders=(), app=HERE, node_config=None, env=None):
    """The command line (the tests': intruders, node_config and env, see deploy; app, the Flower
    App's folder)."""
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
        return run_and_settle(a, intruders, app, node_config, env)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def run_and_settle(a, intruders=(), app=HERE, node_config=None, env=None):
    """main's work once the flags are parsed: the checks, the split exported (a folder a site),
    the deployment, the results at --out; the exit code."""
    logdir = fresh = plan = None
    done, kept = False, []
    try:
        args = check(a)
        if args is None:
            print(f"{a.out} is complete, and its checkpoint was made with these arguments: "
                  f"nothing to continue (nothing started)")
            return 0
        port = a.port or free_port()
        if not port_free(port):
            raise Refused(f"port {port} on 127.0.0.1 is in use; "
                          "pick another --port or leave it out")
        # held for the whole run
        with outputs.claim(a.out, resume=a.resume, overwrite=a.overwrite) as plan:
            logdir = Path(tempfile.mkdtemp(prefix=f"flower-{a.method}-"))
            # the run writes beside its logs, and continues there what --out holds
            fresh = logdir / Path(a.out).name
            if plan.read is not None:
                move(plan.read, outputs.Files(fresh).ckpt)
            a.out = str(fresh)
            with contextlib.redirect_stdout(io.StringIO()):
                folders = sites.export(args, logdir / "sites")
            try:
                run, seconds = deploy(a, port, logdir, folders, intruders, app, node_config, env)
            finally:
                done = outputs.complete(fresh)
                if not done:
                    kept = keep(fresh, plan)
            if not done:
                print(f"run_local.py: error: {failure(run, fresh, logdir, kept)}",
                      file=sys.stderr)
                return 1
            res = settle(fresh, plan)
            a.out = str(plan.files.out)
    except Refused as e:
        if str(e):
            print(f"run_local.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("run_local.py: interrupted; every process it started is stopped; "
              + (saved(kept) if kept else "--out is as it was"), file=sys.stderr)
        return 130
    except subprocess.TimeoutExpired:
        print(f"run_local.py: error: no result in {a.timeout:.0f} s; stopped; {saved(kept)}; "
              f"logs: {logdir}", file=sys.stderr)
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
