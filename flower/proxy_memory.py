"""What an outsider can make the proxy hold (flower/proxy.py, "What an outsider can make nginx
hold"): nginx with proxy.py's configuration on 127.0.0.1 (a throwaway CA and certificate,
credentials.py's; an upstream on 127.0.0.1 that answers a body with its SHA-256), and N
connections from one address, 127.0.0.2 (127.0.0.1, the server's own, is not limited), that need
no certificate: each a POST /v1/fleet/push-object with a Content-Length one byte under
--max-body, its body sent but for the last byte, then silent. Reported per configuration and N:
nginx's resident memory (VmRSS of its master and workers, from /proc) before, at its peak and 2 s
after the connections ended; the answers they got; how long nginx kept them after their last
byte; whether an honest 5 MiB request from another address, 127.0.0.3, sent once the N are
open, passed, its body reaching the upstream unchanged. Two configurations, in one run:
"before", the bound undone (no limit per address, nginx's default timeouts: 60 s), and "after",
proxy.py's. Bad input: one line on stderr, exit 2, nothing started.

    python flower/proxy_memory.py                            # 30 and 200 connections
    python flower/proxy_memory.py --connections 30 --hold 90
"""
import contextlib
import hashlib
import http.server
import os
import platform
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import credentials
import proxy
from proxy import Parser          # bad input: one line, exit 2

MIB = 1 << 20
HONEST = 5 * MIB                  # Flower's largest object: an array's chunk
ROUTE = "/v1/fleet/push-object"
ATTACKER, OTHER = "127.0.0.2", "127.0.0.3"
# the bound's lines in proxy.py's configuration, each removed by unbounded()
BOUND = [
    r"\n *# requests in progress per client address[^\n]*",
    r"\n *map \$remote_addr \$client_address \{[^}]*\}",
    r"\n *limit_conn_zone [^\n]*",
    r"\n *limit_conn per_address [^\n]*",
    r"\n *limit_conn_status [^\n]*",
    r"\n *client_header_timeout [^\n]*",
    r"\n *client_body_timeout [^\n]*",
]


def unbounded(text):
    """proxy.py's configuration `text` as it was before the bound: no limit per address, nginx's
    default timeouts. ValueError if a line of the bound is not there once (proxy.py changed:
    this script must follow)."""
    for pattern in BOUND:
        text, n = re.subn(pattern, "", text)
        if n != 1:
            raise ValueError(f"proxy.py's configuration has {n} lines matching {pattern!r}")
    return text


def nginx_rss(master):
    """KiB resident in nginx: the VmRSS of its master and of every child of it."""
    pids = [master]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == master:
                    pids.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(found[1]) if found else 0
    return total


class Upstream:
    """A stand-in SuperLink on 127.0.0.1 (HTTPS, certs/server.crt, which names localhost): every
    POST answered 200 with its body's SHA-256 in hex."""

    def __init__(self, certs):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                digest = hashlib.sha256(self.rfile.read(int(self.headers["Content-Length"])))
                reply = digest.hexdigest().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs / "server.crt", certs / "server.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def nginx(text, workdir):
    """nginx running configuration `text` (written to workdir/nginx.conf): its master's pid.
    Stopped afterwards, its workers with it."""
    conf = workdir / "nginx.conf"
    conf.write_text(text)
    port = int(re.search(r"listen 127\.0\.0\.1:(\d+) ssl;", text)[1])
    log = open(workdir / "nginx.stderr", "wb")
    proc = subprocess.Popen(["nginx", "-e", "stderr", "-c", str(conf)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx ended: {(workdir / 'nginx.stderr').read_text()[-300:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > end:
                raise RuntimeError("nginx did not listen within 20 s")
            time.sleep(0.05)
        yield proc.pid
    finally:
        proc.terminate()                       # nginx's fast shutdown: its workers end too
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)     # its own session: nginx's processes alone
            proc.wait()
        log.close()


def blind():
    """TLS with no certificate check and none of our own: an outsider's."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def open_request(port, length, sent, source=ATTACKER, timeout=30):
    """A TLS connection from `source` that has sent POST ROUTE with Content-Length `length` and
    the first `sent` bytes of its body (zeros). The socket, or the error that stopped it."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                   source_address=(source, 0))
    try:
        tls = blind().wrap_socket(raw)
        tls.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                    f"application/protobuf\r\nContent-Length: {length}\r\n\r\n".encode())
        zeros = memoryview(bytes(min(sent, MIB)))
        while sent:
            sent -= tls.send(zeros[:sent])
        return tls
    except OSError as e:
        raw.close()
        return e


def status_of(reply):
    found = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
    return int(found[1]) if found else None


def honest(port, source, size=HONEST):
    """One whole POST ROUTE of `size` random bytes from `source`: (status, whether the reply is
    the body's SHA-256, i.e. the body reached the upstream unchanged)."""
    body = os.urandom(size)
    tls = open_request(port, size, 0, source)
    if isinstance(tls, OSError):
        return None, False
    with tls:
        try:
            tls.sendall(body)
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < 64:
                chunk = tls.recv(65536)
                if not chunk:
                    break
                reply += chunk
                if status_of(reply) not in (None, 200) and b"\r\n\r\n" in reply:
                    break
        except OSError:
            return None, False
    digest = hashlib.sha256(body).hexdigest().encode()
    return status_of(reply), reply.endswith(digest)


def attack(port, master, n, length, hold, probe=True):
    """n outsider connections from ATTACKER (open_request, all but the last byte), then watched
    until nginx has dropped them all or `hold` seconds passed: a dict of what the module's
    docstring says."""
    before = nginx_rss(master)
    peak = before
    conns, sent_at, errors = [], [], 0
    t0 = time.monotonic()
    for _ in range(n):
        c = open_request(port, length, length - 1)
        if isinstance(c, OSError):
            errors += 1
            continue
        c.setblocking(False)
        conns.append(c)
        sent_at.append(time.monotonic())
        peak = max(peak, nginx_rss(master))
    sending = time.monotonic() - t0
    passed = honest(port, OTHER) if probe else None
    ended, replies = [], {id(c): b"" for c in conns}
    open_ = dict(zip(map(id, conns), zip(conns, sent_at)))
    end = time.monotonic() + hold
    while open_ and time.monotonic() < end:
        peak = max(peak, nginx_rss(master))
        for key, (c, at) in list(open_.items()):
            try:
                while chunk := c.recv(65536):
                    replies[key] += chunk
            except (ssl.SSLWantReadError, BlockingIOError):
                continue                        # open, nothing more to read now
            except OSError:
                pass                            # reset: dropped
            ended.append((status_of(replies[key]), time.monotonic() - at))
            c.close()
            del open_[key]
        time.sleep(0.25)
    for c, at in open_.values():
        ended.append((status_of(replies[id(c)]), None))     # still open: closed by us
        c.close()
    time.sleep(2)
    return dict(before=before, peak=peak, after=nginx_rss(master), ended=ended, errors=errors,
                sending=sending, honest=passed, hold=hold)


def measure(which, n, hold, tmp, max_body):
    """One nginx with the configuration `which` ("before" or "after") against n connections."""
    workdir = tmp / f"{which}-{n}"
    workdir.mkdir(mode=0o700)
    upstream = Upstream(tmp / "certs")
    port = free_port()
    try:
        text = proxy.config(f"127.0.0.1:{port}", upstream.port, tmp / "certs", workdir, max_body)
        if which == "before":
            text = unbounded(text)
        with nginx(text, workdir) as master:
            return attack(port, master, n, size_of(max_body) - 1, hold)
    finally:
        upstream.close()


def size_of(max_body):
    """nginx's N, Nk or Nm in bytes."""
    unit = {"k": 1 << 10, "m": MIB}.get(max_body[-1], 1)
    return int(max_body.rstrip("km")) * unit


def describe(which, n, r):
    mib = lambda kib: f"{kib / 1024:.0f} MiB"         # noqa: E731
    groups = {}
    for status, held in r["ended"]:
        groups.setdefault(status, []).append(held)
    answers = []
    for status, helds in sorted(groups.items(), key=lambda kv: str(kv[0])):
        dropped = [h for h in helds if h is not None]
        kept = (f"dropped {min(dropped):.1f}-{max(dropped):.1f} s after their last byte"
                if dropped else "")
        if len(dropped) < len(helds):
            kept += f"{', ' if kept else ''}{len(helds) - len(dropped)} open after {r['hold']} s"
        answers.append(f"{len(helds)} {'no answer' if status is None else status}: {kept}")
    probe = r["honest"]
    honest_ = ("passed unchanged" if probe == (200, True) else f"got {probe[0]}") if probe else "-"
    failed = f"; {r['errors']} could not send" if r["errors"] else ""
    return (f"{which:6} {n:3} connections (sent in {r['sending']:.1f} s{failed}): nginx "
            f"{mib(r['before'])} before, {mib(r['peak'])} at the peak, {mib(r['after'])} after; "
            f"{'; '.join(answers)}; an honest 5 MiB request from {OTHER} {honest_}")


def cpu():
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return found[1].strip() if found else platform.machine()


def main(argv=None):
    p = Parser(prog="proxy_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, nargs="+", default=[30, 200],
                   help="outsider connections, 1 to 400 each (default 30 200)")
    p.add_argument("--hold", type=int, default=90,
                   help="seconds to wait for nginx to drop them, 1 to 600 (default 90: past "
                   "nginx's default timeout, 60 s)")
    p.add_argument("--max-body", default="8m", help="proxy.py's --max-body (default 8m)")
    a = p.parse_args(argv)
    bad = [n for n in a.connections if not 1 <= n <= 400]
    if bad:
        p.error(f"--connections must be 1 to 400 each (nginx takes 512 at once), got {bad[0]}")
    if not 1 <= a.hold <= 600:
        p.error(f"--hold must be 1 to 600 seconds, got {a.hold}")
    if not re.fullmatch(r"[1-9][0-9]{0,5}[km]?", a.max_body) or size_of(a.max_body) < 2:
        p.error(f"--max-body {a.max_body!r}: give a size as nginx writes it, e.g. 8m")
    if shutil.which("nginx") is None:
        p.error("nginx not found: apt-get install nginx-light")
    if not Path("/proc/self/status").is_file():
        p.error("no /proc here: nginx's memory is read from /proc/PID/status (Linux)")
    for source in (ATTACKER, OTHER):
        try:
            socket.create_connection(("127.0.0.1", free_port()), timeout=1,
                                     source_address=(source, 0)).close()
        except ConnectionRefusedError:
            pass                               # the address is ours to send from
        except OSError as e:
            p.error(f"cannot send from {source} ({e.strerror}): 127.0.0.0/8 must be loopback")
    version = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
    length = size_of(a.max_body) - 1
    print(f"{version}; {os.cpu_count()} cores ({cpu()}); each connection sends {length - 1} of "
          f"its {length} bytes (--max-body {a.max_body}); after: PER_ADDRESS "
          f"{proxy.PER_ADDRESS}, TIMEOUT {proxy.TIMEOUT}", flush=True)
    with tempfile.TemporaryDirectory(prefix="proxy-memory-") as tmp:
        tmp = Path(tmp)
        credentials.make(tmp / "certs", ["127.0.0.1", "localhost"], 1)
        for n in a.connections:
            for which in ("before", "after"):
                print(describe(which, n, measure(which, n, a.hold, tmp, a.max_body)),
                      flush=True)


if __name__ == "__main__":
    main()
