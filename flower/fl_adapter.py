"""The Flower App: every method file's own round, its clients on Flower's nodes (docs/flower.md).

The ServerApp runs the method file's run through the harness, harness.main(METHOD) (its flags,
defaults and checks; data, the held-out domain, seeding, evaluation, checkpoints, the results JSON),
with one change: the engine of common.on_clients is a `Link`, a parameter of the run. Each exchange
of a round is then one message to every sampled node at once, carrying the client function's name,
what the server sent, the round and the exchange; each node runs that function (the method file's
own) on its client, with the client's own random stream (common.stream of the seed, the held-out
domain, the round, the client and the exchange) and its own state (Flower's Context.state), and
replies. The replies are put in the order of the clients' ids, as in process. So the nodes train at
the same time, and a run equals the method file's own run bit for bit. One node per client: the
node's partition id (node config `partition-id`) is the client id. The server samples with
common.sample_clients on its own seeded generator (never Flower's sampling).
"""
import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

# the checkout (FEDOOD_ROOT where the App runs from a copy of its own, as Flower installs it):
# the methods, and their variants under benchmark/ whose client functions a node may run
ROOT = Path(os.environ.get("FEDOOD_ROOT") or Path(__file__).resolve().parent.parent)
sys.path[:0] = [str(ROOT / d) for d in (".", "benchmark", "benchmark/diagnostics")]

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import harness  # noqa: E402
from harness import outputs  # noqa: E402
from harness.config import after_load, load_data  # noqa: E402
from harness.methods import METHODS, client_functions, qualified  # noqa: E402
from harness.outputs import to_device  # noqa: E402



# ------------------------------------------------------------------------------------ the wire

def pack(d):
    """A dict of tensors, lists of them, numbers, strings, bytes and None -> a RecordDict: tensors
    in the ArrayRecord "a" (exact bytes, numpy format), the rest in the ConfigRecord "c"."""
    arrays, config = {}, {}

    def put(key, v):
        if torch.is_tensor(v):
            arrays[key] = Array(v.detach().cpu().contiguous())
        elif isinstance(v, (list, tuple)) and any(torch.is_tensor(x) or isinstance(x, (list, tuple))
                                                  for x in v):
            config[key + "#n"] = len(v)
            for i, x in enumerate(v):
                put(f"{key}/{i}", x)
        elif v is None:
            config[key + "#none"] = True
        else:
            config[key] = list(v) if isinstance(v, tuple) else v
    for k, v in d.items():
        put(k, v)
    return RecordDict({"a": ArrayRecord(arrays), "c": ConfigRecord(config)})


def unpack(rd):
    arrays, config = rd.get("a", ArrayRecord()), rd.get("c", ConfigRecord())

    def get(key):
        if key in arrays:
            return torch.from_numpy(arrays[key].numpy().copy())
        if key + "#n" in config:
            return [get(f"{key}/{i}") for i in range(int(config[key + "#n"]))]
        return None if key + "#none" in config else config[key]
    keys = {k.split("/")[0].split("#")[0] for k in list(arrays) + list(config)}
    return {k: get(k) for k in keys}


def nbytes(rd):
    """The bytes Flower moves for a RecordDict: its serialised objects, each once (what the
    SuperLink stores: equal chunks of an array are one object)."""
    return sum(len(o.deflate()) for o in get_all_nested_objects(rd).values())


def unpacked_bytes(rd):
    """The bytes a RecordDict takes once rebuilt, every array counted whole (400 MB of zeros is
    400 MB here, a few objects on the wire): what unpacking it would allocate again."""
    arrays = sum(len(a.data) for r in rd.array_records.values() for a in r.values())
    return arrays + sum(len(c.deflate()) for c in rd.config_records.values())


def function(name):
    module, qualname = name.split(":")
    return getattr(importlib.import_module(module), qualname)


def declared(method):
    """What a node may run for a run of `method`: the client functions its method file declares
    (METHOD.clients: those its round passes to common.on_clients) and its init_state, as
    "module:qualname" (harness.client_functions). Any other name in a message is refused."""
    return client_functions(method) if method in METHODS else frozenset()


def activated(info):
    """When a node last came online (Flower's NodeInfo.last_activated_at, ISO 8601), as a sortable
    string; "" where the grid does not say."""
    return str(getattr(info, "last_activated_at", "") or "")


def node_keys(folder):
    """{public key as Flower stores it (PEM): partition id} of the node-K.pub files that
    flower/credentials.py made in `folder` (the key of node K is partition K's)."""
    from cryptography.hazmat.primitives import serialization
    keys = {}
    for path in Path(folder).glob("node-*.pub"):
        k = path.name[len("node-"):-len(".pub")]
        if k.isdigit():
            key = serialization.load_ssh_public_key(path.read_bytes())
            keys[key.public_bytes(serialization.Encoding.PEM,
                                  serialization.PublicFormat.SubjectPublicKeyInfo)] = int(k)
    if not keys:
        raise common.UserError(f"keys {folder}: no node-K.pub in it (flower/credentials.py)")
    return keys


class BadReply(common.NonFinite):
    """A node's reply that the round must not use (or its refusal): the run ends as at a non-finite
    number, exit 1, its last good checkpoint kept, so that --resume goes
    on once the node is fixed."""


# a reply may be at most this many times the bytes of the same reply in process (+ 64 kB)
MAX_BYTES = 4


def schema(reply):
    """{key: ("tensor", shape, dtype) or ("value", type name)} of a client function's reply."""
    def one(v):
        if torch.is_tensor(v):
            return ("tensor", tuple(v.shape), str(v.dtype))
        if isinstance(v, (list, tuple)):
            return ("list", tuple(one(x) for x in v))
        return ("value", type(v).__name__)
    return {k: one(v) for k, v in reply.items()}


# what every reply carries besides the client function's own keys (work, on the node)
SPAN = {"_began": "float", "_ended": "float", "_round": "int", "_phase": "str"}


def what_is_wrong(reply, expect, t, phase):
    """None, or what makes a node's reply to round t's exchange `phase` unusable: missing or extra
    keys, the node's own fields (SPAN) of another type, another round or exchange, a span that
    ends before it begins, tensors of other shapes or dtypes than the same function gives in
    process (`expect`: schema), non-finite values."""
    got = schema(reply)
    want = {**expect, **{k: ("value", kind) for k, kind in SPAN.items()}}
    if got.keys() != want.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        return ", ".join([f"missing {', '.join(missing)}"] * bool(missing)
                         + [f"extra {', '.join(extra)}"] * bool(extra))
    for k in SPAN:
        if got[k] != want[k]:
            return f"{k} is {got[k]}, where a node sends {want[k]}"
    if (reply["_round"], reply["_phase"]) != (t, phase):
        return f"it answers round {reply['_round']} ({reply['_phase']}), not round {t} ({phase})"
    if not (math.isfinite(reply["_began"]) and math.isfinite(reply["_ended"])
            and reply["_began"] <= reply["_ended"]):
        return f"its span {reply['_began']}-{reply['_ended']} is not a span of time"
    for k in expect:
        if got[k] != expect[k]:
            return f"{k} is {got[k]}, where the client function gives {expect[k]}"

    def finite(v):
        if torch.is_tensor(v):
            return not v.is_floating_point() or bool(v.isfinite().all())
        if isinstance(v, (list, tuple)):
            return all(finite(x) for x in v)
        return not isinstance(v, float) or math.isfinite(v)
    bad = [k for k in expect if not finite(reply[k])]
    return f"non-finite {', '.join(bad)}" if bad else None


# --------------------------------------------------------------------------------- the server

class Link:
    """common.on_clients' engine on Flower: which node holds which client, and each exchange as one
    message to every node of it at once. Per round: bytes down and up, seconds, and each node's
    working span."""

    def __init__(self, grid, wait=600.0, method=None, init=None, keys=None):
        self.grid, self.wait, self.nodes, self.args, self.out = grid, wait, None, None, None
        self.method, self.init = method, init       # the run's method and its init_state, by name
        self.keys = keys          # {a node's public key (PEM): the partition id it was made for}
        # round -> [down, up]; seconds; node spans
        self.moved, self.times, self.spans = {}, {}, {}
        self.expected = {}                                 # (fn, phase, domain) -> the replies

    def connect(self, P):
        """Wait for P nodes, ask each its partition id: {client id: node id}. With `keys`, a node
        holds the partition its registered key was made for, whatever it claims; without, of two
        claims of one partition the later node's is refused (its activation time)."""
        end = time.time() + self.wait
        while len(ids := sorted(self.grid.get_node_ids())) < P:
            if time.time() > end:
                raise common.UserError(f"{len(ids)} node(s) connected, {P} needed "
                                       "(one per client)")
            time.sleep(0.5)
        info = {n.node_id: n for n in self.grid.get_nodes()}
        said = [(i, int(r["partition"]))
                for i, r in zip(ids, self._send([(i, "query.hello", {}) for i in ids], 0))]
        if self.keys is not None:
            for i, p in said:
                own = self.keys.get(bytes(getattr(info.get(i), "public_key", b"")))
                if own != p:
                    whose = "a key of no partition" if own is None else f"partition {own}'s key"
                    raise BadReply(f"a bad reply from node {i}: it claims partition id {p}, and "
                                   f"its registered key is {whose}")
        parts = {}
        for i, p in sorted(said, key=lambda s: activated(info.get(s[0]))):
            if p in parts:
                raise BadReply(f"a bad reply from node {i}: it claims partition id {p}, which "
                               f"node {parts[p]} has held since before it connected; "
                               f"this run needs 0..{P - 1}, one node each")
            parts[p] = i
        if sorted(parts) != list(range(P)):
            raise common.UserError(f"the nodes' partition ids are {sorted(parts)}; "
                                   f"this run needs 0..{P - 1}, one each")
        self.nodes = parts

    def __call__(self, fn, S, sents, t, phase, ctx):
        if self.args is None:          # the run's arguments, as the nodes set themselves up with
            self.args, self.out = json.dumps(vars(ctx.args)), ctx.args.out
        if self.nodes is None:
            self.connect(len(ctx.fed.clients))
        expect = [self.reference(fn, c, sent, t, phase, ctx) for c, sent in zip(S, sents)]
        start = time.perf_counter()
        head = {"fn": qualified(fn), "phase": phase, "round": t, "domain": ctx.fed.name,
                "args": self.args, "init": self.init, "method": self.method}
        replies = self._send([(self.nodes[c], "train.client",
                               {**head, **{f"sent.{k}": v for k, v in sent.items()}})
                              for c, sent in zip(S, sents)], t, clients=S,
                             most=[MAX_BYTES * size + 2 ** 16 for _, size in expect])
        # every reply checked before the round sees one
        for c, r, (shape, _) in zip(S, replies, expect):
            wrong = what_is_wrong(r, shape, t, phase)
            if wrong:
                raise BadReply(f"a bad reply in round {t} from node {self.nodes[c]} "
                               f"(partition {c}): {wrong}")
        self.times[t] = self.times.get(t, 0.0) + time.perf_counter() - start
        self.spans.setdefault(t, []).extend((phase, c, r.pop("_began"), r.pop("_ended"))
                                            for c, r in zip(S, replies))
        # in the order of S: the clients' ids
        return [to_device({k: v for k, v in r.items() if not k.startswith("_")}, ctx.device)
                for r in replies]

    def reference(self, fn, c, sent, t, phase, ctx):
        """(schema, bytes) of what `fn` replies for client c in process: run on the server once per
        function, exchange, held-out domain and client (a reply's shapes may follow the client's
        data: FedLOE's predictions), with a scratch state and the random generators as they were."""
        key = (qualified(fn), phase, ctx.fed.name, c)
        if key not in self.expected:
            devices = [ctx.device] if ctx.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                out = fn(common.site(dataclasses.replace(ctx, clients={}), c, t, phase), sent)
            self.expected[key] = schema(out), unpacked_bytes(pack(out))
        return self.expected[key]

    def _send(self, items, t, clients=None, most=None):
        msgs = [Message(pack(d), node, kind, group_id=str(t)) for node, kind, d in items]
        moved = self.moved.setdefault(t, [0, 0])
        moved[0] += sum(nbytes(m.content) for m in msgs)
        replies = {r.metadata.reply_to_message_id: r for r in self.grid.send_and_receive(msgs)}
        out = []
        for k, m in enumerate(msgs):
            r, who = replies.get(m.metadata.message_id), f"node {m.metadata.dst_node_id}" + \
                (f" (partition {clients[k]})" if clients is not None else "")
            if r is None or r.has_error():
                why = r.error.reason if r is not None else "no reply"
                raise BadReply(f"a bad reply in round {t} from {who}: {why}")
            size = unpacked_bytes(r.content)
            if most is not None and size > most[k]:     # before it is unpacked into tensors
                raise BadReply(f"a bad reply in round {t} from {who}: {size:,} bytes, "
                               f"the most this exchange takes is {most[k]:,}")
            moved[1] += nbytes(r.content)
            out.append(unpack(r.content))
        return out


class RunFailed(Exception):
    """The method's run ended in an error (its one line): raised in the ServerApp, so that Flower
    marks the run failed at once, with that line as its details, and sends its logs on."""


class Said(io.TextIOBase):
    """stderr as it was, and every line written to it kept (the run's error line)."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []

    def write(self, text):
        self.lines += [line for line in text.splitlines() if line.strip()]
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def serve(grid, method, argv, wait=600.0, keys=None):
    """The ServerApp's work: `method`'s own run, harness.main(METHOD, argv), with a Link as
    common.on_clients' engine; its clients never train at once in process (--parallel-clients
    auto: off; on: refused). keys: a folder of the nodes' node-K.pub (Link). Returns (results,
    link). A run that ends in an error writes its line into <out>.flower.json ("error") where
    --out is known, and raises RunFailed with it."""
    own = importlib.import_module(method).METHOD
    link = Link(grid, wait, method, qualified(own.init_state) if own.init_state else None)
    on_nodes = dataclasses.replace(own, parallel=lambda args: "trains every client on its own "
                                   "node on Flower")
    said = Said(sys.stderr)
    try:
        with contextlib.redirect_stderr(said):
            link.keys = node_keys(keys) if keys else None
            results = harness.main(on_nodes, argv, engine=link)
    except (SystemExit, common.UserError) as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        line = f"{method}.py: error: {e}" if isinstance(e, common.UserError) else next(
            (x for x in reversed(said.lines) if x.startswith(f"{method}.py: ")),
            f"{method}.py: exit {e.code}")
        if link.out is not None:
            report(link, line)
        raise RunFailed(line) from None
    if link.out is not None:            # (a run with no exchange: a complete result at --out)
        report(link)
    return results, link


def report(link, error=None):
    """Per round: seconds of messages and client work, bytes, and each node's span; the run's
    error line if it failed (<out>.flower.json)."""
    rounds = {t: {"seconds": link.times.get(t, 0.0), "down": d, "up": u,
                  "spans": link.spans.get(t, [])}
              for t, (d, u) in link.moved.items()}
    outputs.write_json(f"{link.out}.flower.json",
                       {"rounds": rounds, **({"error": error} if error else {})})
    for t in sorted(link.moved):
        down, up = link.moved[t]
        print(f"flower: round {t}: {link.times.get(t, 0.0):.2f} s of messages and client work, "
              f"{down / 2**20:.3f} MiB down, {up / 2**20:.3f} MiB up", flush=True)


# ----------------------------------------------------------------------------------- the nodes

class Node:
    """A node's view: the run's federation as the server builds it (its seed fixes it; the method's
    own setup, init_state, done here too: FedLOE's tuning split), a model to compute with, the
    client it holds."""

    def __init__(self, init, args, domain, partition):
        common.set_deterministic(not args.nondeterministic)
        # (the loader's notes are the server's to print)
        with contextlib.redirect_stdout(io.StringIO()):
            ds = load_data(args)
            after_load(args, ds)       # as harness.run: settles --clients, --sample, --client-size
        device = torch.device(args.device)
        names = [d.name for d in ds.domains]
        fed = data.federate_fixed(ds, args.seed, device) if domain == "clients" else \
            data.federate(ds, names.index(domain), args.clients, args.seed, device,
                          client_size=getattr(args, "client_size", None))
        with torch.random.fork_rng(devices=[]):
            model = common.global_model(args, ds, device)
        self.ctx = common.Context(device, torch.Generator(), data.make_prep(args.dataset, device),
                                  args.amp, args, fed, model, {})
        if init:
            function(init)(model, fed, args, self.ctx)
        self.partition, self.domain = partition, domain


_NODES = {}   # (args, init, domain, partition) -> Node: reused while this process lives (one run)
_NODES_LOCK = threading.Lock()   # nodes that answer in threads of one process (simulation engines)


def node_for(req, context):
    """This node's client: made once per run and held-out domain (under the lock: the seeded model
    and the dropping of another run's nodes are one at a time), then reused."""
    key = (req["args"], req["init"], req["domain"], int(context.node_config["partition-id"]))
    with _NODES_LOCK:
        if key not in _NODES:
            args = argparse.Namespace(**json.loads(req["args"]))
            if "data-root" in context.node_config:            # this device's copy of the data
                args.data_root = str(context.node_config["data-root"])
            for old in [k for k in _NODES if k[:3] != key[:3]]:   # another run or held-out domain's
                del _NODES[old]
            _NODES[key] = Node(req["init"], args, req["domain"], key[3])
        return _NODES[key]


def refused(req, context, also=frozenset()):
    """Why this node will not run what `req` names (None: it will): a function that the run's method
    file does not declare a client's work (declared), or a method that is not one of the six."""
    method = str(context.run_config.get("method", "") or req.get("method") or "")
    allowed = declared(method) | set(also)
    for name in (req.get("fn"), req.get("init")):
        if name is not None and name not in allowed:
            return f"{name} is not a client function of {method or 'this run'}.py; nothing was run"
    return None


def work(msg, context, also=frozenset()):
    """One exchange on this node: the named client function on its client, its stream, its state;
    an error reply, and nothing run, where the function is not the method file's (refused)."""
    began, req = time.time(), unpack(msg.content)          # the node's span: its setup and its work
    why = refused(req, context, also)
    if why:
        return Message(reply_to=msg, error=Error(code=403, reason=why))
    node = node_for(req, context)
    ctx, c = node.ctx, node.partition
    sent = to_device({k[5:]: v for k, v in req.items() if k.startswith("sent.")}, ctx.device)
    # the client's own state, per held-out domain
    record = context.state.get("fedood", ConfigRecord())
    kept = (torch.load(io.BytesIO(record[node.domain]), weights_only=True)
            if node.domain in record else {})
    ctx.clients = {c: to_device(kept, ctx.device)}
    out = function(req["fn"])(common.site(ctx, c, req["round"], req["phase"]), sent)
    out = {**out, "_began": began, "_ended": time.time(), "_round": req["round"],
           "_phase": req["phase"]}
    if ctx.clients[c]:
        buf = io.BytesIO()
        torch.save(ctx.clients[c], buf)
        record[node.domain] = buf.getvalue()
        context.state["fedood"] = record
    return Message(pack(out), reply_to=msg)


def client_app(also=()):
    """The ClientApp: its partition id on `query.hello`, an exchange of a round on `train.client`.
    also: functions it runs besides the method files' own (a test's stand-ins)."""
    from flwr.clientapp import ClientApp
    app = ClientApp()

    @app.query("hello")
    def hello(msg, context):
        return Message(pack({"partition": int(context.node_config["partition-id"])}), reply_to=msg)

    allowed = frozenset(qualified(f) for f in also)
    app.train("client")(lambda msg, context: work(msg, context, allowed))
    return app
