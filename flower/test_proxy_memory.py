"""What an outsider can make the proxy hold (flower/proxy.py; measured by flower/proxy_memory.py):
the configuration's bound, the script's refusals, and (nginx, marked slow) the bound on a real
nginx: one address's requests beyond PER_ADDRESS answered 503, its silent ones dropped after
TIMEOUT, while other addresses, and the server's own, pass."""
import difflib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import proxy
import proxy_memory
from proxy_memory import ATTACKER, MIB, OTHER

HERE = Path(__file__).resolve().parent
NGINX = pytest.mark.skipif(shutil.which("nginx") is None,
                           reason="nginx not installed: apt-get install nginx-light")


def test_the_configuration_bounds_what_one_address_holds(tmp_path):
    text = proxy.config("0.0.0.0:9092", 9091, tmp_path, tmp_path)
    server = text[text.index("    server {"):]
    assert re.search(r"map \$remote_addr \$client_address \{\n +default \$binary_remote_addr;\n"
                     r' +127\.0\.0\.1 "";\n +"::1" "";\n +\}', text)
    assert "limit_conn_zone $client_address zone=per_address:1m;" in text
    for line in (f"limit_conn per_address {proxy.PER_ADDRESS};", "limit_conn_status 503;",
                 f"client_header_timeout {proxy.TIMEOUT};", f"client_body_timeout {proxy.TIMEOUT};",
                 "client_body_buffer_size 8m;", "client_max_body_size 8m;"):
        assert re.search(rf"^ +{re.escape(line)}", server, re.M), line
    # an honest SuperNode has up to 3 requests at once (proxy.py's docstring): 2 fit behind one
    # address; the timeout is under nginx's default 60 s
    assert proxy.PER_ADDRESS >= 6 and int(proxy.TIMEOUT.rstrip("s")) < 60


def test_the_configuration_before_is_this_one_less_the_bound(tmp_path):
    """proxy_memory.py's "before": every other line of proxy.py's configuration as it is, in
    order (the routes, the 403s, TLS); only the bound's 11 lines gone."""
    text = proxy.config("0.0.0.0:9092", 9091, tmp_path, tmp_path)
    before = proxy_memory.unbounded(text)
    lines, kept = text.splitlines(), before.splitlines()
    ops = difflib.SequenceMatcher(None, lines, kept, autojunk=False).get_opcodes()
    assert {op for op, *_ in ops} == {"equal", "delete"}        # lines removed, none changed
    gone = [line.strip() for op, i, j, _, _ in ops if op == "delete" for line in lines[i:j]]
    assert len(gone) == len(lines) - len(kept) == 11, gone
    assert all(re.match(r"(#|map \$remote_addr|default \$binary|127\.0\.0\.1 |\"::1\" |\}|"
                        r"limit_conn|client_(header|body)_timeout)", g) for g in gone), gone
    assert "limit_conn" not in before and "timeout" not in before
    assert "return 403;" in before and "client_body_buffer_size 8m;" in before


def script(tmp_path, *argv, path=None):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, str(HERE / "proxy_memory.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("argv,expect", [
    (["--connections", "0"], "--connections must be 1 to 400 each (nginx takes 512 at once), "
                             "got 0"),
    (["--connections", "30", "401"], "--connections must be 1 to 400 each"),
    (["--connections", "x"], "argument --connections: invalid int value: 'x'"),
    (["--hold", "0"], "--hold must be 1 to 600 seconds, got 0"),
    (["--max-body", "8m; allow all"], "--max-body '8m; allow all': give a size as nginx writes"),
    (["--max-body", "1"], "--max-body '1'"),
])
def test_proxy_memory_refuses_bad_input_in_one_line(tmp_path, argv, expect):
    r = script(tmp_path, *argv)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("proxy_memory.py: error: ") and expect in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []                      # no temporary folder, no certificate


def test_proxy_memory_without_nginx_says_how_to_install_it(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    r = script(tmp_path, path=str(empty))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "proxy_memory.py: error: nginx not found: apt-get install nginx-light\n"
    assert os.listdir(tmp_path) == ["bin"]


def status(conn, seconds):
    """The status of the reply on conn within `seconds` (None: closed without one, or none)."""
    if isinstance(conn, OSError):
        return None
    conn.settimeout(seconds)
    got = b""
    try:
        while b"\r\n" not in got and (chunk := conn.recv(4096)):
            got += chunk
    except OSError:
        pass
    return proxy_memory.status_of(got)


def dropped_after(conn, seconds):
    """Seconds until nginx closes conn (None: not within `seconds`)."""
    t0 = time.monotonic()
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
    except socket.timeout:
        return None
    except OSError:
        pass
    return time.monotonic() - t0


@pytest.mark.slow
@NGINX
def test_one_address_holds_at_most_per_address_bodies_for_at_most_the_timeout(
        tmp_path, no_flower_left):
    """On nginx with proxy.py's configuration: 3 * PER_ADDRESS connections from one outsider
    address, each a body one byte short of --max-body, then silent. PER_ADDRESS of them are held
    (nginx's memory grows by about their bodies, not by all of them), the rest answered 503;
    meanwhile an honest 5 MiB request from another address, and from 127.0.0.1 (not limited)
    with PER_ADDRESS silent ones of its own open, pass unchanged; nginx drops the held ones
    about TIMEOUT after their last byte, and the address is served again."""
    import credentials
    credentials.make(tmp_path / "certs", ["127.0.0.1", "localhost"], 1)
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    upstream = proxy_memory.Upstream(tmp_path / "certs")
    port = proxy_memory.free_port()
    text = proxy.config(f"127.0.0.1:{port}", upstream.port, tmp_path / "certs", work)
    length, n, timeout = 8 * MIB - 1, proxy.PER_ADDRESS, int(proxy.TIMEOUT.rstrip("s"))
    conns = []
    try:
        with proxy_memory.nginx(text, work) as master:
            before = proxy_memory.nginx_rss(master)
            held = [proxy_memory.open_request(port, length, length - 1) for _ in range(n)]
            conns += held
            last_byte = time.monotonic()
            more = [proxy_memory.open_request(port, length, length - 1) for _ in range(2 * n)]
            conns += more
            assert [status(c, 10) for c in more] == [503] * (2 * n)
            grown = proxy_memory.nginx_rss(master) - before
            # n bodies of 8 MiB and some slack; all 3n would be 192 MiB
            assert grown < (n + 2) * 8 * 1024, grown / 1024
            assert proxy_memory.honest(port, OTHER) == (200, True)
            local = [proxy_memory.open_request(port, length, length - 1, "127.0.0.1")
                     for _ in range(n)]
            conns += local
            assert proxy_memory.honest(port, "127.0.0.1") == (200, True)
            assert proxy_memory.honest(port, ATTACKER) == (503, False)
            drops = [dropped_after(c, timeout + 10) for c in held]
            assert None not in drops, drops
            # the last held one sent its last byte at last_byte: dropped about TIMEOUT later
            longest = time.monotonic() - last_byte
            assert timeout - 1 < longest < timeout + 5, longest
            assert proxy_memory.honest(port, ATTACKER) == (200, True)
    finally:
        for c in conns:
            if not isinstance(c, OSError):
                c.close()
        upstream.close()
