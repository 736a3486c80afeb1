"""How much does each method's tiny CPU/GPU comparison case (gpu_check.py's, full-batch local steps)
move when its initial weights move by a relative amount s? Two CPU runs, the second with every
weight w replaced by w (1 + s z), z standard normal (a fixed draw); prints gpu_check's differences
(largest relative difference of a round's training loss, largest accuracy difference).

    python benchmark/diagnostics/sensitivity.py     # s = 2^-22 (about two float32 ulps) and 2^-11
    python benchmark/diagnostics/sensitivity.py --scale 1e-3

A GPU's fp32 convolutions are TF32 by default (10-bit mantissa, relative rounding about 2^-11 =
4.9e-4): a method whose case moves by more than gpu_check's CPU-vs-GPU bound at s = 2^-11 cannot
be expected to stay within it on a GPU, whatever the code does right.
"""
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[:3]]   # up to the checkout
import torch  # noqa: E402

import common  # noqa: E402
import gpu_check  # noqa: E402
from harness.config import finite, Parser, help_text  # noqa: E402


def perturbed(s):
    """The initial model (harness.main's model_fn): common.global_model's, every weight w then
    replaced by w (1 + s z), z standard normal drawn on the CPU from seed 1."""
    def model_fn(args, ds, device):
        model = common.global_model(args, ds, device)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p * s * torch.randn(p.shape, generator=g).to(p.device))
        return model
    return model_fn


def main(argv=None):
    p = Parser(prog="sensitivity.py", description=help_text(__doc__))
    p.add_argument("--scale", type=finite, nargs="+", default=[2 ** -22, 2 ** -11],
                   help="relative perturbations s of the initial weights (0: the control, "
                        "nothing moves)")              # (finite: nan, inf refused)
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv_, prec in gpu_check.tiny_cases():
            if prec != "fp32":
                continue
            base = gpu_check.run_method(name, argv_ + ["--device", "cpu"], Path(tmp) / "a.json")
            for s in a.scale:
                moved = gpu_check.run_method(name, argv_ + ["--device", "cpu"],
                                             Path(tmp) / "b.json", model_fn=perturbed(s))
                d = gpu_check.differences(base, moved)
                rows.append(f"| {name} | {s:.1e} | {d['loss']:.1e} | {d['acc']:.3f} |")
    table = ["| method | s | loss (relative) | accuracy |", "|---|---|---|---|", *rows]
    print("\n".join(table))
    return table


if __name__ == "__main__":
    main()
