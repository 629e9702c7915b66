"""Every supported family, on a tiny random-weight checkpoint written by transformers: greedy output equals
transformers' (float32) over prompts several times the sliding window, with prefix caching and chunked
prefill on; sharded safetensors; an unsupported config field refused at load by name."""


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
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, together):
        assert out.outputs[0].token_ids == hf_greedy(folder, p, MAX_TOKENS), f"{name}, batched: {len(p)} tokens"


def test_longrope_long_factors_past_the_original_context(tmp_path):
    """An engine context past `original_max_position_embeddings` rotates with the long factors, as transformers
    does for a sequence past that length."""
    folder = write_checkpoint(tmp_path, *PHI3_LONG)
    llm = LLM(str(folder), **engine_kwargs(max_num_batched_tokens=32, max_model_len=256))
    long = prompt(100)
    out = llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(folder, long, MAX_TOKENS)

