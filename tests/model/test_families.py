"""Every supported family, on a tiny random-weight checkpoint written by transformers: greedy output equals
transformers' (float32) over prompts several times the sliding window, with prefix caching and chunked
prefill on; sharded safetensors; an unsupported config field refused at load by name."""


import json

import pytest

from sobrio import LLM, SamplingParams
from tests.conftest import engine_kwargs
from tests.model.tiny_checkpoints import (
    EXHAUSTIVE_FAMILIES,
    FAMILIES,
    PHI3_LONG,
    WINDOW,
    hf_greedy,
    prompt,
    write_checkpoint,
)
from tests.model.tiny_gguf import write_gguf

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
ALL = [*FAMILIES, *(pytest.param(f, marks=pytest.mark.exhaustive) for f in EXHAUSTIVE_FAMILIES)]


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 64-token prefix (a prefix-cache hit for the second), ~5 windows long, and a
    short one."""
    long = prompt(5 * WINDOW - 3, seed=1)
    return [long, long[:64] + prompt(40, seed=2), prompt(7, seed=3)]


@pytest.fixture(scope="module", params=ALL)
def family(request, tmp_path_factory):
    model_type, fields = {**FAMILIES, **EXHAUSTIVE_FAMILIES}[request.param]
    folder = write_checkpoint(tmp_path_factory.mktemp(request.param), model_type, fields)
    return request.param, folder


def test_greedy_equals_transformers(family):
    name, folder = family
    llm = LLM(str(folder), **engine_kwargs(max_num_batched_tokens=32, block_size=16, enable_prefix_caching=True,
                                           max_model_len=256))
    prompts = _prompts()
    for p in prompts:  # one at a time first (the second hits the first's cached prefix), then all together
        out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(folder, p, MAX_TOKENS), f"{name}: {len(p)}-token prompt"
    assert_batched_greedy_equals_transformers(llm, folder, prompts, f"{name}, batched")


def assert_batched_greedy_equals_transformers(llm, folder, prompts: list[list[int]], what: str) -> None:
    """All `prompts` in one `generate`: each one's greedy tokens are transformers'."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(folder, p, MAX_TOKENS), f"{what}: {len(p)} tokens"


def test_longrope_long_factors_past_the_original_context(tmp_path):
    """An engine context past `original_max_position_embeddings` rotates with the long factors, as transformers
    does for a sequence past that length."""
    folder = write_checkpoint(tmp_path, *PHI3_LONG)
    llm = LLM(str(folder), **engine_kwargs(max_num_batched_tokens=32, max_model_len=256))
    long = prompt(100)
    out = llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(folder, long, MAX_TOKENS)


def test_sliding_window_decode_holds_window_sized_kv(tmp_path):
    """Long Mistral decodes free the blocks behind the window as they go: the blocks in use stay bounded by
    the window, not the context, so two 240-token sequences run in a pool of 24 blocks (30 without freeing)
    without preemption, reusing each other's freed blocks, and still equal transformers (prefix caching on)."""
    folder = write_checkpoint(tmp_path, *FAMILIES["mistral-window"])
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2  # (k, v) x block x kv heads x head dim x float32 x layers
    llm = LLM(str(folder), **engine_kwargs(block_size=16, kv_cache_memory=24 * block_bytes, max_model_len=384,
                                           enable_prefix_caching=True))
    scheduler = llm.engine.scheduler
    pool, schedule, held = scheduler.pool, scheduler.schedule, []
    assert pool.num_blocks == 24

    def counting_schedule():
        out = schedule()
        held.append(pool.num_blocks - pool.num_free)
        return out

    scheduler.schedule = counting_schedule
    prompts = [prompt(40, seed=4), prompt(40, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    bound = 2 * (-(-WINDOW // 16) + 1)  # per sequence: the window's blocks, a partial one at each end
    assert len(held) > 150 and max(held[5:]) <= bound, f"blocks in use grew with the context: {max(held)}"
    assert scheduler.num_preemptions == 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(folder, p, 200, ignore_eos=True)
    assert pool.num_free == pool.num_blocks  # nothing leaked, nothing released twice


@pytest.mark.parametrize("model_type, edits, field", [
    ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}},
     "rope_scaling.rope_type"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen3", {"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("mistral", {"hidden_act": "relu"}, "hidden_act"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_config_field_is_refused_by_name(model_type, edits, field, tmp_path):
    """A checkpoint whose config asks for something sobrio does not compute never loads (it would answer
    wrong): the error names the field."""
    folder = write_checkpoint(tmp_path, model_type, {})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(str(folder), **engine_kwargs(max_model_len=256))


def test_sharded_safetensors_with_tied_head(tmp_path):
    """A checkpoint in several safetensors shards (with their index json) and a head tied to the embedding."""
    folder = write_checkpoint(tmp_path, "qwen3", {"tie_word_embeddings": True}, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2 and (folder / "model.safetensors.index.json").is_file()
    llm = LLM(str(folder), **engine_kwargs(max_model_len=256))
    long = prompt(50)
    out = llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(folder, long, MAX_TOKENS)


def test_tensor_parallelism_refuses_fused_checkpoints(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused, which the rank sharding does not cut: refused, not mis-split."""
    folder = write_checkpoint(tmp_path, "phi3", {})
    with pytest.raises(ValueError, match="tensor parallelism does not split Phi-3"):
        LLM(str(folder), **engine_kwargs(max_model_len=256, tensor_parallel_size=2))


GGUF_FAMILIES = {  # llama.cpp's files carry no Qwen2 window nor Gemma 2's query_pre_attn_scalar (the head size)
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": FAMILIES["qwen3-qk-norm"],
    "gemma2-softcap": ("gemma2", {**FAMILIES["gemma2-softcap"][1], "query_pre_attn_scalar": 16}),
    "phi3-longrope-partial": FAMILIES["phi3-longrope-partial"],
    "glm4-partial-rotary": FAMILIES["glm4-partial-rotary"],  # config and tokenizer read by sobrio, not transformers
}


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_of_the_same_weights_answers_alike(name, tmp_path, monkeypatch):
    """The checkpoint's weights written as a GGUF (llama.cpp's names and metadata, the `gguf` package): loaded
    through sobrio's GGUF path, greedy output equals transformers on the safetensors folder."""
    monkeypatch.setenv("SOBRIO_CACHE", str(tmp_path / "cache"))
    folder = write_checkpoint(tmp_path / "hf", *GGUF_FAMILIES[name])
    path = write_gguf(folder, tmp_path / f"{name}.gguf")
    llm = LLM(str(path), **engine_kwargs(max_model_len=256, max_num_batched_tokens=32))
    long = prompt(5 * WINDOW - 3)
    out = llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(folder, long, MAX_TOKENS)


def test_gguf_of_an_unread_architecture_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "m.gguf"), "starcoder2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'starcoder2'"):
        LLM(str(tmp_path / "m.gguf"), **engine_kwargs())


@pytest.mark.exhaustive
@pytest.mark.parametrize("backend", ["batched", "reference"])
@pytest.mark.parametrize("name", ["mistral-window", "gemma2-softcap", "qwen2-window-bias"])
def test_every_attention_backend_honours_the_window(name, backend, tmp_path):
    """The PyTorch backends (the default run takes the C++ one): windows and softcaps in prompt chunks,
    prefix hits and batched decode."""
    folder = write_checkpoint(tmp_path, *FAMILIES[name])
    llm = LLM(str(folder), **engine_kwargs(max_num_batched_tokens=32, max_model_len=256, attention_backend=backend))
    assert_batched_greedy_equals_transformers(llm, folder, _prompts(), f"{name}, {backend}")


def test_batch_invariance_takes_an_attention_softcap(tmp_path):
    """Gemma 2's softcap under `--batch-invariant` (every row through the C++ decode kernel, which caps):
    transformers' greedy tokens, the prompts batched and chunked."""
    folder = write_checkpoint(tmp_path, *FAMILIES["gemma2-softcap"])
    llm = LLM(str(folder), **engine_kwargs(max_num_batched_tokens=32, max_model_len=256, batch_invariant=True))
    assert_batched_greedy_equals_transformers(llm, folder, _prompts(), "gemma2-softcap, batch-invariant")
