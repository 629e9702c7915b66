"""Tensor parallelism: TP=2 (two processes, gloo) gives the greedy tokens of one rank, for both models in fp32;
a rank that dies fails the step at once with ExecutorDeadError."""

import os
import shutil
import signal
import tempfile
import time

import pytest

from sobrio import LLM, SamplingParams
from sobrio.engine.executor import ExecutorDeadError
from tests.conftest import engine_kwargs

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,",
           # long enough for two chunks of prefill at max_num_batched_tokens=64, and a shared prefix with the next
           "Rules: answer briefly and politely. " * 12 + "Question: what is a prime number?",
           "Rules: answer briefly and politely. " * 12 + "Question: why is the sky blue?"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_two_ranks_give_the_tokens_of_one(model, request):
    reference = request.getfixturevalue(model.split("-")[0])  # the session's one-rank engine (fp32)
    expected = tokens(reference.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(model, **engine_kwargs(tensor_parallel_size=2, max_num_batched_tokens=64)) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        # the long prompts one at a time too (decode alone, and the second one's prefix-cache hits)
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS[3:]] == expected[3:]
        # prompt log-probabilities: every rank runs the LM head on the same rows, in the same order
        scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
        scored = llm.generate(PROMPTS[1:2], scoring, use_tqdm=False)
        reference_scored = reference.generate(PROMPTS[1:2], scoring, use_tqdm=False)
        for ours, theirs in zip(scored, reference_scored):
            for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def test_a_rank_that_dies_fails_the_next_step_promptly():
    llm = LLM("smollm2-135m", **engine_kwargs(tensor_parallel_size=2))
    try:
        [worker] = llm.engine.core.executor.workers.processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError):
            llm.generate(["Still there?"], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
    finally:
        llm.close()


def test_ranks_placed_by_a_local_ray_cluster_give_the_same_tokens(smollm2):
    ray = pytest.importorskip("ray")
    folder = tempfile.mkdtemp(prefix="ray-")  # its session files and logs go here, and go with it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=folder)
    try:
        expected = tokens(smollm2.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
        with LLM("smollm2-135m", **engine_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray")) as llm:
            assert any("Ray actor on" in line for line in llm.engine.core.executor.layout())
            assert tokens(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)) == expected
        assert ray.util.placement_group_table() and all(
            pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
