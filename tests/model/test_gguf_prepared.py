"""A GGUF's prepared folder (loader/gguf.py): config and tokenizer always; the float32 weights only once the dense
path reads them, written tensor by tensor; `--quantization gguf` reads the file's own tensors and writes no
float weights (an 8B GGUF's would be 32 GB, in memory at once before); a folder prepared by an older sobrio
(float weights, no mark) still loads. Greedy tokens equal transformers' on the checkpoint the GGUF was made of."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sobrio import LLM, SamplingParams
from sobrio.loader.gguf import iter_gguf_weights
from sobrio.loader.hf import write_safetensors_stream
from sobrio.loader.load import expected_weight_bytes, load_model_files
from sobrio.loader.resolve import FLOAT_WEIGHTS, PREPARED_MARK, core_may_start_first, is_prepared, prepared_path
from tests.conftest import engine_kwargs
from tests.model.tiny_checkpoints import FAMILIES, hf_greedy, prompt, write_checkpoint
from tests.model.tiny_gguf import write_gguf

MAX_TOKENS = 12
KWARGS = engine_kwargs(max_model_len=256, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, list[int], list[int]]:
    """A tiny Qwen3's GGUF (float32 tensors, so every path is exact), a prompt and transformers' greedy tokens."""
    tmp = tmp_path_factory.mktemp("gguf-prepared")
    folder = write_checkpoint(tmp / "hf", *FAMILIES["qwen3-qk-norm"])
    ids = prompt(40)
    return str(write_gguf(folder, tmp / "tiny.gguf")), ids, hf_greedy(folder, ids, MAX_TOKENS)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SOBRIO_CACHE", str(tmp_path))  # a prepared folder of this test's own
    return tmp_path


def greedy(llm: LLM, ids: list[int]) -> list[int]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_a_packed_load_writes_no_float_weights(tiny, cache):
    path, ids, expected = tiny
    assert not core_may_start_first(path, "gguf")  # nothing prepared: the front prepares first
    assert greedy(LLM(path, quantization="gguf", **KWARGS), ids) == expected
    folder = prepared_path(Path(path))
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert not list(cache.rglob("*.safetensors*")), "the packed path reads the GGUF: no float weights"
    assert core_may_start_first(path, "gguf") and not core_may_start_first(path, None)


def test_a_dense_load_writes_the_float_weights_once(tiny, cache):
    path, ids, expected = tiny
    assert greedy(LLM(path, **KWARGS), ids) == expected
    files = load_model_files(path, tokenizer=False)
    weights = files.folder / FLOAT_WEIGHTS
    written = load_file(str(weights))
    dequantized = dict(iter_gguf_weights(files.source.path, files.config))
    assert written.keys() == dequantized.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in dequantized.items())
    assert core_may_start_first(path, None)
    sized = expected_weight_bytes(files, 2, None)
    weights.rename(cache / "away")  # sizing before the float weights exist: from the GGUF's tensor table
    assert not is_prepared(files.folder, weights=True)
    assert expected_weight_bytes(files, 2, None) == sized == 2 * sum(t.numel() for t in dequantized.values())


def test_a_folder_prepared_by_an_older_sobrio_still_loads(tiny, cache):
    """Before the mark, a folder was complete when its float weights (written last) were there."""
    path, ids, expected = tiny
    files = load_model_files(path, tokenizer=False)
    (files.folder / PREPARED_MARK).unlink()
    stamp = (files.folder / FLOAT_WEIGHTS).stat().st_mtime_ns
    assert core_may_start_first(path, None) and core_may_start_first(path, "gguf")
    assert greedy(LLM(path, **KWARGS), ids) == expected
    assert (files.folder / FLOAT_WEIGHTS).stat().st_mtime_ns == stamp  # read, not written again
    assert not (files.folder / PREPARED_MARK).exists()


def test_the_streaming_writer_refuses_a_tensor_its_header_does_not_hold(tmp_path):
    specs = [("a", torch.float32, (2, 3)), ("b", torch.float32, (4,))]
    write_safetensors_stream(tmp_path / "ok.safetensors", specs, iter([("a", torch.ones(2, 3)),
                                                                      ("b", torch.zeros(4))]), {})
    assert torch.equal(load_file(str(tmp_path / "ok.safetensors"))["a"], torch.ones(2, 3))
    with pytest.raises(ValueError, match="tensor b"):
        write_safetensors_stream(tmp_path / "bad.safetensors", specs, iter([("a", torch.ones(2, 3)),
                                                                           ("b", torch.zeros(5))]), {})
    with pytest.raises(ValueError, match="tensor b of the header never came"):
        write_safetensors_stream(tmp_path / "short.safetensors", specs, iter([("a", torch.ones(2, 3))]), {})
