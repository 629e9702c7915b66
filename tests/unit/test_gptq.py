"""GPTQ for int4 (`sobrio/layers/gptq.py`): with inputs that do not correlate it is plain rounding, with
inputs that do it moves the layer's outputs clearly less than plain rounding, an input channel the
calibration never used is rounded without breaking anything, statistics it cannot use give plain rounding,
a model's int4 quantization hands every decoder Linear its statistics, and the factor of H^-1 it rounds with
is the upper Cholesky factor of the damped inverse (computed from one factorization)."""

import torch

from sobrio.layers import gptq
from sobrio.layers.gptq import gptq_quantize
from sobrio.layers.int4 import Int4Codes, quantize_int4_codes


def hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


def output_error(x: torch.Tensor, weight: torch.Tensor, codes: Int4Codes) -> float:
    return (x @ (codes.dequantize() - weight).T).pow(2).mean().item()


def test_with_uncorrelated_inputs_it_is_plain_rounding() -> None:
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    gptq = Int4Codes(*gptq_quantize(weight, torch.eye(128) * 3.0, 32), 32)
    plain = quantize_int4_codes(weight, 32)
    assert torch.equal(gptq.scales_and_zeros, plain.scales_and_zeros)
    assert (gptq.codes != plain.codes).float().mean() < 1e-3  # a tie may round the other way in fp32


def test_with_correlated_inputs_the_outputs_move_less() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 256, generator=gen) * 0.05
    x = torch.randn(1024, 64, generator=gen) @ torch.randn(64, 256, generator=gen)  # rank 64: correlated
    x += 0.1 * torch.randn(1024, 256, generator=gen)
    codes, grids = gptq_quantize(weight, hessian(x), 32)
    assert codes.dtype == torch.int32 and codes.min() >= 0 and codes.max() <= 15
    assert grids.shape == (256 // 32, 64, 2) and grids.dtype == torch.bfloat16
    gptq_error = output_error(x, weight, Int4Codes(codes, grids, 32))
    plain_error = output_error(x, weight, quantize_int4_codes(weight, 32))
    assert gptq_error < 0.5 * plain_error, (gptq_error, plain_error)


def test_an_unused_input_channel_is_rounded_alone() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 64, generator=gen)
    x = torch.randn(200, 64, generator=gen)
    x[:, 5] = 0  # no calibration token used channel 5
    codes = Int4Codes(*gptq_quantize(weight, hessian(x), 32), 32)
    assert torch.isfinite(codes.dequantize()).all()
    step = codes.scales_and_zeros[0, :, 0].float()
    assert ((codes.dequantize()[:, 5] - weight[:, 5]).abs() <= step * 0.51).all()  # on its group's grid


def test_int4_quantization_runs_gptq_on_every_decoder_linear(monkeypatch) -> None:
    """`quantize("int4")` with calibration tokens hands each decoder Linear its Hessian (a name mismatch
    would silently fall back to plain rounding), and the calibrated model stays nearer the float one."""
    from sobrio.layers import quantization
    from tests.unit.test_smoothing import IDS, hidden_states, randomized, tiny_llama

    reference = randomized(tiny_llama())
    expected = hidden_states(reference, IDS)
    calls = []
    real = quantization.gptq_quantize
    monkeypatch.setattr(quantization, "gptq_quantize", lambda *args: calls.append(args[0].shape) or real(*args))
    errors = {}
    for name, ids in (("gptq", IDS), ("plain", [])):
        model = randomized(tiny_llama())
        model.quantize("int4", ids)
        errors[name] = ((hidden_states(model, IDS) - expected).norm() / expected.norm()).item()
        assert len(calls) == 4 * len(model.model.layers)  # qkv, o, gate_up, down of each layer; none for []
    assert errors["gptq"] < errors["plain"], errors


def test_unusable_statistics_fall_back_to_plain_rounding() -> None:
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    plain = quantize_int4_codes(weight, 32)
    for broken in (torch.full((64, 64), float("nan")), -torch.eye(64)):  # not finite; not positive definite
        codes, grids = gptq_quantize(weight, broken, 32)
        assert torch.equal(codes, plain.codes) and torch.equal(grids, plain.scales_and_zeros.bfloat16())


def test_the_inverse_factor_is_the_upper_cholesky_factor_of_the_damped_inverse() -> None:
    """Sizes past the triangular inverse's leaf and not a power of two, so its halves split unevenly."""
    for k in (gptq.TRIANGULAR_LEAF - 8, 3 * gptq.TRIANGULAR_LEAF + 40):
        x = torch.randn(2 * k, k, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        h = hessian(x)
        damped = h + gptq.DAMPING * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)
        expected = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
        got = gptq._inverse_hessian_factor(h.float()).double()
        assert torch.equal(got, got.triu()) and (got.diagonal() > 0).all()
        assert torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item()), k
