"""flower/credentials.py: bad input refused in one line with nothing written; a good run's modes,
certificate and keys; nothing left behind by a failure, a signal or a second run."""
import ast
import datetime
import errno
import hashlib
import ipaddress
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "credentials.py"

import credentials  # noqa: E402

ROOT = os.geteuid() == 0
PRIVATE = {"ca.key", "server.key"}
PUBLIC = {"ca.crt", "server.crt"}
# A valid DNS name of 253 characters, the most RFC 1123 allows; one more makes it invalid.
LONGEST = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])


def names(nodes):
    """(the private files, the public ones) of a run with this many nodes."""
    private = PRIVATE | {f"node-{k}" for k in range(nodes)}
    return private, PUBLIC | {f"node-{k}.pub" for k in range(nodes)}


def snapshot(folder):
    """Every entry under folder and the folder itself (symbolic links not followed): its kind
    and mode, owner, size, modification time and, for a file, a digest of its bytes."""
    seen = {}
    folder = str(folder)
    for top, dirs, files in os.walk(folder):
        for name in [".", *dirs, *files]:
            path = os.path.join(top, name)
            st = os.lstat(path)
            digest = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            key = os.path.normpath(os.path.relpath(path, folder))
            seen[key] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, digest)
    return seen


def private_folder(path, mode=0o700):
    path.mkdir()
    os.chmod(path, mode)  # exactly, whatever the umask
    return path


def refused(capsys, argv, flag, watch):
    """main(argv) exits 2 with one stderr line naming flag, and the folders in watch (the parent
    folder, a symbolic link's target) are as they were, modification times included."""
    before = [snapshot(w) for w in watch]
    with pytest.raises(SystemExit) as e:
        credentials.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert re.match(rf"credentials\.py: error: (argument )?{flag}\b", lines[0]), lines[0]
    assert out == ""
    assert [snapshot(w) for w in watch] == before
    return lines[0]


def run(out, *hosts, nodes=1):
    return credentials.main(["--out", str(out), "--hosts", *hosts, "--nodes", str(nodes)])


@pytest.mark.parametrize(
    "hosts, why",
    [
        ([""], "empty"),
        (["bad host!!"], "neither an IP address nor a DNS name"),
        (["999.1.1.1"], "not an IP address"),
        (["10.1.2"], "not an IP address"),
        (["*.x"], "wildcard"),
        (["1.2.3.4/24"], "network"),
        (["fe80::1%eth0"], "zone"),
        (["a" * 64 + ".example"], "at most 63"),
        ([LONGEST + "d"], "at most 253"),
        (["a.-lead.example"], "neither"),
        (["trail-.example"], "neither"),
        (["b\u00fccher.example"], "neither"),
        (["a..example"], "neither"),
        (["."], "neither"),
        (["server.example\n"], "neither"),
        (["127.0.0.1", "Lab.Example.", "lab.example"], "names lab.example twice"),
        (["::1", "0:0::1"], "names ::1 twice"),
        # "any address": where a server listens, never an address a client connects to
        (["0.0.0.0"], "the unspecified address means 'any address'"),
        (["::"], "the unspecified address"),
        (["0:0::0"], "the unspecified address"),
        (["10.0.0.1", "::ffff:0.0.0.0"], "the unspecified address"),
        (["224.0.0.1"], "a multicast address"),
        (["ff02::1"], "a multicast address"),
        (["255.255.255.255"], "the broadcast address"),
    ],
)
def test_bad_hosts_are_refused_in_one_line_with_nothing_written(tmp_path, capsys, hosts, why):
    parent = private_folder(tmp_path / "p")
    argv = ["--out", str(parent / "certs"), "--hosts", *hosts, "--nodes", "1"]
    assert why in refused(capsys, argv, "--hosts", [parent])


@pytest.mark.parametrize(
    "nodes, why",
    [
        ("0", "--nodes must be positive, got 0"),
        ("-1", "--nodes must be positive, got -1"),
        ("1001", "--nodes must be at most 1000, got 1001"),
        ("100000", "--nodes must be at most 1000, got 100000"),
        ("x", "argument --nodes: invalid int value: 'x'"),
    ],
)
def test_bad_nodes_are_refused_in_one_line_with_nothing_written(tmp_path, capsys, nodes, why):
    parent = private_folder(tmp_path / "p")
    argv = ["--out", str(parent / "certs"), "--hosts", "127.0.0.1", "--nodes", nodes]
    assert refused(capsys, argv, "--nodes", [parent]) == f"credentials.py: error: {why}"


def out_a_file(parent, elsewhere):
    (parent / "f").write_bytes(b"not a folder")
    return parent / "f", "not a folder"


def out_a_symlink(parent, elsewhere):
    # a symbolic link to an empty private folder: refused all the same, never followed
    os.symlink(private_folder(elsewhere / "target"), parent / "link")
    return parent / "link", "symbolic link"


def out_world_writable(parent, elsewhere):
    return private_folder(parent / "certs", 0o777), "writable by others"


def out_world_writable_sticky(parent, elsewhere):
    return private_folder(parent / "certs", 0o1777), "writable by others"


def out_group_writable(parent, elsewhere):
    return private_folder(parent / "certs", 0o770), "writable by others"


def out_not_empty(parent, elsewhere):
    out = private_folder(parent / "certs")
    (out / "notes.txt").write_text("the operator's")
    return out, "already holds notes.txt: credentials are never written over"


def parent_group_writable(parent, elsewhere):
    os.chmod(parent, 0o770)
    return parent / "certs", "writable by others (mode 770, no sticky bit)"


def parent_world_writable(parent, elsewhere):
    os.chmod(parent, 0o777)
    return parent / "certs", "writable by others (mode 777, no sticky bit)"


def grandparent_group_writable(parent, elsewhere):
    os.chmod(parent, 0o775)
    return private_folder(parent / "inner") / "certs", "writable by others (mode 775"


def parent_missing(parent, elsewhere):
    return parent / "missing" / "certs", "cannot be used (No such file or directory)"


def parent_named_with_a_newline(parent, elsewhere):
    # the message is still one line: control characters escaped
    return parent / "new\nline" / "certs", "new\\nline"


def control_character(char):
    """A situation: --out's own name holds char (the message escapes it: still one line)."""
    def out_holding(parent, elsewhere):
        return parent / f"cer{char}ts", f"--out {parent}/cer{repr(char)[1:-1]}ts holds a control"
    out_holding.__name__ = f"out_holding_{ord(char):#04x}"
    return out_holding


def parent_named_with_a_tab(parent, elsewhere):
    # a control character above --out's own name, in a folder that exists
    return private_folder(parent / "in\tner") / "certs", "in\\tner/certs holds a control"


def cwd_named_with_an_escape(parent, elsewhere):
    # --out relative, the control character in the folder it is relative to (its full path)
    inner = private_folder(parent / "in\x1bner")
    os.chdir(inner)
    return "certs", f"--out certs (its full path {parent}/in\\x1bner/certs) holds a control"


def parent_a_file(parent, elsewhere):
    (parent / "f").write_bytes(b"")
    return parent / "f" / "certs", "is not a folder"


def out_of_another_user(parent, elsewhere):
    out = private_folder(parent / "certs")
    os.chown(out, 4242, -1)
    return out, "belongs to another user (uid 4242)"


def parent_of_another_user(parent, elsewhere):
    inner = private_folder(parent / "theirs")
    os.chown(inner, 4242, -1)
    return inner / "certs", "belongs to another user (uid 4242)"


AS_ROOT = pytest.mark.skipif(not ROOT, reason="only root can give a folder to another user")


@pytest.mark.parametrize(
    "situation",
    [
        out_a_file,
        out_a_symlink,
        out_world_writable,
        out_world_writable_sticky,
        out_group_writable,
        out_not_empty,
        parent_group_writable,
        parent_world_writable,
        grandparent_group_writable,
        parent_missing,
        parent_named_with_a_newline,
        parent_a_file,
        *(control_character(c) for c in "\n\r\t\x00\x01\x1b\x1f\x7f"),
        parent_named_with_a_tab,
        cwd_named_with_an_escape,
        pytest.param(out_of_another_user, marks=AS_ROOT),
        pytest.param(parent_of_another_user, marks=AS_ROOT),
    ],
)
def test_a_bad_out_is_refused_in_one_line_with_nothing_written(tmp_path, capsys, situation,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)          # a situation may change the working folder
    parent = private_folder(tmp_path / "p")
    elsewhere = private_folder(tmp_path / "elsewhere")
    out, why = situation(parent, elsewhere)
    argv = ["--out", str(out), "--hosts", "127.0.0.1", "--nodes", "1"]
    assert why in refused(capsys, argv, "--out", [parent, elsewhere])


@pytest.mark.parametrize("out", ["", "/"])
def test_an_out_naming_no_folder_is_refused(tmp_path, capsys, out):
    parent = private_folder(tmp_path / "p")
    refused(capsys, ["--out", out, "--hosts", "127.0.0.1", "--nodes", "1"], "--out", [parent])


def test_an_out_under_proc_is_refused_in_one_line(capsys):
    # /proc's listing changes with every process: nothing of this run's may be in it
    line = refused(capsys, ["--out", "/proc/nope", "--hosts", "x", "--nodes", "1"], "--out", [])
    assert "no folder can be made in /proc" in line
    assert not [n for n in os.listdir("/proc") if "nope" in n]


def verify(ca, leaf, name):
    """leaf's chain to ca for a TLS server reached at name (cryptography's Web PKI checks)."""
    try:
        value = x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        value = x509.DNSName(name)
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(value)
    return verifier.verify(leaf, [])


def check_folder(out, nodes):
    """out: the 0700 folder of this user holding exactly the files for nodes, private ones 0600,
    public ones 0644; each node's OpenSSH key pair EC P-384 and matching."""
    st = os.lstat(out)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    private, public = names(nodes)
    assert set(os.listdir(out)) == private | public
    for name in private | public:
        st = os.lstat(out / name)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == (0o600 if name in private else 0o644), name
    for k in range(nodes):
        key = serialization.load_ssh_private_key((out / f"node-{k}").read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.curve.name == "secp384r1"
        pub = serialization.load_ssh_public_key((out / f"node-{k}.pub").read_bytes())
        assert pub.public_numbers() == key.public_key().public_numbers()
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    for cert, key_file in ((ca, "ca.key"), (leaf, "server.key")):
        key = serialization.load_pem_private_key((out / key_file).read_bytes(), None)
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    return ca, leaf


def alt_names(leaf):
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return ips, san.get_values_for_type(x509.DNSName)


def common_name(cert):
    return cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value


def test_a_good_run_makes_private_files_and_a_certificate_for_every_host(tmp_path, capsys):
    parent = private_folder(tmp_path / "p")
    out = parent / "certs"
    mask = os.umask(0o077)  # the modes are exact whatever the umask: public files 0644 all the same
    try:
        made = run(out, "10.0.0.1", "Server.Lab.example.", "::1", nodes=3)
    finally:
        os.umask(mask)
    stdout, err = capsys.readouterr()
    assert err == "" and len(stdout.splitlines()) == 1 and stdout.startswith(f"10 files in {out}")
    private, public = names(3)
    assert sorted(made) == sorted(out / n for n in private | public)
    assert os.listdir(parent) == ["certs"]  # no temporary folder left beside it
    ca, leaf = check_folder(out, 3)
    ips, dns = alt_names(leaf)
    assert ips == ["10.0.0.1", "::1", "127.0.0.1"] and dns == ["server.lab.example", "localhost"]
    assert common_name(leaf) == "10.0.0.1"
    for name in ips + dns:
        assert len(verify(ca, leaf, name)) == 2
    for name in ("other.example", "10.0.0.2"):
        with pytest.raises(VerificationError):
            verify(ca, leaf, name)
    now = datetime.datetime.now(datetime.timezone.utc)
    assert leaf.not_valid_before_utc < now < leaf.not_valid_after_utc


def test_a_long_host_name_is_in_the_certificate_under_a_fixed_common_name(tmp_path, capsys):
    parent = private_folder(tmp_path / "p")
    out = parent / "certs"
    mask = os.umask(0)  # and private files 0600 with nothing masked
    try:
        run(out, LONGEST.upper(), "x" * 63 + ".example")
    finally:
        os.umask(mask)
    ca, leaf = check_folder(out, 1)
    ips, dns = alt_names(leaf)
    assert ips == ["127.0.0.1"] and dns == [LONGEST, "x" * 63 + ".example", "localhost"]
    assert common_name(leaf) == credentials.FIXED_COMMON_NAME
    assert len(verify(ca, leaf, LONGEST)) == 2


def test_make_keeps_run_local_s_call_and_adds_no_loopback_twice(tmp_path):
    made = credentials.make(tmp_path / "certs", ["127.0.0.1", "localhost"], 2)
    assert sorted(made) == sorted(tmp_path / "certs" / n for n in set.union(*names(2)))
    ca, leaf = check_folder(tmp_path / "certs", 2)
    assert alt_names(leaf) == (["127.0.0.1"], ["localhost"])
    with pytest.raises(ValueError, match="--nodes"):
        credentials.make(tmp_path / "more", ["127.0.0.1"], True)
    with pytest.raises(ValueError, match="--hosts"):
        credentials.make(tmp_path / "more", "127.0.0.1", 1)
    assert sorted(os.listdir(tmp_path)) == ["certs"]


def test_grpc_trusts_the_superlink_at_loopback_and_only_with_its_ca(tmp_path):
    """What Flower's processes do: gRPC (its own TLS) reaches a server with server.crt at
    127.0.0.1 and localhost trusting ca.crt, and not trusting another CA."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    credentials.make(tmp_path / "certs", ["127.0.0.1", "localhost"], 1)
    credentials.make(tmp_path / "other", ["127.0.0.1"], 1)
    pair = [((tmp_path / "certs/server.key").read_bytes(),
             (tmp_path / "certs/server.crt").read_bytes())]
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair))
    server.start()

    def ready(ca, host, seconds):
        trust = grpc.ssl_channel_credentials(root_certificates=(tmp_path / ca).read_bytes())
        with grpc.secure_channel(f"{host}:{port}", trust) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=seconds)
                return True
            except grpc.FutureTimeoutError:
                return False

    try:
        assert ready("certs/ca.crt", "127.0.0.1", 10)
        assert ready("certs/ca.crt", "localhost", 10)
        assert not ready("other/ca.crt", "127.0.0.1", 1)
    finally:
        server.stop(0)


def test_an_empty_private_out_is_replaced_and_a_sticky_parent_accepted(tmp_path, capsys):
    parent = private_folder(tmp_path / "p", 0o1777)  # as /tmp: others cannot rename our entries
    out = private_folder(parent / "certs", 0o755)
    run(out, "127.0.0.1")
    check_folder(out, 1)
    assert os.listdir(parent) == ["certs"]


def test_a_second_run_is_refused_and_the_first_run_s_files_stay_as_they_were(tmp_path, capsys):
    parent = private_folder(tmp_path / "p")
    made = run(parent / "certs", "127.0.0.1")
    capsys.readouterr()
    before = {p: p.read_bytes() for p in made}
    argv = ["--out", str(parent / "certs"), "--hosts", "127.0.0.1", "--nodes", "2"]
    line = refused(capsys, argv, "--out", [parent])
    assert "credentials are never written over" in line
    with pytest.raises(ValueError, match="never written over"):
        credentials.make(parent / "certs", ["127.0.0.1"], 2)
    assert {p: p.read_bytes() for p in made} == before
    assert not (parent / "certs" / "node-1").exists() and os.listdir(parent) == ["certs"]


def failing_after(monkeypatch, parent, calls, error):
    """credentials.private raises error at its calls-th call, once the temporary folder holds
    files. The list returned: the paths it was given, then {each entry of the parent: the files
    in it} as they were at the failure."""
    seen = []
    write = credentials.private

    def private(path, data):
        seen.append(path)
        if len(seen) == calls:
            seen.append({n: sorted(os.listdir(parent / n)) for n in os.listdir(parent)})
            raise error
        write(path, data)

    monkeypatch.setattr(credentials, "private", private)
    return seen


def test_a_write_failing_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    parent = private_folder(tmp_path / "p")
    seen = failing_after(monkeypatch, parent, 4, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(SystemExit) as e:
        run(parent / "certs", "127.0.0.1", nodes=3)
    out, err = capsys.readouterr()
    assert e.value.code == 1 and out == ""
    assert err.splitlines() == [f"credentials.py: error: --out {parent / 'certs'}: writing failed "
                                f"(No space left on device); nothing was written"]
    # it failed at node-1's key, with the CA's, the server's and node-0's files written beside
    (held,) = seen[-1].values()
    assert seen[-2].name == "node-1" and held == sorted(set.union(*names(1)))
    assert os.listdir(parent) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("a library's failure")])
def test_make_interrupted_or_failing_midway_leaves_nothing(tmp_path, monkeypatch, error):
    """run_local.py's Ctrl-C arrives in make() as KeyboardInterrupt; a library may raise."""
    parent = private_folder(tmp_path / "p")
    seen = failing_after(monkeypatch, parent, 4, error)
    with pytest.raises(type(error)):
        credentials.make(parent / "certs", ["127.0.0.1"], 3)
    (held,) = seen[-1].values()
    assert seen[-2].name == "node-1" and held == sorted(set.union(*names(1)))
    assert os.listdir(parent) == []


def test_a_folder_filled_meanwhile_is_never_written_over(tmp_path, capsys, monkeypatch):
    """--out empty when checked, then filled before the rename: the rename fails, one line."""
    parent = private_folder(tmp_path / "p")
    out = private_folder(parent / "certs")
    write = credentials.public

    def public(path, data):
        write(path, data)
        if path.name == "node-0.pub":
            (out / "theirs").write_text("arrived meanwhile")

    monkeypatch.setattr(credentials, "public", public)
    line = refused(capsys, ["--out", str(out), "--hosts", "127.0.0.1", "--nodes", "1"], "--out",
                   [])
    assert "cannot be replaced now" in line and "nothing was written" in line
    assert os.listdir(parent) == ["certs"] and os.listdir(out) == ["theirs"]
    assert (out / "theirs").read_text() == "arrived meanwhile"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_making_keys_leaves_nothing(tmp_path, sig):
    parent = private_folder(tmp_path / "p")
    argv = ["--out", str(parent / "certs"), "--hosts", "127.0.0.1", "--nodes", "1000"]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # It is making keys once its temporary folder holds node-0 (1000 take seconds).
        deadline = time.monotonic() + 20
        started = False
        while not started and proc.poll() is None and time.monotonic() < deadline:
            for entry in os.listdir(parent):
                try:
                    started = started or "node-0" in os.listdir(parent / entry)
                except FileNotFoundError:
                    pass
            time.sleep(0.005)
        assert started and proc.poll() is None, "the run ended before it was signalled"
        proc.send_signal(sig)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=20)
        # It stops at its next key, not after the 1000 (which take seconds more here).
        assert time.monotonic() - signalled < 2
    finally:
        proc.kill()
        proc.wait()
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err
    assert err.splitlines() == [f"credentials.py: interrupted ({name}); nothing was written"]
    assert out == ""
    assert os.listdir(parent) == []


def test_the_script_stands_alone_and_its_help_says_the_bound(tmp_path):
    """No import of the project and no sys.path edit: it runs isolated (-I), from anywhere."""
    source = SCRIPT.read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"cryptography"}
    assert "sys.path" not in source
    help_ = subprocess.run([sys.executable, "-I", str(SCRIPT), "--help"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "1 to 1000" in " ".join(help_.stdout.split())
    bad = subprocess.run([sys.executable, "-I", str(SCRIPT), "--out", "c", "--hosts", "bad host!!",
                          "--nodes", "1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.splitlines()) == 1
    assert bad.stderr.startswith("credentials.py: error: --hosts 'bad host!!'")
    assert os.listdir(tmp_path) == []
