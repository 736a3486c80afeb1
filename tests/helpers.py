"""What the test files share: the quick run's flags, running a script's main in a test's folder,
one-line refusals, resuming after a stop, the tiny federations and hand computations that more
than one file's tests use. Importing it puts benchmark/ and its diagnostics on the path."""

import copy
import re
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import common
import data
import fedloe
import harness
from harness import datasets, runner


HERE = Path(__file__).resolve().parent.parent       # the checkout
sys.path[:0] = [str(HERE / "benchmark"), str(HERE / "benchmark" / "diagnostics")]
import perinvfl_variants as pv


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
    save = runner.save_checkpoint

    def save_then_die(path, blob):
        save(path, blob)
        if stop(blob):
            if check:
                check(blob)
            raise KeyboardInterrupt
    monkeypatch.setattr(runner, "save_checkpoint", save_then_die)
    try:
        with pytest.raises(SystemExit) as e:
            main(argv)
    finally:
        monkeypatch.setattr(runner, "save_checkpoint", save)
    return e.value.code


def interrupted_then_resumed(main, argv, out, monkeypatch, stop, check=None):
    """Run main, die right after the checkpoint for which stop(blob) holds, then --resume."""
    for ending in ("", ".ckpt", ".next.ckpt"):                    # an earlier run of the test: gone
        Path(f"{out}{ending}").unlink(missing_ok=True)
    assert stopped_at_checkpoint(main, argv + ["--out", out], monkeypatch, stop, check) == 130
    return main(argv + ["--out", out, "--resume"])


def fake_pacs(root, per_class=1, odd=None):
    """data.py --make-fake pacs under root; odd: a further class folder with one image, e.g.
    'sketch/Dogs' (not 'sketch/Dog': a case-insensitive file system has it already as 'dog')."""
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


# Every float flag of every method: a finite number, refused at once otherwise (an inf learning rate
# trains a model of NaNs, an inf server step writes one).
METHODS = ["fedavg", "fediir", "fedomg", "fedloe", "perinvfl", "fedipg"]


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
    return data.Federation("d", clients, None, None, None, None, None, [])


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
    state = pv.init_state(model, fed, args, ctx)           # (perinvfl.py's state and the variants')
    state["clients"] = ctx.clients                               # the clients' own (θ_i kept there)
    return model, fed, ctx, args, state


def hold(ctx, thetas):
    """Each client i keeps θ_i = thetas[i] (the variants' --theta kept: line 8 starts there)."""
    for i, th in enumerate(thetas):
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
