"""--scheduling-policy priority orders the waiting queue by (priority, arrival) and preempts the lowest priority;
logit_bias moves the sampler's choice; chat_template_kwargs are refused where they would replace the
template's own arguments."""

import pytest
import torch

from sobrio.config import SobrioConfig
from sobrio.engine.sampling import build_sampling_metadata
from sobrio.engine.scheduler import Scheduler
from sobrio.errors import ConfigError, InvalidRequestError
from sobrio.sample.sampler import Sampler
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request


def _scheduler(policy: str, num_blocks: int = 64, **kwargs) -> Scheduler:
    config = SobrioConfig.from_kwargs(block_size=8, scheduling_policy=policy, enable_prefix_caching=False, **kwargs)
    return Scheduler(config, num_blocks)


def _request(rid: str, priority: int, arrival: float, prompt_len: int = 8, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens,
                   arrival_time=arrival, priority=priority)


def _admission_order(sched: Scheduler) -> list[str]:
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [r.request_id for r, _ in out.scheduled if r.request_id not in order]
        for req in sched.update_after_step(out):
            sched.append_token(req, 7)
    return order


@pytest.mark.parametrize("policy,expected", [("priority", ["b", "d", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])])
def test_waiting_queue_order(policy, expected):
    sched = _scheduler(policy, max_num_seqs=1)
    for rid, priority, arrival in [("a", 5, 1.0), ("b", -1, 2.0), ("c", 2, 3.0), ("d", 2, 2.5)]:
        sched.add_request(_request(rid, priority, arrival))
    assert _admission_order(sched) == expected


def test_priority_preempts_lowest_priority_first():
    # 3 blocks of 8 tokens: two 8-token prompts fit, then both need a second block for their outputs
    sched = _scheduler("priority", num_blocks=3)
    low, high = _request("low", 9, 1.0, max_tokens=8), _request("high", 0, 2.0, max_tokens=8)
    sched.add_request(low)
    sched.add_request(high)
    preempted = []
    for _ in range(6):
        out = sched.schedule()
        preempted += [r.request_id for r in out.preempted]
        for req in sched.update_after_step(out):
            sched.append_token(req, 7)
    assert preempted and set(preempted) == {"low"}  # FCFS would take the newest, "high"


def test_policy_is_checked():
    with pytest.raises(ConfigError, match="scheduling-policy"):
        SobrioConfig.from_kwargs(scheduling_policy="lottery")


def test_logit_bias_moves_greedy_choice_and_is_validated():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    reqs = [Request(str(i), [1], SamplingParams(temperature=0, logit_bias=bias), 4)
            for i, bias in enumerate([{3: 5.0}, None])]
    assert [t.token_id for t in Sampler()(logits, build_sampling_metadata(reqs))] == [3, 0]
    assert logits[0, 3] == -1.0  # the caller's logits are left as they were
    for bad in [{1: 101.0}, {-1: 1.0}, {1: float("nan")}, [1, 2]]:
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.param == "logit_bias"


def test_priority_needs_the_priority_policy():
    from types import SimpleNamespace

    from sobrio.engine.llm_engine import LLMEngine

    fcfs = SimpleNamespace(config=SobrioConfig.from_kwargs())
    LLMEngine._check_priority(fcfs, 0)
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        LLMEngine._check_priority(fcfs, 3)
    LLMEngine._check_priority(SimpleNamespace(config=SobrioConfig.from_kwargs(scheduling_policy="priority")), 3)
