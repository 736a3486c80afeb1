"""A registered device that answers another node's message in that node's name, for the tests
(flower/test_deploy.py; docs/flower.md: Every reply is its node's). It connects to the SuperLink
through the proxy as a SuperNode of its own key would (Flower's own Fleet client: its requests
signed by that key, naming its own node id), waits until the victim node's log shows the message
of round --round it receives, and pushes a reply to it whose source is the victim node: an update
of the right shape and keys (θ 0.5 everywhere), signed with the forger's own key as if it were the
victim's site (--sign), or unsigned.

    python flower/forger.py --superlink 127.0.0.1:PORT --ca certs/ca.crt --key certs/node-4 \\
        --victim-log logs/supernode-0.log --victim-node ID --victim-site 0 --round 2 --size N

It prints one line: what it pushed (or why it could not), and exits 0 once pushed.
"""
import argparse
import re
import sys
import time
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:2]]   # up to the checkout

RECEIVING = re.compile(r"\[RUN (\d+), ROUND (\d+)\]\s*\n.*Receiving: train\.client message "
                       r"\(ID: ([0-9a-f]+)\)")


def victims_message(log, t, start, seconds=600):
    """(run id, message id) of the first train.client message of round t that the victim's log
    shows after its first `start` characters (those of earlier runs)."""
    end = time.time() + seconds
    while time.time() < end:
        text = Path(log).read_text(errors="replace")[start:]
        found = [(int(run), mid) for run, r, mid in RECEIVING.findall(text) if int(r) == t]
        if found:
            return found[0]
        time.sleep(0.05)
    raise SystemExit(f"forger.py: no message of round {t} in {log} within {seconds} s")


def main(argv=None):
    p = argparse.ArgumentParser(prog="forger.py", description=__doc__.split("\n\n")[0])
    for flag in ("--superlink", "--ca", "--key", "--victim-log"):
        p.add_argument(flag, required=True)
    for flag in ("--victim-node", "--victim-site", "--round", "--size"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--sign", action="store_true", help="sign with the forger's key as the site's")
    a = p.parse_args(argv)
    import torch
    from cryptography.hazmat.primitives import serialization
    from flwr.app import Message
    from flwr.app.metadata import Metadata
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.inflatable.inflatable_object import (get_all_nested_objects,
                                                              get_object_tree)
    from flwr.supernode.fleet_http_connection import http_request_response

    import fl_adapter
    import signing
    private = serialization.load_ssh_private_key(Path(a.key).read_bytes(), None)
    start = len(Path(a.victim_log).read_text(errors="replace"))     # what came before: not this run
    with http_request_response(a.superlink, False, a.ca, (private, private.public_key())) as conn:
        node_id, _, send, _, _, _, push_object, _ = conn
        print(f"forger.py: connected as node {node_id}", flush=True)
        run, answers = victims_message(a.victim_log, a.round, start)
        now = time.time()
        content = fl_adapter.pack({"delta": torch.full((a.size,), 0.5), "loss": torch.tensor(1.0),
                                   "_began": now, "_ready": now, "_ended": now,
                                   "_round": a.round, "_phase": "client_update"})
        if a.sign:
            signing.sign(content, signing.private_key(a.key), run, a.round, "client_update",
                         answers, a.victim_site)
        # the SuperLink takes a reply whose TTL is within what is left of its message's (12 h)
        metadata = Metadata(run, "", a.victim_node, SUPERLINK_NODE_ID, answers, str(a.round),
                            now, 43200 - 600, "train.client")
        reply = Message(content=content, metadata=metadata)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        wanted, session = send(reply, get_object_tree(reply), 0.0)
        for oid, obj in get_all_nested_objects(reply).items():
            if oid in wanted:
                push_object(run, session, oid, obj.deflate())
        how = "signed with its own key" if a.sign else "unsigned"
        print(f"forger.py: device node {node_id} pushed a reply to message {answers[:12]}… in the "
              f"name of node {a.victim_node} ({how})", flush=True)


if __name__ == "__main__":
    main()
