"""The SuperLink's public face (docs/flower.md, "The trust boundary"): an nginx configuration that
terminates TLS on the address the SuperNodes reach and forwards the Fleet API alone, the twelve
POST routes a SuperNode calls, to the SuperLink listening on 127.0.0.1. Everything else, the
Control API (submit, stop or list runs, register nodes), the Runtime API, /openapi.json and
/docs, is refused by nginx with 403 and never reaches the SuperLink.

flwr 1.42's SuperLink serves its Fleet, Control and Runtime APIs on one port and authenticates no
Control user, so the port itself must not be reachable: the SuperLink listens on 127.0.0.1, the
operator runs `flwr` on the server's host (or through `ssh -L`), and nginx, a well-kept server
that Debian packages (`apt-get install nginx-light`), stands on the public address.

    python flower/proxy.py --certs certs --listen 0.0.0.0:9092 --superlink-port 9091 \
        --workdir /var/lib/fedood-proxy > fedood-proxy.conf
    nginx -e stderr -c "$PWD/fedood-proxy.conf"          # in the foreground (daemon off)

The route is matched against the raw request line ($request_uri: before nginx decodes %XX,
merges slashes or resolves dot segments), so a path trick never matches; the Fleet calls carry
their SuperNode's signed headers through to the SuperLink, which checks them (its
--enable-supernode-auth). Bodies are bounded per request (--max-body, default 8 MiB: Flower
sends an array in chunks of at most 5 MiB, one object a request).

What an outsider can make nginx hold. Reaching nginx takes no certificate (a node's credentials
are inside Flower's signed headers, which the SuperLink checks), and nginx holds a request's body
in memory until it has all of it, so anyone could open connections that send bodies just under
--max-body and then wait. So:
- one client address has at most PER_ADDRESS (8) requests in progress at once (headers read,
  body being read or forwarded): more are answered 503, which Flower's SuperNode retries (flwr
  1.42, flwr/supercore/retry/http_retry.py). One address holds at most PER_ADDRESS bodies. An
  honest SuperNode has up to 3 at once (its heartbeat, and its messages or 2 object pushes or
  pulls at a time: FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES, _PULLS). 127.0.0.1 and ::1 are not
  limited: a process on the server's host reaches the SuperLink directly anyway, and a local
  federation's SuperNodes (run_local.py --secure) all come from there;
- headers and body must keep arriving: TIMEOUT (10 s) without a byte of either ends the request
  (nginx's default, 60 s, let a silent connection keep its body six times as long).
A body stays in memory, never on disk (as replies do): nginx's workers, `nobody` when nginx is
started as root, could not write into a private --workdir anyway. flower/proxy_memory.py
measures nginx's memory under such connections, with this configuration and the one before:
200 of them from one address took nginx from 12 MiB to 1621 MiB before, to 87 MiB with this one
(2026-11-29, nginx 1.22.1, 2 AMD EPYC cores).
"""
import argparse
import ipaddress
import re
import sys
from pathlib import Path

# The Fleet API of flwr 1.42.0 (flwr/superlink/routers/fleet/router.py): every route a SuperNode
# calls, all POST under /v1/fleet/ (test_proxy.py checks this list against the installed flwr).
FLEET = ("register-node", "activate-node", "deactivate-node", "unregister-node",
         "send-node-heartbeat", "pull-messages", "push-messages", "get-run", "get-fab",
         "push-object", "pull-object", "confirm-message-received")
# What one client address may make nginx hold (the module's docstring): requests in progress at
# once, seconds without a byte of a request's headers or body.
PER_ADDRESS = 8
TIMEOUT = "10s"

TEMPLATE = """\
# The fedood federation's reverse proxy (flower/proxy.py): TLS on {listen}, the Fleet API alone
# forwarded to the SuperLink at 127.0.0.1:{superlink_port}; everything else refused here.
daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{
    worker_connections 512;
}}
http {{
    access_log {workdir}/access.log;
    client_body_temp_path {workdir}/client-body;
    proxy_temp_path {workdir}/proxy-temp;
    fastcgi_temp_path {workdir}/fastcgi-temp;
    uwsgi_temp_path {workdir}/uwsgi-temp;
    scgi_temp_path {workdir}/scgi-temp;
    server_tokens off;
    # requests in progress per client address, but the server's own (1 MiB: thousands at once)
    map $remote_addr $client_address {{
        default $binary_remote_addr;
        127.0.0.1 "";
        "::1" "";
    }}
    limit_conn_zone $client_address zone=per_address:1m;

    # 1 for a Fleet route exactly as a SuperNode sends it (no query, no encoding, no dots)
    map $request_uri $fleet_route {{
        default 0;
        "~^/v1/fleet/({routes})$" 1;
    }}

    server {{
        listen {listen} ssl;
        ssl_certificate {certs}/server.crt;
        ssl_certificate_key {certs}/server.key;
        ssl_protocols TLSv1.2 TLSv1.3;

        client_max_body_size {max_body};
        client_body_buffer_size {max_body};      # a body stays in memory, never on disk
        client_header_timeout {timeout};         # without a byte of the headers
        client_body_timeout {timeout};           # without a byte of the body
        limit_conn per_address {per_address};
        limit_conn_status 503;                   # what Flower's SuperNode retries

        location / {{
            if ($fleet_route = 0) {{
                return 403;
            }}
            if ($request_method != POST) {{
                return 403;
            }}
            proxy_pass https://127.0.0.1:{superlink_port};
            proxy_http_version 1.1;
            proxy_buffering off;                 # replies stream through, never on disk
            # the SuperLink's certificate names localhost (flower/credentials.py)
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {certs}/ca.crt;
            proxy_ssl_name localhost;
            proxy_ssl_server_name on;
        }}
    }}
}}
"""


# what nginx's configuration language would read as more than a path: whitespace, quotes, its
# separators and variables
UNSAFE = re.compile(r"[\s;{}'\"#$\\]")


def config(listen, superlink_port, certs, workdir, max_body="8m"):
    """The nginx configuration: TLS with certs/server.crt and server.key on `listen` (host:port),
    the Fleet routes forwarded to https://127.0.0.1:superlink_port (its certificate checked
    against certs/ca.crt), its pid, logs and temporary folders in `workdir`; PER_ADDRESS
    requests at once per client address, TIMEOUT without a byte of a request's headers or body.
    ValueError for a path nginx would not read as one path, or a body size that is not nginx's
    N, Nk or Nm."""
    certs, workdir = Path(certs).resolve(), Path(workdir).resolve()
    for flag, path in (("--certs", certs), ("--workdir", workdir)):
        if UNSAFE.search(str(path)):
            raise ValueError(f"{flag} {path}: nginx would not read it as one path (it holds "
                             f"whitespace, a quote, or one of ; {{ }} # $ \\); use another")
    if not re.fullmatch(r"[1-9][0-9]{0,5}[km]?", str(max_body)):
        raise ValueError(f"--max-body {max_body!r}: give a size as nginx writes it, e.g. 8m")
    return TEMPLATE.format(listen=listen, superlink_port=superlink_port, certs=certs,
                           workdir=workdir, max_body=max_body, routes="|".join(FLEET),
                           per_address=PER_ADDRESS, timeout=TIMEOUT)


class Parser(argparse.ArgumentParser):
    def error(self, message):        # one line, not the usage
        self.exit(2, f"{self.prog}: error: {message}\n")


def listen_address(text):
    """host:port with an IP address (IPv6 in brackets) and a port in 1..65535."""
    host, _, port = text.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects IP:PORT, got {text!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be in 1..65535, got {number}")
    return f"[{ip}]:{number}" if ip.version == 6 else f"{ip}:{number}"


def port(text):
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a port number, got {text!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {number}")
    return number


def main(argv=None):
    p = Parser(prog="proxy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--certs", required=True,
                   help="credentials.py's folder: server.crt, server.key, ca.crt")
    p.add_argument("--listen", required=True, type=listen_address,
                   help="the address the SuperNodes reach, IP:PORT (0.0.0.0:PORT: every one)")
    p.add_argument("--superlink-port", required=True, type=port,
                   help="the SuperLink's port on 127.0.0.1 (flower-superlink --host 127.0.0.1)")
    p.add_argument("--workdir", required=True,
                   help="a folder for nginx's pid, logs and temporary folders")
    p.add_argument("--max-body", default="8m", help="the largest request body (default 8m)")
    a = p.parse_args(argv)
    missing = [f for f in ("server.crt", "server.key", "ca.crt")
               if not (Path(a.certs) / f).is_file()]
    if missing:
        p.error(f"--certs {a.certs} lacks {', '.join(missing)} (python flower/credentials.py)")
    if not Path(a.workdir).is_dir():
        p.error(f"--workdir {a.workdir} is not a folder")
    try:
        text = config(a.listen, a.superlink_port, a.certs, a.workdir, a.max_body)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
