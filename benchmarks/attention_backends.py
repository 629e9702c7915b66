"""Decode attention for many sequences: the reference (per-sequence SDPA), the batched PyTorch path and
the C++ operator, on the same paged cache; prints ms per layer and the speed-up over the reference.

    .venv/bin/python benchmarks/attention_backends.py [--seqs 64] [--dtype bfloat16] [--skewed]
        [--heads 9 --kv-heads 3 --head-dim 64]   (SmolLM2-135M's; Qwen2.5-3B's: 16 2 128, Llama-3.1-8B's: 32 8 128)

`--skewed`: the first half of the sequences at --max-ctx, the others at --min-ctx (a split of the tasks by
count gives one thread all the long ones; the C++ operator splits them by key rows).
`--cold-layers N`: also the C++ operator over N layers, each with a cache of its own, as a decode step reads
them: from memory, the caches written over by a buffer larger than the last-level cache between steps (a step's
weights do that). The per-layer figures above repeat one layer whose cache stays in L3, which hides how the
operator waits on memory. Compare two builds by running each from its own tree (`PYTHONPATH=...`).
"""

import argparse
import statistics
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402

from sobrio.csrc import load  # noqa: E402
from sobrio.layers.attention import (  # noqa: E402
    AttentionMetadata,
    BatchedDecodeAttention,
    CppPagedAttention,
    ReferenceAttention,
)


def decode_step(seqs: int, min_ctx: int, max_ctx: int, heads: int, kv_heads: int, dim: int, block: int, dtype,
                skewed: bool = False):
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(min_ctx, max_ctx, (seqs,), generator=gen).tolist()
    if skewed:
        ctx = [max_ctx] * (seqs // 2) + [min_ctx] * (seqs - seqs // 2)
    num_blocks = sum(-(-c // block) for c in ctx) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for c in ctx:
        n = -(-c // block)
        tables.append(order[:n])
        order = order[n:]
        slots.append(tables[-1][(c - 1) // block] * block + (c - 1) % block)
    width = max(map(len, tables))
    meta = AttentionMetadata(torch.tensor(slots), list(range(seqs + 1)), ctx,
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), block)
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(seqs, kv_heads, dim, generator=gen).to(dtype)
    return cache, meta, q, kv, sum(ctx)


def time_backend(cls, cache, meta, q, kv, heads, kv_heads, dim, repeats: int) -> float:
    attn = cls(heads, kv_heads, dim, dim ** -0.5)
    attn.kv_cache = cache
    attn(q, kv, kv, meta)
    start = time.perf_counter()
    for _ in range(repeats):
        attn(q, kv, kv, meta)
    return (time.perf_counter() - start) / repeats * 1000


def time_cold_step(cache, meta, q, kv, heads, kv_heads, dim, layers: int, repeats: int, flush_mb: int) -> float:
    """Median ms of one decode step's `layers` C++ attention calls, each on its own copy of the cache, with a
    buffer of `flush_mb` MB written between steps so that every cache comes from memory."""
    attns = []
    for _ in range(layers):
        attn = CppPagedAttention(heads, kv_heads, dim, dim ** -0.5)
        attn.kv_cache = cache.clone()
        attn(q, kv, kv, meta)
        attns.append(attn)
    flush = torch.empty(flush_mb << 20, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        flush.fill_(len(times) % 255)
        start = time.perf_counter()
        for attn in attns:
            attn(q, kv, kv, meta)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--min-ctx", type=int, default=50)
    parser.add_argument("--max-ctx", type=int, default=600)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skewed", action="store_true", help="half the sequences long, then half short")
    parser.add_argument("--heads", type=int, default=9, help="query heads (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--cold-layers", type=int, default=0,
                        help="also time the C++ operator over this many layers read from memory (default: off)")
    parser.add_argument("--flush-mb", type=int, default=1024,
                        help="MB written between --cold-layers steps: above the LLC (default: %(default)s)")
    args = parser.parse_args()
    heads, kv_heads, dim, block = args.heads, args.kv_heads, args.head_dim, 16
    cache, meta, q, kv, tokens = decode_step(args.seqs, args.min_ctx, args.max_ctx, heads, kv_heads, dim, block,
                                             getattr(torch, args.dtype), args.skewed)
    print(f"{args.seqs} decoding sequences, {tokens} context tokens, heads {heads}/{kv_heads} of {dim}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    backends = [ReferenceAttention, BatchedDecodeAttention] + ([CppPagedAttention] if load() else [])
    base = None
    for cls in backends:
        ms = time_backend(cls, cache, meta, q, kv, heads, kv_heads, dim, args.repeats)
        base = base or ms
        print(f"{cls.__name__:24} {ms:8.3f} ms per layer   {base / ms:6.2f}x the reference")
    if args.cold_layers and load():
        ms = time_cold_step(cache, meta, q, kv, heads, kv_heads, dim, args.cold_layers, args.repeats, args.flush_mb)
        read = tokens * kv_heads * dim * 2 * cache.element_size() * args.cold_layers  # keys and values, once
        print(f"CppPagedAttention, {args.cold_layers} layers from memory: {ms:8.3f} ms a step (median of "
              f"{args.repeats}), {ms / args.cold_layers:.3f} ms a layer, {read / ms / 1e6:.1f} GB/s of keys and values")


if __name__ == "__main__":
    main()
