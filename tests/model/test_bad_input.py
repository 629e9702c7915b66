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


def _drain(engine) -> dict[str, list]:
    finished: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.setdefault(out.request_id, []).append(out.outputs[0])
    return finished


def _assert_idle(engine) -> None:
    assert all(size == 0 for size in engine.table_sizes().values()), engine.table_sizes()
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


@pytest.mark.parametrize("make_params,param", [
    (lambda: SamplingParams(top_k=2**64), "top_k"),
    (lambda: SamplingParams(seed=2**70), "seed"),
    (lambda: SamplingParams(temperature=float("nan")), "temperature"),
    (lambda: SamplingParams(top_p=float("inf")), "top_p"),
    (lambda: SamplingParams(min_tokens=2**40, max_tokens=None), "min_tokens"),
    (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    (lambda: SamplingParams(stop=["x"] * 17), "stop"),
    (lambda: SamplingParams(max_tokens=True), "max_tokens"),
])
def test_sampling_params_refuse_out_of_range_values(make_params, param):
    with pytest.raises(InvalidRequestError) as err:
        make_params()
    assert err.value.param == param


def test_requests_refused_by_the_engine_leave_nothing_behind(smollm2):
    engine = smollm2.engine
    vocab = engine.hf_config.vocab_size
    bad = [
        ("oov-stop", "hi", SamplingParams(stop_token_ids=[vocab + 5], min_tokens=2), None, "stop_token_ids"),
        ("surrogate", "a\ud800", SamplingParams(), None, "prompt"),
        ("empty-salt", "hi", SamplingParams(), "", "cache_salt"),
        ("huge-text", "x" * (engine.input_processor.max_prompt_chars + 1), SamplingParams(), None, "prompt"),
    ]
    for request_id, prompt, params, salt, param in bad:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(request_id, prompt, params, cache_salt=salt)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError):
        smollm2.chat([{"role": "user", "content": "b\udfff"}], use_tqdm=False)
    # The largest seed with n=2: the second sequence's seed wraps around instead of failing half-added.
    engine.add_request("big-seed", "Hello", SamplingParams(n=2, seed=2**64 - 1, max_tokens=4, temperature=1.0))
    assert [len(c) for c in _drain(engine).values()] == [2]
    _assert_idle(engine)


def test_a_step_that_fails_for_one_request_fails_only_that_one(smollm2, monkeypatch):
    engine = smollm2.engine
    prompts = ["The sea is", "Once upon a time", "Paris is the capital of", "One, two, three,"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in smollm2.generate(prompts, greedy, use_tqdm=False)]
    sampler = engine.core.sampler

    def poisoned(logits, meta):  # any batch holding the poison request raises, as a bad row would
        if poison_ids in meta.prompt_token_ids:
            raise IndexError("poisoned row")
        return sampler(logits, meta)

    poison_ids = smollm2.get_tokenizer()("A request that fails").input_ids
    monkeypatch.setattr(engine.core, "sampler", poisoned)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"healthy-{i}", prompt, greedy)
    engine.add_request("poison", "A request that fails", greedy)
    finished = _drain(engine)
    assert finished["poison"][0].finish_reason == "error"
    assert [finished[f"healthy-{i}"][0].token_ids for i in range(len(prompts))] == alone
    _assert_idle(engine)
