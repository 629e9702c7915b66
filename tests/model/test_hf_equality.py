"""Greedy output equals transformers token for token, whatever the batching, chunking and block size."""

import pytest
import torch

from sobrio import LLM, SamplingParams
from tests.conftest import engine_kwargs
from tests.model.reference import hf_greedy, mixed_prompts

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)


def _check_against_hf(alias: str, llm: LLM, prompts: list[list[int]]) -> None:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        expected, _ = hf_greedy(alias, tuple(prompt), MAX_TOKENS)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_greedy_matches_transformers(alias, request):
    llm = request.getfixturevalue(alias.split("-")[0])
    prompts = mixed_prompts(llm.get_tokenizer())
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > 350
    if alias == "gemma3-270m":  # its ~700-token prompt: past the sliding window, which the test below checks
        prompts = prompts[:-1]
    _check_against_hf(alias, llm, prompts)


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_logprobs_match_transformers_logits(alias, request):
    """Engine log-probabilities equal log_softmax of transformers' raw logits at every step."""
    llm = request.getfixturevalue(alias.split("-")[0])
    prompts = mixed_prompts(llm.get_tokenizer())[1:6:2]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        _, logits = hf_greedy(alias, tuple(prompt), MAX_TOKENS)
        reference = logits.log_softmax(dim=-1)
        steps = output.outputs[0].logprobs
        for step in (0, 1, len(steps) // 2, len(steps) - 1):
            for token_id, logprob in steps[step].items():
                assert logprob.logprob == pytest.approx(reference[step, token_id].item(), abs=2e-3)
            top = max(steps[step].items(), key=lambda kv: kv[1].logprob)[0]
            assert top == int(reference[step].argmax())


EXHAUSTIVE = pytest.mark.exhaustive  # `make test-exhaustive`: the default run keeps the chunked and uncached ones


@pytest.mark.parametrize("overrides", [
    dict(max_num_batched_tokens=16),
    pytest.param(dict(max_num_seqs=1), marks=EXHAUSTIVE),
    pytest.param(dict(max_num_seqs=8, max_num_batched_tokens=64), marks=EXHAUSTIVE),
    pytest.param(dict(block_size=32), marks=EXHAUSTIVE),
    dict(block_size=16, enable_prefix_caching=False),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_same_output_under_other_schedules(overrides):
    llm = LLM("smollm2-135m", **engine_kwargs(**overrides))
    _check_against_hf("smollm2-135m", llm, mixed_prompts(llm.get_tokenizer()))


def test_gemma_chunked_prefill_and_small_blocks():
    llm = LLM("gemma3-270m", **engine_kwargs(max_num_batched_tokens=16, block_size=32, max_num_seqs=3))
    _check_against_hf("gemma3-270m", llm, mixed_prompts(llm.get_tokenizer())[2:6])


def test_gemma_sliding_window_matches_past_the_window():
    """A prompt longer than Gemma's 512-token window exercises the sliding layers' masks."""
    llm = LLM("gemma3-270m", **engine_kwargs(max_num_batched_tokens=256))
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer("Count with me: " + " ".join(str(i) for i in range(260))).input_ids
    assert len(prompt) > 512
    expected, _ = hf_greedy("gemma3-270m", tuple(prompt), 16)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_bfloat16_chat_answers_arithmetic():
    llm = LLM("smollm2-135m", kv_cache_memory=128 << 20)
    assert llm.engine.runner.dtype in (torch.bfloat16, torch.float32)
    out = llm.chat([{"role": "user", "content": "What is 2 + 2?"}], SamplingParams(temperature=0, max_tokens=40))
    assert "4" in out[0].outputs[0].text
