"""Int4 weights (`sobrio/layers/int4.py`): the packed kernel, the dequantized path and the row-count dispatch
equal dequantize-then-matmul on ragged row counts for each group size; a weight's round trip is no worse
than the min-max grid and keeps a weight already on a 4-bit grid, and its grids fitted a chunk of groups at a
time equal one pass over all of them; shapes the kernel cannot take are a
ValueError naming the problem; AWQ's scale search helps on activations with outlier channels and never
hurts on the sample."""

import re

import pytest
import torch

from sobrio.layers import int4
from sobrio.layers.int4 import (
    DEQUANT_MIN_ROWS,
    GROUP_SIZES,
    awq_search_scales,
    check_int4_shape,
    dequantize_int4,
    fake_quantize_int4,
    int4_codes,
    int4_dequant_mm,
    int4_linear,
    int4_packed_mm,
    pack_int4,
    quantize_int4,
)

ROWS = [1, 3, 17, 64, 130]
SHAPES = [(80, 384), (1104, 256)]  # (out, in): full 64-channel blocks, a tail, and past one DEQUANT_CHUNK
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3}  # relative, on the whole output (bf16: its rounding)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


def asymmetric_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different magnitudes and offsets, so that groups are far from symmetric around 0."""
    gen = torch.Generator().manual_seed(seed)
    magnitude, offset = torch.rand(n, 1, generator=gen) * 0.1, torch.randn(n, 1, generator=gen) * 0.02
    return torch.randn(n, k, generator=gen) * magnitude + offset


@pytest.mark.parametrize("n", [16, 48, 64, 80, 144, 192])
def test_packed_layout_reads_back_the_codes(n: int):
    """The layout found on this CPU inverts the op's packing on full blocks and every tail size, and a
    weight saved as codes, scales and zeros packs again to the same weight."""
    codes = torch.randint(0, 16, (n, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    w = pack_int4(codes, torch.tensor([1.0, 8.0]).expand(3, n, 2), 32)
    assert torch.equal(int4_codes(w), codes)
    assert torch.equal(dequantize_int4(w), codes.float())
    assert torch.equal(pack_int4(int4_codes(w), w.scales_and_zeros, 32).packed, w.packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_kernels_equal_dequantize_then_matmul(group_size: int, dtype: torch.dtype):
    for n, k in SHAPES:
        w = quantize_int4(asymmetric_weight(n, k, seed=n + group_size), group_size)
        reference_weight = dequantize_int4(w)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            expected = x.float() @ reference_weight.T
            for kernel in (int4_packed_mm, int4_dequant_mm, int4_linear):
                got = kernel(x, w)
                assert got.dtype == dtype and got.shape == (rows, n)
                assert relative_error(got, expected) < TOLERANCE[dtype], (kernel.__name__, rows, n, k)


def test_dispatch_by_rows_and_leading_dims():
    """Both sides of the threshold, and x [batch, seq, K] keeps its leading dimensions."""
    w = quantize_int4(asymmetric_weight(64, 128, seed=1), 64)
    for rows in (DEQUANT_MIN_ROWS[torch.bfloat16] - 1, DEQUANT_MIN_ROWS[torch.bfloat16]):
        x = torch.randn(rows, 128).bfloat16()
        assert relative_error(int4_linear(x.view(1, rows, 128), w)[0], x.float() @ dequantize_int4(w).T) < 1e-2


def test_bf16_dequantization_is_the_rounding_of_the_fp32_reference():
    w = quantize_int4(asymmetric_weight(48, 256, seed=2), 32)
    assert torch.equal(dequantize_int4(w, torch.bfloat16), dequantize_int4(w).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_round_trip_is_no_worse_than_the_min_max_grid(group_size: int, dtype: torch.dtype):
    """Each group's squared error is at most the min-max grid's bound (half a step of (max - min) / 15, the
    step rounded up to bf16, for every weight), and on Gaussian weights clearly below it; a constant group
    is exact; a narrow group far from 0 is within the bf16 rounding of its zero."""
    weight = asymmetric_weight(32, 512, seed=group_size).to(dtype)
    weight[0, :group_size] = 0.75  # a constant group
    weight[1, :group_size] = torch.linspace(3.0, 3.01, group_size)  # narrow, far from zero
    w = quantize_int4(weight, group_size)
    groups = weight.float().view(32, -1, group_size)
    error = (dequantize_int4(w) - weight.float()).view(32, -1, group_size).pow(2).sum(-1)
    min_max_half_step = (groups.amax(-1) - groups.amin(-1)) / 15 / 2 * (1 + 2 ** -7) + 1e-6
    assert (error[2:] <= group_size * min_max_half_step[2:] ** 2).all()
    assert error[0, 0] == 0
    assert error[1, 0] <= group_size * (3.01 * 2 ** -9) ** 2
    assert error[2:].sum() < 0.9 * (group_size * min_max_half_step[2:] ** 2 / 3).sum()  # uniform rounding's


@pytest.mark.parametrize("low_code, high_code", [(0, 14), (1, 15), (0, 15)])
def test_a_weight_already_on_a_4_bit_grid_is_found_again(low_code: int, high_code: int):
    """A Q4_K file's groups are 4-bit on fitted grids whose codes need not reach both ends: the round trip
    keeps them (the min-max grid moves such weights by up to half a step)."""
    gen = torch.Generator().manual_seed(high_code)
    step = (torch.rand(64, 8, 1, generator=gen) * 0.01 + 0.005).bfloat16().float()
    zero = (torch.randn(64, 8, 1, generator=gen) * 4).round() * step  # a whole number of steps: exact
    codes = torch.randint(low_code, high_code + 1, (64, 8, 32), generator=gen)
    codes[..., 0], codes[..., 1] = low_code, high_code
    weight = ((codes - 8) * step + zero).view(64, 256)
    error = (dequantize_int4(quantize_int4(weight, 32)) - weight).abs().view(64, 8, 32)
    assert (error <= step * 0.05).all(), (error / step).max()  # the zero's bf16 rounding, at most
    assert (error == 0).float().mean() > 0.5


def test_grids_fitted_in_chunks_equal_one_pass_over_every_group(monkeypatch):
    """Chunks of a few groups, the last one short, and 3-dimensional input as the callers pass it."""
    weight = torch.randn(48, 7, 32, generator=torch.Generator().manual_seed(5)) * 0.02
    weight[3, 2] = 0.5  # a group with an outlier, and one all equal
    weight[4, 1] = 0.01
    whole = int4.fit_grids(weight)
    monkeypatch.setattr(int4, "FIT_CHUNK_GROUPS", 5)
    chunked = int4.fit_grids(weight)
    assert chunked[0].shape == whole[0].shape == (48, 7, 1)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])


@pytest.mark.parametrize(("shape", "group_size", "message"), [
    ((64, 256), 96, "group size must be one of (32, 64, 128), got 96"),
    ((64, 576), 128, "in_features 576, not divisible by the group size 128 (group sizes that divide it: 32, 64)"),
    ((100, 256), 64, "out_features 100; the packed CPU kernel takes multiples of 16"),
    ((64, 200), 32, "in_features 200, not divisible by the group size 32 (group sizes that divide it: none of"),
])
def test_bad_shapes_are_a_value_error_naming_the_problem(shape: tuple[int, int], group_size: int, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        quantize_int4(torch.randn(*shape), group_size)
    if group_size in GROUP_SIZES:  # a shape problem names the layer
        with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj has"):
            check_int4_shape(*shape, group_size, name="model.layers.0.mlp.down_proj")


def test_bad_inputs_are_a_value_error():
    with pytest.raises(ValueError, match="expected a float weight"):
        quantize_int4(torch.randn(256), 32)
    w = quantize_int4(torch.randn(64, 256), 32)
    with pytest.raises(ValueError, match=r"expected x \[..., 256\]"):
        int4_linear(torch.randn(3, 128), w)
    with pytest.raises(ValueError, match="expected x"):
        int4_linear(torch.ones(3, 256, dtype=torch.int32), w)
    with pytest.raises(ValueError, match=r"awq: activations \(8, 128\) do not feed a weight \(64, 256\)"):
        awq_search_scales(torch.randn(64, 256), torch.randn(8, 128), 32)


def output_error(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int) -> float:
    """Mean squared error of the quantized layer (x / s) @ Q(W * s).T against x @ W.T."""
    quantized = fake_quantize_int4(weight * scales, group_size) / scales
    return (x @ quantized.T - x @ weight.T).pow(2).mean().item()


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_awq_scales_reduce_the_output_error_with_outlier_channels(group_size: int):
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(64, 256, generator=gen) * 0.05
    x = torch.randn(128, 256, generator=gen)
    x[:, [3, 77, 130, 201]] *= 30  # a few outlier input channels, as after an RMSNorm in an LLM
    plain = output_error(x, weight, torch.ones(256), group_size)
    scales = awq_search_scales(weight, x, group_size)
    assert scales.shape == (256,)
    assert output_error(x, weight, scales, group_size) < 0.5 * plain  # measured 0.11-0.21


def test_awq_never_increases_the_error_on_its_sample():
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(32, 128, generator=gen), torch.randn(64, 128, generator=gen)
    plain = output_error(x, weight, torch.ones(128), 64)
    assert output_error(x, weight, awq_search_scales(weight, x, 64), 64) <= plain
