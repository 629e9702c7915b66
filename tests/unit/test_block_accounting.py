"""Scheduler and block pool under random add / step / abort sequences, with a fake model runner."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from sobrio.config import SobrioConfig
from sobrio.engine.scheduler import Scheduler
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request, RequestStatus


def check_invariants(sched: Scheduler) -> None:
    """Each block's reference count equals the block tables holding it; free blocks are exactly ref 0."""
    owners: dict[int, int] = {}
    live = sched.running + [r for r in sched.waiting if r.block_table]
    for req in live:
        assert len(set(req.block_table)) == len(req.block_table), "a request owns a block twice"
        assert len(req.block_table) * sched.pool.block_size >= req.num_computed_tokens
        for block_id in req.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block in sched.pool.blocks:
        assert block.ref_count == owners.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in sched.pool.free)
    assert len(sched.running) <= sched.scheduler_config.max_num_seqs


def fake_step(sched: Scheduler, rng: random.Random, vocab: int) -> None:
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.scheduler_config.max_num_batched_tokens
    check_invariants(sched)
    for req in sched.update_after_step(out):
        sched.append_token(req, rng.randrange(vocab))


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 10_000)),
               min_size=1, max_size=80)


# (long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills,
#  max_prompt_tokens_with_decodes); 0: no cap
policies = st.integers(1, 4).flatmap(lambda partial: st.tuples(
    st.sampled_from([0, 1, 3, 4, 8, 13, 16, 32, 40]), st.just(partial), st.integers(1, partial),
    st.sampled_from([0, 5, 24, 64])))


def policy_config(policy: tuple[int, int, int, int], **kwargs) -> SobrioConfig:
    """A small-block config with one draw of `policies` as its prefill policy."""
    threshold, partial, long, tokens = policy
    return SobrioConfig.from_kwargs(block_size=8, long_prefill_token_threshold=threshold,
                                    max_num_partial_prefills=partial, max_long_partial_prefills=long,
                                    max_prompt_tokens_with_decodes=tokens, **kwargs)


@settings(max_examples=60, deadline=None)
@given(ops=ops, prefix_caching=st.booleans(), num_blocks=st.integers(8, 40), budget=st.integers(4, 64),
       policy=policies)
def test_random_add_step_abort_leaks_nothing(ops, prefix_caching, num_blocks, budget, policy):
    config = policy_config(policy, max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    sched = Scheduler(config, num_blocks)
    rng = random.Random(0)
    shared_prefix = [rng.randrange(50) for _ in range(20)]
    ids = 0
    for op, arg in ops:
        if op == "add":
            prompt = (shared_prefix[: arg % 21] + [rng.randrange(50) for _ in range(1 + arg % 13)])
            max_len = num_blocks * 8
            max_tokens = max(1, min(1 + arg % 17, max_len - len(prompt)))
            sched.add_request(Request(str(ids), prompt, SamplingParams(max_tokens=max_tokens), max_tokens,
                                      frozenset({0})))
            ids += 1
        elif op == "abort" and ids:
            sched.abort(str(arg % ids))
        else:
            fake_step(sched, rng, 50)
        check_invariants(sched)
    for _ in range(2000):  # drain: every request must finish
        if not sched.has_unfinished():
            break
        fake_step(sched, rng, 50)
    assert not sched.has_unfinished()
    assert sched.pool.num_free == num_blocks
    assert all(b.ref_count == 0 for b in sched.pool.blocks)


def test_preemption_frees_newest_and_recomputes():
    config = SobrioConfig.from_kwargs(block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                                      enable_prefix_caching=False)
    sched = Scheduler(config, num_blocks=4)
    reqs = [Request(str(i), list(range(1, 13)), SamplingParams(max_tokens=12), 12, frozenset()) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    rng = random.Random(1)
    while sched.has_unfinished():
        fake_step(sched, rng, 50)
    assert sched.num_preemptions >= 1
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 12 for r in reqs)
    assert sched.pool.num_free == 4


def test_prefix_hits_share_blocks_and_salts_isolate():
    config = SobrioConfig.from_kwargs(block_size=8, max_num_batched_tokens=256)
    sched = Scheduler(config, num_blocks=32)
    prompt = list(range(1, 30))
    first = Request("a", prompt, SamplingParams(max_tokens=2), 2, frozenset())
    sched.add_request(first)
    while sched.has_unfinished():
        fake_step(sched, random.Random(0), 50)
    same = Request("b", prompt, SamplingParams(max_tokens=2), 2, frozenset())
    other_salt = Request("c", prompt, SamplingParams(max_tokens=2), 2, frozenset(), cache_salt="tenant-2")
    sched.add_request(same)
    sched.add_request(other_salt)
    sched.schedule()
    assert same.num_cached_tokens == 24  # three full blocks of 8; the last token is always recomputed
    assert other_salt.num_cached_tokens == 0
    assert not set(same.block_table) & set(other_salt.block_table)
