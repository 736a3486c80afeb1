"""A run's arguments, resolved once: the command line (the shared flags with their help, their
defaults read from common.RUN and common.PROTOCOL, each method's own, the harness's), and
`resolve`, the one function that turns (method, argv) into the arguments a run uses (the method
scripts, benchmark/, flower/ and the tests all call it; a copied method file, without the harness,
common.program and common.settings).

Where a value comes from, first that applies (--print-config shows each value and its source):
  1. the command line;
  2. a rule: the method's `derive(args)`, for flags whose value follows from other flags
     (FedLOE's rounds from its stages, FedIPG's λ from the model) where the command line leaves
     them unset;
  3. the method's table of defaults for the dataset (Method.defaults[dataset]), then for every
     dataset (Method.defaults["*"]);
  4. the protocol's table, per dataset (common.PROTOCOL; its sources: docs/protocol.md);
  5. the flag's own default (the run's: common.RUN, --seed 0, --device auto, ...);
  6. once the data is loaded, `common.after_load`: the counts of clients that follow from the data
     (--print-config loads the data to show them, where the command line and the tables leave
     them open).
A value "auto" is an explicit rule, resolved by common.check (--device, --parallel-clients) or,
where the method declares it (Method.auto: FedOMG's η_g), by the method in every round. The
filling and the checks are common's (fill, check: a copied method's program and common.settings
use them too); a method's `check(args, given)` validates and never fills in a value. Here: the
flags' help, the harness's own flags (--out, --resume, ...) and where each value comes from.
"""
import argparse
import hashlib
import json
import math
import os
import re
import sys

import common
import data
from data import UserError

# The dataset's own flags and the datasets each applies to: elsewhere a value does nothing
# (common.check_data_args refuses a --client-size or --no-rotation given there; --print-config
# leaves them all out)
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
    a("--dataset", help=f"one of {', '.join(data.NAMES)}")
    a("--data-root", help="dataset folder; none: the MNIST family reads the "
      "embedded 5,000 digits (the others need one: python -m harness.datasets --help)")
    a("--test-domain",
      help="held-out domain: 'all' (each in turn), a name or an index")
    a("--clients", type=int, help="number of clients P")
    a("--client-size", type=int,
      help="stained only: examples per client, from the pooled combinations")
    a("--sample", type=count_or_all, help="clients per round C ('all': every one)")
    a("--alpha", type=finite, default=None,
      help="Dirichlet label-skew concentration (mnist, cifar*, emnist)")
    a("--p-test", type=finite, default=None,
      help="rcmnist / rcfmnist: colour-label agreement of the test contexts")
    a("--no-rotation", action="store_true", help="rcmnist / rcfmnist: the same four clients and "
      "colour laws without the rotation by 90·i degrees")
    a("--stain", choices=common.CHOICES["stain"],
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
    a("--select", choices=common.CHOICES["select"],
      help="report the best validation round, or the last")
    a("--model", choices=common.CHOICES["model"], help="featurizer")
    a("--head", choices=common.CHOICES["head"], help="classifier")
    a("--no-pretrained", action="store_true", help="ResNets from random weights: no ImageNet "
      "download (needed offline; the accuracies are then far lower)")
    a("--eval-every", type=int, default=None,
      help="evaluate (and checkpoint) every this many rounds")
    a("--seed", type=int,
      help="seeds the data split, the initialisation, the client sampling, the batches")
    a("--device", choices=common.CHOICES["device"],
      help="auto: cuda if one is visible, else cpu")
    a("--amp", action="store_true", help="bf16 autocast (CUDA only); without it CUDA computes in "
      "IEEE fp32 (TF32 off for matrix products and convolutions)")
    a("--nondeterministic", action="store_true", help="CUDA: let cuDNN and cuBLAS pick their "
      "fastest kernels; two runs then differ (README: GPU)")
    a("--parallel-clients", choices=common.CHOICES["parallel_clients"], help="train the "
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
    p.set_defaults(**common.RUN)                # the run's own defaults, declared in common
    if method.add_args:
        method.add_args(p)
    for act in p._actions:                      # the method's own float flags: finite numbers too
        act.type = finite if act.type is float else act.type
    p.method = method                           # --help: every default (help_defaults)
    return p


def table_sources(method, dataset):
    """{flag: (its default for `dataset`, the table it comes from)}, as common.table takes them."""
    own = method.defaults
    rows = [(common.PROTOCOL.get(dataset, {}), f"shared table, {dataset}"),
            (own.get("*", {}), f"{method.name}'s table, every dataset"),
            (own.get(dataset, {}), f"{method.name}'s table, {dataset}")]
    return {k: (v, where) for row, where in rows for k, v in row.items()}


def help_defaults(p, method):
    """Every flag's help ends with its default: the flag's own, or the one rmnist (the default
    --dataset) takes (docs/protocol.md and the method's page give every dataset's), unless it
    speaks of its default already."""
    base = {a.dest: a.default for a in p._actions if a.dest != "help"}
    values = common.table(method, "rmnist")
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
    for bad, message in [   # the harness's own flags first, then the run's (common.check)
            (args.out == "", "--out is empty: give a folder or file name, or leave the flag out"),
            (bool(args.out) and (args.out.endswith(("/", os.sep)) or os.path.isdir(args.out)),
             f"--out {args.out} is a folder; give a file name, e.g. "
             f"{os.path.join(args.out or '', 'results.json')}"),
            (not args.checkpoint_minutes > 0,
             f"--checkpoint-minutes must be positive, got {args.checkpoint_minutes}")]:
        if bad:
            raise UserError(message)
    derived = common.fill(method, args, given)           # the tables, then the method's derive
    for k, (v, source) in table_sources(method, args.dataset).items():
        if k not in given:
            where[k] = source
    for k in derived:
        if k not in given:
            where[k] = f"rule: {method.name}'s derive ({k} from other flags)"
    for k, rule in method.auto.items():
        if getattr(args, k) == "auto":
            where[k] += f"; auto: {rule}"
    if args.device == "auto":
        where["device"] = "rule: auto, cuda if one is visible, else cpu"
    if args.parallel_clients == "auto":
        where["parallel_clients"] = "rule: auto, on for CUDA but the photos, off on the CPU"
    common.check(method, args, given, derived)           # "auto" resolved, the values checked
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
    ds = common.load_data(args)
    before = {k: getattr(args, k) for k in counts}
    common.after_load(args, ds)
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
