"""The prefill policy only reorders and splits prompt work: greedy output is the same with it as without."""

from dataclasses import replace

import pytest

from sobrio import LLM, SamplingParams
from sobrio.engine.scheduler import is_decode
from tests.conftest import engine_kwargs
from tests.model.reference import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16)
OFF = dict(long_prefill_token_threshold=0, max_num_partial_prefills=64, max_long_partial_prefills=64,
           max_prompt_tokens_with_decodes=0)
TIGHT = dict(long_prefill_token_threshold=32, max_num_partial_prefills=2, max_long_partial_prefills=1,
             max_prompt_tokens_with_decodes=48)


@pytest.fixture(scope="module")
def llm():
    """Prefix caching off, so the second run computes every prompt again, as the first did."""
    return LLM("smollm2-135m", **engine_kwargs(max_num_batched_tokens=128, enable_prefix_caching=False))


def generate(llm: LLM, policy: dict) -> tuple[list[list[int]], list[int]]:
    """Greedy token ids of the mixed prompts, and the prompt tokens of each step that carried decodes."""
    sched, prompt_tokens = llm.engine.scheduler, []
    sched.scheduler_config = replace(sched.scheduler_config, **policy)
    schedule = sched.schedule

    def recording_schedule():
        decoding = {id(r) for r in sched.running if is_decode(r)}
        out = schedule()
        if any(id(r) in decoding for r, _ in out.scheduled):
            prompt_tokens.append(sum(n for r, n in out.scheduled if id(r) not in decoding))
        return out

    sched.schedule = recording_schedule
    try:
        prompts = mixed_prompts(llm.get_tokenizer(), count=7)  # up to 284 tokens
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        del sched.schedule
    return [o.outputs[0].token_ids for o in outputs], prompt_tokens


def test_greedy_output_same_with_and_without_the_policy(llm):
    off, off_prompt_tokens = generate(llm, OFF)
    tight, tight_prompt_tokens = generate(llm, TIGHT)
    assert tight == off
    assert max(off_prompt_tokens) > 64  # without the policy, decodes shared steps with long chunks
    assert max(tight_prompt_tokens) <= 2 * 32 and sum(tight_prompt_tokens) > 0  # with it, they did not
