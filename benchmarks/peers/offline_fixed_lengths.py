"""Offline throughput of one fixed workload through sobrio's `LLM` or vLLM's, so the engines compare
without an HTTP server: 128 requests of 80 random prompt tokens and 128 output tokens (EOS ignored),
at most 32 running at once, greedy; 8 requests first as a warm-up.

    .venv/bin/python benchmarks/peers/offline_fixed_lengths.py sobrio
    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
      .peers/vllm/bin/python benchmarks/peers/offline_fixed_lengths.py vllm PREPARED_FOLDER

`--one-at-a-time` (last argument): 8 requests, one running at a time, as the serving workloads' batch-1
run, so HTTP's cost over the engine shows as a ratio.

PREPARED_FOLDER: the dense safetensors folder sobrio prepares from the GGUF (vllm_server.sh prints how
to find it). Measured 2026-11-30, Xeon with AMX, 2 cores: sobrio 530 and 558 tok/s, vLLM 578 tok/s
(with its torch.compile cache warm; a first vLLM run, compiling inside the timed part, gave 396).
"""

import random
import sys
import time

NUM, PROMPT_LEN, OUTPUT_LEN, MAX_SEQS = 128, 80, 128, 32
if sys.argv[-1] == "--one-at-a-time":
    NUM, MAX_SEQS = 8, 1


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(200, 28000) for _ in range(PROMPT_LEN)] for _ in range(NUM + 8)]  # 8 to warm up


def run_sobrio() -> float:
    import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
    from sobrio import LLM, SamplingParams

    llm = LLM("smollm2-135m", max_num_seqs=MAX_SEQS)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts()]
    return timed(lambda reqs: llm.generate(reqs, params, use_tqdm=False), requests)


def run_vllm(folder: str) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(folder, dtype="bfloat16", max_model_len=2048, max_num_seqs=MAX_SEQS)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    return timed(lambda reqs: llm.generate(reqs, params, use_tqdm=False), requests)


def timed(generate, requests) -> float:
    generate(requests[:8])  # other prompts than the timed ones: no prefix-cache hit
    start = time.perf_counter()
    generate(requests[8:])
    return NUM * OUTPUT_LEN / (time.perf_counter() - start)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    engine = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "sobrio"
    rate = run_sobrio() if engine == "sobrio" else run_vllm(sys.argv[2])
    print(f"{engine} offline {NUM} x ({PROMPT_LEN} in, {OUTPUT_LEN} out), {MAX_SEQS} at once: {rate:.1f} output tok/s")
