"""`batch_invariant=True`: a greedy request's output is the same alone or in any batch, token for token, in
bf16 (where the default mode differs for about half of such requests), whatever the chunking of prompts
and with the prefix cache warm; and in float32 the mode gives the default mode's (transformers') tokens."""

import pytest

from sobrio import LLM, SamplingParams
from sobrio.layers.cpu_ops import invariant_linear_available
from tests.conftest import engine_kwargs
from tests.model.reference import mixed_prompts

pytestmark = pytest.mark.skipif(not invariant_linear_available(), reason="needs the C++ operators and AVX-512 or AVX2")

SENTENCES = [
    "The cat sat on the warm mat by the window.", "Rivers carry water and sand down to the sea.",
    "In 1905 Einstein published four papers that changed physics.", "A good recipe needs fresh ingredients.",
    "The stock market fell sharply after the announcement.", "Photosynthesis turns light into chemical energy.",
    "She opened the old wooden door and saw", "def add(a, b):\n    return", "The meeting was moved to Thursday.",
    "Mountains form when tectonic plates collide.", "He poured the coffee and read the letter again.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BF16 = dict(dtype="bfloat16", batch_invariant=True, kv_cache_memory=256 << 20, max_model_len=1024)


def prompts(count: int = 16) -> list[str]:
    """Different prompts of 10 to about 110 tokens: 1 to 8 sentences, from a different first sentence. 16: the
    prompts generated alone cost ~1.7 s each on 2 cores, and in the default mode about half of them differ
    batched (32 took the suite's longest fixture, 55 s)."""
    return [" ".join(SENTENCES[(i * 7 + j) % len(SENTENCES)] for j in range(1 + i % 8)) + f" ({i})"
            for i in range(count)]


def greedy(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(texts, GREEDY, use_tqdm=False)]


def mismatches(got: list[list[int]], expected: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt generated alone: one sequence at a time, no prefix cache."""
    llm = LLM("smollm2-135m", max_num_seqs=1, enable_prefix_caching=False, **BF16)
    return greedy(llm, prompts())


def test_a_batch_of_requests_equals_each_alone_then_with_the_prefix_cache_warm(alone):
    llm = LLM("smollm2-135m", **BF16)
    assert mismatches(greedy(llm, prompts()), alone) == []
    assert mismatches(greedy(llm, prompts()), alone) == []  # every prompt now starts from cached blocks


def test_chunked_prefill_beside_decodes_equals_alone(alone):
    """A budget of 32 tokens a step: prompts split into chunks that start at different offsets, each sharing
    its step with other requests' decodes."""
    llm = LLM("smollm2-135m", max_num_batched_tokens=32, **BF16)
    assert mismatches(greedy(llm, prompts()), alone) == []


def test_float32_equals_the_default_mode(smollm2):
    """The default float32 engine (`smollm2`) equals transformers token for token (test_hf_equality); the
    batch-invariant one sums in other orders and must still give the same greedy tokens."""
    llm = LLM("smollm2-135m", **engine_kwargs(batch_invariant=True))
    batch = [{"prompt_token_ids": p} for p in mixed_prompts(llm.get_tokenizer())[:5]]
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = [out.outputs[0].token_ids for out in smollm2.generate(batch, params, use_tqdm=False)]
    assert [out.outputs[0].token_ids for out in llm.generate(batch, params, use_tqdm=False)] == expected
