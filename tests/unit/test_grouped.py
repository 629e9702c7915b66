"""Group-wise int8 weights (GGUF's 5-, 6- and 8-bit blocks): each kernel equals a dequantize-then-matmul
reference on ragged shapes, and the embedding reads the rows the codes stand for."""

import pytest
import torch

from sobrio.layers.cpu_ops import cpu_ops
from sobrio.layers.grouped import GEMV_MAX_ROWS, GroupedCodes, GroupedEmbedding, dequant_mm, grouped_linear


def random_codes(n: int, k: int, group: int, offsets: bool, seed: int = 0) -> GroupedCodes:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.01
    offset = torch.randn(n, k // group, generator=g) * 0.05 if offsets else None
    return GroupedCodes(codes, scales, offset, group)


def reference(x: torch.Tensor, w: GroupedCodes, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.dequantize(torch.float64).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("rows", [1, 3, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3])
@pytest.mark.parametrize("n, k, group, offsets", [(37, 64, 32, False), (50, 96, 16, True), (16, 576, 32, True),
                                                  (3, 32, 32, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_equals_dequantized_reference(rows: int, n: int, k: int, group: int, offsets: bool,
                                             dtype: torch.dtype) -> None:
    w = random_codes(n, k, group, offsets)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    expected = reference(x, w, bias)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    for out in (grouped_linear(x, w, bias), dequant_mm(x, w, bias)):
        assert out.dtype == dtype and out.shape == (rows, n)
        torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_kernel_takes_many_rows_and_a_leading_batch_shape() -> None:
    if cpu_ops() is None or not cpu_ops().grouped_linear_supported():
        pytest.skip("the C++ operators are not built here")
    w = random_codes(40, 64, 32, True, seed=1)
    x = torch.randn(9, 64)
    direct = cpu_ops().grouped_linear(x, w.codes, w.scales, w.offsets, 32, None)
    torch.testing.assert_close(direct.double(), reference(x, w, None), rtol=1e-5, atol=1e-4)
    assert grouped_linear(x.view(3, 3, 64), w).shape == (3, 3, 40)


def test_concat_along_output_channels() -> None:
    a, b = random_codes(16, 64, 32, False, 2), random_codes(8, 64, 32, True, 3)
    fused = GroupedCodes.concat([a, b])
    assert fused.out_features == 24
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_embedding_reads_the_rows_the_codes_stand_for() -> None:
    w = random_codes(100, 64, 16, True, seed=4)
    embed = GroupedEmbedding(w, torch.bfloat16)  # without VNNI; with it, tests/unit/test_vnni.py
    ids = torch.tensor([[3, 99, 0], [7, 7, 50]])
    torch.testing.assert_close(embed(ids).float(), w.dequantize()[ids].bfloat16().float())


def test_bad_group_is_refused() -> None:
    with pytest.raises(AssertionError):
        GroupedCodes(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1), None, 32)
