"""The batched decode backend equals the reference on ragged batches (mixed prefill chunks and decodes)."""

import os

import pytest
import torch

from sobrio.csrc import load
from sobrio.layers.attention import AttentionMetadata, BatchedDecodeAttention, CppPagedAttention, ReferenceAttention

FAST_BACKENDS = [BatchedDecodeAttention, CppPagedAttention]


def ragged_step(query_lens: list[int], context_lens: list[int], block_size: int, heads: int, kv_heads: int,
                dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 4
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered through the pool
    tables, slots = [], []
    for q_len, ctx in zip(query_lens, context_lens):
        n = -(-ctx // block_size)
        table, order = order[:n], order[n:]
        tables.append(table)
        positions = torch.arange(ctx - q_len, ctx)
        slots.append(torch.tensor(table)[positions // block_size] * block_size + positions % block_size)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(torch.cat(slots), qsl, list(context_lens), block_tables, block_size)
    total = qsl[-1]
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    return cache, meta, q, k, v


def test_cpp_operator_builds():
    if os.environ.get("SOBRIO_DISABLE_CPP"):
        pytest.skip("C++ operators disabled")
    assert load() is not None, "the C++ attention operator failed to build (is a C++ compiler installed?)"


@pytest.mark.parametrize("backend", FAST_BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64)])  # 64: the C++ bf16 fast path
def test_fast_backends_equal_reference_on_ragged_batches(backend, dtype, tol, window, heads, kv_heads, dim):
    if backend is CppPagedAttention and load() is None:
        pytest.skip("C++ operators unavailable")
    query_lens = [1, 7, 1, 1, 30, 1, 16]  # decodes, a chunk with context, a whole prompt
    context_lens = [1, 40, 77, 5, 30, 130, 16]
    outs = []
    for cls in (ReferenceAttention, backend):
        cache, meta, q, k, v = ragged_step(query_lens, context_lens, 16, heads, kv_heads, dim, dtype)
        attn = cls(heads, kv_heads, dim, dim ** -0.5, window)
        attn.kv_cache = cache
        outs.append(attn(q, k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_reference_matches_dense_causal_attention():
    """The reference itself against plain causal attention over the whole sequence (one prompt, then decode)."""
    cache, meta, q, k, v = ragged_step([1], [50], 16, 4, 4, 16, torch.float32)
    attn = ReferenceAttention(4, 4, 16, 0.25)
    attn.kv_cache = cache
    out = attn(q, k, v, meta)
    keys = attn.caches()[0].index_select(0, meta.context_slots(0))
    values = attn.caches()[1].index_select(0, meta.context_slots(0))
    scores = torch.einsum("hd,lhd->hl", q[0], keys) * 0.25
    expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    torch.testing.assert_close(out.view(4, 16), expected, atol=1e-5, rtol=1e-5)
