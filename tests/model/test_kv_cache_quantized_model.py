"""SmolLM2 with a quantized KV cache: prompt chunks that read earlier chunks back from an int8 or fp8 cache
score the prompt close to the bf16 cache, and the engine frees every block as usual."""

import pytest

from sobrio import LLM, SamplingParams
from tests.conftest import engine_kwargs

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years printing shops had "
        "spread to more than two hundred cities across Europe, and the price of books fell so far that "
        "scholars, merchants and craftsmen could own them. Pamphlets carried the arguments of the Reformation, "
        "scientists exchanged their observations in print, and standardized spelling slowly took hold. ")


def prompt_scores(kv_cache_dtype: str) -> list[float]:
    """Logprob of each prompt token given the ones before it, the prompt computed in 32-token chunks."""
    llm = LLM("smollm2-135m", **engine_kwargs(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                                              max_num_batched_tokens=32, enable_prefix_caching=False))
    out = llm.generate([TEXT * 2], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert llm.engine.scheduler.pool.num_free == llm.engine.scheduler.pool.num_blocks
    ids = out.prompt_token_ids
    return [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]


@pytest.fixture(scope="module")
def dense_scores() -> list[float]:
    return prompt_scores("auto")


@pytest.mark.parametrize("kv_cache_dtype,mean_tol", [("int8", 0.05), ("fp8_e4m3", 0.1)])
def test_quantized_cache_scores_the_prompt_like_the_dense_one(dense_scores, kv_cache_dtype, mean_tol):
    scores = prompt_scores(kv_cache_dtype)
    assert len(scores) == len(dense_scores) > 150
    diffs = [abs(a - b) for a, b in zip(scores, dense_scores)]
    assert sum(diffs) / len(diffs) < mean_tol, (max(diffs), sum(diffs) / len(diffs))
    assert any(d > 0 for d in diffs[32:]), "chunks after the first read the cache: quantization must show"
