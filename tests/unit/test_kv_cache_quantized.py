"""A quantized KV cache (`--kv-cache-dtype int8 | fp8_e4m3`): rows round-trip within half a step of their
scale, every attention backend reads it and lands within tolerance of the bf16 cache's output, and the same
memory holds ~1.94x the blocks."""

import dataclasses

import pytest
import torch

from sobrio.config import SobrioConfig
from sobrio.csrc import load
from sobrio.errors import ConfigError
from sobrio.kv.cache import KVCache, KVCacheSpec, dequantize_rows, quantize_rows
from sobrio.layers.attention import (
    BatchedDecodeAttention,
    BatchInvariantAttention,
    CppPagedAttention,
    ReferenceAttention,
)
from tests.unit.test_attention_backends import ragged_step

CACHE_DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_rows_round_trip_within_their_scale(dtype):
    x = torch.randn(300, 3, 64) * torch.rand(300, 3, 1) * 10
    x[5, 1] = 0.0  # an all-zero row gets a tiny scale, not a division by zero
    q, scale = quantize_rows(x.to(torch.bfloat16), dtype)
    assert q.dtype == dtype and scale.shape == (300, 3) and scale.dtype == torch.bfloat16
    back = dequantize_rows(q, scale, torch.float32)
    assert torch.isfinite(back).all() and (back[5, 1] == 0).all()
    absmax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of absmax/127; fp8 e4m3: 3 mantissa bits, about 1/16 of the value
    bound = absmax / 127 * 0.6 + 1e-2 * absmax if dtype == torch.int8 else x.abs() / 14 + absmax / 448
    assert ((back - x).abs() <= bound).all()


def quantized_copy(meta, dtype: torch.dtype):
    """The same step over a quantized copy of its cache."""
    dense = meta.kv_cache.layer(0)
    rows, scales = quantize_rows(dense, dtype)
    return dataclasses.replace(meta, kv_cache=KVCache([rows], [scales]), _cache={})


BACKENDS = [ReferenceAttention, BatchedDecodeAttention, CppPagedAttention, BatchInvariantAttention]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64), (16, 2, 128)])
def test_every_backend_reads_a_quantized_cache_close_to_the_dense_one(backend, dtype, heads, kv_heads, dim):
    if backend in (CppPagedAttention, BatchInvariantAttention) and load() is None:
        pytest.skip("C++ operators unavailable")
    query_lens = [1, 7, 1, 1, 30, 1, 3]  # decodes, a chunk with context, a whole prompt, a short chunk
    context_lens = [1, 40, 77, 5, 30, 130, 19]
    _, meta, q, k, v = ragged_step(query_lens, context_lens, 16, heads, kv_heads, dim, torch.bfloat16)
    attn = backend(heads, kv_heads, dim, dim ** -0.5)
    quantized = quantized_copy(meta, dtype)
    dense_out = attn(q, k, v, meta).float()
    out = attn(q, k, v, quantized).float()
    tol = 0.03 if dtype == torch.int8 else 0.12  # outputs are ~N(0, 1/sqrt(context)) rows
    assert (out - dense_out).abs().max() < tol * dense_out.abs().max()
    cos = torch.nn.functional.cosine_similarity(out, dense_out, dim=-1)
    assert cos.min() > (0.999 if dtype == torch.int8 else 0.99)
    # the step's new rows went in quantized, with their scales
    key_rows, key_scales = quantized.kv_cache.slots(0)[0], quantized.kv_cache.scales(0)[0]
    written = dequantize_rows(key_rows[meta.slot_mapping], key_scales[meta.slot_mapping], torch.float32)
    assert (written - k.float()).abs().max() < (0.05 if dtype == torch.int8 else 0.5)


@pytest.mark.skipif(load() is None, reason="C++ operators unavailable")
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (16, 2, 128), (4, 1, 256), (32, 2, 128), (6, 6, 96)])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_cpp_kernel_equals_the_dequantized_gather(dtype, heads, kv_heads, dim, softcap):
    """In-place reads with the scales applied to scores and weights equal attention over the dequantized rows
    (with Gemma 2's softcap too)."""
    _, meta, q, k, v = ragged_step([1] * 6, [1, 17, 40, 77, 130, 5], 16, heads, kv_heads, dim, torch.bfloat16,
                                   seed=3)
    quantized = quantized_copy(meta, dtype)
    outs = [cls(heads, kv_heads, dim, dim ** -0.5, softcap=softcap)(q, k, v, quantized).float()
            for cls in (ReferenceAttention, CppPagedAttention)]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def test_the_same_memory_holds_nearly_twice_the_blocks():
    dense = KVCacheSpec(30, 3, 64, torch.bfloat16, 16)
    int8 = dataclasses.replace(dense, cache_dtype=torch.int8)
    assert int8.token_bytes * 128 == dense.token_bytes * 66  # 64 int8 + one bf16 scale per 64-wide row
    budget = 64 << 20
    assert int8.num_blocks_for(budget) >= 1.9 * dense.num_blocks_for(budget)
    cache = KVCache.allocate(int8, 10)
    assert cache.scales(0) is not None and cache.nbytes() == 10 * int8.block_bytes


def test_kv_cache_dtype_flag():
    assert SobrioConfig.from_kwargs(kv_cache_dtype="int8").cache_config.kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        SobrioConfig.from_kwargs(kv_cache_dtype="int4")


@pytest.mark.skipif(load() is None, reason="C++ operators unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpp_int8_write_equals_the_python_quantizer(dtype):
    """The C++ write (one call a layer) stores exactly what `quantize_rows` computes, on strided rows."""
    fused = torch.randn(37, 3 * 64 * 3, dtype=dtype) * 4  # k and v as views of a fused projection, as in models
    k, v = fused[:, :192].view(37, 3, 64), fused[:, 192:384].view(37, 3, 64)
    slots = torch.randperm(100)[:37]
    cache, scales = torch.zeros(2, 100, 3, 64, dtype=torch.int8), torch.zeros(2, 100, 3, dtype=torch.bfloat16)
    load().write_kv_int8(k, v, cache[0], cache[1], scales[0], scales[1], slots)
    for i, new in enumerate((k, v)):
        rows, row_scales = quantize_rows(new, torch.int8)
        assert torch.equal(cache[i][slots], rows) and torch.equal(scales[i][slots], row_scales)
