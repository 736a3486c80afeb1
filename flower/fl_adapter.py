"""The Flower App: every method file's own round, its clients on Flower's nodes (docs/flower.md).

The ServerApp runs the method file's run through the harness, harness.main(METHOD) (its flags,
defaults and checks; seeding, checkpoints, the results JSON), with two parameters of the run: the
engine of common.on_clients is a `Link`, and so are the run's `sites`: the server reads no data,
it learns each site's sizes from its node (query.hello) and computes with stand-ins of them
(harness.sites). Each exchange of a round is one message to every node of it at once, carrying the
client function's name, what the server sent, the round and the exchange; each node runs that
function (the method file's own) on its own site, read from its own folder (node config `data`),
with the client's own random stream (common.stream of the seed, the held-out domain, the round,
the client and the exchange) and its own state (Flower's Context.state), and replies, signed with
its key (flower/signing.py). The server checks every reply (its signature, then its fields against
the function's declaration) and puts them in the order of the sites' ids, as in process. So the
nodes train at the same time, every site evaluates on its own data, and a run equals the method
file's own run bit for bit. One node per site: its partition id (node config `partition-id`) is
the site's id (the clients, then the evaluation sites). The server samples with
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
import secagg  # noqa: E402
import signing  # noqa: E402
from harness import outputs, sites  # noqa: E402
from harness.methods import METHODS, client_functions, qualified, run_clients  # noqa: E402
from harness.outputs import to_device  # noqa: E402
from harness.runner import NonFinite  # noqa: E402



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


def declared(method, evaluate_only=False, args=None):
    """What a node may run for a run of `method` with the arguments `args` (a dict): the client
    functions its method file declares (METHOD.clients: those its round passes to
    common.on_clients; METHOD.evaluations) and its init_state, as "module:qualname"
    (harness.client_functions); an evaluation-only node the evaluations alone (and the setup).
    Any other name in a message is refused."""
    if method not in METHODS:
        return frozenset()
    try:
        return client_functions(method, evaluate_only,
                                argparse.Namespace(**args) if args is not None else None)
    except AttributeError:          # run arguments without a flag its clients follow: none of them
        return client_functions(method, evaluate_only)


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


class BadReply(NonFinite):
    """A node's reply that the round must not use (or its refusal): the run ends as at a non-finite
    number, exit 1, its last good checkpoint kept, so that --resume goes
    on once the node is fixed."""


# a reply may be at most this many times the bytes of its declaration (+ 64 kB)
MAX_BYTES = 4


def kind(v):
    """What a reply's value is, to compare with its declaration: ("tensor", shape, dtype),
    ("count", most, shape) (declared: common.Count), ("list", ...) or ("value", type name)."""
    if isinstance(v, common.Count):
        return ("count", v.most, tuple(v.shape))
    if torch.is_tensor(v):
        return ("tensor", tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return ("list", tuple(kind(x) for x in v))
    return ("value", type(v).__name__)


def schema(reply):
    """{key: kind} of a reply, or of a client function's declaration (common.replies)."""
    return {k: kind(v) for k, v in reply.items()}


def declared_bytes(want):
    """The bytes a reply of this declaration takes: its tensors', 8 a number or count, 1 kB for
    the rest."""
    size = lambda v: v.numel() * v.element_size() if torch.is_tensor(v) else \
        sum(map(size, v)) if isinstance(v, (list, tuple)) else \
        8 * math.prod(v.shape) if isinstance(v, common.Count) else 8
    return sum(size(v) for v in want.values()) + 1024


# what every reply carries besides the client function's own keys (work, on the node)
SPAN = {"_began": "float", "_ready": "float", "_ended": "float", "_round": "int", "_phase": "str"}


def reduction(fn, keys):
    """{key: "sum" or "mean"}, what the server uses of fn's reply (common.replies: each of `keys`,
    a reply's or its declaration's, where fn declares every key summed), or None."""
    how = getattr(fn, "reduced", None)
    return dict.fromkeys([k for k in keys if k not in SPAN], how) if isinstance(how, str) else how


def what_is_wrong(reply, expect, t, phase):
    """None, or what makes a node's reply to round t's exchange `phase` unusable: missing or extra
    keys, the node's own fields (SPAN) of another type, another round or exchange, a span that
    ends before it begins, tensors of other shapes or dtypes than the client function declares
    (`expect`: schema), a count outside 0..its examples, non-finite values."""
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
    began, ready, ended = reply["_began"], reply["_ready"], reply["_ended"]
    if not (all(map(math.isfinite, (began, ready, ended))) and began <= ready <= ended):
        return f"its span {began}-{ready}-{ended} is not a span of time"
    for k, want_k in expect.items():
        if want_k[0] == "count" and got[k] == ("tensor", want_k[2], "torch.int64"):
            if not bool(((reply[k] >= 0) & (reply[k] <= want_k[1])).all()):
                return f"{k} counts {reply[k].tolist()} of {want_k[1]} examples"
        elif got[k] != want_k:
            return f"{k} is {got[k]}, where the client function declares {want_k}"

    def finite(v):
        if torch.is_tensor(v):
            return not v.is_floating_point() or bool(v.isfinite().all())
        if isinstance(v, (list, tuple)):
            return all(finite(x) for x in v)
        return not isinstance(v, float) or math.isfinite(v)
    bad = [k for k in expect if not finite(reply[k])]
    return f"non-finite {', '.join(bad)}" if bad else None


def what_the_node_said(r):
    """None, or what makes a node's answer to query.hello (its report, harness.sites.read) unusable:
    a field missing or of another type."""
    entry = r.get("roster")
    checks = [(isinstance(r.get("site"), int), "site"),
              (r.get("role") in ("train", "evaluate"), "role"),
              (isinstance(r.get("dataset"), str), "dataset"),
              (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
               and all(isinstance(n, int) and n >= 0 for n in entry[1:3])
               and (entry[3] is None or isinstance(entry[3], int) and entry[3] >= 0), "sizes"),
              (isinstance(r.get("shape"), list) and len(r["shape"]) == 3
               and all(isinstance(n, int) and n > 0 for n in r["shape"]), "shape"),
              (isinstance(r.get("classes"), int) and r["classes"] > 1, "classes")]
    bad = [name for ok, name in checks if not ok]
    return f"its report has no usable {', '.join(bad)}" if bad else None


# --------------------------------------------------------------------------------- the server

HELLO_GRACE = 30.0  # s: once every site is held, how long the other nodes' reports are awaited
#                     (at most `wait`: a run that gives its nodes less to connect waits less)


class Link:
    """The server's side of the federation: which node holds which site (`sites`, at connection:
    what each node reports of its data, the only thing the server learns of it), and each exchange
    of common.on_clients as one message to every node of it at once, every reply checked against
    the client function's declaration. Per round: bytes down and up, seconds, each node's span."""

    def __init__(self, grid, wait=600.0, method=None, init=None, keys=None, evaluators=None,
                 clip=None):
        self.grid, self.wait, self.nodes, self.args, self.out = grid, wait, None, None, None
        self.method, self.init = method, init       # the run's method and its init_state, by name
        self.keys = keys          # {a node's public key (PEM): the partition id it was made for}
        self.signers = None       # {site: its public key}: with keys, every reply must be signed
        self.evaluators = evaluators                # evaluation sites (None: by the protocol)
        self.roster = None                          # [[domain, n, n_val, n_test]] by site
        self.clip = clip          # secure aggregation (run config secagg) within ±clip; None: off
        # round -> [down, up]; seconds; node spans; each node's setup (seconds)
        self.moved, self.times, self.spans, self.setup = {}, {}, {}, {}
        self.secured = {}         # round -> its exchanges summed by SecAgg+ (secagg)

    def sites(self, args, load=None):
        """harness.run's `sites`: the federation that the nodes hold, as they report it: --clients
        training sites (0..P-1) and the evaluation sites (P..; run config `evaluators`, by default
        one for a held-out domain, none for fixed clients). The server loads no data: it knows the
        sites' sizes, the images' shape and the classes, and settles --sample from them."""
        self.out = args.out
        if args.clients is None:
            raise common.UserError("on Flower give --clients: the number of training sites (one "
                                   "node each)")
        apart = [f for f in run_clients(harness.method(self.method), args)
                 if not getattr(f, "reduced", None)]
        if self.clip is not None and apart:              # before any node is asked for anything
            names = ", ".join(f"{f.__name__} ({qualified(f)})" for f in apart)
            many = len(apart) > 1
            raise common.UserError(
                f"secagg: {self.method}'s exchange{'s' if many else ''} {names} send"
                f"{'' if many else 's'} the server each client's own reply, which its round reads "
                f"one by one (no sum declared, common.replies): it cannot run under secure "
                f"aggregation; nothing was run")
        P = args.clients
        E = self.evaluators if self.evaluators is not None else int(args.dataset in data.LODO)
        reports = self.connect(args, P, E)
        self.roster = [reports[k]["roster"] for k in range(P + E)]
        shape, classes = reports[0]["shape"], reports[0]["classes"]
        for k, r in reports.items():
            if (r["shape"], r["classes"]) != (shape, classes):
                raise BadReply(f"a bad reply from node {self.nodes[k]} (partition {k}): its "
                               f"images are {r['shape']} of {r['classes']} classes, site 0's "
                               f"{shape} of {classes}")
        sites.settle(args, self.roster)
        fed = sites.federation(self.roster, P)
        ds = sites.dataset(args, shape, classes, f"the sites' own data, on their nodes: {P} "
                           f"training, {E} evaluation (the server reads none)")
        count = lambda k: sum(e[k] or 0 for e in self.roster)
        print(f"data: {ds.source}\ndata: {count(1) + count(2) + count(3):,} images of "
              f"{classes} classes, {shape[0]}x{shape[1]}x{shape[2]}", flush=True)
        return ds, [(fed.name, lambda: fed)]

    def connect(self, args, P, E):
        """Wait for a node of every site (0..P+E-1; `wait` seconds at most), ask each new one its
        report (query.hello, with the run's arguments: it reads its folder) and check it at once
        (`admit`): {site: report}."""
        hello = {"args": json.dumps(vars(args)), "method": self.method}
        end = time.time() + self.wait
        said = {}           # node id: its report
        asked = set()       # the nodes sent a query.hello
        waiting = {}        # message id: the query.hello not answered yet
        self.nodes = {}
        held = None         # when every site was first held
        while True:    # a node that never answers (a registered device of no site) holds nothing
            new = sorted(set(self.grid.get_node_ids()) - asked)
            msgs = self._push([(i, "query.hello", hello) for i in new], 0)
            asked.update(new)
            waiting.update(zip(self.grid.push_messages(msgs), msgs) if msgs else [])
            replies = list(self.grid.pull_messages(list(waiting))) if waiting else []
            for r in replies:
                m = waiting.pop(r.metadata.reply_to_message_id)
                i = m.metadata.dst_node_id
                r = self._take(m, r, 0, phase="query.hello")
                report = json.loads(r["report"]) if isinstance(r.get("report"), str) else {}
                where = f"node {i}" + (f" (partition {report['site']})"
                                       if isinstance(report.get("site"), int) else "")
                wrong = report.get("refused") or what_the_node_said(report)
                if wrong:
                    raise BadReply(f"a bad reply from {where}: {wrong}")
                said[i] = report
            if replies:
                self.admit(said, args, P, E)
            missing = sorted(set(range(P + E)) - set(self.nodes))
            if missing:
                held = None
            else:            # every site held: the other connected nodes' answers, HELLO_GRACE s
                held = held or time.time()
                if not waiting or time.time() > held + min(HELLO_GRACE, self.wait):
                    return {p: said[i] for p, i in self.nodes.items()}
            if missing and time.time() > end:
                raise common.UserError(self.absent(missing, P, len(said), len(waiting)))
            time.sleep(0.5)

    def admit(self, said, args, P, E):
        """The nodes that reported so far ({node id: report}) by site, into self.nodes. With `keys`,
        a node holds the partition its registered key was made for, whatever it claims; without,
        of two claims of one partition the later node's is refused (its activation time); a node's
        role (training or evaluation-only) and dataset must be its site's."""
        info = {n.node_id: n for n in self.grid.get_nodes()}
        says = {"train": "it trains", "evaluate": "evaluate-only"}
        site_is = {"train": "a training site", "evaluate": "an evaluation site"}
        parts = {}
        for i, r in sorted(said.items(), key=lambda s: activated(info.get(s[0]))):
            p, role = r["site"], "train" if r["site"] < P else "evaluate"
            own = self.keys.get(bytes(getattr(info.get(i), "public_key", b""))) \
                if self.keys is not None else p
            if own != p:
                whose = "a key of no partition" if own is None else f"partition {own}'s key"
                raise BadReply(f"a bad reply from node {i}: it claims partition id {p}, and its "
                               f"registered key is {whose}")
            if p in parts:
                raise BadReply(f"a bad reply from node {i}: it claims partition id {p}, which "
                               f"node {parts[p]} has held since before it connected; "
                               f"this run needs 0..{P + E - 1}, one node each")
            if not 0 <= p < P + E:
                raise BadReply(f"a bad reply from node {i}: it claims partition id {p}; this run "
                               f"has sites 0..{P + E - 1} ({P} training, {E} evaluation)")
            if r["dataset"] != args.dataset:
                raise BadReply(f"a bad reply from node {i} (partition {p}): its data are of "
                               f"{r['dataset']}, this run's of {args.dataset}")
            if r["role"] != role:
                raise BadReply(f"a bad reply from node {i} (partition {p}): its node config says "
                               f"{says[r['role']]}, and site {p} is {site_is[role]} (sites "
                               f"0..{P - 1} train, {P}..{P + E - 1} evaluate)")
            parts[p] = i
        self.nodes = parts

    def absent(self, missing, P, connected, silent=0):
        """The line for sites no node held after `wait` seconds."""
        train, ev = [k for k in missing if k < P], [k for k in missing if k >= P]
        named = [f"training site(s) {', '.join(map(str, train))}"] * bool(train) + \
            [f"evaluation site(s) {', '.join(map(str, ev))} (evaluate-only=true: the held-out "
             f"domain)"] * bool(ev)
        silent = f" ({silent} more never answered)" if silent else ""
        return (f"{connected} node(s) connected within {self.wait:g} s{silent}, and none holds "
                f"{' or '.join(named)}: start one node per site (node config partition-id, data)")

    def __call__(self, fn, S, sents, t, phase, ctx):
        if self.args is None:          # the run's arguments, as the nodes set themselves up with
            self.args, self.out = json.dumps(vars(ctx.args)), ctx.args.out
        expect = [self.expected(fn, c, sent, t, phase, ctx) for c, sent in zip(S, sents)]
        start = time.perf_counter()
        head = {"fn": qualified(fn), "phase": phase, "round": t, "domain": ctx.fed.name,
                "args": self.args, "init": self.init, "method": self.method,
                "roster": json.dumps(self.roster)}
        if self.clip is not None and getattr(fn, "reduced", None):
            return self.secure(fn, S, sents, t, phase, ctx, head, [want for want, _ in expect])
        if self.clip is not None:
            raise common.UserError(
                f"secagg: round {t}'s exchange {phase} ({qualified(fn)}) sends the server each "
                f"client's own reply, which the round reads one by one (the function declares "
                f"no sum, common.replies): it cannot run under secure aggregation")
        replies = self._send([(self.nodes[c], "train.client",
                               {**head, **{f"sent.{k}": v for k, v in sent.items()}})
                              for c, sent in zip(S, sents)], t, clients=S,
                             most=[MAX_BYTES * size + 2 ** 16 for _, size in expect], phase=phase)
        # every reply checked before the round sees one
        for c, r, (shape, _) in zip(S, replies, expect):
            wrong = what_is_wrong(r, shape, t, phase)
            if wrong:
                raise BadReply(f"a bad reply in round {t} from node {self.nodes[c]} "
                               f"(partition {c}): {wrong}")
        self.times[t] = self.times.get(t, 0.0) + time.perf_counter() - start
        self.setup.setdefault(t, []).extend((phase, c, r["_ready"] - r["_began"]) for c, r in
                                            zip(S, replies))
        self.spans.setdefault(t, []).extend((phase, c, r.pop("_began"), r.pop("_ended"))
                                            for c, r in zip(S, replies))
        # in the order of S: the clients' ids
        return [to_device({k: v for k, v in r.items() if not k.startswith("_")}, ctx.device)
                for r in replies]

    def secure(self, fn, S, sents, t, phase, ctx, head, wants):
        """Round t's exchange `phase` of a `reduced` fn by Flower's SecAgg+ (flower/secagg.py): the
        server receives the sums alone, never a client's reply; the declared means are the sums
        over C. `wants`: each client's declared reply (schema), whose reduced keys make the summed
        vector; counts alone (an evaluation) are summed exactly (secagg.count_clip)."""
        want = wants[0]
        how = reduction(fn, want)
        C = len(S)
        if C < 2:
            raise common.UserError(f"secagg: round {t}'s exchange {phase} has one client; secure "
                                   f"aggregation hides a client only among two at least")
        clip = self.clip
        if all(w[k][0] == "count" for w in wants for k in how):
            try:
                clip = secagg.count_clip(max(w[k][1] for w in wants for k in how), C)
            except ValueError as e:
                raise common.UserError(f"secagg: round {t}'s exchange {phase}: {e}") from None
        part = {self.nodes[c]: c for c in S}
        values = sum(math.prod(secagg.shape(want[k])) for k in how)
        most = MAX_BYTES * 8 * (values + 1) + 2 ** 16 + 2 ** 12 * C     # a masked int64 vector

        def records(sent):          # what each stage's message carries besides Flower's own
            full = pack({**head, "clip": clip, **{f"sent.{k}": v for k, v in sent.items()}})
            short = RecordDict({"c": ConfigRecord({"round": t, "phase": phase})})
            return lambda stage: full if stage == "collect_masked_vectors" else short

        def check(m, r, stage):     # every reply: its signature, a refusal (BadReply), its bytes
            self._take(m, r, t, part[m.metadata.dst_node_id], most, f"{phase}/{stage}")

        def count(down):
            self.moved.setdefault(t, [0, 0])[0] += sum(nbytes(m.content) for m in down)
        heads = {self.nodes[c]: records(sent) for c, sent in zip(S, sents)}
        try:
            total, seconds = secagg.secure_sum(self.grid, [self.nodes[c] for c in S], heads, t,
                                               check, count, clip, self.wait)
        except ValueError as e:
            raise BadReply(f"round {t}'s exchange {phase}: {e}") from None
        self.times[t] = self.times.get(t, 0.0) + seconds
        self.secured[t] = self.secured.get(t, 0) + 1
        return secagg.decode(total, how, want, C, ctx.device)

    def expected(self, fn, c, sent, t, phase, ctx):
        """(schema, bytes) of what `fn` replies for site c, from its declaration (common.replies)
        at the site as the server knows it: a stand-in of its sizes."""
        if getattr(fn, "replies", None) is None:
            raise common.UserError(f"{qualified(fn)} declares no reply (common.replies): on "
                                   f"Flower the server checks every reply against it")
        want = fn.replies(common.site(dataclasses.replace(ctx, clients={}), c, t, phase), sent)
        return schema(want), declared_bytes(want)

    def _send(self, items, t, clients=None, most=None, phase=None):
        msgs = self._push(items, t)
        replies = {r.metadata.reply_to_message_id: r for r in self.grid.send_and_receive(msgs)}
        return [self._take(m, replies.get(m.metadata.message_id), t,
                           clients[k] if clients is not None else None,
                           most[k] if most is not None else None, phase)
                for k, m in enumerate(msgs)]

    def _push(self, items, t):
        """Messages of (node, kind, content) for round t, counted as sent (not yet pushed)."""
        msgs = [Message(pack(d), node, kind, group_id=str(t)) for node, kind, d in items]
        self.moved.setdefault(t, [0, 0])[0] += sum(nbytes(m.content) for m in msgs)
        return msgs

    def _take(self, m, r, t, client=None, most=None, phase=None):
        """The reply r (None: none came) to message m, checked (its signature first), unpacked."""
        who = f"node {m.metadata.dst_node_id}" + \
            (f" (partition {client})" if client is not None else "")
        if r is not None and not r.has_error() and self.signers is not None:  # whose it is
            self.check_signature(r, m, t, phase, client)
        if r is None or r.has_error():
            why = r.error.reason if r is not None else "no reply"
            unsigned = " (Flower's error reply, which no key signs: another registered " \
                "device may have sent it in that node's name)" if self.signers else ""
            raise BadReply(f"a bad reply in round {t} from {who}: {why}"
                           f"{unsigned if r is not None else ''}")
        size = unpacked_bytes(r.content)
        if most is not None and size > most:            # before it is unpacked into tensors
            raise BadReply(f"a bad reply in round {t} from {who}: {size:,} bytes, "
                           f"the most this exchange takes is {most:,}")
        self.moved[t][1] += nbytes(r.content)
        reply = unpack(r.content)
        reply.pop(signing.RECORD, None)
        if isinstance(reply.get("_error"), str):        # the node's own refusal, signed
            raise BadReply(f"a bad reply in round {t} from {who}: {reply['_error']}")
        return reply

    def check_signature(self, r, m, t, phase, site):
        """A reply `r` to message `m` (not Flower's error reply: none is signed) is its node's:
        signed by the key registered for its site (the site the server sent m for; at
        query.hello, the one its report claims), else BadReply. The line names the node only as
        the one in whose name the reply came: the SuperLink does not check who pushed it
        (docs/flower.md: Every reply is its node's)."""
        node = m.metadata.dst_node_id
        if site is None:                                       # query.hello: the site it claims
            try:
                site = json.loads(unpack(r.content)["report"])["site"]
            except (KeyError, TypeError, ValueError):
                site = None
        if not isinstance(site, int):
            wrong = "its report names no site"
        else:
            wrong = signing.unsigned(r.content, self.signers.get(site), self.grid.run.run_id, t,
                                     phase, m.metadata.message_id, site)
        if wrong:
            where = f"partition {site}" if isinstance(site, int) else "a site"
            raise BadReply(f"a reply in round {t} in the name of node {node} ({where}) failed its "
                           f"signature: {wrong}; nothing of it was used (another registered "
                           f"device may have pushed it in that node's name: the SuperLink does "
                           f"not check a reply's source)")


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


def on_nodes(record):
    """A method's record as it runs on Flower: its clients never train at once in process
    (--parallel-clients auto: off; on, and --compile, refused)."""
    return dataclasses.replace(record, parallel=lambda args: "trains every client on its own "
                               "node on Flower")


def serve(grid, method, argv, wait=600.0, keys=None, evaluators=None, clip=None):
    """The ServerApp's work: `method`'s own run, harness.main(METHOD, argv), with a Link as
    common.on_clients' engine and as the run's `sites` (the nodes hold the data: the server reads
    none); its clients never train at once in process (--parallel-clients auto: off; on:
    refused). keys: a folder of the nodes' node-K.pub; evaluators: the evaluation sites (Link);
    clip: secure aggregation within ±clip (run config secagg, secagg-clip), None: off.
    Returns (results, link). A run that ends in an error writes its line into <out>.flower.json
    ("error") where --out is known, and raises RunFailed with it."""
    own = importlib.import_module(method).METHOD
    link = Link(grid, wait, method, qualified(own.init_state) if own.init_state else None,
                evaluators=evaluators, clip=clip)
    said = Said(sys.stderr)
    try:
        with contextlib.redirect_stderr(said):
            if any(a == "--data-root" or a.startswith("--data-root=") for a in argv):
                raise common.UserError("--data-root: on Flower the server reads no data; each "
                                       "node reads its own folder (node config data)")
            link.keys = node_keys(keys) if keys else None
            link.signers = signing.public_keys(keys) if keys else None
            results = harness.main(on_nodes(own), argv, engine=link, sites=link.sites)
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
    """Per round: seconds of messages and client work, bytes, each node's span and the exchanges
    summed by SecAgg+; the run's error line if it failed (<out>.flower.json)."""
    rounds = {t: {"seconds": link.times.get(t, 0.0), "down": d, "up": u,
                  "spans": link.spans.get(t, []), "setup": link.setup.get(t, []),
                  "secagg": link.secured.get(t, 0)}
              for t, (d, u) in link.moved.items()}
    outputs.write_json(f"{link.out}.flower.json",
                       {"rounds": rounds, **({"error": error} if error else {})})
    for t in sorted(link.moved):
        down, up = link.moved[t]
        print(f"flower: round {t}: {link.times.get(t, 0.0):.2f} s of messages and client work, "
              f"{down / 2**20:.3f} MiB down, {up / 2**20:.3f} MiB up", flush=True)


# ----------------------------------------------------------------------------------- the nodes

def own_site(context):
    """This node's site (node config `partition-id`), its folder (`data`) and whether it is
    evaluation-only (`evaluate-only`, default false)."""
    config = context.node_config
    if "data" not in config:
        raise common.UserError("this node's config has no data=FOLDER (its own data)")
    only = config.get("evaluate-only", False)
    return int(config["partition-id"]), str(config["data"]), only is True or only == "true"


class Node:
    """A node's view: its own site, read from its folder alone (harness.sites.read), among the
    others as the server's roster says (stand-ins of their sizes: the method's own setup,
    init_state, runs here on that federation, as on the server; FedLOE's tuning split), and a
    model to compute with."""

    def __init__(self, init, args, roster, site, folder, evaluate_only):
        common.deterministic(not args.nondeterministic)
        device = torch.device(args.device)
        with contextlib.redirect_stdout(io.StringIO()):     # (its cache's notes: the node's own)
            own, report = sites.read(folder, args, site, evaluate_only)
        if roster[site] != report["roster"]:
            raise common.UserError(f"node folder {folder}: it holds {report['roster']}, the run's "
                                   f"roster has site {site} as {roster[site]}")
        own = dataclasses.replace(own, **{k: v.to(device) for k, v in vars(own).items()
                                          if torch.is_tensor(v)})
        fed = sites.federation(roster, args.clients, own)
        ds = sites.dataset(args, report["shape"], report["classes"], report["source"])
        with torch.random.fork_rng(devices=[]):
            model = common.global_model(args, ds, device)
        self.ctx = common.Context(device, torch.Generator(), data.make_prep(args.dataset, device),
                                  args.amp, args, fed, model, {})
        if init:
            function(init)(model, fed, args, self.ctx)
        self.partition = site


_NODES = {}   # (args, init, roster, site, folder, role) -> Node: reused while this process lives
_NODES_LOCK = threading.Lock()   # nodes that answer in threads of one process (simulation engines)


def node_for(req, context):
    """This node's site: made once per run (under the lock: the seeded model and the dropping of
    another run's nodes are one at a time), then reused."""
    site, folder, only = own_site(context)
    key = (req["args"], req["init"], req["roster"], site, folder, only)
    with _NODES_LOCK:
        if key not in _NODES:
            args = argparse.Namespace(**json.loads(req["args"]))
            for old in [k for k in _NODES if k[:3] != key[:3]]:   # another run's
                del _NODES[old]
            _NODES[key] = Node(req["init"], args, json.loads(req["roster"]), site, folder, only)
        return _NODES[key]


def refused(req, context, also=frozenset()):
    """Why this node will not run what `req` names (None: it will): a function that the run's method
    file does not declare a client's work (declared; an evaluation-only node: an evaluation), or a
    method that is not one of the six."""
    method = str(context.run_config.get("method", "") or req.get("method") or "")
    only = own_site(context)[2] if "data" in context.node_config else False
    try:
        args = json.loads(req["args"]) if "args" in req else None
    except (TypeError, ValueError):
        args = None
    allowed = declared(method, only, args if isinstance(args, dict) else None) | set(also)
    for name in (req.get("fn"), req.get("init")):
        if name is not None and name not in allowed:
            what = "an evaluation of" if only else "a client function of"
            return f"{name} is not {what} {method or 'this run'}.py; nothing was run"
    return None


def answer(msg, context, content, t, phase):
    """This node's reply to `msg` (round t's exchange `phase`): content packed and, where its node
    config names its key, signed (flower/signing.py); an unsigned error reply where the key cannot
    be read. content: a dict, or a RecordDict as it is (a SecAgg+ stage's)."""
    rd = content if isinstance(content, RecordDict) else pack(content)
    path = context.node_config.get("key")
    if not path:
        return Message(rd, reply_to=msg)
    try:
        key = signing.private_key(str(path))
    except ValueError as e:
        return Message(reply_to=msg, error=Error(code=400, reason=str(e)))
    site = int(context.node_config["partition-id"])
    return Message(signing.sign(rd, key, context.run_id, t, phase, msg.metadata.message_id, site),
                   reply_to=msg)


def hello(msg, context):
    """query.hello: this node's report of its own data (harness.sites.read, with the run's
    arguments), or why it refuses (its folder, in one line)."""
    req = unpack(msg.content)
    site = int(context.node_config["partition-id"])
    try:
        args = argparse.Namespace(**json.loads(req["args"]))
        site, folder, only = own_site(context)
        with contextlib.redirect_stdout(io.StringIO()):
            report = sites.read(folder, args, site, only)[1]
    except common.UserError as e:
        report = {"site": site, "refused": str(e)}
    return answer(msg, context, {"report": json.dumps(report)}, 0, "query.hello")


def work(msg, context, also=frozenset()):
    """One exchange on this node: the named client function on its site, its stream, its state;
    an error reply, and nothing run, where the function is not the method file's (refused) or
    its folder cannot be read."""
    began = time.time()                                    # the node's span: its setup and its work
    req = unpack(msg.content)
    t, phase = req.get("round", 0), str(req.get("phase", ""))
    try:
        out = client_work(req, context, also, began)
    except secagg.Refused as e:
        return answer(msg, context, {"_error": str(e)}, t, phase)
    return answer(msg, context, out, t, phase)


def secure_work(msg, context, also=frozenset()):
    """The masked-vectors stage of SecAgg+ on this node (secaggplus_mod calls it): the exchange's
    client function as in `work`, its reduced keys as one vector for the mod (secagg.encode:
    refused outside ±secagg-clip, never clipped) and the node's span. secagg.Refused: nothing
    sent (secagg.signed answers it)."""
    began = time.time()
    req = unpack(msg.content)
    why = refused(req, context, also)                # (a name the method file declares)
    fn = None if why else function(req["fn"])
    if not getattr(fn, "reduced", None):
        raise secagg.Refused(why or f"{req['fn']} declares no sum (common.replies): nothing "
                             f"was run")
    out = client_work(req, context, also, began)
    site = own_site(context)[0]
    vector = secagg.encode(out, reduction(fn, out), float(req["clip"]), site)
    seed = json.loads(req["args"])["seed"]                      # (the client's stream's key)
    secagg.seed_rounding(f"{seed}/{req['domain']}/{req['round']}/{site}/{req['phase']}")
    return secagg.fit_reply(msg, vector, {k: out[k] for k in SPAN})


def client_work(req, context, also, began):
    """What the request `req` names, run on this node's site: the client function's reply and the
    node's span (SPAN), or secagg.Refused (the function is not the method's, its folder...)."""
    why = refused(req, context, also)
    if why:
        raise secagg.Refused(why)
    try:
        node = node_for(req, context)
    except common.UserError as e:
        raise secagg.Refused(str(e)) from None
    ctx, c = node.ctx, node.partition
    sent = to_device({k[5:]: v for k, v in req.items() if k.startswith("sent.")}, ctx.device)
    # the client's own state, per held-out domain
    record = context.state.get("fedood", ConfigRecord())
    kept = (torch.load(io.BytesIO(record[req["domain"]]), weights_only=True)
            if req["domain"] in record else {})
    ctx.clients = {c: to_device(kept, ctx.device)}
    ready = time.time()                                 # set up: its first step comes now
    out = function(req["fn"])(common.site(ctx, c, req["round"], req["phase"]), sent)
    out = {**out, "_began": began, "_ready": ready, "_ended": time.time(),
           "_round": req["round"], "_phase": req["phase"]}
    if ctx.clients[c]:
        buf = io.BytesIO()
        torch.save(ctx.clients[c], buf)
        record[req["domain"]] = buf.getvalue()
        context.state["fedood"] = record
    return out


def client_app(also=()):
    """The ClientApp: its report on `query.hello`, an exchange of a round on `train.client`, and
    a summed exchange's SecAgg+ stages on `train` (Flower's secaggplus_mod, its replies signed).
    also: functions it runs besides the method files' own (a test's stand-ins)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    app = ClientApp()
    app.query("hello")(hello)
    allowed = frozenset(qualified(f) for f in also)
    app.train("client")(lambda msg, context: work(msg, context, allowed))
    app.train(mods=[secagg.signed(answer), secaggplus_mod])(
        lambda msg, context: secure_work(msg, context, allowed))
    return app
