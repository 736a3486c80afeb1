"""A run's arguments, resolved once: the shared flags and their defaults, each method's own, and
`resolve`, the one function that turns (method, argv) into the arguments a run uses (the method
scripts, benchmark/, flower/ and the tests all call it).

Where a value comes from, first that applies (--print-config shows each value and its source):
  1. the command line;
  2. a rule: the method's `derive(args)`, for flags whose value follows from other flags
     (FedLOE's rounds from its stages, FedIPG's λ from the model) where the command line leaves
     them unset;
  3. the method's table of defaults for the dataset (Method.defaults[dataset]), then for every
     dataset (Method.defaults["*"]);
  4. the shared table below, per dataset (its sources: docs/protocol.md);
  5. the flag's own default (the run's flags: --seed 0, --device auto, ...);
  6. once the data is loaded, `after_load`: the counts of clients that follow from the data
     (--print-config loads the data to show them, where the command line and the tables leave
     them open).
A value "auto" is an explicit rule, resolved here (--device, --parallel-clients) or, where the
method declares it (Method.auto: FedOMG's η_g), by the method in every round. A method's
`check(args, given)` then validates and never fills in a value.
"""
import argparse
import hashlib
import json
import math
import os
import re
import sys

import torch

import data
from data import UserError

# One table per dataset (the sources: docs/protocol.md): FedIIR's Table 3 for the DG benchmarks,
# FedOMG's Table 1 for label skew, PerInvFL's Table 6 with IRM's ColoredMNIST MLP (full batch,
# last round) for RC-MNIST. sample "all": every client in every round.
_ALL = dict(rounds=100, local_epochs=1, momentum=0.9, weight_decay=0.0, global_lr=1.0,
            eval_every=10, alpha=0.1, head="linear", select="val", p_test=0.1)
_FL = dict(_ALL, model="cnn", lr=5e-3, batch_size=16, local_epochs=5, momentum=0.0, clients=100,
           sample=20)
_RC = dict(_ALL, model="mlp", lr=0.1, batch_size=25000, momentum=0.0, weight_decay=2.2e-3,
           clients=4, sample=4, rounds=500, eval_every=50, select="last")
_PHOTO = dict(_ALL, model="resnet18", lr=1e-3, batch_size=32, head="mlp")
DEFAULTS = {
    "rmnist": dict(_ALL, model="convnet", lr=1e-2, batch_size=64),
    "vlcs": _PHOTO, "pacs": dict(_PHOTO, lr=2.5e-3), "officehome": dict(_PHOTO, model="resnet50"),
    "synthetic": dict(_ALL, model="smallconv", lr=5e-2, batch_size=32),
    "stained": dict(_ALL, model="mlp", lr=0.1, batch_size=64, sample="all"),  # FedIPG VI-C
    "mnist": _FL, "emnist": _FL, "cifar10": _FL, "cifar100": _FL, "rcmnist": _RC, "rcfmnist": _RC,
    "waterbird": dict(_PHOTO, head="linear", clients=4, sample=4, select="last"),
}

# The dataset's own flags and the datasets each applies to: elsewhere a value does nothing
# (check_data_args refuses a --client-size or --no-rotation given there; --print-config leaves
# them all out)
APPLIES = {"alpha": data.FL, "p_test": ("rcmnist", "rcfmnist", "waterbird"),
           "no_rotation": ("rcmnist", "rcfmnist"), "stain": ("stained",),
           "client_size": ("stained",)}


class Parser(argparse.ArgumentParser):
    """argparse's, with bad input in one line; a method's (`method` set) writes each flag's
    default into its help when --help asks for it (help_defaults), not on every run."""
    method = None

    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self):
        if self.method is not None:
            help_defaults(self, self.method)
            self.method = None                                  # (once)
        return super().format_help()


def help_text(doc):
    """A docstring's first paragraph as one line: what a script's --help says it does."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def finite(text):
    """The type of every float flag: a finite number (nan and inf are refused when parsing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_or_auto(text):
    """The type of a float flag that the method has a rule for (Method.auto): a number, or auto."""
    return text if text == "auto" else finite(text)


def count_or_all(text):
    """The type of --sample: a number of clients, or 'all'."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number or 'all', got {text!r}") from None


def parser(method):
    """The command line of `method`: the dataset's and its protocol's flags, training's, the run's,
    then the method's own; every help ends with its default for rmnist (help_defaults)."""
    p = Parser(prog=f"{method.name}.py", description=help_text(method.doc))
    a = p.add_argument
    a("--dataset", default="rmnist", help=f"one of {', '.join(data.NAMES)}")
    a("--data-root", default=None, help="dataset folder; none: the MNIST family reads the "
      "embedded 5,000 digits (the others need one: python -m harness.datasets --help)")
    a("--test-domain", default="all",
      help="held-out domain: 'all' (each in turn), a name or an index")
    a("--clients", type=int, default=None, help="number of clients P")
    a("--client-size", type=int, default=None,
      help="stained only: examples per client, from the pooled combinations")
    a("--sample", type=count_or_all, default=None, help="clients per round C ('all': every one)")
    a("--alpha", type=finite, default=None,
      help="Dirichlet label-skew concentration (mnist, cifar*, emnist)")
    a("--p-test", type=finite, default=None,
      help="rcmnist / rcfmnist: colour-label agreement of the test contexts")
    a("--no-rotation", action="store_true", help="rcmnist / rcfmnist: the same four clients and "
      "colour laws without the rotation by 90·i degrees")
    a("--stain", default="fg", choices=["fg", "bg", "both"],
      help="stained MNIST: foreground, background or both")
    a("--rounds", type=int, default=None, help="communication rounds T")
    a("--local-epochs", type=int, default=None, help="local epochs per round")
    a("--batch-size", type=int, default=None, help="local batch size")
    a("--lr", type=finite, default=None, help="local learning rate")
    a("--momentum", type=finite, default=None, help="local SGD momentum")
    a("--weight-decay", type=finite, default=None, help="local SGD weight decay")
    a("--global-lr", type=finite_or_auto if "global_lr" in method.auto else finite, default=None,
      help="server step size eta_g" + (" (a number, or auto: the method's rule)"
                                      if "global_lr" in method.auto else ""))
    a("--select", default=None, choices=["val", "last"],
      help="report the best validation round, or the last")
    a("--model", default=None,
      choices=["convnet", "smallconv", "cnn", "mlp", "resnet18", "resnet50"], help="featurizer")
    a("--head", default=None, choices=["linear", "mlp"], help="classifier")
    a("--no-pretrained", action="store_true", help="ResNets from random weights: no ImageNet "
      "download (needed offline; the accuracies are then far lower)")
    a("--eval-every", type=int, default=None,
      help="evaluate (and checkpoint) every this many rounds")
    a("--seed", type=int, default=0,
      help="seeds the data split, the initialisation, the client sampling, the batches")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"],
      help="auto: cuda if one is visible, else cpu")
    a("--amp", action="store_true", help="bf16 autocast (CUDA only); without it CUDA computes in "
      "IEEE fp32 (TF32 off for matrix products and convolutions)")
    a("--nondeterministic", action="store_true", help="CUDA: let cuDNN and cuBLAS pick their "
      "fastest kernels; two runs then differ (README: GPU)")
    a("--parallel-clients", default="auto", choices=["auto", "on", "off"], help="train the "
      "sampled clients of a round at once (torch.func); auto: on for CUDA, off on the CPU")
    a("--compile", action="store_true", help="torch.compile the step of the clients trained at "
      "once, on all of them while any trains (CUDA: a CUDA graph); other floats than the eager "
      "step's (docs/gpu-and-speed.md)")
    a("--out", default=None, help="results JSON, default results/<method>-<dataset>-<test "
      "domain>-seed<seed>-<digest of the other arguments>.json; the checkpoint is <out>.ckpt "
      "(docs/results-format.md)")
    a("--resume", action="store_true", help="continue from <out>.ckpt (refused without one); "
      "with --overwrite: continue an interrupted replacement (<out>.next.ckpt)")
    a("--overwrite", action="store_true", help="replace a complete result, or an interrupted "
      "run, at --out, once the new run completes (refused without it)")
    a("--allow-code-change", action="store_true", help="--resume a checkpoint made with other "
      "code (refused without it); the result then records both versions of the code and says it "
      "is mixed")
    a("--checkpoint-minutes", type=finite, default=5.0,
      help="a checkpoint at least this often while training, besides each evaluation's")
    a("--print-config", action="store_true", help="print every value the run would use and where "
      "it comes from (command line, a table, a rule, the data), then exit: nothing is run (the "
      "data is loaded where it settles the counts of clients)")
    if method.add_args:
        method.add_args(p)
    for act in p._actions:                      # the method's own float flags: finite numbers too
        act.type = finite if act.type is float else act.type
    p.method = method                           # --help: every default (help_defaults)
    return p


def table(method, dataset):
    """The defaults for `dataset`: the method's for it, else the method's for every dataset, else
    the shared table's."""
    return {k: v for k, (v, _) in table_sources(method, dataset).items()}


def table_sources(method, dataset):
    """{flag: (its default for `dataset`, the table it comes from)}, as `table` takes them."""
    own = method.defaults
    rows = [(DEFAULTS.get(dataset, {}), f"shared table, {dataset}"),
            (own.get("*", {}), f"{method.name}'s table, every dataset"),
            (own.get(dataset, {}), f"{method.name}'s table, {dataset}")]
    return {k: (v, where) for row, where in rows for k, v in row.items()}


def help_defaults(p, method):
    """Every flag's help ends with its default: the flag's own, or the one rmnist (the default
    --dataset) takes (docs/protocol.md and the method's page give every dataset's), unless it
    speaks of its default already."""
    base = {a.dest: a.default for a in p._actions if a.dest != "help"}
    values = table(method, "rmnist")
    if method.derive:
        values.update(method.derive(argparse.Namespace(**{**base, **values, "dataset": "rmnist"})))
    for act in p._actions:
        if act.nargs == 0 or not act.option_strings or not act.help or act.default == "" \
                or "default" in act.help.lower():
            continue
        value, where = (act.default, "") if act.default is not None else \
            (values[act.dest], " for rmnist") if act.dest in values else \
            ("per dataset, see docs/protocol.md", "")
        value = f"none: set by {method.name}" if value is None else value
        act.help += f" (default{where}: {value})".replace("%", "%%")
    p.epilog = ("Defaults for --dataset rmnist; those of every dataset: docs/protocol.md and the "
                "method's page in docs/.")


def resolve(method, argv=None):
    """The arguments of a run of `method` with the command line argv (default: sys.argv[1:]):
    every flag filled (the module's docstring says from where), bad values refused in one line
    (UserError) before any work, --test-domain, --parallel-clients and --out settled. A flag the
    data decides (the counts of clients) is settled by after_load. --print-config: every value
    and where it comes from, printed (the data loaded where it settles a count: settle_counts),
    then SystemExit(0)."""
    argv = sys.argv[1:] if argv is None else argv
    p = parser(method)
    args = p.parse_args(argv)
    show = args.print_config
    del args.print_config                       # (not a run's argument: never recorded)
    given = {k for k, v in vars(args).items() if v is not None}
    unset = object()                            # the flags the command line names: not unset
    p.set_defaults(**{a.dest: unset for a in p._actions})
    typed = {k for k, v in vars(p.parse_args(argv)).items() if v is not unset}
    where = {k: "command line" if k in typed else "the command line's default" for k in given}
    if args.dataset not in data.NAMES:
        raise UserError(f"unknown dataset {args.dataset!r}; choose from {', '.join(data.NAMES)}")
    for k, (v, source) in table_sources(method, args.dataset).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
            where[k] = source
    derived = method.derive(args) if method.derive else {}
    for k, v in derived.items():
        if k not in given:
            setattr(args, k, v)
            where[k] = f"rule: {method.name}'s derive ({k} from other flags)"
    for k, rule in method.auto.items():
        if getattr(args, k) == "auto":
            where[k] += f"; auto: {rule}"
    check_data_args(args)
    check_test_domain(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        where["device"] = "rule: auto, cuda if one is visible, else cpu"
    ours = lambda k: k in given or k not in derived          # a derived value: the method checks it
    positive = ("rounds", "local_epochs", "batch_size", "eval_every", "lr", "global_lr")
    for bad, message in [   # in order: the first that holds is the error
            (args.out == "", "--out is empty: give a folder or file name, or leave the flag out"),
            (bool(args.out) and (args.out.endswith(("/", os.sep)) or os.path.isdir(args.out)),
             f"--out {args.out} is a folder; give a file name, e.g. "
             f"{os.path.join(args.out or '', 'results.json')}"),
            (not 0 <= args.seed < 2 ** 31, f"--seed must be in [0, 2**31), got {args.seed}"),
            *[(not getattr(args, k) > 0, f"--{k.replace('_', '-')} must be positive, got "
               f"{getattr(args, k)}") for k in positive if ours(k) and getattr(args, k) != "auto"],
            (ours("momentum") and not 0 <= args.momentum < 1,
             f"--momentum must be in [0, 1), got {args.momentum}"),
            (args.weight_decay < 0, f"--weight-decay must be >= 0, got {args.weight_decay}"),
            (args.device == "cuda" and not torch.cuda.is_available(),
             "--device cuda: no CUDA device is visible"),
            (args.amp and args.device != "cuda", "--amp needs a CUDA device"),
            (not args.checkpoint_minutes > 0,
             f"--checkpoint-minutes must be positive, got {args.checkpoint_minutes}")]:
        if bad:
            raise UserError(message)
    if method.check:
        method.check(args, given)
    if args.parallel_clients == "auto":
        where["parallel_clients"] = "rule: auto, on for CUDA but the photos, off on the CPU"
    check_parallel(args, method)
    if not args.out:
        where["out"] = "rule: results/<method>-<dataset>-<test domain>-seed<seed>-<digest>.json"
    args.out = os.path.normpath(args.out or default_out(method.name, args))
    if show:
        note = settle_counts(args, where)
        print_config(method, args, where, note)
        raise SystemExit(0)
    return args


def print_config(method, args, where, note=None):
    """Every value of a run and where it comes from, but the flags of other datasets (APPLIES);
    note: how the data settled the counts of clients (settle_counts)."""
    print(f"{method.name}.py on {args.dataset}: every value of the run, and where it comes from")
    if note:
        print(note)
    for k, v in vars(args).items():
        if args.dataset not in APPLIES.get(k, (args.dataset,)):
            continue
        flag = f"--{k.replace('_', '-')}"
        print(f"  {flag:<22} {'' if v is None else v!s:<12} {where.get(k, 'not set')}")


def settle_counts(args, where):
    """--print-config: the counts of clients that a run settles once its data loads (after_load),
    where the command line and the tables leave them open, settled as the run settles them: the
    data loaded (bad data: UserError, one line), `where` told the rule. Returns the line that
    says so, or None where no count needed the data."""
    counts = [k for k in ("clients", "sample", "client_size") if getattr(args, k) in (None, "all")
              and args.dataset in APPLIES.get(k, (args.dataset,))]
    if not counts:
        return None
    ds = load_data(args)
    before = {k: getattr(args, k) for k in counts}
    after_load(args, ds)
    stained = f"Section VI-C's for --stain {args.stain} (data.STAINED)"
    rules = {"clients": stained if args.dataset == "stained" else
             "the data, one client per training domain",
             "client_size": f"{stained}, within the data's nine training combinations",
             "sample": "every client" if args.dataset == "stained" else
             "the data, min(--clients, training domains)"}
    for k, was in before.items():
        where[k] = (f"{where[k]}; all: every client" if was == "all" else
                    f"rule: {rules[k]} (docs/protocol.md: Federation)")
    flags = [f"--{k.replace('_', '-')}" for k in counts]
    return (f"(loaded the data to settle {', '.join(flags[:-1])}{' and ' * (len(flags) > 1)}"
            f"{flags[-1]}: {ds.source})")


def check_data_args(args):
    """Refuse, before any work, a value of the dataset's flags that no dataset could take, or one
    given to a dataset it does not apply to (the counts of clients: after_load)."""
    positive = [(getattr(args, k) is not None and not getattr(args, k) > 0,
                 f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
                for k in ("clients", "client_size", "alpha")]   # None: settled by after_load
    for bad, message in [   # in order: the first that holds is the error
            (args.data_root == "",
             "--data-root is empty: give a folder or file name, or leave the flag out"),
            *positive,
            (args.client_size is not None and args.dataset != "stained",
             f"--client-size applies to stained only, not {args.dataset}"),
            (args.no_rotation and args.dataset not in ("rcmnist", "rcfmnist"),
             f"--no-rotation applies to rcmnist and rcfmnist only, not {args.dataset}"),
            (not 0 <= args.p_test <= 1, f"--p-test must be in [0, 1], got {args.p_test}")]:
        if bad:
            raise UserError(message)


def check_test_domain(args):
    """--test-domain against the dataset's domains, before any data loads; a photo dataset's are
    its folders, where they are (a missing one is refused when it loads, with the command that
    fetches it)."""
    if args.dataset in data.FOLDERS and (args.data_root is None or not os.path.isdir(
            os.path.join(args.data_root, data.FOLDERS[args.dataset]))):
        return
    held_out(args.dataset, data.domain_names(args.dataset, args.data_root), args.test_domain)


def held_out(dataset, names, pick):
    """The indices of the domains to hold out, one after another, for --test-domain `pick` ('all', a
    domain's name or its index) among `names`; [None] where the clients are fixed (names None)."""
    if names is None:
        if pick != "all":
            raise UserError(f"--test-domain does not apply to {dataset}: its clients have their "
                            f"own test sets")
        return [None]
    M = len(names)
    if pick == "all":
        return list(range(M))
    if pick in names:
        return [names.index(pick)]
    if pick.lstrip("-").isdigit() and 0 <= int(pick) < M:
        return [int(pick)]
    raise UserError(f"unknown test domain {pick!r} for {dataset}; choose 'all', one of "
                    f"{', '.join(names)} or an index 0..{M - 1}")


def parallel(args):
    """--parallel-clients: 'auto' is on for CUDA except for the photos and ResNets, off on the
    CPU."""
    return args.parallel_clients == "on" or (
        args.parallel_clients == "auto" and str(args.device).startswith("cuda")
        and args.dataset not in data.PHOTOS and not args.model.startswith("resnet"))


def check_parallel(args, method):
    """Refuse --parallel-clients on where it cannot apply and record what 'auto' chose
    (method.parallel: a bool, or a function of args giving None where it applies, else the
    reason)."""
    supported = method.parallel
    reason = supported(args) if callable(supported) else None if supported else \
        "trains its clients one after another (its local loss is not written with torch.func)"
    supported = reason is None
    if args.parallel_clients == "on" and not supported:
        raise UserError(f"--parallel-clients on: {method.name} {reason}; use off")
    if args.parallel_clients == "on" and args.dataset in data.PHOTOS:
        raise UserError(f"--parallel-clients on: not for {args.dataset} (each client's "
                        f"augmentation draws from its own stream, and a ResNet fills a GPU "
                        f"alone); use off")
    args.parallel_clients = "on" if supported and parallel(args) else "off"
    if getattr(args, "compile", False) and args.parallel_clients == "off":   # the stacked step
        raise UserError(f"--compile: {method.name} {reason}, and --compile compiles the step of "
                        f"clients trained at once" if reason else "--compile compiles the step "
                        "of the clients trained at once: add --parallel-clients on (the default "
                        "on CUDA)")


NOT_IN_THE_NAME = ("out", "resume", "overwrite", "allow_code_change", "checkpoint_minutes",
                   "data_root", "dataset", "test_domain", "seed")


def default_out(method, args):
    """results/<method>-<dataset>-<test domain>-seed<seed>-<digest>.json: every choice of the
    command line that names another experiment, the resolved arguments other than those four as
    a digest of their values."""
    rest = {k: v for k, v in sorted(vars(args).items()) if k not in NOT_IN_THE_NAME}
    digest = hashlib.sha256(json.dumps(rest, default=str).encode()).hexdigest()[:8]
    test = re.sub(r"[^\w.+-]", "_", str(args.test_domain))
    return f"results/{method}-{args.dataset}-{test}-seed{args.seed}-{digest}.json"


# ------------------------------------------------------------- once the data is loaded

def load_data(args, load=None):
    """The dataset of a run (load: data.load's stand-in, e.g. a cached one)."""
    return (load or data.load)(args.dataset, args.data_root, args.seed,
                               clients=args.clients or 100, alpha=args.alpha, p_test=args.p_test,
                               stain=args.stain, rotation=not args.no_rotation)


def after_load(args, ds):
    """Indices of the domains to hold out, from --test-domain ([None]: the fixed clients), once
    --clients, --sample and (stained) --client-size are settled: by default one client per
    training domain (a fixed split: its clients) and min(P, training domains) per round ('all':
    every client), then checked against what the data allows (data.enough_clients,
    data.stained_clients: every client holds one full minibatch of --batch-size)."""
    names = None if ds.protocol == "clients" else [d.name for d in ds.domains]
    todo = held_out(ds.name, names, args.test_domain)
    n_train = len(ds.domains) - (ds.protocol == "lodo")
    if ds.protocol == "clients" and args.clients != n_train:
        raise UserError(f"--clients {args.clients} does not match the {n_train} clients of the "
                        f"split")
    if args.dataset == "stained":
        args.clients, args.client_size, args.sample = data.stained_clients(
            ds, args.stain, args.clients, args.client_size, args.sample, args.batch_size)
        return todo
    args.clients = n_train if args.clients is None else args.clients
    args.sample = min(args.clients, n_train) if args.sample is None else \
        args.clients if args.sample == "all" else args.sample
    if args.clients < n_train:
        raise UserError(f"--clients {args.clients} is below the {n_train} training domains (a "
                        f"client never mixes domains)")
    if not 1 <= args.sample <= args.clients:
        raise UserError(f"--sample must be between 1 and --clients ({args.clients}), got "
                        f"{args.sample}")
    if ds.protocol == "lodo":
        data.enough_clients(ds, todo, args.clients, args.batch_size)
    return todo
