"""Group-wise int8 matmul kernels (`--quantization gguf`'s Q8_0 / Q6_K / Q5_* weights) on SmolLM2-135M's
tied LM head (49152 x 576, the biggest matmul of a decode step; random codes in groups of 32, as Q8_0),
at a given row count, against the bf16 `F.linear` on the same matrix and the per-channel int8 kernel the
`int8`/`int4` modes use for their head. Prints ms per call and the ratio to bf16 (> 1: faster). This is
the measurement behind `GEMV_MAX_ROWS` in `sobrio/layers/grouped.py`.

- dense: `F.linear` on the bf16 matrix (oneDNN, AMX where present);
- grouped C++: `grouped_linear` (codes read once, widened in registers, float32 sums);
- grouped dequant+mm: the codes dequantized 1024 channels at a time, then `torch.mm`;
- int8pack (per channel): `aten._weight_int8pack_mm`, one scale per row.

`--dtype float32`: x, the dense matrix and the row scales in float32, as a float32 model's
`--quantization int8-weight-only` runs them (the measurement behind `grouped_int8_preferred` there).

    .venv/bin/python benchmarks/grouped_kernels.py [--rows 1 4 16 32 64] [--threads 2] [--dtype float32]
"""

import argparse

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_timing import best_times  # noqa: E402  (benchmarks/ is on the path when a script here runs)

from sobrio.layers.cpu_ops import cpu_ops  # noqa: E402
from sobrio.layers.grouped import GroupedCodes, dequant_mm  # noqa: E402

VOCAB, HIDDEN, GROUP = 49152, 576, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the activations', dense matrix's and row scales' dtype (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    codes = GroupedCodes(torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8, generator=g),
                             torch.rand(VOCAB, HIDDEN // GROUP, generator=g) * 0.01, None, GROUP)
    dtype = getattr(torch, args.dtype)
    dense = codes.dequantize(dtype)
    row_scale = torch.rand(VOCAB, generator=g).to(dtype)
    ops = cpu_ops()
    kernels = {
        "dense": lambda x: F.linear(x, dense),
        "grouped C++": lambda x: ops.grouped_linear(x, codes.codes, codes.scales, None, GROUP, None),
        "grouped dequant+mm": lambda x: dequant_mm(x, codes),
        "int8pack (per channel)": lambda x: torch.ops.aten._weight_int8pack_mm(x, codes.codes, row_scale),
    }
    print(f"LM head {VOCAB} x {HIDDEN}, {args.dtype} x, {args.threads} thread(s), best of {args.repeats}")
    print(f"{'rows':>5}  {'kernel':<23} {'ms':>7}  {'vs dense':>8}")
    for rows in args.rows:
        best = best_times(kernels, torch.randn(rows, HIDDEN, generator=g).to(dtype), args.repeats, args.threads)
        for name, seconds in best.items():
            print(f"{rows:>5}  {name:<23} {seconds * 1e3:7.2f}  {best['dense'] / seconds:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
