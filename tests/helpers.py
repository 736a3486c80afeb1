"""What the test files share: the quick run's flags, running a script's main in a test's folder,
one-line refusals, resuming after a stop, the tiny federations and hand computations that more
than one file's tests use, the float64 fixture, the copy harness (a method's plain functions lifted
into a torch-only namespace and the loops that drive them) and the host-synchronisation guard.
It imports no benchmark code at import (a core test never does; the few helpers that compare
with a benchmark/ variant import it when called)."""

import contextlib
import copy
import functools
import importlib
import inspect
import os
import re
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import common
import data
import fedloe
import fedomg
import harness
import perinvfl
from harness import datasets, outputs


HERE = Path(__file__).resolve().parent.parent       # the checkout


QUICK = ["--dataset", "synthetic", "--rounds", "4", "--eval-every", "2"]

# FedLOE's batch of 128 is more than a synthetic client
# holds (108 training examples at 4 clients), which data.py
# refuses; a --batch-size of the largest training domain
# (240) asks for full-batch steps instead: the same one
# batch per client as 128 gave, so the same numbers.
LOE_FULL = ["--batch-size", "240"]

# The bit-exactness promise is per device: those tests
# run on the CPU always and on CUDA when present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

on_every_device = pytest.mark.parametrize("device", DEVICES)


def run(main, argv, tmp_path, name="r.json"):
    """main(argv) writing `name` in tmp_path, replacing what an earlier run of the test left
    there."""
    out = str(tmp_path / name)
    return main(argv + ["--out", out] + ([] if "--resume" in argv else ["--overwrite"])), out


def fails(main, argv, capsys, code=2):
    """main(argv) must exit with `code` and print exactly one line on stderr; returns that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def refused(fn, *args):
    """fn(*args) must raise ValueError (a plain function refusing what it cannot mean); returns its
    message."""
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


def read(updates, seen):
    """The updates one at a time, each appended to `seen` as it is read."""
    for u in updates:
        seen.append(u)
        yield u


def strip_times(results):
    r = copy.deepcopy(results)
    for d in r["domains"].values():
        for row in d["history"]:
            row.pop("seconds")
    for k in ("out", "resume", "overwrite"):  # where a run writes and how it
                                              # started, not what it computes
        r["args"].pop(k, None)
    r.pop("provenance", None)              # its command names --out and --resume
    return r


def rows(x):
    """Every image as bytes, to check set relations between splits."""
    return {bytes(v.flatten().tolist()) for v in x.cpu()}


def stopped_at_checkpoint(main, argv, monkeypatch, stop=lambda blob: True, check=None):
    """main(argv) dies (as a kill would) right after the first checkpoint for which stop(blob)
    holds, check(blob) first; returns its exit code."""
    save = outputs.save_checkpoint

    def save_then_die(path, blob):
        save(path, blob)
        if stop(blob):
            if check:
                check(blob)
            raise KeyboardInterrupt
    monkeypatch.setattr(outputs, "save_checkpoint", save_then_die)
    try:
        with pytest.raises(SystemExit) as e:
            main(argv)
    finally:
        monkeypatch.setattr(outputs, "save_checkpoint", save)
    return e.value.code


def interrupted_then_resumed(main, argv, out, monkeypatch, stop, check=None):
    """Run main, die right after the checkpoint for which stop(blob) holds, then --resume."""
    for ending in ("", ".ckpt", ".next.ckpt"):                    # an earlier run of the test: gone
        Path(f"{out}{ending}").unlink(missing_ok=True)
    assert stopped_at_checkpoint(main, argv + ["--out", out], monkeypatch, stop, check) == 130
    return main(argv + ["--out", out, "--resume"])


def fake_pacs(root, per_class=1, odd=None):
    """python -m harness.datasets --make-fake pacs under root; odd: a further class folder with one
    image, e.g. 'sketch/Dogs' (not 'sketch/Dog': a case-insensitive file system has it as 'dog')."""
    datasets.make_fake("pacs", str(root), per_class)
    if odd:
        folder = Path(root, "PACS", odd)
        folder.mkdir()
        any_image = next(Path(root, "PACS", "photo", "dog").iterdir())
        (folder / any_image.name).write_bytes(any_image.read_bytes())
    return str(root)


def flag_blocks(text):
    """--help's options as {flag: its help, one line}."""
    blocks, name = {}, None
    for line in text.split("\noptions:\n")[1].split("\n\n")[0].splitlines():
        m = re.match(r"  (--[\w-]+|-h)", line)
        if m:
            name = m.group(1)
            blocks[name] = ""
        blocks[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def tiny_ctx(args=None, fed=None, model=None, engine=None):
    """A Context on the CPU, the server's sampler seeded 2; given args, fed and model, all a round
    needs: a scratch copy of the model for the clients' work, their states, on_clients' engine
    (default one after another)."""
    return common.Context(torch.device("cpu"), torch.Generator().manual_seed(2),
                          data.make_prep("rmnist", "cpu"), False,
                          args, fed, None if model is None else copy.deepcopy(model), {}, engine)


METHODS = list(harness.METHODS)                     # the one list (harness/methods.py)


def resolved_args(module, argv, tmp_path=None):
    """harness.resolve of the module's METHOD with argv, its --out under tmp_path."""
    where = Path(tmp_path) if tmp_path is not None else Path(tempfile.mkdtemp())
    return harness.resolve(module.METHOD, argv + ["--out", str(where / "r.json")])


MINI = "leaves clients fewer training examples than one minibatch"


def tiny_federation(n=(6, 10)):
    g = torch.Generator().manual_seed(0)
    clients = [data.Client(i, "d", (torch.rand(k, 1, 4, 4, generator=g) * 255).to(torch.uint8),
                           torch.randint(3, (k,), generator=g),
                           torch.zeros(1, 1, 4, 4, dtype=torch.uint8),
                           torch.zeros(1, dtype=torch.long)) for i, k in enumerate(n)]
    return data.Federation("d", clients, [], [])


def tiny_args(**kw):
    a = dict(sample=2, batch_size=100, local_epochs=1, lr=0.5, momentum=0.0, weight_decay=0.0,
             global_lr=1.0,
             uniform_avg=False, size_avg=False, parallel_clients="off", seed=0, dataset="rmnist",
             device="cpu")
    a.update(kw)
    return types.SimpleNamespace(**a)


def tiny_model():
    torch.manual_seed(0)
    return (common.Net(torch.nn.Flatten(), torch.nn.Linear(16, 3)).double().to(
        torch.get_default_dtype()))


def irm_derivative_by_hand(z, y):
    """d/dw CE(w·z, y) at w = 1 = mean_i (softmax(z_i)·z_i − z_{i,y_i}): IRMv1's derivative, from
    its formula."""
    return ((z.softmax(1) * z).sum(1) - z.gather(1, y[:, None])[:, 0]).mean()


def loe_split(fed, seed=0, dataset="synthetic"):
    """fedloe.init_state's Appendix D.2 split (leave-one-domain-out unless `dataset` has fixed
    clients)."""
    return fedloe.init_state(None, fed, types.SimpleNamespace(seed=seed, dataset=dataset),
                             tiny_ctx())


# FedLOE on the fixed-client datasets: both stages with the split's clients as the
# environments of Eq. 11, scored on the clients' own
# test sets as FedAvg is. Stage 1 is checked against
# FedAvg run with Adam, bit for bit; the final scores against the final model evaluated here.
RC_ARGV = ["--dataset", "rcmnist", "--eval-every", "1"]


def irm_penalty_by_hand(z, y):
    """IRMv1 as PerInvFL's code computes it: the derivative over the batch, squared."""
    return irm_derivative_by_hand(z, y).pow(2)


def pinv_args(**kw):
    a = dict(sample=2, batch_size=100, lr=0.05, momentum=0.0, weight_decay=0.01, global_lr=1.0,
             inv="irm",
             personalize="dual", beta=0.0, lam=3.0, anneal=0, R=1, S=1, opt="sgd", eta_q=0.5,
             theta="reset",
             # (no end-of-round
             theta_opt="sgd", eta=None, eval_every=10 ** 6, rounds=10 ** 6, parallel_clients="off",
             seed=0, dataset="rmnist", device="cpu")                                        # check)
    a.update(kw)
    a["eta"] = a["lr"] if a["eta"] is None else a["eta"]                    # perinvfl.derive's
    return types.SimpleNamespace(**a)


def pinv_loss_by_hand(theta, x, y, lam, wd, weight=1.0):
    """L_INV of tiny_model (Flatten + Linear(16, 3)) from a flat parameter vector, written out."""
    W, b = theta[:48].view(3, 16), theta[48:]
    z = x.flatten(1) @ W.T + b
    loss = (weight * F.cross_entropy(z, y) + lam * irm_penalty_by_hand(z, y) + wd / 2
            * theta.pow(2).sum())
    return loss / lam if lam > 1 else loss


def grad_by_hand(theta, client, lam, wd, weight=1.0):
    theta = theta.clone().requires_grad_()
    g, = torch.autograd.grad(pinv_loss_by_hand(theta, client.x.to(theta.dtype) / 255, client.y, lam,
                                               wd, weight), theta)
    return g


def pinv_setup(**kw):
    model, fed, args = tiny_model(), tiny_federation(), pinv_args(**kw)
    ctx = tiny_ctx(args, fed, model)
    import perinvfl_variants as pv                      # (perinvfl.py's state and the variants')
    state = pv.init_state(model, fed, args, ctx)
    state["clients"] = ctx.clients                               # the clients' own (θ_i kept there)
    return model, fed, ctx, args, state


def hold(ctx, kept):
    """Each client i keeps θ_i = thetas[i] (the variants' --theta kept: line 8 starts there)."""
    for i, th in enumerate(kept):
        ctx.clients.setdefault(i, {})["theta"] = th.clone()


# PerInvFL's Algorithm 1, line 8: which θ_i line 8 starts
# from (`--theta reset|kept`, perinvfl_variants.py), its
# optimiser's state across rounds and across the switch
# to the large λ, line 8 ending no worse than ν on
# its own objective J_i (Eq. 4, as the file defines it), and R > 1 local steps of ν.
def J_by_hand(theta, centre, c, lam, args):
    """Line 8's objective written out: (risk + λ·IRMv1 penalty + L2 + β||θ − ν||²) / λ once λ >
    1."""
    scale = lam if lam > 1 else 1.0
    return (pinv_loss_by_hand(theta, c.x.float() / 255, c.y, lam, args.weight_decay)
            + args.beta * (theta - centre).pow(2).sum() / scale)


def ipg_args(**kw):
    return tiny_args(**dict(dict(lam=0.0, exit="off", exit_warmup=3, exit_L=0.5, exit_clients=[],
                                 aberrant=None, aberrant_client=0, local_step="sgd",
                                 warmup="pretraining"), **kw))


def why_sync(func, args, kwargs):
    """Why the aten call `func` would make the host wait for a CUDA device, or None. The ops that
    read device values on the host, whatever the device: a tensor read as a number, the ops whose
    output size depends on the values, the comparisons returning a Python bool, and copies between
    devices."""
    name = func._schema.name.removeprefix("aten::")
    if name == "_local_scalar_dense":
        return ".item() / bool() / int() / float() / a format of a tensor"
    if name in ("nonzero", "masked_select", "masked_scatter", "masked_scatter_", "equal",
                "_unique2", "unique_dim",
                "unique_consecutive", "unique_dim_consecutive", "bincount", "histc"):
        return f"aten.{name} (its output size, or its answer, is a value on the device)"
    if (name == "repeat_interleave" and func._overloadname == "Tensor"
            and kwargs.get("output_size") is None):
        return "repeat_interleave without output_size"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        if any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
               if i is not None):
            return f"aten.{name} with a boolean mask (x[mask]: a nonzero inside)"
    if (name == "_to_copy" and kwargs.get("device") is not None
            and torch.device(kwargs["device"]) != args[0].device):
        return f"a copy from {args[0].device} to {kwargs['device']}"
    if name == "copy_" and args[0].device != args[1].device:
        return f"a copy from {args[1].device} to {args[0].device}"
    return None


def in_torch_optim():
    """Called from torch.optim: its step counts are CPU tensors (not capturable), read without a
    device sync."""
    f, here = sys._getframe(), os.path.join("torch", "optim", "")
    while f is not None:
        if here in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


class SyncGuard(TorchDispatchMode):
    """Checks the calls of the functions wrapped by `checked`: any aten op that synchronises the
    host with a CUDA device raises, on the CPU too (this machine has no GPU), and .tolist() / .cpu()
    / .numpy(), which a dispatch mode cannot see on a CPU tensor, raise as well. On CUDA the same
    calls also run under torch.cuda.set_sync_debug_mode("error") (unless cuda_debug=False).
    `unchecked` exempts a call made inside a checked one. A copy of host data to the device is seen
    on the CPU in its commonest form, a tensor indexed with a Python list (`host_index`; where
    cuda_debug is on); not seen there: a .to() between devices (a no-op) and other copies (CUDA's
    debug mode sees them)."""

    def __init__(self, cuda):
        super().__init__()
        self.cuda, self.depth, self.paused, self.debugging, self.where, self.entered = (
            cuda, 0, 0, False, None, {})
        self.strict = 0                                  # depth of checked calls with cuda_debug on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = None if self.paused else why_sync(func, args, kwargs)
        if why and not (func._schema.name == "aten::_local_scalar_dense" and args[0].device.type
                        == "cpu"
                        and (self.cuda or in_torch_optim())):
            raise AssertionError(f"host synchronisation inside {self.where}: {why}")
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def cuda_debug(self, mode):
        before, self.debugging = (torch.cuda.get_sync_debug_mode(), self.debugging), mode == "error"
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before[0])
            self.debugging = before[1]

    def checked(self, fn, where, cuda_debug=True):
        @functools.wraps(fn)                   # (keeps a client function's `stackable` mark)
        def run(*a, **k):
            self.entered[where] = self.entered.get(where, 0) + 1
            outer, self.where = self.where, where
            with contextlib.ExitStack() as stack:
                if not self.depth:
                    stack.enter_context(self)
                if self.cuda and cuda_debug and not self.debugging:
                    stack.enter_context(self.cuda_debug("error"))
                self.depth, self.strict = self.depth + 1, self.strict + cuda_debug
                try:
                    return fn(*a, **k)
                finally:
                    self.depth, self.strict = self.depth - 1, self.strict - cuda_debug
                    self.where = outer
        return run

    def host_index(self, name):
        """t[[i, j]] / t[:, [i, j]]: the list becomes a CPU tensor copied to t's device (a sync on
        CUDA)."""
        original = getattr(torch.Tensor, name)

        def run(t, index, *a):
            parts = index if isinstance(index, tuple) else (index,)
            if self.strict and not self.paused and any(isinstance(i, list) for i in parts):
                raise AssertionError(f"host synchronisation inside {self.where}: a tensor indexed "
                                     "with a Python list")
            return original(t, index, *a)
        return run

    def unchecked(self, fn):
        def run(*a, **k):
            with contextlib.ExitStack() as stack:
                if self.debugging:
                    stack.enter_context(self.cuda_debug("default"))
                self.paused += 1
                try:
                    return fn(*a, **k)
                finally:
                    self.paused -= 1
        return run

    def host_read(self, name):
        original = getattr(torch.Tensor, name)

        def run(t, *a, **k):
            if self.depth and not self.paused:
                raise AssertionError(f"host synchronisation inside {self.where}: .{name}()")
            return original(t, *a, **k)
        return run


def checked_one_hot(one_hot, guard):
    """F.one_hot with its number of classes given checks its input's range on the host on the CPU
    only (on CUDA a device-side assert does it): no sync on CUDA, so not one here either."""
    def run(x, num_classes=-1):
        if num_classes < 0:
            raise AssertionError(f"host synchronisation inside {guard.where}: F.one_hot without "
                                 "num_classes")
        return guard.unchecked(one_hot)(x, num_classes)
    return run


def guarded_run(method, argv, steps, device, tmp_path, monkeypatch):
    """A run of the script `method` (a module's name) with the functions `steps` ("module.name")
    checked by a SyncGuard, the once-per-round reads outside them; every one of them must run."""
    guard = SyncGuard(device == "cuda")
    for where in steps:
        module, name = where.split(".")
        module = importlib.import_module(module)
        monkeypatch.setattr(module, name, guard.checked(getattr(module, name), where))
    monkeypatch.setattr(F, "one_hot", checked_one_hot(F.one_hot, guard))
    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, guard.host_read(name))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, guard.host_index(name))
    run(importlib.import_module(method).main, argv + ["--device", device], tmp_path)
    assert set(guard.entered) == set(steps)          # every per-step function ran (under the check)


def ragged_federation(sizes=(20, 45, 70, 108, 33)):
    """Synthetic clients cut to uneven sizes: different step counts and partial last batches."""
    fed = data.federate(data.synthetic(), 0, len(sizes), seed=0, device="cpu")
    for c, n in zip(fed.clients, sizes):
        c.x, c.y = c.x[:n], c.y[:n]
    assert [c.n for c in fed.clients] == list(sizes)
    return fed


def method_args(module, name, argv, tmp_path):
    """The method's resolved arguments on the synthetic data with the FL CNN (--compile: the clients
    at once, as it needs)."""
    on = (["--parallel-clients", "on"] if "--compile" in argv and "--parallel-clients" not in argv
          else [])
    return resolved_args(module, ["--dataset", "synthetic", "--model", "cnn"] + argv + on, tmp_path)


def both_ways(round_fn, args, rounds, init_state=lambda *a: {},
              fed_fn=ragged_federation):
    """The same seeded rounds with the clients one after another (common.one_by_one) and all at once
    (common.all_at_once); the latter must never train one client alone. {mode: (θ_T, θ_0, state,
    last losses)}."""
    out = {}
    for mode in ("off", "on"):
        args.parallel_clients = mode
        fed = fed_fn()
        torch.manual_seed(0)
        model = common.build_model(args, data.synthetic())
        theta0 = common.get_flat(model)
        ctx = tiny_ctx(args, fed, model, at_once_only if mode == "on" else common.one_by_one)
        state = init_state(model, fed, args, ctx)
        state["clients"] = ctx.clients
        for t in range(1, rounds + 1):
            losses = round_fn(t, model, fed, args, state, ctx)
        out[mode] = (common.get_flat(model), theta0, state, losses)
    return out


def at_once_only(fn, S, sents, t, phase, ctx):
    """common.all_at_once, as on_clients' engine, failing the test where a client function that
    trains at once (stackable) would run one client alone."""
    if getattr(fn, "stackable", False) and len(S) == 1:
        pytest.fail("the clients-at-once run trained one client alone")
    return common.all_at_once(fn, S, sents, t, phase, ctx)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


F64 = dict(params=1e-12, update=1e-12, losses=1e-6)    # float64: θ_T and θ_T − θ_0


def assert_same_to_tolerance(out, params, update, losses=1e-5):
    """Relative 2-norm differences of θ_T and of the update θ_T − θ_0, relative ones of the
    losses."""
    (seq, theta0, _, seq_loss), (par, _, _, par_loss) = out["off"], out["on"]
    assert seq.dtype == par.dtype == torch.get_default_dtype()
    assert rel(par, seq) < params and rel(par - theta0, seq - theta0) < update
    assert rel(seq, theta0) > 1e-3                                  # they did train
    assert sorted(par_loss) == sorted(seq_loss)
    assert torch.allclose(torch.stack([par_loss[c] for c in seq_loss]),
                          torch.stack(list(seq_loss.values())),
                          rtol=losses, atol=0)


def smallconv():
    torch.manual_seed(0)
    return common.build_model(type("A", (), dict(model="smallconv", head="linear")),
                              data.synthetic())


# Copy a method, not the project: each method's plain functions are lifted by their source into a
# namespace that holds torch alone, driven by a loop
# written here (its own model, three clients of its
# own data, no common.py, no data.py), and checked against the method file's own round on the same
# data and minibatches.
def copied(module, *names):
    """The source of module's functions `names`, executed in a fresh namespace with torch alone
    (and torch.nn as nn, torch.nn.functional as F, math): a function that reaches for the project
    fails here."""
    src = "\n\n".join(textwrap.dedent(inspect.getsource(getattr(module, n))) for n in names)
    ns = {"__name__": "copied"}
    head = "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
    exec(head + "\n" + src, ns)
    return types.SimpleNamespace(**{n: ns[n] for n in names})


def load(model, vec):
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vec[i:i + p.numel()].view_as(p))
            i += p.numel()


IIR = ["--gamma", "1", "--ema", "0.5"]      # γ and v large enough that the penalty moves θ by ~1e-2


IPG = ["--local-step", "sgd", "--lam", "5"]


def max_diff(a, b):
    return (a - b).abs().max().item()


def final_theta(out):
    """θ_T from the last checkpoint, in float64 (exact for float32 checkpoints)."""
    blob = torch.load(out + ".ckpt", weights_only=True)
    return torch.cat([v.reshape(-1).double() for v in blob["model"].values()])


def history_losses(r):
    return torch.tensor([row["loss"] for row in r["domains"]["style0"]["history"]],
                        dtype=torch.float64)


def full_batch_step(model, client, lr):
    """One plain gradient step on the client's whole training set, written independently."""
    m = copy.deepcopy(model)
    loss = F.cross_entropy(m(client.x.to(torch.get_default_dtype()) / 255), client.y)
    grads = torch.autograd.grad(loss, list(m.parameters()))
    return torch.cat([(p - lr * g).reshape(-1) for p, g in zip(m.parameters(), grads)]).detach()


TINY_TOL = {torch.float32: dict(atol=1e-6), torch.float64: dict(rtol=0, atol=1e-12)}


def three_clients(seed=0, sizes=(7, 12, 9), shape=(1, 4, 4), classes=3):
    """Three clients of uint8 images and labels, as a user's own data would be."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(n, *shape, generator=g) * 255).to(torch.uint8),
             torch.randint(classes, (n,), generator=g))
            for n in sizes]


def as_federation(clients):
    """The same clients for the method file's own round."""
    cs = [data.Client(i, "d", x, y, x[:1], y[:1]) for i, (x, y) in enumerate(clients)]
    return data.Federation("d", cs, [], [])


def own_model(seed=0):
    torch.manual_seed(seed)
    return common.Net(torch.nn.Flatten(), torch.nn.Linear(16, 3))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def own_local_sgd(model, x, y, gen, lr, momentum, batch_size, epochs, loss_fn):
    """The test's own client loop: shuffled passes of minibatch SGD (the draws of a generator the
    caller owns), pixels / 255."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch_size):
            idx = perm[i:i + batch_size]
            loss = loss_fn(model, x[idx].float() / 255, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return flat(model)


def ce(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


ARGS = dict(sample=3, batch_size=4, local_epochs=2, lr=0.1, momentum=0.9, weight_decay=0.0,
            global_lr=1.0,
            uniform_avg=False, parallel_clients="off", seed=0, dataset="rmnist", device="cpu")


def method_rounds(round_fn, clients, rounds, state=None, **kw):
    """The method file's own round, `rounds` times, from own_model(); returns the final θ."""
    model, fed = own_model(), as_federation(clients)
    args = types.SimpleNamespace(**dict(ARGS, **kw))
    ctx = tiny_ctx(args, fed, model)
    state = state if state is not None else {}
    state["clients"] = ctx.clients
    for t in range(1, rounds + 1):
        round_fn(t, model, fed, args, state, ctx)
    return flat(model)


# FedIIR copied: its plain functions (classifier_grads, gbar_update, iir_penalty, iir_objective,
# server_update) lifted by their source into a torch-only
# namespace, driven for two rounds by a loop written
# here (the test's own model, three ragged clients of
# its own data, no common.py, no data.py), and checked
# against fediir.fediir_round on the same data and
# minibatches (each client's own stream): bit for bit
# (torch.equal, CPU). The "Copy it" loop of docs/fediir.md is run too, against this one.
PLAIN = ("classifier_grads", "gbar_update", "iir_penalty", "iir_objective", "server_update")


def streams(phase):
    """Client c's generator in round t, as method_rounds' run draws it (seed 0, federation "d")."""
    return lambda t, c: common.stream(0, "d", t, c, phase, "cpu")


def copied_fediir_rounds(m, clients, rounds, gamma, v, batch_size, full_batch_gbar, size_avg,
                         draws=None):
    """Algorithm 1 with the copied functions: step 1 the sampled clients, step 2 their classifier
    gradients at θ^{t-1} (features without a graph), summed and counted, into g_bar and smoothed
    into g̃ (Appendix C), step 3 local SGD on R_c + γ||∇_ω R_c − g̃||², step 4 the server's average.
    draws: the sampling generator and each client's (t, c) -> generator; default those of
    method_rounds."""
    model = own_model()
    sampler, gen = draws or (torch.Generator().manual_seed(2), streams("client_update"))
    net = torch.nn.ModuleDict({"featurizer": model.featurizer, "classifier": model.classifier})
    params = dict(net.named_parameters())
    g_tilde = torch.zeros(sum(p.numel() for p in model.classifier.parameters()))   # g̃^0 = 0
    theta = flat(model)
    for t in range(1, rounds + 1):
        S = sorted(torch.randperm(len(clients), generator=sampler)[:3].tolist())    # step 1
        model.train()
        grad, count = 0, 0
        for c in S:                                                            # step 2, client side
            x, y = clients[c]
            with torch.no_grad():
                z = model.featurizer(x.float() / 255)
            g, k = m.classifier_grads(model.classifier, z, y, None if full_batch_gbar
                                      else batch_size)
            grad, count = grad + g, count + k
        g_tilde = m.gbar_update(g_tilde, grad / count, v)                  # step 2, server + App. C

        def loss(model, x, y):
            return m.iir_objective(net, params, {}, x, y, torch.full((len(y),), 1 / len(y)),
                                   g_tilde, gamma)
        p = [float(len(clients[c][1])) if size_avg else 1.0 for c in S]
        delta_sum = torch.zeros_like(theta)                         # Σ_c p_c Δ_c: the clients' sum
        for c, p_c in zip(S, p):                                                # step 3
            load(model, theta)
            theta_c = own_local_sgd(model, *clients[c], gen(t, c), 0.1, 0.9, batch_size, 2, loss)
            delta_sum += p_c * (theta_c - theta)
        theta = m.server_update(theta, delta_sum, sum(p), 1.0)                  # step 4
        load(model, theta)
    return theta, g_tilde


# FedOMG copied: its server step (server_update on updates and code_step, the Gram matrix, Eq. 15's
# objective and Table 4's solver) lifted by source into
# a namespace holding torch alone, driven by the loop of
# docs/fedomg.md's "Copy it" (each client's SGD kept across rounds, as the official DG code; the DG
# code's lr step), and checked against fedomg_round on the same data and minibatches.
FUNCTIONS = ("server_update", "updates", "code_step", "objective", "solve", "gram")


R = 2                                       # rounds: the DG code's lr step (0.8 R) falls on round 2


def own_rounds(m, clients, kappa, weighted, eta_g, keep, rounds=R, lr=0.1, momentum=0.9,
               weight_decay=1e-2, batch_size=4, epochs=2, draws=None, lr_step=0.8, docs=False):
    """The loop of docs/fedomg.md, with method_rounds' draws (the server's sampling, each client's
    stream; docs: torch's global generator for all, as the docs' loop, and its mean cross-entropy;
    otherwise the method's Σ_j CE_j / b, the same operations) and pixels / 255: each client trains
    its own SGD from θ (kept across rounds when `keep`), the server steps by server_update.
    eta_g(U): the round's η_g."""
    model = own_model()
    sampler, gen = (None, lambda r, c: None) if docs else draws or (
        torch.Generator().manual_seed(2),
                                                                      streams("client_update"))
    ce = (lambda out, y: F.cross_entropy(out, y)) if docs else \
        (lambda out, y: (F.cross_entropy(out, y, reduction="none")
                         * torch.full((len(y),), 1 / len(y))).sum())
    theta, opts = flat(model), {}
    for r in range(1, rounds + 1):
        S = sorted(torch.randperm(len(clients), generator=sampler).tolist())
        lr_r = lr * (0.1 if r > lr_step * rounds else 1.0)     # the DG code's StepLR (FL: 1, never)

        def trained(c):                                           # client c: E epochs of SGD from θ
            x, y = clients[c]
            load(model, theta)
            if keep and c in opts:
                opts[c].param_groups[0]["lr"] = lr_r
            else:
                opts[c] = torch.optim.SGD(model.parameters(), lr=lr_r, momentum=momentum,
                                          weight_decay=weight_decay)
            g = gen(r, c)                                           # the client's stream this round
            for _ in range(epochs):
                perm = torch.randperm(len(y), generator=g)
                for i in range(0, len(y), batch_size):
                    idx = perm[i:i + batch_size]
                    opts[c].zero_grad()
                    ce(model(x[idx].float() / 255), y[idx]).backward()
                    opts[c].step()
            return flat(model)                                       # the upload θ_u
        N = [len(clients[c][1]) for c in S]
        theta = m.server_update(theta, (trained(c) for c in S), N, eta_g(len(S)), kappa, weighted)
    return theta


# FedLOE copied: its plain functions (Eq. 4's average,
# Eq. 10's overfit_head, the tuning predictions,
# the server's Tuning, Eq. 11's fit_phi with its terms, Eq. 12's ensemble) lifted by source into a
# namespace holding torch alone, driven by the loop
# of docs/fedloe.md's "Copy it" (a tiny model of the
# test's own with a trainable featurizer, three clients with their own tuning splits), and checked
# against fedloe_round on the same data and minibatches: bit for bit on the CPU.
LOE_FUNCTIONS = ("average", "overfit_head", "head_predictions", "Tuning", "risks", "irm_penalty",
                 "rex_penalty", "fit_phi", "ensemble")


SIZES = (30, 40, 50)


class Tiny(torch.nn.Module):
    """The test's own model: a featurizer with weights (stage 1 trains it, stage 2 freezes it), a
    linear head."""

    def __init__(self):
        super().__init__()
        self.featurizer = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 6),
                                              torch.nn.ReLU())
        self.classifier = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.classifier(self.featurizer(x))


def tiny(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def split(clients):
    """Each client's own tuning split: its last 10% (at least one example); uint8 images."""
    return [(x[:-max(1, len(y) // 10)], y[:-max(1, len(y) // 10)], x[-max(1, len(y) // 10):],
             y[-max(1, len(y) // 10):])
            for x, y in clients]


def as_floats(clients):
    return [(x.float() / 255, y, xt.float() / 255, yt) for x, y, xt, yt in clients]


def loe_own_rounds(m, clients, K1, E1, K2, E2, B, lr, wd, lr2, wd2, r, lam, steps, meta_lr,
                   docs=False):
    """The loop of docs/fedloe.md's "Copy it" with its numbers as arguments, each client's
    minibatches drawn from its own stream as fedloe_round's clients draw them, the losses in the
    method's form (Σ_j CE_j / b); docs: torch's global generator and the mean cross-entropy, as the
    docs' loop. Returns θ and the last φ."""
    model = tiny()
    gen = (lambda t, c, phase: None) if docs else (lambda t, c,
                                                   phase: common.stream(0, "d", t, c, phase, "cpu"))
    ce = (lambda out, y: F.cross_entropy(out, y)) if docs else \
        (lambda out, y: (F.cross_entropy(out, y, reduction="none")
                         * torch.full((len(y),), 1 / len(y))).sum())

    def epochs_of(n, E, g):                                  # E shuffled passes of minibatches of B
        for _ in range(E):
            perm = torch.randperm(n, generator=g)
            yield from (perm[i:i + B] for i in range(0, n, B))
    theta = flat(model)
    for t in range(1, K1 + 1):                                   # stage 1
        delta_sum = torch.zeros_like(theta)                  # Σ_c n_c (θ_c − θ): the clients' sum
        for c, (x, y, _, _) in enumerate(clients):          # client c: E1/K1 epochs of a fresh Adam
            load(model, theta)
            opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
            for idx in epochs_of(len(y), E1 // K1, gen(t, c, "stage1_update")):
                opt.zero_grad()
                ce(model(x[idx]), y[idx]).backward()
                opt.step()
            delta_sum += len(y) * (flat(model) - theta)
        theta = m.average(theta, delta_sum, float(sum(len(y) for _, y, _, _ in clients)))  # Eq. 4
    load(model, theta)
    with torch.no_grad():                                        # stage 2: θ̂ frozen
        Z = [(model.featurizer(x), model.featurizer(xt)) for x, _, xt, _ in clients]
    head, phi = model.classifier, None
    for t in range(K1 + 1, K1 + K2 + 1):
        W0, b0 = head.weight.detach(), head.bias.detach()
        psi = [m.overfit_head(W0, b0, z, y, epochs_of(len(y), E2 // K2, gen(t, c, "head_update")),
                              lr2, 0.0, wd2)[:2]
               for c, ((z, _), (_, y, _, _)) in enumerate(zip(Z, clients))]    # Eq. 10
        Ws, bs = torch.stack([W for W, _ in psi]), torch.stack([b for _, b in psi])
        Y = torch.cat([m.head_predictions(zt, Ws, bs) for _, zt in Z])
        T = m.Tuning(Y, torch.cat([yt for *_, yt in clients]), [len(yt) for *_, yt in clients])
        phi = m.fit_phi(T, r, lam, lr2, wd2, steps, meta_lr)                     # Eq. 11
        W, b = m.ensemble(phi, Ws, bs)                                            # Eq. 12
        with torch.no_grad():
            head.weight.copy_(W)
            head.bias.copy_(b)
    return flat(model), phi


# PerInvFL copied: its plain functions (risk_of_scale,
# irm_penalty, l_inv, rescale, J_i, server_update,
# server_adam; GroupDRO's q_update from perinvfl_variants.py) lifted by their
# source into a torch-only namespace, driven for two rounds of Algorithm 1 by
# a loop written here (the test's own model, three ragged clients of its own data, no common.py, no
# data.py), and checked against perinvfl.perinvfl_round
# on the same data and minibatches: bit for bit
# (torch.equal, CPU). The loop of docs/perinvfl.md's
# "Copy it" is run as printed and checked the same
# way.
PINV_PLAIN = ("risk_of_scale", "irm_penalty", "l_inv", "rescale", "J_i", "server_update",
              "server_adam")


def pinv_copied():
    """perinvfl.py's plain functions and the variants' q_update, copied alone into one namespace."""
    import perinvfl_variants as pv                              # (benchmark/: only when asked)
    return types.SimpleNamespace(**vars(copied(perinvfl, *PINV_PLAIN)),
                                 **vars(copied(pv, "q_update")))


def copied_perinvfl_rounds(m, clients, rounds, lam, anneal, beta, wd, gamma, eta, alpha, momentum,
                           R, S, B, reading="reset", adam=True, groupdro=False, personalize="dual",
                           eta_q=0.5, C=3):
    """Algorithm 1 with the copied functions, every choice as perinvfl.py makes it: the C sampled
    clients (in the order of their ids); θ_i from ν^t (`reset`) or kept on the client; per r: S
    plain steps of line 8 on J_i(θ_i; ν_{i,r}) (SGD at η), then one of line 9 on L_INV / rescale
    (SGD at γ); R an integer or "epoch" (2 passes of minibatches of B: the local_epochs of the copy
    harness's ARGS); line 10 by the server's Adam or the plain average; GroupDRO's q from the risks
    of ν^t on each client's split. Each step draws a random minibatch of B (all of a client's data
    if B covers it) from the client's own stream, pixels / 255, losses Σ_j w_j ℓ_j with w_j = 1/b.
    Returns ν, the θ_i and q."""
    model = own_model()                                           # ν_{i,r} and θ_i take turns in it
    gen, sampler = streams("client_update"), torch.Generator().manual_seed(2)
    N = len(clients)
    nu = flat(model)
    theta, q, adam_state = [nu.clone() for _ in range(N)], torch.full((N,), 1.0 / N), None

    def steps(lr, start, loss_fn, x_all, y_all, g, k):      # k steps of SGD from `start` on loss_fn
        load(model, start)
        opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=True)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for _ in range(k):
            idx = (torch.arange(len(y_all)) if B >= len(y_all)
                   else torch.randperm(len(y_all), generator=g)[:B])
            x, y, w = x_all[idx].float() / 255, y_all[idx], torch.full((len(idx),), 1 / len(idx))
            opt.zero_grad(set_to_none=True)
            loss_fn(params, buffers, x, y, w).backward()
            opt.step()
        return flat(model)

    for t in range(1, rounds + 1):
        lam_t = lam if t > anneal else 1.0
        pen = 0.0 if groupdro else lam_t                     # L_INV's IRMv1 weight (GroupDRO: none)
        pen8 = 0.0 if personalize == "l2" or groupdro else pen     # ERM + β||θ_i − ν||² on
                                                                   # line 8 (IRM-L2, GroupDRO)
        deltas, risks = [], {}
        S_t = sorted(torch.randperm(N, generator=sampler)[:C].tolist())
        for i in S_t:
            xi, yi = clients[i]
            g = gen(t, i)
            th, nu_ir = (nu if reading == "reset" else theta[i]), nu
            for r in range(R if R != "epoch" else 2 * -(-len(yi) // B)):
                J = lambda p, b, x, y, w: m.J_i(model, p, b, x, y, w, nu_ir, pen8, wd, beta)
                th = steps(eta, th, J, xi, yi, g, S)               # line 8
                if groupdro:                                       # N q_i R_i + IRM's L2
                    L = lambda p, b, x, y, w: N * q[i] * m.l_inv(model, p, b, x, y, w, 0.0, wd)
                else:
                    L = lambda p, b, x, y, w: m.l_inv(model, p, b, x, y, w, pen,
                                                      wd) / m.rescale(pen)
                nu_ir = steps(gamma, nu_ir, L, xi, yi, g, 1)       # line 9
            deltas.append(nu_ir - nu)                              # Δ_i, uploaded
            theta[i] = th
            load(model, nu)                                  # the risk of ν^t on the client's split
            with torch.no_grad():
                w = torch.full((len(yi),), 1 / len(yi))
                risks[i] = (F.cross_entropy(model(xi.float() / 255), yi, reduction="none")
                            * w).sum()
        if adam:                                                   # line 10
            nu, adam_state = m.server_adam(nu, torch.stack(deltas).mean(0), alpha, gamma,
                                           adam_state)
        else:
            nu = m.server_update(nu, torch.stack(deltas).mean(0), alpha)
        if groupdro:
            q = m.q_update(q, S_t, torch.stack([risks[i] for i in S_t]), eta_q)
    return nu, theta, q


def pinv_flags(loop, extra):
    """perinvfl.py's args for the loop's arguments, over the copy harness's ARGS (3 of 3 clients, 2
    local epochs for --R epoch); no round is evaluated (the end-of-round check changes nothing but
    its numbers)."""
    return dict(ARGS, beta=loop["beta"], lam=loop["lam"], anneal=loop["anneal"],
                weight_decay=loop["wd"], lr=loop["gamma"], eta=loop["eta"],
                global_lr=loop["alpha"], momentum=loop["momentum"], batch_size=loop["B"],
                theta_opt="sgd", eta_q=0.5, eval_every=10 ** 6, rounds=10 ** 6, **extra)


def perinvfl_rounds(clients, T, kw):
    """perinvfl_round (a variant: perinvfl_variants' round), T times, from own_model() and
    init_state, as the copy harness's method_rounds draws (whose `rounds` cannot be the args' own);
    returns ν and the state."""
    model, fed = own_model(), as_federation(clients)
    args = types.SimpleNamespace(**kw)
    ctx = tiny_ctx(args, fed, model)
    import perinvfl_variants as pv                              # (benchmark/: only when asked)
    state = pv.init_state(model, fed, args, ctx)
    # perinvfl.py's, else a variant
    own = (kw["inv"], kw["personalize"], kw["theta"]) == ("irm", "dual", "reset")
    state["clients"] = ctx.clients                               # the clients' own (θ_i kept there)
    for t in range(1, T + 1):
        (perinvfl.perinvfl_round if own else pv.variant_round)(t, model, fed, args, state, ctx)
    return flat(model), state


def thetas(state):
    """PerInvFL's θ_i, in the order of the clients' ids: each kept in its client's own state."""
    return [state["clients"][i]["theta"] for i in sorted(state["clients"])
            if "theta" in state["clients"][i]]


def with_solver(monkeypatch, solver):
    """fedomg's Γ solver for the test: Table 4's ("sgd", fedomg.solve) or SLSQP ("exact")."""
    if solver == "exact":
        import fedomg_readings                                  # (benchmark/: only when asked)
        monkeypatch.setattr(fedomg, "solve", fedomg_readings.solve_exact)


SGD = ["--clients", "5", "--sample", "4", "--batch-size", "16", "--momentum", "0.9",
       "--weight-decay", "1e-2"]


def max_abs(out):
    return max_diff(out["on"][0], out["off"][0])


LOE = ["--dataset", "synthetic", "--clients", "4", "--test-domain", "1", "--stage1-epochs", "4",
       "--stage1-comms", "2",
       "--stage2-epochs", "2", "--stage2-comms", "2", "--server-steps", "20"] + LOE_FULL
