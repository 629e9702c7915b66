"""Int8 matmul kernels against the engine's bf16 path, on a SmolLM2-135M step's matmuls (30 layers' qkv, o,
gate_up and down, then the tied LM head: 270 MB of bf16 weights), at a given row count. Prints ms per step's
matmuls and the ratio to bf16 (> 1: faster than bf16). This is the measurement behind the choice of kernel
by row count in `sobrio/layers/quantization.py`.

- bf16: `sobrio.layers.linear.linear` with its oneDNN and AMX packed copies (the GEMV for few rows), as
  the engine runs today;
- int8pack_mm: `aten._weight_int8pack_mm`, int8 weights, bf16 activations (weight-only);
- dequant+mm: the int8 weight converted to bf16 on each call, aten's matmul, the scales on the output
  (weight-only);
- int_mm W8A8: per-token int8 activations, `torch._int_mm` on the plain int8 weight, fp32 scaling;
- oneDNN W8A8: the same activations through oneDNN's int8 linear on its packed copy of the weight
  (`onednn::qlinear_pointwise`), the per-token scales applied to its output;
- ao dynamic: torch.ao's dynamic quantized linear (fbgemm; per-tensor activations, fp32 in and out;
  deprecated by PyTorch).

Run it on a quiet machine; `--threads 1` (the default) times CPU, so it holds up under load.

    .venv/bin/python benchmarks/quant_kernels.py [--rows 1 8 32 64 256] [--threads 1]
"""

import argparse
import warnings
from collections.abc import Callable

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
from kernel_timing import best_times  # noqa: E402  (benchmarks/ is on the path when a script here runs)

from sobrio.layers.linear import amx_pack_weight, linear, pack_weight  # noqa: E402
from sobrio.layers.quantization import (  # noqa: E402
    dequant_mm,
    int8_mm,
    onednn_int8_mm,
    onednn_pack,
    quantize_weight,
    weight_only_mm,
)

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def weights() -> list[torch.Tensor]:
    layers = [torch.randn(n, k).bfloat16() for _ in range(LAYERS) for (n, k) in LAYER_SHAPES]
    return layers + [torch.randn(VOCAB, HIDDEN).bfloat16()]


def ao_dynamic(x: torch.Tensor, packed) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x.float(), packed).to(x.dtype)


def ao_pack(w: torch.Tensor):
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
    q, scale = quantize_weight(w, torch.float32)
    qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, None)


def kernels(ws: list[torch.Tensor]) -> dict[str, Callable[[dict], list]]:
    """name -> a function running every matmul once on the inputs `xs` (in features -> [rows, K])."""
    packed = [(pack_weight(w), amx_pack_weight(w)) for w in ws]
    int8 = [quantize_weight(w, torch.bfloat16) for w in ws]
    onednn = [(onednn_pack(q), s.float()) for q, s in int8]
    ao = [ao_pack(w) for w in ws]
    x_of = lambda xs, w: xs[w.shape[1]]  # noqa: E731
    return {
        "bf16": lambda xs: [linear(x_of(xs, w), w, packed=p, amx_packed=a) for w, (p, a) in zip(ws, packed)],
        "int8pack_mm": lambda xs: [weight_only_mm(x_of(xs, w), q, s) for w, (q, s) in zip(ws, int8)],
        "dequant+mm": lambda xs: [dequant_mm(x_of(xs, w), q, s) for w, (q, s) in zip(ws, int8)],
        "int_mm W8A8": lambda xs: [int8_mm(x_of(xs, w), q, s) for w, (q, s) in zip(ws, int8)],
        "oneDNN W8A8": lambda xs: [onednn_int8_mm(x_of(xs, w), p, s) for w, (p, s) in zip(ws, onednn)],
        "ao dynamic": lambda xs: [ao_dynamic(x_of(xs, w), p) for w, p in zip(ws, ao)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", nargs="+", help="only these (bf16 is always run, as the baseline)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ws = weights()
    found = kernels(ws)
    if args.kernels:
        found = {n: k for n, k in found.items() if n == "bf16" or n in args.kernels}
    print(f"{args.threads} thread(s), best of {args.repeats}; ratio = bf16 time / kernel time")
    print(f"{'rows':>5}  {'kernel':<14} {'ms/step':>8}  {'vs bf16':>7}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in ws}}
        best = best_times(found, xs, args.repeats, args.threads)
        for name, seconds in best.items():
            print(f"{rows:>5}  {name:<14} {seconds * 1e3:8.2f}  {best['bf16'] / seconds:6.2f}x")


if __name__ == "__main__":
    main()
