"""KV-cache dtypes side by side on one model: blocks held by the same memory, and the time of a batch-32
decode step (contexts of 100-400 tokens), best of 3 runs of 20 steps, each dtype in the same process.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--model smollm2-135m] [--dtypes auto,int8,fp8_e4m3]
"""

import argparse
import random
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402


def decode_step_ms(llm: LLM, batch: int, seed: int = 0) -> float:
    engine, rng = llm.engine, random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(200, 20000) for _ in range(rng.randint(100, 400))]
        engine.add_request(str(i), None, SamplingParams(max_tokens=100, ignore_eos=True), prompt_token_ids=prompt)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        best = min(best, (time.perf_counter() - start) / 20)
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="auto,int8,fp8_e4m3")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    args = parser.parse_args()
    print(f"{'kv dtype':10} {'blocks':>7} {'bytes/token':>12} {'decode step ms':>15}")
    for dtype in args.dtypes.split(","):
        llm = LLM(args.model, kv_cache_dtype=dtype, kv_cache_memory=args.kv_cache_memory)
        runner = llm.engine.runner
        ms = decode_step_ms(llm, args.batch)
        print(f"{dtype:10} {runner.num_blocks:7d} {runner.kv_spec.token_bytes:12d} {ms:15.1f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
