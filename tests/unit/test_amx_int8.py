"""`int8` (W8A8) on Intel AMX-INT8 (csrc/amx_linear.cpp): the kernel equals the int8 reference (activations
rounded per token, integer products, both scales) and dequantize-then-matmul within tolerance on ragged row
counts and tails, per token and per group of 64 inputs (a down_proj's); the tied LM head and the embedding
share its one tile copy; a shape that does not fill whole tiles keeps oneDNN's kernel. Skipped where the CPU
or the build has no AMX-INT8."""

import pytest
import torch

from sobrio.layers.cpu_ops import amx_int8_available, cpu_ops
from sobrio.layers.quantization import (
    AMX_ACT_GROUP,
    QuantizedEmbedding,
    QuantizedLinear,
    amx_int8_fits,
    amx_int8_rows,
    dequantize_weight,
    int8_mm,
    quantize_per_token,
    quantize_weight,
)

pytestmark = pytest.mark.skipif(not amx_int8_available(),
                                reason="no AMX-INT8 here (or the C++ operators did not build)")

ROWS = [1, 5, 31, 32, 33, 64, 300]  # tails of the 32-row blocks, and more than one 256-row pass
SHAPES = [(64, 32), (576, 960), (1536, 96)]  # (K, N): one tile, SmolLM2's qkv, a long K


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, x_scale = quantize_per_token(x)
    return (xq.double() @ q.double().T).float() * x_scale * scale.float()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_int8_reference_and_dequantize_then_matmul(rows, k, n, dtype):
    torch.manual_seed(rows * 7 + k)
    w, bias = torch.randn(n, k), torch.randn(n)
    q, scale = quantize_weight(w, torch.float32)
    x = (torch.randn(rows, k) * 4).to(dtype)
    x[0, 3] = 20.0  # an outlier token: its own scale
    got = cpu_ops().amx_int8_linear(x, cpu_ops().amx_pack_weight_int8(q), scale, n, bias.to(dtype))
    assert got.dtype == dtype and got.shape == (rows, n)
    expected = int8_reference(x, q, scale) + bias.to(dtype).float()
    assert relative_error(got, expected) < (1e-6 if dtype == torch.float32 else 4e-3)
    dense = x.float() @ dequantize_weight(q, scale, torch.float32).T + bias.to(dtype).float()
    assert relative_error(got, dense) < 3e-2  # what rounding the activations to 8 bits costs


def test_a_strided_row_view_and_zero_rows():
    q, scale = quantize_weight(torch.randn(64, 128), torch.float32)
    packed = cpu_ops().amx_pack_weight_int8(q)
    wide = torch.randn(7, 256).bfloat16()
    x = wide[:, :128]  # rows 256 apart
    assert relative_error(cpu_ops().amx_int8_linear(x, packed, scale, 64, None), int8_reference(x, q, scale)) < 4e-3
    zeros = torch.zeros(3, 128, dtype=torch.bfloat16)  # an all-zero token: scale tiny, output 0
    out = cpu_ops().amx_int8_linear(zeros, packed, scale, 64, None)
    assert torch.equal(out, torch.zeros(3, 64, dtype=torch.bfloat16))


def grouped_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """`int8_reference` with a scale per token and group of `group` inputs."""
    rows, k = x.shape
    xq, x_scale = quantize_per_token(x.reshape(rows * k // group, group))
    groups = k // group
    products = xq.double().view(rows, groups, 1, group) @ q.double().view(-1, groups, group).permute(1, 2, 0)
    return (products.float().squeeze(2) * x_scale.view(rows, groups, 1)).sum(1) * scale.float()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n, group", [(64, 32, 64), (576, 960, 64), (1536, 96, 64), (1536, 96, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_equals_its_reference(rows, k, n, group, dtype):
    torch.manual_seed(rows * 5 + k)
    w, bias = torch.randn(n, k), torch.randn(n)
    q, scale = quantize_weight(w, torch.float32)
    x = (torch.randn(rows, k) * 4).to(dtype)
    x[:, 7] *= 30  # an outlier channel: it sets its own group's step only
    got = cpu_ops().amx_int8_linear(x, cpu_ops().amx_pack_weight_int8(q), scale, n, bias.to(dtype), group_k=group)
    assert got.dtype == dtype and got.shape == (rows, n)
    expected = grouped_reference(x, q, scale, group) + bias.to(dtype).float()
    assert relative_error(got, expected) < (1e-6 if dtype == torch.float32 else 4e-3)
    if k > group:
        per_token = int8_reference(x, q, scale) + bias.to(dtype).float()
        dense = x.float() @ dequantize_weight(q, scale, torch.float32).T + bias.to(dtype).float()
        assert relative_error(got, dense) < relative_error(per_token, dense)


def test_bad_operands_are_refused_with_a_clear_error():
    q, scale = quantize_weight(torch.randn(64, 128), torch.float32)
    packed = cpu_ops().amx_pack_weight_int8(q)
    with pytest.raises(RuntimeError, match="N a multiple of 32, K of 64"):
        cpu_ops().amx_pack_weight_int8(torch.zeros(64, 96, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        cpu_ops().amx_int8_linear(torch.randn(2, 128).half(), packed, scale, 64, None)
    with pytest.raises(RuntimeError, match="packed weight shape"):
        cpu_ops().amx_int8_linear(torch.randn(2, 64), packed, scale, 64, None)
    for group in (32, 96, 256):  # not whole tiles, not dividing K, larger than K
        with pytest.raises(RuntimeError, match="multiple of 64 dividing K"):
            cpu_ops().amx_int8_linear(torch.randn(2, 128), packed, scale, 64, None, group_k=group)


def test_int8_layers_keep_only_the_tile_copy_where_the_shape_fits():
    fits = QuantizedLinear.from_float(torch.randn(96, 128).bfloat16(), None, "int8")
    assert fits.amx_packed is not None and fits.weight is None and fits.packed is None
    ragged = QuantizedLinear.from_float(torch.randn(70, 96).bfloat16(), None, "int8")  # N % 32, K % 64
    assert ragged.amx_packed is None and not amx_int8_fits(torch.zeros(70, 96), torch.bfloat16)
    assert not amx_int8_fits(torch.zeros(96, 128), torch.float16)  # fp16 activations: oneDNN's kernel
    weight_only = QuantizedLinear.from_float(torch.randn(96, 128).bfloat16(), None, "int8-weight-only")
    assert weight_only.amx_packed is None  # bf16 activations there: the int8 weight kernels
    x = torch.randn(2, 3, 128).bfloat16()
    out = fits(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.bfloat16


def test_the_tied_head_and_the_embedding_share_the_tile_copy():
    torch.manual_seed(0)
    w = torch.randn(1024, 128).bfloat16()
    embed = QuantizedEmbedding.from_float(w)
    plain, scale = embed.weight.clone(), embed.weight_scale
    ids = torch.tensor([[0, 1023, 17], [17, 500, 16]])
    before = embed(ids)
    max_abs_x = torch.rand(128)
    max_abs_x[[5, 77]] = 50.0  # two outlier channels, kept in float
    head = embed.lm_head("int8", max_abs_x)
    assert embed.weight is None and head.weight is None and embed.amx_rows.data_ptr() == head.amx_packed.data_ptr()
    assert torch.equal(embed(ids), before)  # lookups from the tile copy: the same rows
    assert torch.equal(amx_int8_rows(head.amx_packed, ids.view(-1)), plain[ids.view(-1)])
    hidden = torch.randn(9, 128).bfloat16()
    hidden[:, 5] *= 50
    logits = head(hidden)
    assert logits.dtype == torch.float32  # the logits stay float32
    index = head.outliers.index
    assert len(index) == 64 and {5, 77} <= set(index.tolist())
    rest = hidden.index_fill(1, index, 0)  # two groups, each rounded on its own per-token scale
    expected = (int8_reference(rest, plain, torch.ones(1024)) + int8_reference(hidden[:, index], plain[:, index],
                                                                              torch.ones(1024))) * scale.float()
    assert relative_error(logits, expected) < 1e-5
    dense = hidden.float() @ dequantize_weight(plain, scale, torch.float32).T
    assert relative_error(logits, dense) < 2.5e-2
    single = int8_reference(hidden, plain, scale)  # one scale per token: the outlier channels set its step
    assert relative_error(logits, dense) < relative_error(single, dense)


def test_a_small_head_keeps_its_outliers_in_float():
    embed = QuantizedEmbedding.from_float(torch.randn(256, 64).bfloat16())  # 64 inputs: no room for a group
    plain, scale = embed.weight.clone(), embed.weight_scale
    head = embed.lm_head("int8", torch.rand(64))
    assert head.outliers.weight.dtype == torch.float32
    hidden = torch.randn(5, 64).bfloat16()
    assert relative_error(head(hidden), int8_mm(hidden, plain, scale, head.outliers).float()) < 1e-2


def test_a_down_proj_rounds_its_inputs_per_group_of_64():
    torch.manual_seed(1)
    w = torch.randn(64, 512).bfloat16()
    layer = QuantizedLinear.from_float(w, None, "int8", grouped_inputs=True)  # a down_proj
    plain = QuantizedLinear.from_float(w, None, "int8")
    assert layer.act_group == AMX_ACT_GROUP and plain.act_group == 0 and layer.weight is None  # the tile copy only
    x = torch.randn(6, 512).bfloat16()
    x[:, [3, 200]] *= 80  # GELU's products: a few channels far above the rest, in 2 of the 8 groups
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 64)
    q, scale = quantize_weight(w, w.dtype)  # as the layer rounded it: bf16 scales
    assert relative_error(out, grouped_reference(x, q, scale, AMX_ACT_GROUP)) < 4e-3
    dense = x.float() @ dequantize_weight(q, scale, torch.float32).T
    assert relative_error(out, dense) < 0.5 * relative_error(plain(x), dense)


def kernel_codes(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """The int8 codes the kernel rounds x's rows to, read back through an identity weight: each output is
    one input's code times its row's (or group's) scale, in float32."""
    k = x.shape[1]
    identity = cpu_ops().amx_pack_weight_int8(torch.eye(k, dtype=torch.int8))
    out = cpu_ops().amx_int8_linear(x, identity, torch.ones(k), k, None, None, None, True, group)
    _, scale = quantize_per_token(x.reshape(-1, group) if group else x)
    return (out.view(scale.shape[0], -1) / scale).round().to(torch.int8).view(x.shape)


@pytest.mark.parametrize("group", [0, 64])
def test_the_kernel_rounds_activations_as_python_does_bit_for_bit(group):
    """The kernel's codes equal `quantize_per_token`'s (x / scale, ties to even) on rows built to land on and
    around ties: multiplying by the scale's reciprocal instead (a kernel tried on 2026-12-07, not faster here)
    rounds some of them the other way and fails this."""
    generator = torch.Generator().manual_seed(group)
    rows, k = 64, 256
    scale = torch.rand(rows, 1, generator=generator) * 3 + 0.01
    halves = torch.randint(-127, 127, (rows, k), generator=generator) + 0.5  # k + 0.5: the ties
    ulps = torch.randint(-3, 4, (rows, k), generator=generator).float()  # and a few float steps either side
    x = halves * scale
    x = x + ulps * x.abs() * 2**-23
    x[:, 0] = 127 * scale[:, 0]  # each row's largest: its scale is `scale`, so x / scale lies on the ties
    x[3] = 0  # an all-zero row: a subnormal scale, divided everywhere
    x[5, 1:] = torch.randn(k - 1, generator=generator)  # a plain row
    expected, _ = quantize_per_token(x.reshape(-1, group) if group else x)
    got = kernel_codes(x, group)
    assert torch.equal(got, expected.view(x.shape))
    # and the rows do reach ties: some quotients are exactly k + 0.5, rounded to the even side
    quotients = (x.reshape(-1, group) if group else x) / quantize_per_token(x.reshape(-1, group) if group else x)[1]
    assert ((quotients - quotients.floor()) == 0.5).sum() > 100
