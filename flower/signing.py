"""Every reply is its own node's: each node signs its reply with its own key (the node-K file of
flower/credentials.py, the one its SuperNode authenticates with: node config `key`) over what it
answers, and the server checks the signature against the key registered for that site (run config
`keys`, node-K.pub) before anything else (docs/flower.md: Every reply is its node's).

Why: flwr 1.42's SuperLink checks that a pushed message is signed by a registered node, not that
it is that node's: a registered device can push a reply whose source is another node and which
answers that node's message, and the SuperLink stores it as that node's. The signature binds the
reply to the site whose key made it.

What a node signs (`statement`): this format's name, the run, the round and the exchange the
server sent, the message it answers, its site, and a SHA-256 of its reply's content (every record
but the signature's, in key order: each array's dtype, shape and bytes, each value's repr). ECDSA
with SHA-384 on the nodes' EC P-384 keys (the `cryptography` package, as Flower's own).
"""
import hashlib
from pathlib import Path

from flwr.app import Array, ConfigRecord

FORMAT = "fedood-reply/1"
RECORD = "s"                              # the record that holds the signature, in a reply


def private_key(path):
    """A node's own private key (an OpenSSH file, as flower/credentials.py writes node-K)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    try:
        key = serialization.load_ssh_private_key(Path(path).read_bytes(), None)
    except (OSError, ValueError) as e:
        raise ValueError(f"node config key {path}: not an unencrypted OpenSSH private key "
                         f"({type(e).__name__})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"node config key {path}: not an EC key (credentials.py makes EC P-384)")
    return key


def public_keys(folder):
    """{site: its public key} of the node-K.pub files in `folder` (flower/credentials.py's)."""
    from cryptography.hazmat.primitives import serialization
    keys = {}
    for path in Path(folder).glob("node-*.pub"):
        k = path.name[len("node-"):-len(".pub")]
        if k.isdigit():
            keys[int(k)] = serialization.load_ssh_public_key(path.read_bytes())
    return keys


def digest(content):
    """SHA-256 of a reply's records (a RecordDict) but the signature's, in key order."""
    h = hashlib.sha256()
    for name in sorted(k for k in content if k != RECORD):
        record = content[name]
        for k in sorted(record):
            v = record[k]
            h.update(f"{name}/{k}\0".encode())
            h.update(f"{v.dtype} {v.shape}\0".encode() + v.data if isinstance(v, Array) else
                     repr(v).encode())
            h.update(b"\0")
    return h.hexdigest()


def statement(run, t, phase, answers, site, content):
    """The bytes a node signs for its reply `content` to message `answers` of round t's exchange
    `phase`, from site `site` in run `run`."""
    return "\n".join([FORMAT, str(run), str(t), phase, answers, str(site),
                      digest(content)]).encode()


def sign(content, key, run, t, phase, answers, site):
    """content (a reply's RecordDict), signed: the signature in its record RECORD."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    text = statement(run, t, phase, answers, site, content)
    content[RECORD] = ConfigRecord({"signature": key.sign(text, ec.ECDSA(hashes.SHA384()))})
    return content


def unsigned(content, key, run, t, phase, answers, site):
    """None if `content` carries a signature of `statement` by `key` (a public key), else why."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    if key is None:
        return f"no key of site {site} is registered (run config keys)"
    record = content.get(RECORD)
    signature = record.get("signature") if record is not None else None
    if not isinstance(signature, bytes):
        return "it is not signed"
    try:
        key.verify(signature, statement(run, t, phase, answers, site, content),
                   ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return f"its signature is not site {site}'s key's over it"
    return None
