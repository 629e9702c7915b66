"""Int4 matmul kernels against bf16 `F.linear`, on a SmolLM2-135M step's matmuls (30 layers' qkv 960x576,
o 576x576, gate_up 3072x576 and down 576x1536, then the 49152x576 LM head: 270 MB of bf16 weights, random
here), at a given row count. Prints ms per step's matmuls and the ratio to the dense baseline (> 1: faster).
This is the measurement behind the choice of kernel by row count in `sobrio/layers/int4.py`.

- dense: `F.linear` on the float weight in the activations' dtype (aten -> oneDNN, AMX in bf16);
- int4pack: `aten._weight_int4pack_mm_for_cpu` on the packed int4 weight (`int4_packed_mm`);
- dequant+mm: the int4 weight dequantized into the activations' dtype on each call, then `F.linear`
  (`int4_dequant_mm`).

Run it on a quiet machine; `--threads 1` (the default) times CPU, so it holds up under load.

    .venv/bin/python benchmarks/int4_kernels.py [--rows 1 8 32 64 256] [--threads 1] [--group-size 64]
"""

import argparse
from collections.abc import Callable

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_timing import best_times  # noqa: E402  (benchmarks/ is on the path when a script here runs)

from sobrio.layers.int4 import int4_dequant_mm, int4_packed_mm, quantize_int4  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    layers = [torch.randn(n, k, dtype=dtype) for _ in range(LAYERS) for (n, k) in LAYER_SHAPES]
    return layers + [torch.randn(VOCAB, HIDDEN, dtype=dtype)]


def kernels(ws: list[torch.Tensor], group_size: int) -> dict[str, Callable[[dict], list]]:
    """name -> a function running every matmul once on the inputs `xs` (in features -> [rows, K])."""
    int4 = [quantize_int4(w, group_size) for w in ws]
    return {
        "dense": lambda xs: [F.linear(xs[w.shape[1]], w) for w in ws],
        "int4pack": lambda xs: [int4_packed_mm(xs[q.in_features], q) for q in int4],
        "dequant+mm": lambda xs: [int4_dequant_mm(xs[q.in_features], q) for q in int4],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64, help="32 or 64 (128 does not divide 576)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    found = kernels(weights(dtype), args.group_size)
    print(f"{args.dtype}, group size {args.group_size}, {args.threads} thread(s), best of {args.repeats}; "
          f"ratio = dense time / kernel time")
    print(f"{'rows':>5}  {'kernel':<11} {'ms/step':>8}  {'vs dense':>8}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in {HIDDEN, 1536}}
        best = best_times(found, xs, args.repeats, args.threads)
        for name, seconds in best.items():
            print(f"{rows:>5}  {name:<11} {seconds * 1e3:8.2f}  {best['dense'] / seconds:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
