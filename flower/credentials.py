"""What a secure Flower federation needs (docs/flower.md, "Several devices"): a CA, the SuperLink's
TLS certificate for the addresses the SuperNodes reach it at, and one key pair per SuperNode, whose
public key the SuperLink's operator registers (flwr supernode register). Every private file is
written for its owner alone (0600, in a 0700 folder); nothing is ever written over.

    python flower/credentials.py --out certs --hosts 127.0.0.1 server.lab.example --nodes 3

    certs/ca.crt                   the CA's certificate: every SuperNode and `flwr` trusts it
    certs/ca.key                   the CA's key: keep it off the devices
    certs/server.crt, server.key   the SuperLink's certificate (its names: --hosts) and key
    certs/node-K, node-K.pub       SuperNode K's key pair (EC P-384, OpenSSH format), K = 0..N-1
"""

import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DAYS = 365


def private(path, data):
    """data at path, readable and writable by its owner alone, never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def public(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def pem(key):
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def certificate(subject, issuer, key, signer, ca=False, names=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
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


def make(out, hosts, nodes):
    """Everything above in `out` (made, 0700, if missing): the paths written."""
    out = Path(out)
    taken = [f for f in files(nodes) if (out / f).exists()]
    if taken:
        raise ValueError(
            f"{out} already holds {', '.join(taken[:3])}: credentials are never written over; "
            f"give another --out"
        )
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP384R1()),
        ec.generate_private_key(ec.SECP384R1()),
    )
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedood federation CA")])
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    private(out / "ca.key", pem(ca_key))
    public(out / "ca.crt", certificate(ca_name, ca_name, ca_key, ca_key, ca=True))
    private(out / "server.key", pem(server_key))
    public(out / "server.crt", certificate(server_name, ca_name, server_key, ca_key, names=hosts))
    for k in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        private(
            out / f"node-{k}",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            ),
        )
        public(
            out / f"node-{k}.pub",
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            ),
        )
    return [out / f for f in files(nodes)]


def main(argv=None):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from harness.config import Parser

    p = Parser(prog="credentials.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", required=True, help="folder for the files (made 0700; nothing in it overwritten)"
    )
    p.add_argument(
        "--hosts",
        nargs="+",
        required=True,
        help="the SuperLink's addresses as the SuperNodes reach it (IPs or DNS names)",
    )
    p.add_argument("--nodes", type=int, required=True, help="SuperNode key pairs to make")
    a = p.parse_args(argv)
    if a.nodes < 1:
        p.error(f"--nodes must be positive, got {a.nodes}")
    try:
        made = make(a.out, a.hosts, a.nodes)
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(
        f"{len(made)} files in {a.out}: ca.crt for every SuperNode and flwr; server.crt and "
        f"server.key for "
        f"the SuperLink; node-K for SuperNode K, node-K.pub to register (flwr supernode register)"
    )
    return made


if __name__ == "__main__":
    main()
