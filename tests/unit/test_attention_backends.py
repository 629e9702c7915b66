"""The batched decode backend equals the reference on ragged batches (mixed prefill chunks and decodes);
each layer reads its own cache from the step's metadata."""

import os

import pytest
import torch

from sobrio.csrc import load
from sobrio.kv.cache import KVCache
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
    meta = AttentionMetadata(torch.cat(slots), qsl, list(context_lens), block_tables, block_size, KVCache([cache]))
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
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64), (16, 2, 128), (4, 1, 256), (32, 2, 128),
                                                (10, 1, 128), (6, 6, 96)])  # C++ fast paths: 64, 96, 128, 256
# dims, groups 1-8 and 16
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 7, 1, 1, 30, 1, 16], [1, 40, 77, 5, 30, 130, 16]),  # decodes, a chunk with context, a whole prompt
    ([4, 2, 1, 3], [60, 9, 33, 120])],  # verifying drafts only: every query short, several rows each
    ids=["mixed", "verifying"])
def test_fast_backends_equal_reference_on_ragged_batches(backend, dtype, tol, window, softcap, heads, kv_heads, dim,
                                                         query_lens, context_lens):
    if backend is CppPagedAttention and load() is None:
        pytest.skip("C++ operators unavailable")
    outs = []
    for cls in (ReferenceAttention, backend):
        cache, meta, q, k, v = ragged_step(query_lens, context_lens, 16, heads, kv_heads, dim, dtype)
        attn = cls(heads, kv_heads, dim, dim ** -0.5, window, softcap=softcap)
        outs.append(attn(q, k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 1, 20, 128, 161, 400])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (6, 6, 128), (4, 1, 256), (8, 8, 96), (4, 2, 32)])
def test_prompt_kernel_equals_sdpa_on_chunks_after_a_prefix(heads, kv_heads, dim, window):
    """The C++ prompt_attention (bf16): whole prompts and chunks after cached keys, lengths off the kernel's
    blocks of 16 positions and 32 keys (AMX: tasks of 32 positions, spans of 128 keys, 32 rows a pass), beside
    decodes, against the SDPA reference; sliding windows of a key, within a block, of a span, off the spans,
    and longer than some chunks but not their contexts (rows whose first spans hold no key they see)."""
    if load() is None or not load().prompt_attention_supported():
        pytest.skip("no C++ operators, or no AVX512-BF16")
    query_lens, context_lens = [45, 1, 70, 33, 17, 260], [45, 90, 301, 97, 17, 600]
    outs = []
    for cls in (ReferenceAttention, CppPagedAttention):
        cache, meta, q, k, v = ragged_step(query_lens, context_lens, 16, heads, kv_heads, dim, torch.bfloat16, seed=3)
        attn = cls(heads, kv_heads, dim, dim ** -0.5, window)
        if cls is CppPagedAttention:
            assert attn.prompt_kernel
        outs.append(attn(q, k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 20, 161])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 64), (4, 1, 256)])
def test_prompt_kernel_with_a_softcap_equals_the_capped_reference(heads, kv_heads, dim, window):
    """Gemma 2's logit softcap (scores become cap * tanh(s / cap)) on the kernel's blocks, against the
    reference's scores by hand; a cap of 1.5 bends most scores here (theirs are about N(0, 1) after scaling,
    and 3x that where q is scaled), so a kernel that skipped it would not pass."""
    if load() is None or not load().prompt_attention_supported():
        pytest.skip("no C++ operators, or no AVX512-BF16")
    query_lens, context_lens = [45, 1, 70, 260, 1], [45, 90, 301, 600, 700]
    outs = []
    for cls in (ReferenceAttention, CppPagedAttention):
        cache, meta, q, k, v = ragged_step(query_lens, context_lens, 16, heads, kv_heads, dim, torch.bfloat16, seed=7)
        q = (q.float() * 3).bfloat16()
        attn = cls(heads, kv_heads, dim, dim ** -0.5, window, softcap=1.5)
        if cls is CppPagedAttention:
            assert attn.prompt_kernel
        outs.append(attn(q, k, v, meta).float())
    uncapped = CppPagedAttention(heads, kv_heads, dim, dim ** -0.5, window)(q, k, v, meta).float()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    for rows in (slice(0, 45), slice(45, 46), slice(46, None)):  # the cap matters for prompt and decode rows
        assert (uncapped[rows] - outs[0][rows]).abs().max() > 0.2


@pytest.mark.parametrize("backend", FAST_BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decodes_alone_with_a_softcap_equal_the_capped_reference(backend, dtype):
    """A pure decode step with Gemma 2's softcap (the C++ backend once took its decode kernel, which had no
    softcap then, from inside the PyTorch path it fell back to)."""
    if backend is CppPagedAttention and load() is None:
        pytest.skip("C++ operators unavailable")
    outs = []
    for cls in (ReferenceAttention, backend):
        cache, meta, q, k, v = ragged_step([1, 1, 1], [40, 90, 301], 16, 8, 4, 64, dtype, seed=7)
        outs.append(cls(8, 4, 64, 64 ** -0.5, None, softcap=1.5)((q.float() * 3).to(dtype), k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("prefix,chunk", [(0, 700), (400, 300), (1000, 37)])
def test_prompt_kernel_equals_sdpa_when_the_scores_grow_along_the_keys(prefix, chunk, window):
    """Scores that grow along the keys (and one far key above all) move each row's running maximum after its
    first span of keys, so the kernel's online softmax must rescale what it summed so far, against the SDPA
    reference; under a window the far key leaves later rows' windows."""
    if load() is None or not load().prompt_attention_supported():
        pytest.skip("no C++ operators, or no AVX512-BF16")
    heads, kv_heads, dim, ctx = 8, 2, 64, prefix + chunk
    outs = []
    for cls in (ReferenceAttention, CppPagedAttention):
        cache, meta, q, k, v = ragged_step([chunk], [ctx], 16, heads, kv_heads, dim, torch.bfloat16, seed=5)
        growth = 1 + 5 * torch.arange(ctx, dtype=torch.float32) / ctx  # keys, and so scores, up to 6x the first
        growth[ctx // 2] = 9.0
        table = meta.block_tables[0]
        slots = table[torch.arange(ctx) // 16] * 16 + torch.arange(ctx) % 16
        keys = cache[0].view(-1, kv_heads, dim)
        keys[slots] = (keys[slots].float() * growth[:, None, None]).bfloat16()
        k = (k.float() * growth[prefix:, None, None]).bfloat16()
        q = (q.float() * 2).bfloat16()
        attn = cls(heads, kv_heads, dim, dim ** -0.5, window)
        outs.append(attn(q, k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=3e-2, rtol=2e-2)


def test_reference_matches_dense_causal_attention():
    """The reference itself against plain causal attention over the whole sequence (one prompt, then decode)."""
    cache, meta, q, k, v = ragged_step([1], [50], 16, 4, 4, 16, torch.float32)
    attn = ReferenceAttention(4, 4, 16, 0.25)
    out = attn(q, k, v, meta)
    keys = attn.caches(meta)[0].index_select(0, meta.context_slots(0))
    values = attn.caches(meta)[1].index_select(0, meta.context_slots(0))
    scores = torch.einsum("hd,lhd->hl", q[0], keys) * 0.25
    expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    torch.testing.assert_close(out.view(4, 16), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [ReferenceAttention] + FAST_BACKENDS, ids=lambda c: c.__name__)
def test_each_layer_reads_and_writes_its_own_cache(backend):
    """Two layers over one step's metadata: each writes its keys to its layer of the KVCache only, and
    attends as if it were alone."""
    if backend is CppPagedAttention and load() is None:
        pytest.skip("C++ operators unavailable")
    cache, meta, q, k, v = ragged_step([1, 7], [40, 7], 16, 4, 2, 32, torch.float32)
    other = torch.randn(cache.shape, generator=torch.Generator().manual_seed(1))
    two = KVCache([other.clone(), cache.clone()])
    alone = backend(4, 2, 32, 32 ** -0.5)(q, k, v, meta)  # writes this step's keys into `cache`
    meta2 = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.context_lens, meta.block_tables, 16, two)
    out = backend(4, 2, 32, 32 ** -0.5, layer_idx=1)(q, k, v, meta2)
    torch.testing.assert_close(out, alone)
    assert torch.equal(two.layer(0), other), "layer 1 wrote into layer 0's cache"
    assert torch.equal(two.layer(1), cache)


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (16, 2, 128)])
def test_a_skewed_decode_batch_split_over_threads_equals_each_sequence_alone(window, heads, kv_heads, dim):
    """Long contexts first, short after: past ~4k key rows the C++ operator splits the tasks over the
    threads by key rows. A row's result must not depend on that: bitwise the result of its sequence alone
    (under 4k rows: one thread), and close to the reference."""
    if load() is None:
        pytest.skip("C++ operators unavailable")
    context_lens = [900] * 6 + [20] * 6
    cache, meta, q, k, v = ragged_step([1] * len(context_lens), context_lens, 16, heads, kv_heads, dim,
                                       torch.bfloat16)
    attn = CppPagedAttention(heads, kv_heads, dim, dim ** -0.5, window)
    batched = attn(q, k, v, meta)
    for i, ctx in enumerate(context_lens):
        one = AttentionMetadata(meta.slot_mapping[i:i + 1], [0, 1], [ctx], meta.block_tables[i:i + 1], 16,
                                meta.kv_cache)
        assert torch.equal(attn(q[i:i + 1], k[i:i + 1], v[i:i + 1], one), batched[i:i + 1])
    reference = ReferenceAttention(heads, kv_heads, dim, dim ** -0.5, window)(q, k, v, meta)
    torch.testing.assert_close(batched.float(), reference.float(), atol=2e-2, rtol=2e-2)
