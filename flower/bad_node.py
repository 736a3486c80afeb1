"""A node that answers badly, for the tests: the ways a registered but broken (or hostile) node can
spoil its reply (signed with its own key, where it has one: it is its own reply), and a ClientApp
that does so. In process, test_flower.py wraps the honest
ClientApp with `tampered`; on real processes, test_deploy.py submits a copy of this App whose
ClientApp is `bad_node:app`: the node whose node config says `bad=true` spoils its reply to the
exchange of round `tamper-round` (run config, default 2) the way `tamper` says (run config)."""
import time

import torch
from flwr.clientapp import ClientApp

import fl_adapter

HOW = ("nan", "shape", "dtype", "missing", "extra", "began", "round", "oversized", "zeros",
       "chunk", "huge")


def spoil(r, how):
    """The unpacked reply r of a client_update (its "delta", n_c Δ_c), spoiled the way `how`
    names."""
    delta = r["delta"]
    if how == "nan":
        r["delta"] = delta.clone().index_fill_(0, torch.tensor([3]), float("nan"))
    elif how == "shape":
        r["delta"] = delta[:-1]
    elif how == "dtype":
        r["delta"] = delta.double()
    elif how == "missing":
        del r["loss"]
    elif how == "extra":
        r["note"] = "hello"
    elif how == "began":                        # the node's own field, not the function's
        del r["_began"]
    elif how == "round":
        r["_round"] -= 1
    elif how == "oversized":
        r["delta"] = delta.repeat(8)
    elif how == "zeros":          # 64 MiB that Flower sends as a few equal chunks of 5 MiB
        r["delta"] = torch.zeros(2 ** 24)
    elif how == "huge":           # finite, of the right shape: every check passes it
        r["delta"] = delta * 1e30
    elif how == "chunk":          # 64 MiB as one object: one request, more than the proxy takes
        import flwr.app.message.array as array
        array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = 2 ** 27
        r["delta"] = torch.rand(2 ** 24)
    else:
        raise ValueError(f"unknown way to spoil a reply: {how!r}")
    return r


def tampered(app, how, when=2, bad=lambda context: context.node_config["partition-id"] == 0):
    """The ClientApp `app`, whose nodes that are `bad` spoil their train reply of round `when`."""
    def answer(msg, context):
        reply = app(msg, context)
        if msg.metadata.message_type != "train.client" or not bad(context) \
                or reply.has_error():
            return reply
        r = fl_adapter.unpack(reply.content)
        req = fl_adapter.unpack(msg.content)
        if r["_round"] == when and "delta" in r:         # an update (not the evaluation's counts)
            return fl_adapter.answer(msg, context, spoil(r, how), req["round"], req["phase"])
        return reply                   # (signed by the node, as it spoils it, for what it answers)
    return answer


def _real(msg, context):
    """This node's answer on real processes: honest unless its node config says bad=true (tamper
    "slow": honest, but its update of round `when` 20 s late, a race that a forger wins)."""
    how = str(context.run_config.get("tamper", ""))
    when = int(context.run_config.get("tamper-round", 2))
    if how == "slow" and context.node_config.get("bad"):
        req = fl_adapter.unpack(msg.content)
        if req.get("round") == when and req.get("phase") == "client_update":
            time.sleep(20)
    if how in ("", "slow"):
        return _honest(msg, context)
    return tampered(_honest, how, when, lambda c: bool(c.node_config.get("bad")))(msg, context)


_honest = fl_adapter.client_app()
app = ClientApp()
app.query("hello")(lambda msg, context: _honest(msg, context))
app.train("client")(_real)
