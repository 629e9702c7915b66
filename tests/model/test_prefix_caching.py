"""Prefix caching, preemption and parallel sampling never change greedy output and never leak blocks."""

import pytest

from sobrio import LLM, SamplingParams
from tests.conftest import engine_kwargs
from tests.model.reference import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _prompts(tokenizer, block_size: int = 16) -> list[list[int]]:
    system = tokenizer("You are a careful assistant. Answer briefly and precisely. " * 4).input_ids
    prompts = [system + tokenizer(q).input_ids for q in ["What is a cat?", "Name a river.", "Why is the sky blue?"]]
    exact = (system * 3)[: 4 * block_size]  # an exact multiple of the block size
    assert len(exact) % block_size == 0
    return prompts + [exact] + mixed_prompts(tokenizer)[3:6]


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_same_output_with_cache_on_and_off(alias):
    on = LLM(alias, **engine_kwargs(enable_prefix_caching=True))
    prompts = _prompts(on.get_tokenizer())
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = on.generate(batch, GREEDY, use_tqdm=False)
    again = on.generate(batch, GREEDY, use_tqdm=False)  # every prompt now fully cached (but its last token)
    assert all(o.num_cached_tokens == (len(o.prompt_token_ids) - 1) // 16 * 16 for o in again)
    system_blocks = len(prompts[0]) // 16 - 1
    fresh = on.generate({"prompt_token_ids": prompts[0][:-3] + prompts[1][-3:]}, GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens >= system_blocks * 16  # a new question after the shared system prompt
    del on
    off = LLM(alias, **engine_kwargs(enable_prefix_caching=False))
    reference = off.generate(batch, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in reference)
    assert _ids(first) == _ids(reference)
    assert _ids(again) == _ids(reference)


def test_requests_arriving_together_compute_a_shared_prefix_once(smollm2):
    """The second of two prompts sharing 8 blocks waits for the first's prefill and then hits the cache,
    instead of computing the same blocks in the same step; its output does not change."""
    tokenizer = smollm2.get_tokenizer()
    shared = (tokenizer("Shared instructions for every request in this batch. ").input_ids * 20)[:128]
    prompts = [shared + tokenizer(q).input_ids for q in ["Say one.", "Say two.", "Say three."]]
    alone = [smollm2.generate({"prompt_token_ids": p, "cache_salt": f"alone-{i}"}, GREEDY, use_tqdm=False)[0]
             for i, p in enumerate(prompts)]
    together = smollm2.generate([{"prompt_token_ids": p, "cache_salt": "together"} for p in prompts], GREEDY,
                                use_tqdm=False)
    assert together[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 128 for o in together[1:])
    assert _ids(together) == _ids(alone)
    pool = smollm2.engine.scheduler.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)  # nothing held


def test_cache_salts_never_share(smollm2):
    prompt = smollm2.get_tokenizer()("A salted prompt that is long enough to fill a few blocks. " * 3).input_ids
    params = SamplingParams(temperature=0, max_tokens=4)
    a1 = smollm2.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)[0]
    b1 = smollm2.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, params, use_tqdm=False)[0]
    a2 = smollm2.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)[0]
    assert b1.num_cached_tokens == 0 and a2.num_cached_tokens > 0
    assert a1.outputs[0].token_ids == b1.outputs[0].token_ids == a2.outputs[0].token_ids


def test_forced_preemption_same_output_no_leak():
    roomy = LLM("smollm2-135m", **engine_kwargs(enable_prefix_caching=False))
    # A salt each: nothing shared through the cache, so the whole running set needs its own blocks.
    texts = mixed_prompts(roomy.get_tokenizer())[1:6]
    prompts = [{"prompt_token_ids": p, "cache_salt": str(i)} for i, p in enumerate(texts)]
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = _ids(roomy.generate(prompts, params, use_tqdm=False))
    del roomy
    # 24 blocks of 16 = 384 tokens of KV for ~900 tokens of running set: preemption is certain.
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    tight = LLM("smollm2-135m", **engine_kwargs(kv_cache_memory=24 * block_bytes, max_model_len=384))
    assert tight.engine.scheduler.pool.num_blocks == 24
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert _ids(outputs) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    pool = tight.engine.scheduler.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


def test_parallel_sampling_shares_prompt_blocks(smollm2):
    engine = smollm2.engine
    prompt = smollm2.get_tokenizer()("Tell me about the moon and the stars and the sea. " * 4).input_ids
    engine.add_request("par", None, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8),
                       prompt_token_ids=prompt)
    while len(engine.scheduler.running) < 4:
        engine.step()
    tables = [r.block_table for r in engine.scheduler.running]
    shared = (len(prompt) - 1) // 16
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert all(engine.scheduler.pool.blocks[b].ref_count == 4 for b in tables[0][:shared])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_n4_greedy_identical_and_seeded_reproducible(smollm2):
    greedy = smollm2.generate("The best thing about mornings is", SamplingParams(n=4, temperature=0, max_tokens=12),
                              use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1 and len(greedy.outputs) == 4
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    runs = [smollm2.generate("The best thing about mornings is", params, use_tqdm=False)[0] for _ in range(2)]
    assert [c.token_ids for c in runs[0].outputs] == [c.token_ids for c in runs[1].outputs]
    assert len({tuple(c.token_ids) for c in runs[0].outputs}) > 1
