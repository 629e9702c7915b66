"""`sobrio bench` builds prompts with a model's tokenizer alone: a .gguf's weights are never prepared for it."""

import pytest

from sobrio.bench.datasets import load_tokenizer
from sobrio.loader import gguf
from sobrio.loader.resolve import is_installed, resolve_model

pytestmark = pytest.mark.skipif(not is_installed("smollm2-135m"), reason="needs the smollm2-135m alias")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SOBRIO_CACHE", str(tmp_path))
    return tmp_path


def test_a_gguf_tokenizer_writes_no_weights(empty_cache):
    path = resolve_model("smollm2-135m").path
    tokenizer = load_tokenizer(str(path))
    assert tokenizer("Hello there", add_special_tokens=False).input_ids
    assert len(tokenizer) > 1000
    assert not list(empty_cache.rglob("model.safetensors")), "preparing the weights is not the client's job"


def test_a_prepared_folder_is_read_first(empty_cache):
    path = resolve_model("smollm2-135m").path
    tokenizer = gguf.gguf_tokenizer(path)
    tokenizer.add_tokens(["<only-in-the-prepared-folder>"])
    tokenizer.save_pretrained(gguf.prepared_path(path))
    assert "<only-in-the-prepared-folder>" in load_tokenizer("smollm2-135m").get_vocab()


def test_an_hf_folder_gives_its_tokenizer(empty_cache):
    path = resolve_model("smollm2-135m").path
    converted = gguf.gguf_tokenizer(path)  # ~7 s: once
    converted.save_pretrained(empty_cache / "hf")
    (empty_cache / "hf" / "config.json").write_text("{}")  # a model folder is known by its config.json
    tokenizer = load_tokenizer(str(empty_cache / "hf"))
    assert tokenizer("Hello").input_ids == converted("Hello").input_ids
