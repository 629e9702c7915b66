"""Attention for a prompt chunk: PyTorch's SDPA (causal for a whole prompt, the chunk's mask after keys already
in the cache, as `ReferenceAttention` computes it; with a softcap, its scores by hand) against sobrio's C++
`prompt_attention` (`CppPagedAttention`), on the same paged bf16 cache. Prints CPU milliseconds per layer (all
threads: a busy neighbour stretches wall time, not this), GFLOP per CPU second of the useful (unmasked) work,
and the ratio.

    .venv/bin/python benchmarks/prompt_chunk_attention.py [--shapes 0:1024,0:2048,2048:2048] [--heads 32 --kv-heads 8]
        [--window W] [--softcap CAP]

A shape is `prefix:chunk`: keys already in the cache, then the chunk's query rows.
"""

import argparse

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
from kernel_timing import best_cpu_ms  # noqa: E402  (benchmarks/ is on the path when a script here runs)

from sobrio.layers.attention import AttentionMetadata, CppPagedAttention, ReferenceAttention  # noqa: E402


def time_shape(prefix: int, chunk: int, heads: int, kv_heads: int, dim: int, repeats: int,
               window: int | None = None, softcap: float | None = None) -> tuple[float, float]:
    block, ctx = 16, prefix + chunk
    blocks = -(-ctx // block)
    cache = torch.randn(2, blocks, block, kv_heads, dim, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.arange(prefix, ctx), query_start_loc=[0, chunk], context_lens=[ctx],
                             block_tables=torch.randperm(blocks).unsqueeze(0), block_size=block)
    q = torch.randn(chunk, heads, dim, dtype=torch.bfloat16)
    k, v = (torch.randn(chunk, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    result = []
    for cls in (ReferenceAttention, CppPagedAttention):
        attention = cls(heads, kv_heads, dim, dim ** -0.5, window, softcap=softcap)
        attention.kv_cache = cache
        attention.write_cache(k, v, meta)
        result.append(best_cpu_ms(lambda a=attention: a.attend_each(q, k, v, meta, [0], out), repeats))
    return result[0], result[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="0:1024,0:2048,2048:2048,512:512", help="prefix:chunk, comma-separated")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=None, help="a sliding window (keys a query sees)")
    parser.add_argument("--softcap", type=float, default=None, help="an attention logit softcap (Gemma 2: 50)")
    args = parser.parse_args()
    print(f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, window {args.window}, softcap {args.softcap}, bf16, "
          f"{torch.get_num_threads()} threads; "
          f"CPU ms per layer (GFLOP per CPU second)")
    print(f"{'prefix':>7} {'chunk':>6} {'SDPA':>16} {'prompt_attention':>18} {'ratio':>6}")
    for shape in args.shapes.split(","):
        prefix, chunk = (int(x) for x in shape.split(":"))
        sdpa, kernel = time_shape(prefix, chunk, args.heads, args.kv_heads, args.head_dim, args.repeats, args.window,
                                  args.softcap)
        seen = sum(min(p + 1, args.window or p + 1) for p in range(prefix, prefix + chunk))  # keys each query sees
        useful = 4 * args.heads * args.head_dim * seen  # QK^T and PV, unmasked
        print(f"{prefix:>7} {chunk:>6} {sdpa:8.0f} ({useful / sdpa / 1e6:4.0f}) "
              f"{kernel:10.0f} ({useful / kernel / 1e6:4.0f}) {sdpa / kernel:5.2f}x")


if __name__ == "__main__":
    main()
