"""A load quantized at start streams its decoder layers (models/registry.py `build_model`'s `reread`): each
layer's float weights are read just before the layer is calibrated and quantized, so only one layer's are
ever in memory beside the quantized ones, and the result is the tensors of a load that read every float
weight first, bit for bit."""

import re
from pathlib import Path

import pytest
import torch

from sobrio.layers.linear import Linear
from sobrio.loader.hf import iter_safetensors_weights, safetensors_elements
from sobrio.models import registry
from sobrio.models.registry import build_model
from tests.model.test_quantization_cache import assert_same_state, model_state
from tests.model.tiny_checkpoints import write_checkpoint

CALIBRATION = list(range(5, 120))  # token ids: the tiny tokenizer's words


def build(folder: Path, method: str, dtype: torch.dtype, streamed: bool):
    from transformers import AutoConfig

    reread = (lambda: iter_safetensors_weights(folder, in_place=True)) if streamed else None
    return build_model(AutoConfig.from_pretrained(folder), 256, iter_safetensors_weights(folder, in_place=True), dtype,
                       "auto", quantization=method, calibration_ids=CALIBRATION, reread=reread)


def plain_state(model: torch.nn.Module) -> dict[str, object]:
    """`model_state` without oneDNN's opaque tensors (tiny W8A8 layers where the CPU has no AMX), which
    cannot be compared; their plain int8 matrices and scales are."""
    def comparable(value) -> bool:
        try:
            return not isinstance(value, torch.Tensor) or value.untyped_storage() is not None
        except (NotImplementedError, RuntimeError):
            return False
    return {name: value for name, value in model_state(model).items() if comparable(value)}


@pytest.mark.parametrize("family, method, dtype", [
    ("llama", "int8", torch.bfloat16), ("llama", "int4", torch.float32), ("gemma2", "int8", torch.float32),
    ("qwen3_moe", "int8-weight-only", torch.bfloat16)])
def test_a_streamed_load_quantizes_to_the_same_tensors(family, method, dtype, tmp_path, monkeypatch):
    if family == "qwen3_moe":
        from tests.model.tiny_moe import write_checkpoint as write_moe

        folder = write_moe(family, tmp_path / family)
    else:
        folder = write_checkpoint(tmp_path / family, family, {"sliding_window": 16} if family == "gemma2" else {})
    expected = plain_state(build(folder, method, dtype, streamed=False))
    filled: list[str] = []
    fill = registry._fill

    def one_layer_at_a_time(model, weights, prefix):
        i = int(prefix.split(".")[2]) if prefix.startswith("model.layers.") else 0  # the untied head: first
        for name, module in model.named_modules():  # the layers before i are quantized, none after is read
            if isinstance(module, Linear) and (layer := re.match(r"model\.layers\.(\d+)\.", name)):
                assert int(layer.group(1)) >= i, f"{name} still float when {prefix} is read"
        fill(model, weights, prefix)
        filled.append(prefix)

    monkeypatch.setattr(registry, "_fill", one_layer_at_a_time)
    model = build(folder, method, dtype, streamed=True)
    head = [] if model.config.tie_word_embeddings else ["lm_head."]
    assert filled == head + [f"model.layers.{i}." for i in range(len(model.model.layers))]
    assert_same_state(plain_state(model), expected)


def peak_growth(build_it) -> tuple[int, torch.nn.Module]:
    """How far this process's peak resident memory rises above its resident memory while `build_it` runs
    (the peak reset first through /proc/self/clear_refs; the heap's free memory given back first, so that
    what the build allocates shows)."""
    from sobrio.memory import release_freed_memory

    def status(field: str) -> int:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    model = build_it()
    return status("VmHWM:") - before, model


def test_a_quantizing_load_peaks_well_below_reading_every_float_weight_first(tmp_path):
    """48 layers of ~7.6 MB in bf16 (~370 MB in all), quantized to int8: the streamed load's peak rises ~0.65x
    the float model's bytes above where it started (the quantized model, one float layer, one layer's float32
    work, first calls' buffers), a load that reads every float weight first ~1.1x (both measured here)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=48,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=4000,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    float_bytes = safetensors_elements(tmp_path)[0] * 2
    whole, _ = peak_growth(lambda: build(tmp_path, "int8", torch.bfloat16, streamed=False))
    streamed, _ = peak_growth(lambda: build(tmp_path, "int8", torch.bfloat16, streamed=True))
    assert streamed < whole - 0.25 * float_bytes and streamed < float_bytes, \
        f"peak rose {streamed / 2**20:.0f} MB streamed, {whole / 2**20:.0f} MB whole, for {float_bytes / 2**20:.0f} MB"
