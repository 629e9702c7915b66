"""Prefix cache: 32 requests sharing a ~1,000-token system prompt, each with its own ~50-token question.
Prints TTFT p50 and total time with the cache on and off, and their ratios.

    .venv/bin/python benchmarks/prefix_cache.py [--model smollm2-135m] [--num-requests 32]
"""

import argparse
import random
import statistics
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402


def make_prompts(tokenizer, count: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = range(200, min(tokenizer.vocab_size, 20000))
    system = [rng.choice(vocab) for _ in range(system_len)]
    return [system + [rng.choice(vocab) for _ in range(question_len)] for _ in range(count)]


def run(args, prompts, caching: bool) -> tuple[float, float, int]:
    llm = LLM(args.model, enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    total = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return statistics.median(ttfts), total, sum(o.num_cached_tokens for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = LLM(args.model).get_tokenizer()
    prompts = make_prompts(tokenizer, args.num_requests, args.system_len, args.question_len, args.seed)
    on_ttft, on_total, cached = run(args, prompts, True)
    off_ttft, off_total, _ = run(args, prompts, False)
    print(f"model={args.model} requests={args.num_requests} system={args.system_len} question={args.question_len} "
          f"output={args.output_len}")
    print(f"cache on : TTFT p50 {on_ttft * 1000:8.1f} ms  total {on_total:6.2f} s  cached prompt tokens {cached}")
    print(f"cache off: TTFT p50 {off_ttft * 1000:8.1f} ms  total {off_total:6.2f} s")
    print(f"ratio off/on: TTFT p50 {off_ttft / on_ttft:.2f}x  total {off_total / on_total:.2f}x")


if __name__ == "__main__":
    main()
