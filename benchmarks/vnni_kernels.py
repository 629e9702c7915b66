"""The matmuls of one SmolLM2-135M decode step on its GGUF's formats, kernel against kernel: the 120 layer
matmuls (30 x qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576) as Q4_1-like 4-bit groups of 32,
and the tied LM head (576->49152) as Q8_0, each matrix distinct so that it comes from memory as in a step.

    .venv/bin/python benchmarks/vnni_kernels.py [--rows 1,4,32]

Kernels: `vnni_linear`'s int8 dot products with 16-bit activations (what `--quantization gguf` runs below
the operator's `vnni_dense_min_rows` rows) and 8-bit ones (llama.cpp's Q8 activations); "dequant": the
codes dequantized to bf16 by `vnni_dequantize`, then aten's bf16 matmul (what gguf runs from there: prompt
chunks); aten's int4 kernel (`_weight_int4pack_mm_for_cpu`, before), `grouped_linear` for the head (before), and bf16
F.linear on dense weights (the unquantized model). Best of 5, ms.

    .venv/bin/python benchmarks/vnni_kernels.py --rows 64,128,1000   # where "dequant" overtakes the kernel
"""

import argparse
import time
from collections.abc import Callable

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sobrio.layers import vnni  # noqa: E402
from sobrio.layers.cpu_ops import cpu_ops, vnni_linear_available  # noqa: E402
from sobrio.layers.grouped import GroupedCodes, grouped_linear  # noqa: E402
from sobrio.layers.int4 import Int4Codes, int4_packed_mm, pack_int4  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in)
HEAD = (49152, 576)


def best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def int4_codes(n: int, k: int, gen: torch.Generator) -> Int4Codes:
    scales = torch.rand(k // 32, n, generator=gen) * 0.01
    zeros = (torch.rand(k // 32, n, generator=gen) - 0.5) * 0.1
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    return Int4Codes(codes, torch.stack([scales, zeros], -1), 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,32")
    args = parser.parse_args()
    assert vnni_linear_available(), "vnni_linear was not built here (it needs AVX512-VNNI)"
    gen = torch.Generator().manual_seed(0)
    codes = [int4_codes(n, k, gen) for n, k in LAYER_SHAPES]
    layers = {"vnni": [c.vnni() for c in codes],
              "int4pack": [pack_int4(c.codes, c.scales_and_zeros, 32) for c in codes],
              "bf16": [torch.randn(n, k, generator=gen).bfloat16() for n, k in LAYER_SHAPES]}
    head_codes = GroupedCodes(torch.randint(-127, 128, HEAD, generator=gen, dtype=torch.int8),
                              torch.rand(HEAD[0], HEAD[1] // 32, generator=gen) * 0.01, None, 32)
    head_vnni, head_bf16 = head_codes.vnni(), torch.randn(*HEAD, generator=gen).bfloat16()
    print(f"{torch.get_num_threads()} threads; ms, best of 5")
    print("rows | layers: vnni act16 | vnni act8 | dequant | int4pack | bf16 || head: vnni act16 | vnni act8 | "
          "dequant | grouped | bf16")
    for rows in (int(r) for r in args.rows.split(",")):
        timings = step_timings({k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}, layers,
                               head_vnni, head_codes, head_bf16)
        print(f"{rows:4} | " + " | ".join(f"{t:7.2f}" for t in timings[:5]) + " || "
              + " | ".join(f"{t:7.2f}" for t in timings[5:]))


def kernel(x: torch.Tensor, w: vnni.VnniCodes, act_bits: int) -> torch.Tensor:
    """The C++ int8-dot-product kernel itself, at any row count (the operator leaves it at many rows)."""
    return cpu_ops().vnni_linear(x, w.weight, w.scales, w.offsets, w.out_features, w.bits, w.group_size,
                                 w.code_zero, act_bits, None, dense_min_rows=x.shape[0] + 1)


def dequant(x: torch.Tensor, w: vnni.VnniCodes) -> torch.Tensor:
    return F.linear(x, vnni.dense_weight(w, x.dtype))


def step_timings(x: dict, layers: dict, head_vnni, head_codes, head_bf16) -> list[float]:
    """ms of the layers' matmuls by each kernel, then of the head by each: x by input width."""
    return [
        best_ms(lambda: [kernel(x[w.in_features], w, 16) for w in layers["vnni"]]),
        best_ms(lambda: [kernel(x[w.in_features], w, 8) for w in layers["vnni"]]),
        best_ms(lambda: [dequant(x[w.in_features], w) for w in layers["vnni"]]),
        best_ms(lambda: [int4_packed_mm(x[w.in_features], w) for w in layers["int4pack"]]),
        best_ms(lambda: [F.linear(x[w.shape[1]], w) for w in layers["bf16"]]),
        best_ms(lambda: kernel(x[576], head_vnni, 16)),
        best_ms(lambda: kernel(x[576], head_vnni, 8)),
        best_ms(lambda: dequant(x[576], head_vnni)),
        best_ms(lambda: grouped_linear(x[576], head_codes)),
        best_ms(lambda: F.linear(x[576], head_bf16)),
    ]


if __name__ == "__main__":
    main()
