"""The prefill policy (vLLM's long-prefill threshold and partial-prefill limits) with a fake model runner:
a step that carries decodes never takes more prompt work than the policy allows, and every prompt finishes."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sobrio.config import SchedulerConfig, SobrioConfig
from sobrio.engine.scheduler import Scheduler, SchedulerOutput, is_decode
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request, RequestStatus
from tests.unit.test_block_accounting import check_invariants, policies, policy_config


def make_request(request_id: str, prompt_len: int, max_tokens: int, rng: random.Random) -> Request:
    prompt = [rng.randrange(1, 50) for _ in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset())


def check_policy(config: SchedulerConfig, out: SchedulerOutput, decoding: set[str], remaining: dict[str, int]) -> None:
    """`decoding`: ids of the running requests that were decoding before the step; `remaining`: tokens each
    scheduled request had left to compute then. Everything else scheduled is prompt work."""
    if not any(req.request_id in decoding for req, _ in out.scheduled):
        return  # no decode waits on this step: only the token budget applies
    threshold = config.long_prefill_token_threshold
    prompts = [(req, n) for req, n in out.scheduled if req.request_id not in decoding]
    assert len(prompts) <= config.max_num_partial_prefills
    assert sum(0 < threshold < remaining[req.request_id] for req, _ in prompts) <= config.max_long_partial_prefills
    if config.max_prompt_tokens_with_decodes:
        assert sum(n for _, n in prompts) <= config.max_prompt_tokens_with_decodes
    if threshold:
        assert all(n <= threshold for _, n in prompts)
        assert sum(n for _, n in prompts) <= config.max_num_partial_prefills * threshold


def policy_step(sched: Scheduler, rng: random.Random) -> SchedulerOutput:
    """One step of a fake runner that checks the policy and the block invariants."""
    decoding = {r.request_id for r in sched.running if is_decode(r)}
    out = sched.schedule()
    remaining = {r.request_id: r.num_tokens - r.num_computed_tokens for r, _ in out.scheduled}
    assert out.num_batched_tokens <= sched.scheduler_config.max_num_batched_tokens
    check_policy(sched.scheduler_config, out, decoding, remaining)
    check_invariants(sched)
    for req in sched.update_after_step(out):
        sched.append_token(req, rng.randrange(1, 50))
    return out


def drain(sched: Scheduler, rng: random.Random, max_steps: int = 5000) -> int:
    for step in range(max_steps):
        if not sched.has_unfinished():
            return step
        policy_step(sched, rng)
    raise AssertionError("a request starved: the scheduler did not drain")


@settings(max_examples=60, deadline=None)
@given(policy=policies, budget=st.integers(4, 96), num_blocks=st.integers(12, 64), prefix_caching=st.booleans(),
       arrivals=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 60), st.integers(1, 12)), min_size=1,
                         max_size=24))
def test_random_policies_bound_decode_steps_and_drain(policy, budget, num_blocks, prefix_caching, arrivals):
    config = policy_config(policy, max_num_seqs=6, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    sched = Scheduler(config, num_blocks)
    rng = random.Random(0)
    reqs = []
    for gap, prompt_len, max_tokens in arrivals:  # arrive between steps, while others decode
        for _ in range(gap):
            policy_step(sched, rng)
        prompt_len = min(prompt_len, num_blocks * 8 - max_tokens)
        reqs.append(make_request(str(len(reqs)), prompt_len, max_tokens, rng))
        sched.add_request(reqs[-1])
    drain(sched, rng)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert sched.pool.num_free == num_blocks


def decoding_scheduler(**policy) -> tuple[Scheduler, random.Random]:
    """A scheduler with one request decoding, so every following step carries a decode."""
    config = SobrioConfig.from_kwargs(block_size=8, max_num_seqs=8, max_num_batched_tokens=512, **policy)
    sched, rng = Scheduler(config, num_blocks=256), random.Random(0)
    sched.add_request(make_request("decoder", 4, 200, rng))
    policy_step(sched, rng)
    return sched, rng


def chunks(out: SchedulerOutput) -> dict[str, int]:
    return {req.request_id: n for req, n in out.scheduled}


def test_long_prompt_is_chunked_beside_decodes_and_not_alone():
    sched, rng = decoding_scheduler(long_prefill_token_threshold=64)
    sched.add_request(make_request("long", 300, 2, rng))
    assert chunks(policy_step(sched, rng)) == {"decoder": 1, "long": 64}
    alone = Scheduler(sched.config, num_blocks=256)
    alone.add_request(make_request("long", 300, 2, rng))
    assert chunks(policy_step(alone, rng)) == {"long": 300}  # no decode waits: the whole budget


def test_short_prompt_passes_a_long_one_when_the_long_slot_is_taken():
    sched, rng = decoding_scheduler(long_prefill_token_threshold=64, max_num_partial_prefills=2,
                                    max_long_partial_prefills=1)
    for request_id, length in [("long1", 300), ("long2", 300), ("short", 40)]:
        sched.add_request(make_request(request_id, length, 2, rng))
    assert chunks(policy_step(sched, rng)) == {"decoder": 1, "long1": 64, "short": 40}
    assert [r.request_id for r in sched.waiting] == ["long2"]  # it keeps its place at the head
    assert not sched.waiting[0].block_table  # and holds no blocks while it waits
    for _ in range(12):  # long1: 5 chunks, then long2: 5 chunks and 2 tokens
        policy_step(sched, rng)
    assert set(sched.requests) == {"decoder"}


def test_partial_prefills_bound_how_many_prompts_advance():
    sched, rng = decoding_scheduler(long_prefill_token_threshold=32, max_num_partial_prefills=1,
                                    max_long_partial_prefills=1)
    for request_id in ("a", "b"):
        sched.add_request(make_request(request_id, 70, 2, rng))
    seen = [chunks(policy_step(sched, rng)) for _ in range(4)]
    assert seen[:3] == [{"decoder": 1, "a": 32}, {"decoder": 1, "a": 32}, {"decoder": 1, "a": 6}]
    assert seen[3] == {"decoder": 1, "a": 1, "b": 32}  # a decodes; b starts once a's prompt is done


def test_prompts_share_the_token_cap_of_a_step_with_decodes():
    sched, rng = decoding_scheduler(long_prefill_token_threshold=64, max_num_partial_prefills=4,
                                    max_long_partial_prefills=2, max_prompt_tokens_with_decodes=80)
    for request_id, length in [("a", 50), ("b", 50), ("c", 50)]:
        sched.add_request(make_request(request_id, length, 2, rng))
    assert chunks(policy_step(sched, rng)) == {"decoder": 1, "a": 50, "b": 30}
    assert [r.request_id for r in sched.waiting] == ["c"]  # no tokens left for it: it waits, holding nothing
    assert not sched.waiting[0].block_table


def test_no_threshold_leaves_chunks_to_the_budget():
    sched, rng = decoding_scheduler(long_prefill_token_threshold=0, max_num_partial_prefills=8,
                                    max_long_partial_prefills=8, max_prompt_tokens_with_decodes=0)
    sched.add_request(make_request("long", 600, 2, rng))
    assert chunks(policy_step(sched, rng)) == {"decoder": 1, "long": 511}


@pytest.mark.parametrize("policy", [dict(long_prefill_token_threshold=-1), dict(max_num_partial_prefills=0),
                                    dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
                                    dict(max_long_partial_prefills=0), dict(max_prompt_tokens_with_decodes=-1)])
def test_bad_policy_values_raise(policy):
    with pytest.raises(ValueError):
        SchedulerConfig(**policy)
