"""FedLOE's stage 2 with each invariance term from one stage-1 run: stage 1 is trained once.

    python benchmark/diagnostics/fedloe_stage2.py results/s1.json --test-domain 0 \\
        --stage1-epochs 8 --stage1-comms 2
        (then any fedloe flags) runs, for a single held-out domain,
    1. python fedloe.py FLAGS --stage2-comms 0 --out results/s1.json [--resume, where its
       checkpoint is] (stage 1 only, "our FedAvg"; nothing to do if that run is complete)
    2. for X in irm fish rex: python fedloe.py FLAGS --dg X --out results/s1-X.json, continued
       from a copy of the stage-1 checkpoint instead of from scratch.

Why 2 gives the numbers of a run from scratch: no stage-1 computation depends on a stage-2 flag,
and the checkpoint written after the last stage-1 round holds everything a run needs to go on
(model, state, random generators; a test checks that a resumed run ends with the uninterrupted
numbers). The copy's recorded arguments are those of the stage-2 run, once it is checked that
they differ from the stage-1 run's in the stage-2 flags alone (STAGE2), nothing else.

Bad input (no STAGE1.json first, no single --test-domain, an --out or --dg of one's own, a flag
that fedloe.py refuses for stage 1 or stage 2) ends with one line on stderr and exit code 2
before stage 1 starts: fedloe.py's own checks run first, in this process (benchmark/run.py's
method_args).
"""
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
from harness.outputs import identity, save_checkpoint  # noqa: E402  (first: Ctrl-C, harness/)
import torch  # noqa: E402

import common  # noqa: E402
import fedloe  # noqa: E402
import run as bench_run  # noqa: E402

STAGE2 = {"stage2_comms", "stage2_epochs", "stage2_lr", "stage2_wd", "dg", "dg_lambda", "dg_form",
          "meta_lr", "server_steps", "rounds", "out"}


def check(argv):
    """(STAGE1.json, fedloe flags) from the command line, or UserError: every refusal before
    stage 1 starts."""
    if not argv or argv[0].startswith("-"):
        raise common.UserError("give the stage-1 results file first: fedloe_stage2.py "
                               "STAGE1.json --test-domain D [fedloe flags]")
    s1, flags = argv[0], argv[1:]
    if not s1.endswith(".json"):
        raise common.UserError(f"STAGE1 {s1!r} must end with .json (stage 2 writes "
                               f"STAGE1-<dg>.json beside it)")
    for flag, why in (("--out", "STAGE1.json, then STAGE1-irm / -fish / -rex.json"),
                      ("--dg", "irm, fish, rex in turn")):
        if any(f == flag or f.startswith(flag + "=") for f in flags):
            raise common.UserError(f"{flag} is set here ({why}): drop it")
    for stage, extra in (("stage 1", ["--stage2-comms", "0"]), ("stage 2", ["--dg", "irm"])):
        args, refusal = bench_run.method_args("fedloe", flags + extra)
        if refusal:
            raise common.UserError(f"fedloe.py refuses the flags for {stage}: {refusal}")
        if args.test_domain == "all":
            raise common.UserError("give one --test-domain: stage 2 continues the checkpoint of "
                                   "one held-out domain")
        if stage == "stage 2" and args.stage2_comms < 1:
            raise common.UserError("--stage2-comms 0 leaves no stage 2 to run")
    return s1, flags


def as_stage2(path, argv):
    """The stage-1 checkpoint copied to `path`, its recorded arguments made those of the stage-2
    run of argv (as fedloe.py resolves them: harness.resolve of fedloe.METHOD, then after_load
    with the data, benchmark/run.py's method_args), after checking that they differ in stage-2
    flags only (UserError otherwise)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    args, refusal = bench_run.method_args("fedloe", argv)
    if refusal:
        raise common.UserError(refusal)
    now = identity(args)
    diff = {k for k in set(blob["args"]) | set(now) if blob["args"].get(k) != now.get(k)} - STAGE2
    if diff:
        raise common.UserError(f"{path}: the stage-1 run differs in {sorted(diff)}")
    save_checkpoint(path, {**blob, "args": now})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    try:
        s1, flags = check(argv)
    except common.UserError as e:
        print(f"fedloe_stage2.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    resume = ["--resume"] if Path(f"{s1}.ckpt").exists() else []   # nothing to do if complete
    fedloe.main(flags + ["--stage2-comms", "0", "--out", s1, *resume])
    for dg in ("irm", "fish", "rex"):
        out = s1.replace(".json", f"-{dg}.json")
        if Path(out).exists():
            print(f"{out} exists; skipped")
            continue
        shutil.copy(f"{s1}.ckpt", f"{out}.ckpt")
        stage2 = flags + ["--dg", dg, "--out", out, "--resume"]
        try:
            as_stage2(f"{out}.ckpt", stage2)
        except common.UserError as e:                   # (fedloe.py's line, as it refused it)
            print(f"fedloe.py: error: {e}", file=sys.stderr)
            sys.exit(2)
        fedloe.main(stage2)


if __name__ == "__main__":
    main()
