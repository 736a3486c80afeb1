"""What every method shares on Flower: the wire format, the server's link to the nodes, the node's
view of its partition, and the entry points of the ServerApp and the ClientApp.

The server runs the method file's own main() (its flags, defaults and checks), and through it
common.run (data, the held-out domain, seeding, evaluation, checkpoints, the results JSON); only the
round function is the Flower one of fl_methods.py, which sends the clients' parts of the round to
the nodes as messages and runs the server's parts (the method file's server functions) on their
replies. One node per client: the node's partition id (node config `partition-id`) is the client id.

Random streams. Every method file draws all its clients' minibatches from ONE generator (ctx.gen),
client after client in the order of the round; the server keeps that generator and hands its state
to each node that draws from it, takes back the state the node leaves, and hands it to the next one:
those messages go one node after another, and the run equals the method file's own bit for bit.
Messages that draw nothing go to all nodes at once. The server samples with common.sample_clients
on its own seeded generator (never Flower's node sampling). Replies are ordered by partition id.
"""
import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("FEDOOD_ROOT") or Path(__file__).resolve().parent.parent)
if (ROOT / "common.py").exists() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402

METHODS = ("fedavg", "fediir", "fedomg", "fedloe", "perinvfl", "fedipg")


# ------------------------------------------------------------------------------------ the wire

def pack(d):
    """A dict of tensors, lists of them, numbers, strings, bytes and None -> a RecordDict: tensors
    in the ArrayRecord "a" (exact bytes, numpy format), the rest in the ConfigRecord "c"."""
    arrays, config = {}, {}

    def put(key, v):
        if torch.is_tensor(v):
            arrays[key] = Array(v.detach().cpu().contiguous())
        elif isinstance(v, (list, tuple)) and any(torch.is_tensor(x) or isinstance(x, (list, tuple)) for x in v):
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
    """The bytes Flower moves for a RecordDict: its serialised objects (what the SuperLink stores)."""
    return sum(len(o.deflate()) for o in get_all_nested_objects(rd).values())


# --------------------------------------------------------------------------------- the server

class Link:
    """The server's side: which node holds which client, and the message round trips of a round."""

    def __init__(self, grid, wait=600.0):
        self.grid, self.wait, self.nodes, self.args, self.method, self.out = grid, wait, None, None, None, None
        self.moved = {}        # round -> [bytes down, bytes up]
        self.times = {}        # round -> seconds of messaging and client work

    def connect(self, P):
        """Wait for P nodes, ask each its partition id: {client id: node id}."""
        end = time.time() + self.wait
        while len(ids := sorted(self.grid.get_node_ids())) < P:
            if time.time() > end:
                raise common.UserError(f"{len(ids)} node(s) connected, {P} needed (one per client)")
            time.sleep(0.5)
        replies = self._send([(i, "query.hello", {}) for i in ids], 0)
        parts = {int(r["partition"]): i for i, r in zip(ids, replies)}
        if sorted(parts) != list(range(P)):
            raise common.UserError(f"the nodes' partition ids are {sorted(parts)}; this run needs 0..{P - 1}, one each")
        self.nodes = parts

    def ask(self, t, kind, requests, fed, gen=None):
        """requests: [(client id, dict)]; `kind` a message type ("train.fedavg"). Returns the replies'
        dicts in the order of `requests`. gen: the minibatch generator the clients draw from, handed
        from one to the next (one message at a time); None: all at once."""
        if self.nodes is None:
            self.connect(len(fed.clients))
        start = time.perf_counter()
        common_part = {"method": self.method, "args": self.args, "domain": fed.name, "round": t}
        if gen is None:
            out = self._send([(self.nodes[c], kind, {**common_part, **d}) for c, d in requests], t)
        else:
            out = []
            for c, d in requests:
                (r,) = self._send([(self.nodes[c], kind, {**common_part, **d, "gen": gen.get_state()})], t)
                gen.set_state(r.pop("gen"))
                out.append(r)
        self.times[t] = self.times.get(t, 0.0) + time.perf_counter() - start
        return out

    def _send(self, items, t):
        msgs = [Message(pack(d), node, kind, group_id=str(t)) for node, kind, d in items]
        moved = self.moved.setdefault(t, [0, 0])
        moved[0] += sum(nbytes(m.content) for m in msgs)
        replies = {}
        for r in self.grid.send_and_receive(msgs):
            replies[r.metadata.reply_to_message_id] = r
        out = []
        for m in msgs:
            r = replies.get(m.metadata.message_id)
            if r is None or r.has_error():
                why = r.error.reason if r is not None else "no reply"
                raise RuntimeError(f"node {m.metadata.dst_node_id} ({m.metadata.message_type}): {why}")
            moved[1] += nbytes(r.content)
            out.append(unpack(r.content))
        return out


def serve(grid, method, argv, rounds, wait=600.0):
    """The ServerApp's work: `method`'s own main(argv) with its round function replaced by
    rounds(link, t, model, fed, args, state, ctx). Returns (results, link)."""
    mod = importlib.import_module(method)
    link, run = Link(grid, wait), common.run
    link.method = method

    def flower_run(name, args, round_fn, init_state, evaluate_fn, argv=None):
        if args.parallel_clients == "on":
            raise common.UserError("--parallel-clients on: on Flower every client trains on its own node; use off")
        link.args, link.out = json.dumps(vars(args)), args.out   # as common.run receives them; the nodes resolve the rest alike
        fn = lambda t, model, fed, a, state, ctx: rounds(link, t, model, fed, a, state, ctx)
        return run(name, args, fn, init_state, evaluate_fn, argv)
    common.run = flower_run
    try:
        return mod.main(argv), link
    finally:
        common.run = run


# ----------------------------------------------------------------------------------- the nodes

class Node:
    """A node's client: the method's args, its own Client of the federation, a model, a Context."""

    def __init__(self, method, args, domain, partition):
        self.args = args
        common.set_deterministic(not args.nondeterministic)
        with contextlib.redirect_stdout(io.StringIO()):   # (the loader's notes are the server's to print)
            ds = data.load(args.dataset, args.data_root, args.seed, clients=args.clients or 100, alpha=args.alpha,
                           p_test=args.p_test, stain=args.stain, rotation=not args.no_rotation)
            data.test_domains(args, ds)       # as common.run: resolves --clients, --sample, --client-size
        device = torch.device(args.device)
        names = [d.name for d in ds.domains]
        self.fed = data.federate_fixed(ds, args.seed, device) if domain == "clients" else \
            data.federate(ds, names.index(domain), args.clients, args.seed, device,
                            client_size=getattr(args, "client_size", None))
        with torch.random.fork_rng(devices=[]):            # the server's initial model, as train_domain
            torch.manual_seed(args.seed)
            self.model = common.build_model(args, ds).to(device)
        self.ctx = common.Context(device, torch.Generator(device), torch.Generator(), data.make_prep(args.dataset, device),
                                  args.amp)
        mod = importlib.import_module(method)
        # the method's own start on this federation (FedLOE's tune split, FedIPG's rotated client, PerInvFL's θ_i^0)
        self.init = mod.init_state(self.model, self.fed, args, self.ctx) if hasattr(mod, "init_state") else {}
        self.client = self.fed.clients[partition]


_NODES = {}   # (args, domain, partition) -> Node: reused while this process lives (one run in-process)


def node_for(req, context):
    key = (req["args"], req["domain"], int(context.node_config["partition-id"]))
    if key not in _NODES:
        args = argparse.Namespace(**json.loads(req["args"]))
        if "data-root" in context.node_config:            # this device's copy of the data
            args.data_root = str(context.node_config["data-root"])
        _NODES.clear()
        _NODES[key] = Node(req["method"], args, req["domain"], key[2])
    return _NODES[key]


def load_state(context, node):
    """What this node keeps across rounds for the current held-out domain (Flower's Context.state)."""
    rec = context.state.get("fedood", ConfigRecord())
    blob = rec.get(node.fed.name)
    return torch.load(io.BytesIO(blob), weights_only=True) if blob else {}


def save_state(context, node, kept):
    buf = io.BytesIO()
    torch.save(kept, buf)
    rec = context.state.get("fedood", ConfigRecord())
    rec[node.fed.name] = buf.getvalue()
    context.state["fedood"] = rec


def client_app(handlers):
    """A ClientApp with handlers {message type: fn(node, request, context) -> reply dict}."""
    from flwr.clientapp import ClientApp
    app = ClientApp()

    @app.query("hello")
    def hello(msg, context):
        return Message(pack({"partition": int(context.node_config["partition-id"])}), reply_to=msg)

    def wrap(fn):
        def handle(msg, context):
            req = unpack(msg.content)
            node = node_for(req, context)
            req = common.to_device(req, node.ctx.device)
            if "gen" in req:
                node.ctx.gen.set_state(req["gen"].cpu())
            out = fn(node, req, context)
            if "gen" in req:
                out["gen"] = node.ctx.gen.get_state()
            return Message(pack(out), reply_to=msg)
        return handle
    for kind, fn in handlers.items():
        category, action = kind.split(".")
        getattr(app, category)(action)(wrap(fn))
    return app


def report(link):
    """Per-round messaging time and bytes: on the server's stdout and in <out>.flower.json."""
    rounds = {t: {"seconds": link.times.get(t, 0.0), "down": d, "up": u} for t, (d, u) in link.moved.items()}
    common.write_json(str(Path(link.out).with_suffix(".flower.json")), {"rounds": rounds})
    for t in sorted(link.moved):
        down, up = link.moved[t]
        print(f"flower: round {t}: {link.times.get(t, 0.0):.2f} s of messages and client work, "
              f"{down / 2**20:.3f} MiB down, {up / 2**20:.3f} MiB up", flush=True)
