"""A Grid in one process for tests and timing: no ports, no ray. Every message and every reply goes
through Flower's own serialisation (the objects a SuperLink stores, deflated to bytes and inflated
back) on its way to the ClientApp, which runs with a Context per node (its node config and
state) and on behalf of its folder (audit.acting: what the node may read)."""
import itertools
import types
import uuid

from flwr.app import Context, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

import audit


def round_trip(rd):
    """rd as bytes and back: a new RecordDict, nothing shared with rd."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(rd).items()}
    out = inflate_object_from_contents(rd.object_id, contents)
    assert isinstance(out, RecordDict)
    return out


class FakeGrid(Grid):
    """A node per folder of `folders`, node k holding site k (its node config: partition-id k, data
    its folder, evaluate-only from site `train` on; `train` None: every node trains); node ids
    unrelated to partition ids. Each node's NodeInfo (get_nodes) says when it came online (node k
    at second k) and its public key, as the SuperLink's do: `keys`, {node id: PEM bytes}, default
    none."""

    def __init__(self, client_app, folders, run_config=None, node_ids=None, keys=None,
                 train=None):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.app, self._run = client_app, types.SimpleNamespace(run_id=1)     # the nodes' run too
        n = len(folders)
        ids = node_ids or [1000 + 7 * k for k in range(n)][::-1]
        config = lambda p: {"partition-id": p, "num-partitions": n, "data": str(folders[p]),
                            "evaluate-only": train is not None and p >= train}
        self.contexts = {nid: Context(1, nid, config(p), RecordDict(), run_config or {})
                         for p, nid in enumerate(ids)}
        self.activated = {nid: f"2026-01-01T00:00:{k:02d}+00:00" for k, nid in enumerate(ids)}
        self.keys = keys or {}
        self.replies, self.sent = {}, itertools.count()

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        from flwr.app import Message
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def get_nodes(self):
        from flwr.proto.node_pb2 import NodeInfo
        return [NodeInfo(node_id=i, last_activated_at=self.activated[i],
                         public_key=self.keys.get(i, b"")) for i in self.contexts]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            msg.content = round_trip(msg.content)
            context = self.contexts[msg.metadata.dst_node_id]
            with audit.acting(str(context.node_config["data"])):     # on the node's behalf
                reply = self.app(msg, context)
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            if reply.has_content():
                reply.content = round_trip(reply.content)
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(list(messages)))


class ThreadGrid(FakeGrid):
    """FakeGrid whose nodes answer the messages of one send_and_receive at the same time, one thread
    each (as SuperNodes would), so that the timing of the nodes' work can be checked in process."""

    def push_messages(self, messages):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max(1, len(messages))) as pool:
            return [i for ids in pool.map(lambda m: FakeGrid.push_messages(self, [m]), messages)
                    for i in ids]
