"""FedLOE's stage 2 with each invariance term from one stage-1 run: stage 1 is trained once.

    python benchmark/diagnostics/fedloe_stage2.py results/s1.json --test-domain 0 --stage1-epochs 8 --stage1-comms 2
        (then any fedloe flags) runs, for a single held-out domain,
    1. python fedloe.py FLAGS --stage2-comms 0 --out results/s1.json --resume   (stage 1 only, "our FedAvg";
       nothing to do if that run is complete)
    2. for X in irm fish rex: python fedloe.py FLAGS --dg X --out results/s1-X.json, continued from a copy
       of the stage-1 checkpoint instead of from scratch.

Why 2 gives the numbers of a run from scratch: no stage-1 computation depends on a stage-2 flag, and
the checkpoint written after the last stage-1 round holds everything a run needs to go on (model,
state, random generators; a test checks that a resumed run ends with the uninterrupted numbers).
The checkpoint's argument check is relaxed to the stage-2 flags, nothing else.
"""
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import common  # noqa: E402
import fedloe  # noqa: E402

STAGE2 = {"stage2_comms", "stage2_epochs", "stage2_lr", "stage2_wd", "dg", "dg_lambda", "dg_form", "meta_lr",
          "server_steps", "rounds", "out"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") or "--test-domain" not in argv or "--out" in argv:
        sys.exit("usage: fedloe_stage2.py STAGE1.json --test-domain D [fedloe flags, no --out]")
    s1, flags = argv[0], argv[1:]
    fedloe.main(flags + ["--stage2-comms", "0", "--out", s1, "--resume"])
    strict = common.load_checkpoint

    def stage2_only(path, args):                         # the stage-1 checkpoint, other stage-2 flags
        saved = torch.load(path, map_location="cpu", weights_only=True)
        now = common.identity(args)
        diff = {k for k in set(saved["args"]) | set(now) if saved["args"].get(k) != now.get(k)} - STAGE2
        if diff:
            raise common.UserError(f"{path}: the stage-1 run differs in {sorted(diff)}")
        return saved
    for dg in ("irm", "fish", "rex"):
        out = s1.replace(".json", f"-{dg}.json")
        if Path(out).exists():
            print(f"{out} exists; skipped")
            continue
        shutil.copy(Path(s1).with_suffix(".ckpt"), Path(out).with_suffix(".ckpt"))
        common.load_checkpoint = stage2_only
        try:
            fedloe.main(flags + ["--dg", dg, "--out", out, "--resume"])
        finally:
            common.load_checkpoint = strict


if __name__ == "__main__":
    main()
