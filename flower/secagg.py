"""The server sees only sums (run config `secagg`): every exchange whose client function declares
its reply a sum or a mean over the clients (common.replies) reaches the ServerApp only as that
sum, through Flower's own SecAgg+ (flwr 1.42, docs/flower.md: The server sees only sums).

Which parts of Flower, and why not SecAggPlusWorkflow as a whole: the workflow is bound to the
legacy Strategy (a LegacyContext; configure_fit and aggregate_fit, one FitIns per node per round)
and returns a weighted mean, while a method's round has several exchanges a round, each with its
own clients and what the server sends each. So each summed exchange runs the workflow's own four
stages (setup, share keys, collect masked vectors, unmask: SecAggPlusWorkflow's methods, on a
WorkflowState of their own) with a one-exchange Strategy (`Exchange`), and each node runs
Flower's secaggplus_mod around the client function. Nothing cryptographic is written here.

What this adds around Flower's parts:
  - the weights: a client weighs its own update (n_c Δ_c is the method's reply), so every node
    says num_examples = 1 to the mod with max_weight 1: Flower's ratio is exactly 1, and its
    aggregate (the mean) times the number of clients is the sum;
  - the range: Flower's quantize clips to ±clipping_range silently; a node refuses instead, in one
    line naming its site and the value, before the mod sees anything (`encode`);
  - the levels: the most a sum of C clients allows below Flower's modulus 2^32 (`levels`);
  - the rounding: Flower's quantize draws its stochastic rounding from numpy's global generator;
    a node seeds it from its client's stream key first (`seed_rounding`), so a run repeats;
  - every stage's reply signed by its node (`signed`, a mod outside secaggplus_mod) and checked by
    the server before the workflow reads it (`Watched`).
"""
import hashlib
import logging
import math
import time
import types

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod  # noqa: F401  (the nodes' mod: fl_adapter)
from flwr.common import Code, FitIns, FitRes, Parameters, Status
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

CLIP = 1024.0          # run config secagg-clip: no value of a reply may lie outside ±CLIP
MODULUS = 2 ** 32      # Flower's modulus_range (its default, the most it allows)


def levels(C):
    """Flower's quantization_range for C clients: the largest power of two Q with C·Q ≤ 2^31, so
    that the sum of C quantised values and of their C weight factors (Q each) stays below the
    modulus, and a value fits Flower's int32."""
    return 2 ** (31 - (C - 1).bit_length())


def step(C, clip=CLIP):
    """The quantisation step of one value: 2 clip / Q (stochastic rounding, unbiased)."""
    return 2 * clip / levels(C)


def count_clip(most, C):
    """The range of an exchange of counts (an evaluation's, 0..most each): the least power of two
    above most, so that a count is a whole number of steps (2 clip / Q divides 1: no rounding, the
    sum exact). ValueError where C clients' levels are too few for that."""
    clip = 2 ** int(most).bit_length()
    if 2 * clip > levels(C):
        raise ValueError(f"counts up to {most} over {C} clients cannot be summed exactly within "
                         f"Flower's modulus (levels {levels(C)})")
    return float(clip)


def shape(want):
    """The shape of a declared value (a schema's: fl_adapter.kind): a tensor's or a count's."""
    return want[1] if want[0] == "tensor" else want[2] if want[0] == "count" else ()


# ------------------------------------------------------------------------------ on the node

class Refused(Exception):
    """A node will not answer this stage: its one line goes back signed, as the reply."""


def encode(out, how, clip, site):
    """The reply's reduced keys (`how`, in key order) as one float64 vector for the mod, or
    Refused naming the key and the value that lies outside ±clip (never clipped) or is not
    finite."""
    parts = []
    for k in sorted(how):
        v = torch.as_tensor(out[k]).detach().double().cpu().reshape(-1)
        worst = v.abs().max().item() if v.numel() else 0.0
        if not worst <= clip:
            raise Refused(f"site {site}'s {k} reaches {worst:.6g}, outside secagg-clip ±{clip:g}: "
                          f"nothing of it was sent (raise secagg-clip in the run config)")
        parts.append(v.numpy())
    return np.concatenate(parts)


def seed_rounding(key):
    """Seeds numpy's global generator, from which Flower's quantize draws the stochastic rounding
    of the vector it is handed next, from `key`: the client's stream key (common.stream's: the
    run's seed, the held-out domain, the round, the client, the exchange). So a run under secagg
    repeats bit for bit. The draws decide only each value's last step, and the
    masks come from the mod's own secrets, not from this generator."""
    digest = hashlib.blake2b(f"{key}/secagg".encode(), digest_size=4).digest()
    np.random.seed(int.from_bytes(digest, "little"))


def fit_reply(msg, vector, span):
    """The client function's reply as secaggplus_mod reads it (a FitRes of one array, weight 1),
    and the node's span (record "c", in the clear)."""
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), 1, {})
    content = compat.fitres_to_recorddict(res, keep_input=True)
    content["c"] = ConfigRecord(span)
    return Message(content, reply_to=msg)


def signed(answer):
    """A mod outside secaggplus_mod: each stage's reply signed by this node (answer(msg, context,
    content, t, phase): fl_adapter.answer) over the exchange "<phase>/<stage>", and a Refused as a
    signed refusal."""
    def mod(msg, context, call_next):
        head = msg.content.config_records.get("c", ConfigRecord())
        t, phase = int(head.get("round", 0)), str(head.get("phase", ""))
        stage = msg.content.config_records.get(RECORD_KEY_CONFIGS, ConfigRecord()).get(Key.STAGE)
        exchange = f"{phase}/{stage}"
        try:
            reply = call_next(msg, context)
        except Refused as e:
            return answer(msg, context, {"_error": str(e)}, t, exchange)
        return reply if reply.has_error() else answer(msg, context, reply.content, t, exchange)
    return mod


# ---------------------------------------------------------------------------- on the server

class Exchange(Strategy):
    """The Strategy SecAggPlusWorkflow's stages ask: this exchange's nodes (configure_fit, an empty
    FitIns each: what the server sends goes with the stage's message, `Watched`) and, after
    unmask, Flower's aggregate, kept (aggregate_fit)."""

    def __init__(self, nodes):
        self.nodes, self.aggregate = nodes, None

    def configure_fit(self, server_round, parameters, client_manager):
        empty = FitIns(Parameters(tensors=[], tensor_type=""), {})
        return [(types.SimpleNamespace(node_id=n), empty) for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        if results and not failures:
            self.aggregate = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class Watched:
    """The grid as the workflow's stages see it: every message carries the exchange's head (record
    "c": round and exchange; at the masked-vectors stage also what the server sends that node), and
    every reply is checked (its signature, a refusal) by `check(message, reply, stage)` before a
    stage reads it; the bytes sent counted by `count(messages)`."""

    def __init__(self, grid, heads, check, count):
        self.grid, self.heads, self.check, self.count = grid, heads, check, count

    def send_and_receive(self, messages, *, timeout=None):
        stages = {}
        for m in messages:
            stage = m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            head = self.heads[m.metadata.dst_node_id]
            for name, record in head(stage).items():
                m.content[name] = record
            stages[id(m)] = stage
        self.count(messages)
        replies = {r.metadata.reply_to_message_id: r for r in
                   self.grid.send_and_receive(messages, timeout=timeout)}
        out = []
        for m in messages:
            r = replies.get(m.metadata.message_id)
            self.check(m, r, stages[id(m)])                 # BadReply: the run ends here
            out.append(r)
        return out


def workflow(C, clip):
    """Flower's SecAgg+ for C clients: every node shares with every other (num_shares 1.0: all C),
    a secret rebuilt from C // 2 + 1 shares (a majority: a server that asks two halves of the nodes
    for a node's two secrets cannot get both; Flower's 0.5 would round 2.5 to 2), weights of 1
    (max_weight 1), ±clip in levels(C) levels."""
    return SecAggPlusWorkflow(1.0, C // 2 + 1, max_weight=1.0, clipping_range=float(clip),
                              quantization_range=levels(C), modulus_range=MODULUS)


def secure_sum(grid, nodes, heads, t, check, count, clip=CLIP, timeout=None):
    """The sum over the nodes of the vectors their client functions encode, by SecAgg+'s four
    stages: the server sees each node's public keys, encrypted shares for other nodes, masked
    vectors and, at unmask, the shares that remove the masks of the sum; never a node's vector.
    Returns the sum (float64) and the seconds; ValueError where a stage cannot complete."""
    start = time.perf_counter()
    C = len(nodes)
    flower = workflow(C, clip)
    strategy = Exchange(nodes)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: t}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(grid.run.run_id, 0, {}, state, {}), strategy=strategy)
    flower.timeout = timeout
    watched = Watched(grid, heads, check, count)
    run = WorkflowState()
    quiet = logging.getLogger("flwr")                  # (the workflow's INFO lines, every round)
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        for stage in (flower.setup_stage, flower.share_keys_stage,
                      flower.collect_masked_vectors_stage, flower.unmask_stage):
            if not stage(watched, context, run) or run.failures or \
                    run.active_node_ids != set(nodes):
                raise ValueError(f"secure aggregation stopped at {stage.__name__} with "
                                 f"{len(run.active_node_ids)} of {C} nodes")
    finally:
        quiet.setLevel(level)
    if strategy.aggregate is None:
        raise ValueError("secure aggregation gave no sum")
    return strategy.aggregate[0] * C, time.perf_counter() - start     # Flower's mean, times C


def decode(total, how, want, C, device):
    """The reduced keys (`how`) back from the summed vector, as their declaration (`want`, a
    schema) has them: tensors of its shapes and dtypes (whole numbers rounded), numbers; a declared
    mean is the sum over C."""
    out, at = {}, 0
    for k in sorted(how):
        n = math.prod(shape(want[k]))
        v = torch.from_numpy(total[at:at + n].copy()).reshape(shape(want[k]))
        at += n
        v = v / C if how[k] == "mean" else v
        if want[k][0] in ("tensor", "count"):
            dtype = getattr(torch, want[k][2].removeprefix("torch.")) if want[k][0] == "tensor" \
                else torch.int64
            out[k] = (v if dtype.is_floating_point else v.round()).to(dtype).to(device)
        else:
            out[k] = round(float(v)) if want[k][1] == "int" else float(v)
    return out
