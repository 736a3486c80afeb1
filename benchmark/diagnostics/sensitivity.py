"""How much does each method's tiny CPU/GPU comparison case (gpu_check.py's, full-batch local steps)
move when its initial weights move by a relative amount s? Two CPU runs, the second with every
weight w replaced by w (1 + s z), z standard normal (a fixed draw); prints gpu_check's differences
(largest relative difference of a round's training loss, largest accuracy difference).

    python benchmark/diagnostics/sensitivity.py                 # s = 2^-22 (about two float32 ulps) and 2^-11
    python benchmark/diagnostics/sensitivity.py --scale 1e-3

A GPU's fp32 convolutions are TF32 by default (10-bit mantissa, relative rounding about 2^-11 =
4.9e-4): a method whose case moves by more than gpu_check's CPU-vs-GPU bound at s = 2^-11 cannot be
expected to stay within it on a GPU, whatever the code does right.
"""
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import common  # noqa: E402
import data  # noqa: E402
import gpu_check  # noqa: E402


def perturbed(build, s):
    def build_model(args, ds):
        model = build(args, ds)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p * s * torch.randn(p.shape, generator=g))
        return model
    return build_model


def main(argv=None):
    p = data.Parser(prog="sensitivity.py", description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=data.finite, nargs="+", default=[2 ** -22, 2 ** -11],   # nan, inf: refused
                   help="relative perturbations s of the initial weights (0: the control, nothing moves)")
    a = p.parse_args(argv)
    build, rows = common.build_model, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv_, prec in gpu_check.tiny_cases():
            if prec != "fp32":
                continue
            common.build_model = build
            base = gpu_check.run_method(name, argv_ + ["--device", "cpu"], Path(tmp) / "a.json")
            for s in a.scale:
                common.build_model = perturbed(build, s)
                try:
                    moved = gpu_check.run_method(name, argv_ + ["--device", "cpu"], Path(tmp) / "b.json")
                finally:
                    common.build_model = build
                d = gpu_check.differences(base, moved)
                rows.append(f"| {name} | {s:.1e} | {d['loss']:.1e} | {d['acc']:.3f} |")
    table = ["| method | s | loss (relative) | accuracy |", "|---|---|---|---|", *rows]
    print("\n".join(table))
    return table


if __name__ == "__main__":
    main()
