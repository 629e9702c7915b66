"""`--quantization-cache` (loader/quantization_cache.py): the second start of a quantized model reads what the
first one quantized, and gets the same modules, tensors and greedy tokens; a changed checkpoint or method is
another entry (a changed checkpoint's replaces the old one); an entry cut short is skipped, quantized again
and rewritten."""

import logging
import os
from pathlib import Path

import pytest
import torch

from sobrio import LLM, SamplingParams
from sobrio.loader.hf import iter_safetensors_weights
from sobrio.loader.quantization_cache import QuantizationCache, cache_folder
from sobrio.models.llama import CausalLM
from sobrio.models.registry import build_model
from tests.model.tiny_checkpoints import write_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [[5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", {})


def model_state(model: torch.nn.Module) -> dict[str, object]:
    """Every module's class and every tensor it holds (buffers, parameters, and the packed weights it keeps
    as plain attributes), by name."""
    state: dict[str, object] = {}
    for name, module in model.named_modules():
        state[f"{name}:class"] = type(module).__name__
        for key, value in [*module._buffers.items(), *module._parameters.items(), *vars(module).items()]:
            if isinstance(value, torch.Tensor):
                state[f"{name}.{key}"] = value
            elif hasattr(value, "__dataclass_fields__"):  # VnniCodes, Int4Weight, ...
                state |= {f"{name}.{key}.{k}": v for k, v in vars(value).items() if isinstance(v, torch.Tensor)}
    return state


def assert_same_state(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[name].dtype and torch.equal(value, b[name]), name
        else:
            assert value == b[name], name


def test_second_start_reads_the_cache_same_tokens_same_tensors(folder, tmp_path, monkeypatch):
    kwargs = dict(quantization="int8", quantization_cache=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20,
                  max_model_len=256)
    with LLM(str(folder), **kwargs) as first:
        expected = first.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        expected_state = model_state(first.engine.runner.model)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1

    def no_quantizing(*args, **kwargs):
        raise AssertionError("quantized again despite the cache")

    monkeypatch.setattr(CausalLM, "quantize", no_quantizing)
    with LLM(str(folder), **kwargs) as second:
        assert second.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert_same_state(model_state(second.engine.runner.model), expected_state)


def build(folder: Path, method: str, cache: QuantizationCache) -> CausalLM:
    """The tiny model quantized by `method` without calibration (quick), through `cache`."""
    from transformers import AutoConfig

    return build_model(AutoConfig.from_pretrained(folder), 256, iter_safetensors_weights(folder), torch.float32, "auto",
                       quantization=method, calibration_ids=[], quantization_cache=cache)


@pytest.mark.parametrize("method", ["int4", "int8-weight-only"])
def test_entry_gives_identical_packed_tensors_and_changes_with_the_checkpoint_and_method(folder, tmp_path, method):
    cache = QuantizationCache.for_model(str(tmp_path), folder, method, torch.float32, [])
    assert cache.read() is None
    expected = model_state(build(folder, method, cache))
    assert cache.path.is_file() and not list(tmp_path.glob(".*.tmp"))  # written whole, renamed into place
    assert_same_state(model_state(build(folder, method, cache)), expected)

    other_method = QuantizationCache.for_model(str(tmp_path), folder, "int8", torch.float32, [])
    assert other_method.path != cache.path and other_method.read() is None
    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the same bytes, touched
    try:
        touched = QuantizationCache.for_model(str(tmp_path), folder, method, torch.float32, [])
        assert touched.path != cache.path and touched.read() is None
        assert_same_state(model_state(build(folder, method, touched)), expected)  # the same bytes, quantized again
        assert touched.path.is_file() and not cache.path.exists()  # the entry it replaces is removed
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_cut_short_entry_is_quantized_again_and_rewritten(folder, tmp_path, caplog, monkeypatch):
    cache = QuantizationCache.for_model(str(tmp_path), folder, "int4", torch.float32, [])
    expected = model_state(build(folder, "int4", cache))
    size = cache.path.stat().st_size
    with open(cache.path, "r+b") as f:
        f.truncate(size - 100)
    quantized, real = [], CausalLM.quantize
    monkeypatch.setattr(CausalLM, "quantize", lambda self, *a: (quantized.append(1), real(self, *a))[1])
    with caplog.at_level(logging.WARNING, "sobrio.loader.quantization_cache"):
        assert_same_state(model_state(build(folder, "int4", cache)), expected)
    assert quantized == [1]
    assert "unusable" in caplog.text and "quantizing again" in caplog.text
    assert cache.path.stat().st_size == size


def test_the_flag_names_a_folder_or_turns_the_cache_off(tmp_path, monkeypatch):
    assert cache_folder("off") is None
    assert cache_folder(str(tmp_path)) == tmp_path
    monkeypatch.delenv("SOBRIO_QUANTIZATION_CACHE", raising=False)
    monkeypatch.setenv("SOBRIO_CACHE", str(tmp_path))
    assert cache_folder("auto") == tmp_path / "quantized"  # the default: under sobrio's cache
    monkeypatch.setenv("SOBRIO_QUANTIZATION_CACHE", "off")
    assert cache_folder("auto") is None


@pytest.mark.parametrize("model_type, method", [("qwen3_moe", "int8-weight-only"), ("mixtral", "int4")])
def test_a_mixture_of_experts_second_start_reads_its_experts_from_the_cache(model_type, method, tmp_path,
                                                                             monkeypatch):
    """The experts' quantized matrices (lists of modules on each layer's `FusedExperts`) are in the entry, so a
    second start of an MoE model quantizes nothing (it did at every start: 110 s for two layers of
    Mixtral-8x7B's widths in int4), holds no float stack of experts, and gives the same tensors and tokens."""
    from tests.model.tiny_moe import write_checkpoint as write_moe

    folder = write_moe(model_type, tmp_path / model_type)
    kwargs = dict(quantization=method, quantization_cache=str(tmp_path / "cache"), dtype="float32",
                  kv_cache_memory=16 << 20, max_model_len=256)
    with LLM(str(folder), **kwargs) as first:
        expected = first.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        expected_state = model_state(first.engine.runner.model)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1  # (tiny int8 W8A8 is oneDNN's: not cached)
    monkeypatch.setattr(CausalLM, "quantize", lambda *a, **k: pytest.fail("quantized again despite the cache"))
    with LLM(str(folder), **kwargs) as second:
        model = second.engine.runner.model
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj is None and experts.down_proj is None
        assert len(experts.quantized_gate_up) == len(experts.quantized_down) == experts.num_experts
        assert second.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert_same_state(model_state(model), expected_state)
