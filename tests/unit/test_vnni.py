"""The int8-dot-product matmul on 4- and 8-bit group-wise codes (layers/vnni.py): packing keeps every code
and the fp16 scales; the C++ kernel equals its PyTorch reference (the same rounding of x) on ragged shapes
and tails, and the dequantize-then-matmul product within the rounding of x; GGUF's records convert to it
exactly up to fp16 scales; the embedding reads the rows the codes stand for."""

import pytest
import torch

from sobrio.layers import quantization, vnni
from sobrio.layers.cpu_ops import cpu_ops, vnni_linear_available
from sobrio.layers.grouped import GroupedCodes
from sobrio.layers.int4 import Int4Codes
from sobrio.layers.vnni import VnniLinear

needs_kernel = pytest.mark.skipif(not vnni_linear_available(), reason="vnni_linear needs AVX512-VNNI")


def random_weight(n: int, k: int, bits: int, group: int, offsets: bool, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    offset = (torch.rand(n, k // group, generator=g) - 0.5) * 0.1 if offsets else None
    return codes, scales, offset


def exact_dequantized(codes, scales, offsets, group: int, code_zero: int) -> torch.Tensor:
    """What the codes stand for with the scales and offsets rounded to fp16, as they are stored."""
    w = (codes.float() - code_zero).unflatten(-1, (-1, group)) * scales.half().float()[..., None]
    if offsets is not None:
        w += offsets.half().float()[..., None]
    return w.flatten(1)


@pytest.mark.parametrize("bits, n, k, group, code_zero, offsets", [
    (4, 70, 96, 32, 0, True), (4, 32, 256, 128, 0, False), (8, 37, 64, 16, 128, False), (8, 33, 128, 64, 128, True),
])
def test_pack_keeps_every_code_and_the_fp16_scales(bits, n, k, group, code_zero, offsets) -> None:
    codes, scales, offset = random_weight(n, k, bits, group, offsets)
    w = vnni.VnniCodes.pack(codes, scales, offset, bits, group, code_zero)
    assert w.weight.numel() == -(-n // vnni.TILE) * vnni.TILE * k * bits // 8  # padded to whole tiles
    expected = exact_dequantized(codes, scales, offset, group, code_zero)
    assert torch.equal(w.dequantize(), expected)
    ids = torch.tensor([[n - 1, 0, 5], [17, 17, n // 2]])
    assert torch.equal(w.embedding(torch.float32)(ids), expected[ids])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("bits, n, k, group, code_zero, offsets", [
    (4, 70, 96, 32, 0, True), (4, 64, 256, 128, 0, True), (4, 33, 576, 32, 0, False),
    (8, 50, 64, 16, 128, False), (8, 33, 128, 64, 128, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_kernel_equals_its_reference_and_the_dequantized_product(rows, bits, n, k, group, code_zero, offsets,
                                                                  dtype, act_bits) -> None:
    codes, scales, offset = random_weight(n, k, bits, group, offsets, seed=rows)
    w = vnni.VnniCodes.pack(codes, scales, offset, bits, group, code_zero)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 40  # an outlier channel: its group's step grows, the others' do not
    x = x.to(dtype)
    bias = torch.randn(n, generator=gen)
    got = vnni.vnni_linear(x, w, bias, act_bits)
    assert got.dtype == dtype and got.shape == (rows, n)
    reference = vnni.reference(x, w, bias, act_bits).float()
    ulp = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding (bf16: one ulp of the largest)
    torch.testing.assert_close(got.float(), reference, rtol=ulp, atol=ulp * reference.abs().max().item())
    exact = x.float() @ w.dequantize().T + bias
    error = (got.float() - exact).abs().max() / exact.abs().max()
    assert error < (6e-2 if act_bits == 8 else 1e-2 if dtype == torch.bfloat16 else 3e-4), error  # 8 bits: ~2^-8


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5, 9, 261])
@pytest.mark.parametrize("bits, k, group, code_zero", [(8, 256, 64, 128), (8, 96, 16, 128), (4, 128, 32, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_one_scale_a_channel_computes_what_that_scale_in_every_group_does(rows, bits, k, group, code_zero, dtype,
                                                                          act_bits) -> None:
    """Scales [N, 1] (`--quantization int8`'s): the kernel scales each group's sums by x's step alone and by
    the channel's scale once at the end; the result is the reference's, and the same weight with its scale
    repeated in every group gives it too, within the output's rounding, also for activations far from zero
    on average (a large code_zero term). 261 rows: two passes of 256."""
    n = 45
    codes, scales, _ = random_weight(n, k, bits, group, False, seed=rows)
    channel = vnni.VnniCodes.pack(codes, scales[:, :1], None, bits, group, code_zero)
    grouped = vnni.VnniCodes.pack(codes, scales[:, :1].expand(n, k // group), None, bits, group, code_zero)
    assert channel.scales.shape == (2, 1, vnni.TILE) and torch.equal(channel.dequantize(), grouped.dequantize())
    assert torch.equal(vnni.dense_weight(channel, dtype), vnni.dense_weight(grouped, dtype))
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen)
    ulp = 1e-5 if dtype == torch.float32 else 1e-2

    def product(w: vnni.VnniCodes, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops().vnni_linear(x, w.weight, w.scales, None, n, bits, group, code_zero, act_bits, bias,
                                     vnni.NO_DENSE_ROWS).float()

    centred = torch.randn(rows, k, generator=gen).to(dtype)
    off_centre = (torch.randn(rows, k, generator=gen) * 0.1 + 2).to(dtype)
    reference = vnni.reference(centred, channel, bias, act_bits).float()
    torch.testing.assert_close(product(channel, centred), reference, rtol=ulp, atol=ulp * reference.abs().max().item())
    # (the reference is left out here: off-centre x * step lands on ties, which it may round the other way)
    got, expected = product(channel, off_centre), product(grouped, off_centre)
    torch.testing.assert_close(got, expected, rtol=ulp, atol=ulp * expected.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("bits, act_bits", [(8, 8), (8, 16), (4, 16)])
def test_prompt_rows_below_the_dense_threshold_take_the_dot_products(bits, act_bits) -> None:
    """Up to `dense_min_rows` (where there is no AMX: a whole 2,048-token chunk with W8A8's 8-bit activations,
    about 512 rows with 16-bit ones) prompt rows take the int8 kernel: its result is the reference's, with the
    activations rounded, not the dequantized weight's product."""
    rows = min(vnni.dense_min_rows(act_bits) - 1, 600)
    w = vnni.VnniCodes.pack(*random_weight(40, 128, bits, 32, bits == 4), bits, 32, 128 if bits == 8 else 0)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))  # fp32: the dense product is ~0.5% off
    reference = vnni.reference(x, w, None, act_bits)
    torch.testing.assert_close(vnni.vnni_linear(x, w, None, act_bits), reference, rtol=1e-5,
                               atol=1e-5 * reference.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("bits, n, k, group, code_zero, offsets", [
    (4, 70, 96, 32, 0, True), (4, 33, 576, 32, 0, False), (8, 37, 64, 16, 128, True), (8, 33, 128, 64, 128, False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_multiply_the_dequantized_weight(bits, n, k, group, code_zero, offsets, dtype) -> None:
    """From `dense_min_rows` rows on (16-bit activations): the C++ dequantizer gives `VnniCodes.dequantize`'s
    values (in bf16 rounded once), and the product is aten's on them."""
    codes, scales, offset = random_weight(n, k, bits, group, offsets)
    w = vnni.VnniCodes.pack(codes, scales, offset, bits, group, code_zero)
    dense = vnni.dense_weight(w, dtype)
    assert dense.dtype == dtype and torch.equal(dense, w.dequantize().to(dtype))
    x = torch.randn(vnni.dense_min_rows(16) + 3, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n)
    got = vnni.vnni_linear(x, w, bias)
    assert torch.equal(got, torch.nn.functional.linear(x, dense, bias.to(dtype)))
    exact = x.float() @ w.dequantize().T + bias
    assert (got.float() - exact).abs().max() / exact.abs().max() < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_kernel
def test_a_zero_row_and_a_leading_batch_shape() -> None:
    w = vnni.VnniCodes.pack(*random_weight(40, 64, 4, 32, True), 4, 32)
    x = torch.randn(2, 3, 64)
    x[0, 1] = 0
    bias = torch.randn(40)
    out = vnni.vnni_linear(x, w, bias)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out[0, 1], bias)


@needs_kernel
def test_bad_arguments_are_errors_naming_the_problem() -> None:
    w = vnni.VnniCodes.pack(*random_weight(32, 512, 8, 512, False), 8, 512, 128)
    with pytest.raises(RuntimeError, match="group 512 too large for 8-bit codes"):
        vnni.vnni_linear(torch.randn(1, 512), w, act_bits=16)
    with pytest.raises(RuntimeError, match="act_bits: 8 or 16"):
        vnni.vnni_linear(torch.randn(1, 512), w, act_bits=4)
    with pytest.raises(RuntimeError, match="weight: contiguous uint8"):
        cpu_ops().vnni_linear(torch.randn(1, 512), w.weight.flatten()[64:], w.scales, None, 32, 8, 512, 128, 8, None)
    codes, scales, offsets = random_weight(32, 128, 4, 32, True)
    grouped = vnni.VnniCodes.pack(codes, scales, offsets, 4, 32)
    with pytest.raises(RuntimeError, match="offsets: as scales, one a group"):  # one scale a channel: no offsets
        cpu_ops().vnni_linear(torch.randn(1, 128), grouped.weight, grouped.scales[:, :1].contiguous(),
                              grouped.offsets, 32, 4, 32, 0, 16, None)
    with pytest.raises(RuntimeError, match=r"scales: contiguous fp16 \[tiles, K / group, 32\] or \[tiles, 1, 32\]"):
        cpu_ops().vnni_linear(torch.randn(1, 128), grouped.weight, grouped.scales[:, :2].contiguous(), None, 32, 4,
                              32, 0, 16, None)


def test_gguf_records_convert_exactly_up_to_fp16_scales() -> None:
    """Int4Codes (Q4_0/Q4_1/Q4_K, AWQ/GPTQ) and GroupedCodes (Q5/Q6/Q8) as VnniCodes: the same weight, the
    scales and offsets rounded to fp16 (GGUF's own d and m are fp16 already: no change for those)."""
    g = torch.Generator().manual_seed(7)
    d = (torch.rand(48, 2, generator=g) * 0.01).half().float()
    m = (-torch.rand(48, 2, generator=g) * 0.05).half().float()
    q4 = Int4Codes(torch.randint(0, 16, (48, 64), generator=g, dtype=torch.int32),
                   torch.stack([d.T, (m + 8 * d).T], -1).contiguous(), 32)  # Q4_1: w = d q + m
    torch.testing.assert_close(q4.vnni().dequantize(), q4.dequantize(), rtol=1e-6, atol=1e-8)  # order of sums
    q8 = GroupedCodes(torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8), d[:40], None, 32)
    assert torch.equal(q8.vnni().dequantize(), q8.dequantize())
    assert q8.vnni() is q8.vnni()  # made once: the tied embedding and LM head share it
    q6 = GroupedCodes(torch.randint(-32, 32, (40, 64), generator=g, dtype=torch.int8),
                      torch.rand(40, 4, generator=g) * 0.01 + 1e-3, None, 16)  # fp16 normals
    torch.testing.assert_close(q6.vnni().dequantize(), q6.dequantize(), rtol=2 ** -11, atol=0)


@needs_kernel
@pytest.mark.parametrize("method, act_bits", [("int8", 8), ("int8-weight-only", 16)])
def test_int8_modes_on_the_kernel_keep_one_copy_for_embedding_and_head(method, act_bits) -> None:
    """`--quantization int8 | int8-weight-only` on the kernel (weight-only wherever the CPU has VNNI, int8 where
    it has no AMX-INT8): int8 per channel, scales repeated per group of 32; W8A8 rounds activations to 8 bits
    per group, weight-only to 16."""
    w = torch.randn(1000, 96).bfloat16()
    codes = quantization.vnni_int8_codes(w)
    q, scale = quantization.quantize_weight(w, torch.float16)
    assert torch.equal(codes.dequantize(), quantization.dequantize_weight(q, scale, torch.float32))
    embed = codes.embedding(torch.bfloat16)
    ids = torch.tensor([0, 999, 5, 5])
    assert torch.equal(embed(ids), codes.dequantize()[ids].bfloat16())
    head = embed.lm_head(method)
    assert head.codes.data_ptr() == embed.codes.data_ptr() and head.act_bits == act_bits  # no second copy
    for rows in (1, 8, 30):
        hidden = torch.randn(rows, 96).bfloat16()
        expected = hidden.float() @ codes.dequantize().T
        assert ((head(hidden).float() - expected).norm() / expected.norm()) < (2e-2 if act_bits == 8 else 5e-3)
    layer = quantization.quantized_linear(w[:70], torch.randn(70), method, "layer")
    assert isinstance(layer, VnniLinear) == quantization.vnni_int8_preferred(96, method)


@needs_kernel
@pytest.mark.skipif(not quantization.vnni_int8_preferred(256, "int8"), reason="int8 takes AMX-INT8 here")
def test_int8_rounds_activations_per_256_inputs_and_a_down_projs_per_64() -> None:
    """W8A8's groups on the kernel (`quantization.VNNI_INPUT_GROUPS`): 256 inputs (the largest power of two
    that divides K where 256 does not), a down_proj's 64 (its outliers), weight-only's 32; the head of a
    tied embedding takes the mode's; the codes stand for the same int8 weight whatever the group."""
    w = torch.randn(64, 768).bfloat16()
    group = lambda layer: layer.weight_codes.group_size  # noqa: E731
    assert group(quantization.quantized_linear(w, None, "int8", "q")) == 256
    assert group(quantization.quantized_linear(w, None, "int8", "down", grouped_inputs=True)) == 64
    assert group(quantization.quantized_linear(w, None, "int8-weight-only", "q")) == 32
    assert quantization.vnni_int8_codes(w[:, :576], 256).group_size == 64  # SmolLM2's hidden size
    assert quantization.quantized_embedding(w, "int8").lm_head("int8").weight_codes.group_size == 256
    assert torch.equal(quantization.vnni_int8_codes(w, 256).dequantize(), quantization.vnni_int8_codes(w).dequantize())
