"""A run of a method script over its held-out domains, and the signals that stop it after a round.
Nothing here is a method's numerics: each round is the method's, and the loop over rounds is
common.train. What a run writes (results, checkpoints) and its rules: outputs.py; where a result
came from: provenance.py; the progress line: progress.py.

    main(method, argv)        the script's entry: resolve, claim --out, run; errors in one line
    run(method, args, ...)    load the data, then every held-out domain (train_domain)

Extension by parameters (benchmark/, flower/), of run and of main alike: engine (on_clients'
engine: Flower's nodes), after_round (called after every round with (t, model, state, ctx)),
model_fn (a stand-in for common.global_model), load (for data.load); a swapped round or state:
dataclasses.replace(method, round=...), the round written from the method's plain functions.
"""
import functools
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

import common
from data import UserError
from harness import outputs
from harness.config import resolve
from harness.outputs import to_device
from harness.progress import Pace, Progress
from harness.provenance import code_files, provenance


class NonFinite(Exception):
    """A non-finite loss or server quantity: exit 1. `saved`: a checkpoint of this run is on
    disk (the harness sets it)."""

    def __init__(self, message, saved=False):
        super().__init__(message)
        self.saved = saved


def main(method, argv=None, **hooks):
    """The entry point of every method script: bad input -> one line on stderr and exit 2, a
    non-finite loss or server quantity -> exit 1, SIGINT / SIGTERM -> saved after the round,
    exit 128 + the signal (a second one: at once, exit 130); however it ends, one line on stderr
    says what happened and how to go on. hooks: run's (engine, after_round, model_fn, load,
    sites)."""
    plan, handlers, name = None, {}, method.name

    def how():                   # how to continue, and what stays meanwhile
        if plan is None or not plan.write.exists():
            return "nothing was saved" + ("; the older result and checkpoint are as they were"
                                          if plan is not None and plan.replacing else "")
        if plan.replacing:
            return (f"its checkpoint: {plan.write}; the older result and checkpoint at "
                    f"{plan.files.out} stay as they were; continue the replacement with the same "
                    f"arguments and --overwrite --resume")
        return f"its checkpoint: {plan.write}; continue with the same arguments and --resume"
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = resolve(method, argv)
        with outputs.claim(args.out, args.resume, args.overwrite) as plan:
            if threading.current_thread() is threading.main_thread():   # after the round
                STOP.signal = None
                handlers = {s: signal.signal(s, stop_after_the_round)
                            for s in (signal.SIGINT, signal.SIGTERM)}
            return run(method, args, argv, plan=plan, **hooks)
    except (UserError, NonFinite) as e:
        print(f"{name}.py: error: {e}", file=sys.stderr)
        sys.exit(1 if isinstance(e, NonFinite) else 2)
    except Stopped as e:
        print(f"{name}.py: stopped by {signal.Signals(e.signum).name} after round {e.t} (testing "
              f"on {e.domain}); {how()}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:   # a second signal (no newline first: a terminal's ^C is on the
        # progress line, which Progress erased)
        print(f"{name}.py: interrupted; {how()}", file=sys.stderr)
        sys.exit(130)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def run(method, args, argv=None, engine=None, plan=None, after_round=None, model_fn=None,
        load=None, sites=None):
    """Load, then for every held-out domain: federate and train_domain; results JSON and
    checkpoint. args: resolve's; argv: the command line, recorded in the provenance; engine:
    on_clients' (default: one_by_one, or all_at_once with --parallel-clients on); plan: what to
    do with --out's files (harness/outputs.py, claim; None: continue <out>.ckpt with --resume,
    and write it); after_round(t, model, state, ctx): called after every round; model_fn(args,
    ds, device): the initial model (default common.global_model); load: data.load's stand-in;
    sites(args, load) -> (ds, [(name, make)]): the data and the federations in place of
    `federations` (Flower: the nodes hold the data, the server their sizes)."""
    name = method.name
    if plan is None:
        files = outputs.Files(args.out)
        plan = outputs.Plan(files, read=files.ckpt if args.resume and files.ckpt.exists()
                            else None, write=files.ckpt)
    common.deterministic(not args.nondeterministic)   # before anything meets CUDA
    device, ckpt_path = torch.device(args.device), str(plan.write)
    try:
        ds, todo = (sites or federations)(args, load)
    except NonFinite as e:                  # a node's bad report (Flower): before any training
        kept = f"the last good checkpoint ({ckpt_path}) is kept" if plan.write.exists() else \
            "nothing of this run was saved"
        raise NonFinite(f"{e}; stopped; {kept}") from None
    code = code_files(method.round)
    blob = outputs.load_checkpoint(plan.read, args, name, code) if plan.read is not None else None
    if blob is not None and not plan.replacing and outputs.complete(args.out):
        print(f"{args.out} is complete, and its checkpoint was made with these arguments: "
              f"nothing to continue")
        return outputs.read_result(args.out)
    command = sys.argv[1:] if argv is None else argv
    results = {"method": name, "dataset": args.dataset, "seed": args.seed, "args": vars(args),
               "source": ds.source, "protocol": ds.protocol, "domains": {},
               "mean_test_acc": None, "complete": False,
               "provenance": provenance(name, command, device,
                                        (args.out, plan.files.ckpt, plan.files.next))}
    made = {k: results["provenance"][k] for k in ("commit", "dirty")}
    versions = blob.get("code", []) if blob is not None else []
    if not versions or versions[-1].get("files") != code:
        versions = versions + [dict(made, files=code)]
    results["provenance"]["code"] = code
    if len(versions) > 1:       # --allow-code-change: both versions recorded, the result mixed
        results["provenance"]["mixed_code"] = versions
        print(f"note: continuing under other code than {plan.read} was made with; the result "
              f"records both (provenance: mixed_code)")
    if blob is not None:
        results["domains"] = blob["finished"]
        print(f"resuming from {plan.read}: {len(blob['finished'])} domain(s) done, "
              f"'{blob['domain']}' at round {blob['round']}")
    print(f"{name} on {args.dataset}: {args.clients} clients, {args.sample} per round, "
          f"{args.rounds} rounds, {args.local_epochs} local epoch(s), lr {args.lr}, batch "
          f"{args.batch_size}, device {device}")
    own = {"method": name, "code": versions}
    hooks = dict(engine=engine, after_round=after_round, model_fn=model_fn)
    for k, (domain, make) in enumerate(todo):
        if domain in results["domains"]:
            continue                                            # finished before a --resume
        fed = make()
        resume = blob if blob is not None and blob["domain"] == fed.name else None
        try:
            with Progress():
                results["domains"][fed.name] = train_domain(
                    method, args, ds, fed, resume, results, ckpt_path, len(todo) - k - 1, own,
                    **hooks)
        except NonFinite as e:   # name only the files this run wrote (or resumed from)
            done = bool(results["domains"])                 # finished here, or before --resume
            kept = [f"the last good checkpoint ({ckpt_path})"] * (blob is not None or done
                                                                   or e.saved) + \
                [f"the results of the finished test domains ({args.out})"] * \
                (done and not plan.replacing)
            said = " and ".join(kept) + (" are kept" if len(kept) > 1 else " is kept")
            raise NonFinite(f"{e}; stopped; " + (said if kept else "nothing of this run was "
                                                 "saved")) from None
        if not plan.replacing:       # an --overwrite writes --out once complete, not before
            outputs.write_json(args.out, with_mean(results))
    results["complete"] = True                                  # every held-out domain is done
    outputs.finish(plan, with_mean(results))
    print_table(results)
    print(f"results: {args.out}")
    if plan.files.ckpt.exists():    # the only copy of the trained model: said what deleting loses
        print(f"checkpoint: {plan.files.ckpt} ({size(plan.files.ckpt)}): the final model and the "
              f"method's state, the only copy of the trained model; deleting it loses the model, "
              f"not the results")
    return results


def federations(args, load=None):
    """The run's data, loaded here, and its federations, one per held-out domain to be run (the
    fixed clients: one), as (name, make): each made when its turn comes."""
    ds = common.load_data(args, load)
    print(f"data: {ds.source}\ndata: {counts(ds)}", flush=True)
    name = lambda test: "clients" if test is None else ds.domains[test].name
    return ds, [(name(test), functools.partial(common.federation, args, ds, test))
                for test in common.after_load(args, ds)]


def counts(ds):
    """One line: how many domains (or clients), classes and images a dataset holds."""
    images = sum(len(d.y) + (0 if d.y_test is None else len(d.y_test)) for d in ds.domains)
    parts = (f"{len(ds.domains)} domains ({', '.join(d.name for d in ds.domains)})"
             if ds.protocol == "lodo" else f"{len(ds.domains)} clients")
    return f"{parts}, {ds.num_classes} classes, {images:,} images"


def with_mean(results):
    accs = [r["test_acc"] for r in results["domains"].values()]
    results["mean_test_acc"] = sum(accs) / len(accs)
    return results


def train_domain(method, args, ds, fed, resume, results, ckpt_path, remaining, own=None,
                 engine=None, after_round=None, model_fn=None):
    """common.train on one federation, the best evaluation kept, a checkpoint at each evaluation
    and every --checkpoint-minutes between them; a stop signal ends it after its round's
    checkpoint (Stopped)."""
    model, state, ctx = start_domain(args, ds, fed, method.init_state, resume, engine, model_fn)
    so_far = Trained.of(resume) if resume is not None else Trained()
    pace = Pace(so_far.next_round, so_far.seconds, args.rounds, remaining)
    saved, saved_at = resume is not None, time.monotonic()

    def checkpoint(t):
        nonlocal saved, saved_at
        outputs.save_checkpoint(ckpt_path, {
            **(own or {}), "args": outputs.identity(args), "finished": results["domains"],
            "domain": fed.name, "round": t, "model": model.state_dict(), "state": state,
            "losses": so_far.losses, "sampler": ctx.sampler.get_state(),
            "torch_rng": torch.get_rng_state(), "history": so_far.history, "best": so_far.best,
            "seconds": pace.seconds(ctx.device)})
        saved, saved_at = True, time.monotonic()
    rounds = common.train(method.round, model, fed, args, state, ctx, method.evaluate,
                          so_far.next_round, checked)
    while True:
        try:
            t, loss, scores = next(rounds)
        except StopIteration:
            break
        except NonFinite as e:
            e.saved = e.saved or saved
            raise
        so_far.losses.append(loss)
        if after_round:
            after_round(t, model, state, ctx)
        if scores is None:
            if STOP.signal or time.monotonic() - saved_at > 60 * args.checkpoint_minutes:
                checkpoint(t)                           # (the losses since the last evaluation too)
            if STOP.signal:
                raise Stopped(STOP.signal, ckpt_path, fed.name, t)
            if isinstance(sys.stdout, Progress):        # a terminal: a line the next overwrites
                sys.stdout.show(f"round {t:4d}/{args.rounds} | round loss "
                                f"{so_far.losses[-1]:.4f} | {pace(t)}")
            continue
        so_far.evaluated(t, scores, pace.seconds(ctx.device), args.select)
        row = so_far.history[-1]
        shown = "".join(f" | {k} {v:.4f}" for k, v in row.items()
                        if k not in Trained.ROW and isinstance(v, float))
        print(f"round {t:4d}/{args.rounds} | val {row['val_acc']:.4f} | test "
              f"{row['test_acc']:.4f}{shown} | mean loss (rounds {t - so_far.averaged + 1}-{t}) "
              f"{row['loss']:.4f} | {pace(t)}", flush=True)
        checkpoint(t)
        if STOP.signal and t < args.rounds:
            raise Stopped(STOP.signal, ckpt_path, fed.name, t)
    return domain_result(ds, fed, so_far.history, so_far.best)


def checked(t, losses, model, state, fed):
    """Round t's losses ({client id: mean local loss}, or {the clients' ids: their mean}) after one
    host read: their mean, or NonFinite naming the first non-finite client loss, else the model's
    or the state's tensors that are not finite (common.train's check)."""
    ids, vals = list(losses), torch.stack([losses[c] for c in losses])
    named = tensors(model, state)
    ok = torch.stack([v.isfinite().all().to(vals.device) for _, v in named]).all()  # no host read
    vals = torch.cat([vals, ok.to(vals.dtype)[None]]).cpu()                   # one sync a round
    bad = [c for c, v in zip(ids, vals.tolist()) if not math.isfinite(v)]
    if bad and isinstance(bad[0], tuple):         # the mean loss of these clients (a reduction)
        raise NonFinite(f"non-finite loss in round {t}, the mean over its {len(bad[0])} clients "
                        f"(testing on {fed.name})")
    if bad:
        c = fed.clients[bad[0]]
        raise NonFinite(f"non-finite loss in round {t} on client {c.id} (training domain "
                        f"{c.domain}, testing on {fed.name})")
    if not vals[-1]:        # the server's step or a server quantity: never written as a result
        bad = [k for k, v in named if not bool(v.isfinite().all())]
        more = [f"{len(bad) - 3} more"] * (len(bad) > 3)
        raise NonFinite(f"non-finite {', '.join(bad[:3] + more)} after the server step of round "
                        f"{t} (testing on {fed.name})")
    return vals[:-1].mean().item()


def tensors(model, state):
    """(name, tensor) for every floating tensor of the global model and of the method's state
    (server quantities, client states: tensors in dicts and lists), model first. A state key that
    starts with "_" holds a diagnostic, not a server quantity (nan: not measured): left out."""
    def walk(obj, name):
        if torch.is_tensor(obj):
            return [(name, obj)] if obj.is_floating_point() else []
        items = [(k, v) for k, v in obj.items() if not str(k).startswith("_")] \
            if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
        return [pair for k, v in items for pair in walk(v, f"{name}[{k!r}]")]
    named = [(f"model {k}", v) for k, v in model.state_dict().items() if v.is_floating_point()]
    named += walk(state, "state")
    return [(k, v) for k, v in named if v.device.type != "meta"]


@dataclass
class Trained:
    """A domain's training so far: the next round to train, the evaluations (history) and the best
    one by --select, the seconds spent, and the round losses since the last evaluation; from a
    checkpoint (of) on --resume."""
    next_round: int = 1
    history: list = field(default_factory=list)
    best: dict = None
    seconds: float = 0.0
    losses: list = field(default_factory=list)
    averaged: int = 0                       # how many losses the last evaluation's mean took
    ROW = ("round", "val_acc", "test_acc", "loss", "seconds")

    @classmethod
    def of(cls, blob):
        return cls(blob["round"] + 1, blob["history"], blob["best"], blob["seconds"],
                   blob.get("losses", []))

    def evaluated(self, t, scores, seconds, select):
        """An evaluation after round t, (val, test, per test set[, a method's further numbers]):
        a row of the history, the best kept, the losses since the last one averaged."""
        val, test, per, *more = scores
        extra = more[0] if more else {}   # further numbers of a method (PerInvFL: the global's)
        row = dict(zip(self.ROW, (t, val, test, sum(self.losses) / len(self.losses), seconds)),
                   **extra)
        self.history.append(row)
        if self.best is None or val > self.best["val_acc"] or select == "last":
            self.best = dict(row, per_test=per)
        self.averaged, self.losses = len(self.losses), []


def start_domain(args, ds, fed, init_state, resume=None, engine=None, model_fn=None):
    """The initial model (seeded), the method's state and the domain's Context with its random
    streams (fixed by the seed), then a checkpoint's (resume): (model, state, ctx), what a round
    takes."""
    device = torch.device(args.device)
    model = (model_fn or common.global_model)(args, ds, device)
    ctx = common.make_context(args, fed, model, engine)
    state = init_state(model, fed, args, ctx) if init_state else {}
    count = lambda split: sum(len(getattr(s, split)) for s in fed.sites
                              if getattr(s, split) is not None)
    print(f"-- test domain {fed.name}: {len(fed.clients)} clients, {count('y'):,} training / "
          f"{count('val_y'):,} validation / {count('test_y'):,} test examples")
    if resume is not None:
        model.load_state_dict(resume["model"])
        ctx.sampler.set_state(resume["sampler"])
        torch.set_rng_state(resume["torch_rng"])
        state = to_device(resume["state"], ctx.device)   # checkpoints load on the CPU
    ctx.clients = state.setdefault("clients", {})   # the clients' own states (Flower: the nodes')
    return model, state, ctx


# -------------------------------------------------------------------------------- signals

class Stopped(Exception):
    """A SIGINT or SIGTERM honoured after a round, its checkpoint written: exit 128 + signal."""

    def __init__(self, signum, path, domain, t):
        super().__init__(signum)
        self.signum, self.path, self.domain, self.t = signum, path, domain, t


class STOP:
    """The stop signal received while training (None: none): the round under way finishes and
    is saved."""
    signal = None


def stop_after_the_round(signum, frame):
    """The first signal: the run stops after the round under way, said at once on stdout (the
    progress line's stream; stderr gets one line, main's, however the run ends); a second: at
    once (KeyboardInterrupt; the last checkpoint stays)."""
    if STOP.signal is not None:
        raise KeyboardInterrupt
    STOP.signal = signum
    try:
        print(f"{signal.Signals(signum).name}: stopping after this round and its checkpoint "
              f"(again: at once)", flush=True)
    except (RuntimeError, OSError):  # stdout mid-write (a reentrant call) or closed: main says it
        pass


# ------------------------------------------------------------------------------------ results

def domain_result(ds, fed, history, best):
    skip = ("round", "val_acc", "test_acc", "loss", "seconds", "per_test")
    out = {"test_acc": best["test_acc"], "val_acc": best["val_acc"], "best_round": best["round"],
           "train_examples": sum(c.n for c in fed.clients),
           "last_test_acc": history[-1]["test_acc"], "history": history,
           **{k: v for k, v in best.items() if k not in skip}}    # and a method's extra numbers
    if ds.protocol == "clients":
        out["per_client_test_acc"] = dict(zip(fed.test_names, best["per_test"]))
    return out


def print_table(results):
    rows, width = results["domains"], max([11] + [len(k) for k in results["domains"]])
    sel = "(last)" if results["args"].get("select") == "last" else "(best val)"
    print(f"\n{'test domain':<{width}}  test acc {sel:<10}  last round  best round")
    for name, r in rows.items():
        print(f"{name:<{width}}  {r['test_acc']:19.4f}  {r['last_test_acc']:10.4f}  "
              f"{r['best_round']:10d}")
    if len(rows) > 1:
        last = sum(r['last_test_acc'] for r in rows.values()) / len(rows)
        print(f"{'mean':<{width}}  {results['mean_test_acc']:19.4f}  {last:10.4f}")


def size(path):
    n = os.path.getsize(path)
    return next(f"{n / 1024 ** k:.0f} {unit}"
                for k, unit in ((3, "GB"), (2, "MB"), (1, "kB"), (0, "bytes"))
                if n >= 1024 ** k or k == 0)
