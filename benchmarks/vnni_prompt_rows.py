"""Prompt rows on VNNI codes: where the int8 dot products stop paying against the dequantized weight
(`layers/vnni.py dense_min_rows`). One decoder layer's four matmuls of Llama-3.2-1B's shapes (qkv 2048->3072,
o 2048->2048, gate_up 2048->16384, down 8192->2048) as codes in groups of 32: `vnni_linear` forced onto the
dot products, the same call forced onto the dequantized product, and oneDNN's bf16 on its packed weight
(the unquantized model). CPU ms (all threads, best of 3: a busy neighbour stretches wall time, not this).

    .venv/bin/python benchmarks/vnni_prompt_rows.py [--rows 128,512,2048] [--bits 8] [--act-bits 8] [--group 32]
        [--channel]

`--group`: the inputs whose activations are rounded together (and whose weight scale is one): `int8` takes 256
(`quantization.VNNI_INPUT_GROUPS`), GGUF's blocks 32. `--channel`: one weight scale a channel instead, as
`--quantization int8` packs its weights (8-bit codes, no offsets).
"""

import argparse

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
from kernel_timing import best_cpu_ms  # noqa: E402  (benchmarks/ is on the path when a script here runs)

from sobrio.layers import vnni  # noqa: E402
from sobrio.layers.cpu_ops import cpu_ops  # noqa: E402
from sobrio.layers.linear import pack_weight  # noqa: E402

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (out, in)
NEVER = vnni.NO_DENSE_ROWS



def codes(n: int, k: int, bits: int, group: int, channel: bool) -> vnni.VnniCodes:
    gen = torch.Generator().manual_seed(n + k)
    values = torch.randint(0, 2 ** bits, (n, k), generator=gen)
    scales = torch.rand(n, 1 if channel else k // group, generator=gen) * 0.01
    offsets = scales if bits == 4 and not channel else None
    return vnni.VnniCodes.pack(values, scales, offsets, bits, group, 128 if bits == 8 else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="128,512,2048", help="row counts, comma-separated (default: %(default)s)")
    parser.add_argument("--bits", type=int, default=8, choices=[4, 8], help="bits a weight code (default: %(default)s)")
    parser.add_argument("--act-bits", type=int, default=8, choices=[8, 16],
                        help="bits an activation is rounded to (default: %(default)s)")
    parser.add_argument("--group", type=int, default=32, choices=[32, 64, 128, 256],
                        help="inputs rounded together, one weight scale each (default: %(default)s)")
    parser.add_argument("--channel", action="store_true", help="one weight scale a channel (int8's packing)")
    args = parser.parse_args()
    ops = cpu_ops()
    weights = [codes(n, k, args.bits, args.group, args.channel) for n, k in SHAPES]
    packed = [pack_weight(torch.randn(n, k).bfloat16()) for n, k in SHAPES]

    def layer(xs, dense_min_rows: int) -> None:
        for x, w in zip(xs, weights):
            ops.vnni_linear(x, w.weight, w.scales, w.offsets, w.out_features, w.bits, w.group_size, w.code_zero,
                            args.act_bits, None, dense_min_rows)

    print(f"{args.bits}-bit codes{', one scale a channel' if args.channel else ''}, {args.act_bits}-bit "
          f"activations in groups of {args.group}, "
          f"{torch.get_num_threads()} threads; "
          f"dense_min_rows here: {vnni.dense_min_rows(args.act_bits)}; CPU ms a layer")
    print(f"{'rows':>6} {'dot products':>13} {'dequantized':>12} {'bf16 packed':>12} {'dot/dequant':>12} "
          f"{'dot/bf16':>9}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        dots = best_cpu_ms(lambda xs=xs: layer(xs, NEVER))
        dense = best_cpu_ms(lambda xs=xs: layer(xs, 1))
        bf16 = best_cpu_ms(lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                          for x, p in zip(xs, packed)])
        print(f"{rows:>6} {dots:13.0f} {dense:12.0f} {bf16:12.0f} {dense / dots:11.2f}x {bf16 / dots:8.2f}x")


if __name__ == "__main__":
    main()
