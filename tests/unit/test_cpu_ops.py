"""The fused C++ operators equal the PyTorch expressions they replace (sobrio/csrc/cpu_ops.cpp)."""

import pytest
import torch
import torch.nn.functional as F

from sobrio.layers.cpu_ops import amx_available, cpu_ops, gemv_available
from sobrio.layers.linear import amx_pack_weight, blocked_view, pack_weight
from sobrio.layers.norm import GemmaRMSNorm, RMSNorm
from sobrio.models.llama import GatedMLP

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="C++ operators did not build")
DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: equal to rounding; bf16: at most one bf16 step apart (float32 sums in another order)."""
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


@pytest.mark.skipif(not gemv_available(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k", [64, 100, 576])  # 100: a tail shorter than one 32-lane vector
def test_gemv_equals_linear(rows: int, k: int):
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(203, k, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(203, generator=gen).bfloat16()
    expected = F.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(cpu_ops().gemv_bf16(x, w, bias).float(), expected, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(cpu_ops().gemv_bf16(x, w).float(), expected - bias.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(not amx_available(), reason="needs Intel AMX-BF16")
@pytest.mark.parametrize("rows", [1, 5, 16, 31, 32, 33, 40, 48, 64, 80, 100])  # one tile, partial tiles, several 32-row
# blocks, a last block of one whole tile (48, 80: read in place)
@pytest.mark.parametrize("n,k", [(32, 32), (960, 576), (576, 1536)])
def test_amx_linear_equals_linear(rows: int, n: int, k: int):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = amx_pack_weight(w)
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(cpu_ops().amx_linear(x, packed, n).float(), expected, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(cpu_ops().amx_linear(x, packed, n, bias).float(), expected + bias.float(),
                               atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(not amx_available(), reason="needs Intel AMX-BF16")
@pytest.mark.parametrize("n,k", [(32, 32), (96, 576), (2048, 64)])
def test_the_amx_layout_is_onednns_packed_copy(n: int, k: int):
    """The AMX kernel reads oneDNN's packed bytes, so a Linear on AMX keeps that copy alone (layers/linear.py)."""
    w = torch.randn(n, k).bfloat16()
    onednn = pack_weight(w)
    assert torch.ops.mkldnn._nbytes(onednn) == n * k * 2
    view = blocked_view(onednn, w)
    assert view is not None and view.shape == (n // 32, k // 2, 32, 2)
    assert torch.equal(amx_pack_weight(w).view(torch.int16).reshape(-1), view.view(torch.int16).reshape(-1))


@pytest.mark.skipif(not amx_available(), reason="needs Intel AMX-BF16")
def test_amx_pack_refuses_shapes_off_its_blocks():
    assert amx_pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16)) is None  # 48 outputs: not whole blocks
    assert amx_pack_weight(torch.zeros(64, 64)) is None  # float32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops().amx_pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_and_fused_residual(dtype: torch.dtype, norm_cls):
    gen = torch.Generator().manual_seed(1)
    norm = norm_cls(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    residual = torch.randn(7, 96, generator=gen).to(dtype)
    close(norm(x), norm.reference(x), dtype)
    expected_sum = x + residual
    out, new_residual = norm.add_and_norm(x, residual.clone())
    assert torch.equal(new_residual, expected_sum)  # one rounding of the sum, as PyTorch
    close(out, norm.reference(expected_sum), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_packed_views(dtype: torch.dtype):
    from transformers import LlamaConfig

    from sobrio.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, 64, 512).to(dtype)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, 4 * 64 + 2 * 2 * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (9,), generator=gen)
    q, k, _ = qkv.split([256, 128, 128], dim=-1)
    q, k = q.view(9, 4, 64), k.view(9, 2, 64)
    expected_q, expected_k = rotary.reference(positions, q.clone(), k.clone())
    rotated_q, rotated_k = rotary(positions, q, k)
    close(rotated_q, expected_q, dtype)
    close(rotated_k, expected_k, dtype)
    assert rotated_q.data_ptr() == qkv.data_ptr()  # rotated where they lie, no copy
    for outside in (512, -1):  # past the table, or before it: refused, not read from other memory
        with pytest.raises(RuntimeError, match=r"a position outside 0\.\.511"):
            rotary(torch.tensor([3, outside]), q[:2], k[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul(dtype: torch.dtype, act: str):
    mlp = GatedMLP(16, 40, act)
    gate_up = torch.randn(5, 80, generator=torch.Generator().manual_seed(3)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(cpu_ops().act_and_mul(gate_up, mlp.act_code), mlp.act(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [5, 300])  # a decode's few rows inline; a prompt chunk's over the threads
def test_write_kv_equals_index_copy_from_packed_views(dtype: torch.dtype, tokens: int):
    """Keys and values as the attention layer gets them (strided views of the fused qkv output) land in
    the same slots as two index_copy_ calls put them; a slot outside the cache is refused."""
    ops = cpu_ops()
    heads, dim, slots = 3, 64, 400
    qkv = torch.randn(tokens, (4 + 2 * heads) * dim).to(dtype)
    _, k, v = qkv.split([4 * dim, heads * dim, heads * dim], dim=-1)
    k, v = k.view(tokens, heads, dim), v.view(tokens, heads, dim)
    slot_mapping = torch.randperm(slots, generator=torch.Generator().manual_seed(tokens))[:tokens]
    caches = [torch.zeros(slots, heads, dim, dtype=dtype) for _ in range(4)]
    ops.write_kv(k, v, caches[0], caches[1], slot_mapping)
    caches[2].index_copy_(0, slot_mapping, k)
    caches[3].index_copy_(0, slot_mapping, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(k, v, caches[0], caches[1], torch.cat([slot_mapping[:-1], torch.tensor([slots])]))
