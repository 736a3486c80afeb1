"""Make what a secure Flower federation needs (docs/flower.md, "Several devices"): a CA, the
SuperLink's TLS certificate for the names the SuperNodes reach it at, and one key pair per
SuperNode, whose public key the SuperLink's operator registers (flwr supernode register).

    python flower/credentials.py --out certs --hosts SERVER_IP server.lab.example --nodes 3

    certs/ca.crt                   the CA's certificate: every SuperNode and `flwr` trusts it
    certs/ca.key                   the CA's key: keep it off the devices
    certs/server.crt, server.key   the SuperLink's certificate and key
    certs/node-K, node-K.pub       SuperNode K's key pair (EC P-384, OpenSSH format), K = 0..N-1

The certificate (EC P-384, 365 days). Its SubjectAlternativeName holds every --hosts entry and,
always, 127.0.0.1 (an IP address) and localhost (a DNS name): on the server, a TLS-terminating
proxy, the operator's `flwr` and Flower's own ServerApp process reach the SuperLink at loopback and
check its certificate. Its CommonName is the first --hosts entry if it fits in x509's 64
characters, else "fedood SuperLink": TLS clients check the SubjectAlternativeName, not the name.

Checked before anything is written; a refusal is one line on stderr naming the flag, and exit 2:
- --hosts: IP addresses (no networks, no IPv6 zone) and DNS names (RFC 1123: labels of 1 to 63
  letters, digits and inner hyphens, at most 253 characters in all; a trailing dot dropped; letter
  case ignored; no wildcard; a last label of digits alone, neither a name nor an IP address, is
  refused). A name given twice is refused: it is a mistake, not a wish. An address no client
  connects to is refused too: 0.0.0.0 and :: (the unspecified address, in any spelling, IPv4 in
  IPv6 included: "any address" is where a server listens, not an address it is reached at), a
  multicast address and 255.255.255.255 (a TLS connection has one peer).
- --nodes: 1 to MAX_NODES (1000).
- --out: no control character (below 0x20, or 0x7f) in its full path: a newline, tab or escape
  in a folder's name is a mistake, not a wish.
- --out must not exist, or be an empty folder, not a symbolic link (never followed), owned by this
  user and writable by no one else: it is then replaced. The folder that holds --out must exist;
  it and each folder above it must belong to this user or root and be writable by no one else,
  unless it has the sticky bit (as /tmp has): whoever can rename entries there could swap the
  credentials for a set of their own before they are handed out. OpenSSH checks ~/.ssh so.

How it writes (POSIX). Into a fresh temporary folder (mkdtemp, 0700) beside --out, on the same
file system: each file made new (never over another), the private keys (ca.key, server.key,
node-K) 0600 and the rest 0644 whatever the umask, each flushed to disk; then that folder becomes
--out, 0700, in one rename. A failure before that rename, or SIGINT, SIGTERM or SIGHUP (one line,
exit 128 + the signal's number), removes the temporary folder: --out holds all the files or does
not exist. A second run with the same --out is refused: nothing is ever written over.
"""

import argparse
import datetime
import ipaddress
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAYS = 365
MAX_NODES = 1000
# Always in the certificate: the server's own processes reach the SuperLink at loopback.
LOOPBACK = ("127.0.0.1", "localhost")
# The CommonName when the first --hosts entry is longer than x509 allows (64 characters).
FIXED_COMMON_NAME = "fedood SuperLink"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# One DNS label (RFC 1123): letters and digits, hyphens inside, 1 to 63 characters (ASCII only).
LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", re.ASCII)
# The control characters (C0 and DEL), refused in --out.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The one IPv4 address that is neither unspecified nor multicast and still names no one peer.
BROADCAST = ipaddress.IPv4Address("255.255.255.255")


class Refused(ValueError):
    """Bad input, found before anything is written; the message starts with its flag."""


class Interrupted(Exception):
    """A signal noted by main()'s handler; make() stops at its next file and cleans up."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The signals main()'s handler noted. The handler only notes them and make() checks between
# files, so that no exception lands in the middle of a write or of the removal of what it made.
_noted = []


def _note(signum, frame):
    _noted.append(signum)


def _stop_if_signalled():
    if _noted:
        raise Interrupted(_noted[0])


def host(text):
    """text as the certificate holds it (an IP address in its usual form, a DNS name in lower case
    without a trailing dot), or Refused."""
    if not isinstance(text, str):
        raise Refused(f"--hosts takes names as text, got {text!r}")
    if not text:
        raise Refused("--hosts holds an empty name")
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        ip = None
    if ip is not None:
        if getattr(ip, "scope_id", None):
            raise Refused(f"--hosts {text!r}: an IPv6 zone (%...) cannot be in a certificate")
        # ::ffff:0.0.0.0 is 0.0.0.0 for a client: judged as the IPv4 address it carries
        plain = getattr(ip, "ipv4_mapped", None) or ip
        if plain.is_unspecified:
            raise Refused(f"--hosts {text!r}: the unspecified address means 'any address', where "
                          f"a server listens; a certificate names an address clients connect to: "
                          f"give the SuperLink's own")
        if plain.is_multicast or plain == BROADCAST:
            kind = "a multicast" if plain.is_multicast else "the broadcast"
            raise Refused(f"--hosts {text!r}: {kind} address, which no TLS client connects to: "
                          f"give the SuperLink's own")
        return str(ip)
    name = text[:-1] if text.endswith(".") else text
    name = name.lower()
    why = None
    if "*" in name:
        why = "a wildcard is not accepted: give each name"
    elif "/" in name:
        why = "a network is not an address: give the SuperLink's own address"
    elif len(name) > 253:
        why = f"a DNS name has at most 253 characters, this one {len(name)}"
    else:
        labels = name.split(".")
        long = [label for label in labels if len(label) > 63]
        if long:
            why = f"a DNS label has at most 63 characters, {long[0][:8]}... has {len(long[0])}"
        elif not all(LABEL.fullmatch(label) for label in labels):
            why = ("neither an IP address nor a DNS name (labels of letters, digits and inner "
                   "hyphens, joined by dots)")
        elif labels[-1].isdigit():
            # 999.1.1.1 or 10.1.2: not an IP address, and no top-level domain is a number
            why = "not an IP address, and a DNS name's last label is not a number"
    if why:
        raise Refused(f"--hosts {text!r}: {why}")
    return name


def host_names(hosts):
    """The --hosts entries as the certificate holds them, in order; Refused if one is bad or given
    twice (after the forms above: 'Lab.example.' and 'lab.example' are one name)."""
    if isinstance(hosts, str):
        raise Refused(f"--hosts takes a list of names, got the text {hosts!r}")
    if not hosts:
        raise Refused("--hosts needs at least one IP address or DNS name")
    out = []
    for text in hosts:
        name = host(text)
        if name in out:
            raise Refused(f"--hosts names {name} twice")
        out.append(name)
    return out


def _node_count(nodes):
    if isinstance(nodes, bool) or not isinstance(nodes, int):
        raise Refused(f"--nodes must be a whole number, got {nodes!r}")
    if nodes < 1:
        raise Refused(f"--nodes must be positive, got {nodes}")
    if nodes > MAX_NODES:
        raise Refused(f"--nodes must be at most {MAX_NODES}, got {nodes}")
    return nodes


def _open_to_others(st):
    """Whether others than the owner may rename or remove entries in this folder."""
    return bool(st.st_mode & 0o022) and not st.st_mode & stat.S_ISVTX


def destination(out):
    """(the real folder that will hold --out, --out's name in it), or Refused: the rules for --out
    and the folders above it in the module's docstring."""
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
        raise Refused("--out is empty")
    text = os.fsdecode(os.fspath(out))
    path = os.path.abspath(text)
    bad = CONTROL.search(path)
    if bad:
        where = "" if CONTROL.search(text) else f" (its full path {one_line(path)})"
        raise Refused(f"--out {one_line(text)}{where} holds a control character "
                      f"({one_line(bad[0])}): give a folder name without one")
    name = os.path.basename(path)
    if not name:
        raise Refused(f"--out {out} names no folder")
    me = os.geteuid()
    # Symbolic links above --out are resolved once, here; from then on only the real path is used.
    parent = os.path.realpath(os.path.dirname(path))
    try:
        st = os.stat(parent)
    except OSError as e:
        raise Refused(f"--out {out}: its folder {parent} cannot be used ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"--out {out}: {parent} is not a folder")
    folder = parent
    while True:
        st = os.lstat(folder)
        if st.st_uid not in (0, me):
            raise Refused(f"--out {out}: {folder} belongs to another user (uid {st.st_uid}), "
                          f"who could swap the files: choose a folder of your own")
        if _open_to_others(st):
            raise Refused(f"--out {out}: {folder} is writable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}, no sticky bit), who could swap the "
                          f"files: choose a private folder")
        above = os.path.dirname(folder)
        if above == folder:
            break
        folder = above
    target = os.path.join(parent, name)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return parent, name
    except OSError as e:
        raise Refused(f"--out {out} cannot be used ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise Refused(f"--out {out} is a symbolic link, which is never followed: give a new "
                      f"folder's name")
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"--out {out} exists and is not a folder")
    if st.st_uid != me:
        raise Refused(f"--out {out} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise Refused(f"--out {out} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                      f"give a new folder's name")
    held = sorted(os.listdir(target))
    if held:
        raise Refused(f"--out {out} already holds {', '.join(held[:3])}"
                      f"{', ...' if len(held) > 3 else ''}: credentials are never written over; "
                      f"give another --out")
    return parent, name


def _write(path, data, mode):
    """A new file at path holding data, with exactly `mode` whatever the umask, flushed to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def private(path, data):
    """data at path, readable and writable by its owner alone, never over an existing file."""
    _write(path, data, 0o600)


def public(path, data):
    """data at path, readable by all, never over an existing file."""
    _write(path, data, 0o644)


def _sync_folder(path):
    """Flush a folder's entries to disk (the names of the files in it, a rename into it). At best:
    some file systems cannot flush a folder, and the files themselves were flushed already."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pem(key):
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def certificate(subject, issuer, key, signer, ca=False, names=()):
    """A certificate for `key`'s public key, signed by `signer` (whose certificate names `issuer`):
    the CA's (ca=True: it signs certificates only) or a TLS server's for `names`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=DAYS))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
            critical=False,
        )
    )
    if ca:
        # A CA that signs end certificates only (no intermediate CAs below it).
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        usage = dict(key_cert_sign=True, crl_sign=True, digital_signature=False)
    else:
        b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        b = b.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        # An EC key signs the TLS handshake: digital signature is its one use.
        usage = dict(key_cert_sign=False, crl_sign=False, digital_signature=True)
    b = b.add_extension(
        x509.KeyUsage(
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
            **usage,
        ),
        critical=True,
    )
    if names:
        alt = []
        for n in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                alt.append(x509.DNSName(n))
        b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return b.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def files(nodes):
    return ["ca.crt", "ca.key", "server.crt", "server.key"] + [
        f"node-{k}{e}" for k in range(nodes) for e in ("", ".pub")
    ]


def _write_all(folder, hosts, nodes):
    """Every file of `files(nodes)` in `folder`, the server's certificate for `hosts`."""
    sans = hosts + [n for n in LOOPBACK if n not in hosts]
    common = hosts[0] if len(hosts[0]) <= 64 else FIXED_COMMON_NAME
    ca_key = ec.generate_private_key(ec.SECP384R1())
    server_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedood federation CA")])
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
    private(folder / "ca.key", pem(ca_key))
    public(folder / "ca.crt", certificate(ca_name, ca_name, ca_key, ca_key, ca=True))
    private(folder / "server.key", pem(server_key))
    public(folder / "server.crt", certificate(server_name, ca_name, server_key, ca_key, names=sans))
    for k in range(nodes):
        _stop_if_signalled()
        key = ec.generate_private_key(ec.SECP384R1())
        private(
            folder / f"node-{k}",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            ),
        )
        public(
            folder / f"node-{k}.pub",
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            ),
        )


def make(out, hosts, nodes):
    """The files of the module's docstring in a new folder `out`, by its rules: the paths
    written. Refused (a ValueError) for bad input, before anything is written; any other failure,
    KeyboardInterrupt included, leaves no folder behind."""
    nodes = _node_count(nodes)
    hosts = host_names(hosts)
    parent, name = destination(out)
    _stop_if_signalled()
    try:
        # The leading dot keeps it out of plain listings; mkdtemp makes it 0700 with a fresh name.
        tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
    except OSError as e:
        raise Refused(f"--out {out}: no folder can be made in {parent} ({e.strerror})") from None
    try:
        os.chmod(tmp, 0o700)  # mkdtemp's 0700 less the umask's bits: 0700 exactly
        _write_all(Path(tmp), hosts, nodes)
        _sync_folder(tmp)
        _stop_if_signalled()
        try:
            # The one step at which the files appear. Onto an existing folder it succeeds only if
            # that folder is still empty: a folder filled meanwhile is never written over.
            os.rename(tmp, os.path.join(parent, name))
        except OSError as e:
            raise Refused(f"--out {out} cannot be replaced now ({e.strerror}): nothing was "
                          f"written") from None
    except BaseException:
        # Our own 0700 folder: nothing but a failing disk keeps its removal from succeeding.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync_folder(parent)
    return [Path(out) / f for f in files(nodes)]


def one_line(text):
    """text with its control characters escaped: a path holding a newline stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage and the message
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def parser():
    p = Parser(
        prog="credentials.py",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        epilog="Bad input is refused before anything is written; the files appear together, in "
        "one rename, or not at all (a failure or SIGINT/SIGTERM/SIGHUP removes the temporary "
        "folder). The details: the docstring of flower/credentials.py.",
    )
    p.add_argument(
        "--out",
        required=True,
        help="the folder to make (0700; private keys 0600, the rest 0644): it must not exist, or "
        "be an empty folder of yours that no one else can write to (not a symbolic link); the "
        "folders above it must belong to you or root and be writable by no one else (or be "
        "sticky, as /tmp)",
    )
    p.add_argument(
        "--hosts",
        nargs="+",
        required=True,
        help="the SuperLink's IP addresses and DNS names as the SuperNodes reach it, each once "
        "(no networks, no wildcards; not 0.0.0.0, :: or a multicast address, which no client "
        "connects to); the certificate also holds 127.0.0.1 and localhost, where the server's "
        "own processes reach it; its CommonName is the first entry, or "
        f"'{FIXED_COMMON_NAME}' if that is over 64 characters",
    )
    p.add_argument(
        "--nodes",
        type=int,
        required=True,
        help=f"SuperNode key pairs to make, 1 to {MAX_NODES}: each is registered by hand (flwr "
        "supernode register) and run on a device of its own, so more is a typo, not a federation",
    )
    return p


def main(argv=None):
    """The command line; the paths made (or SystemExit: 2 for bad input, 1 for a failure while
    writing, 128 + the signal's number for SIGINT, SIGTERM and SIGHUP)."""
    p = parser()
    a = p.parse_args(argv)
    _noted.clear()
    before = {s: signal.signal(s, _note) for s in SIGNALS}
    try:
        made = make(a.out, a.hosts, a.nodes)
    except Refused as e:
        p.error(str(e))
    except Interrupted as e:
        print(f"{p.prog}: interrupted ({e}); nothing was written", file=sys.stderr)
        sys.exit(128 + e.signum)
    except OSError as e:
        why = one_line(f"--out {a.out}: writing failed ({e.strerror or e})")
        print(f"{p.prog}: error: {why}; nothing was written", file=sys.stderr)
        sys.exit(1)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    # A signal after the rename is ignored: the folder is complete by then.
    print(
        f"{len(made)} files in {a.out}: ca.crt for every SuperNode and flwr; server.crt and "
        f"server.key for the SuperLink; node-K for SuperNode K, node-K.pub to register (flwr "
        f"supernode register)"
    )
    return made


if __name__ == "__main__":
    main()
