"""Bad input raises a typed error with a clear message, and the engine keeps serving others."""

import pytest

from sobrio import LLM, InvalidRequestError, SamplingParams, UnknownModelError


def test_unknown_alias_lists_known_ones():
    with pytest.raises(UnknownModelError) as err:
        LLM("no-such-model")
    assert "smollm2-135m" in str(err.value) and "gemma3-270m" in str(err.value)


def test_bad_requests_fail_alone(smollm2):
    engine = smollm2.engine
    engine.add_request("good-1", "Once upon a time", SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    too_long = list(range(100, 100 + smollm2.engine.max_model_len + 5))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad-1", too_long, SamplingParams())
    assert str(len(too_long)) in str(err.value) and str(engine.max_model_len) in str(err.value)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad-2", "", SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad-3", [], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad-4", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad-5", "hi", SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=1.01)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["good-1"]
    assert len(finished["good-1"].outputs[0].token_ids) == 20
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_abort_frees_blocks(smollm2):
    engine = smollm2.engine
    engine.add_request("to-abort", "A long story begins", SamplingParams(max_tokens=200))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.pool.num_free < engine.scheduler.pool.num_blocks
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
