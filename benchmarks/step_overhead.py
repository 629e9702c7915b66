"""Time per engine step and the share spent outside the model's forward pass (scheduling, input
preparation, sampling, detokenizing), for pure decode steps at a given batch size.

    .venv/bin/python benchmarks/step_overhead.py [--batch 64] [--model smollm2-135m] [--quantization gguf]
        [--kv-cache-dtype int8] [--temperature 1.0] [--top-p 1.0] [--top-k 0]
"""

import argparse
import random
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--quantization", default=None, help="as sobrio serve's --quantization (gguf, int4, ...)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as sobrio serve's --kv-cache-dtype (int8, fp8)")
    args = parser.parse_args()
    llm = LLM(args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine, rng = llm.engine, random.Random(0)
    for i in range(args.batch):
        prompt = [rng.randrange(200, 20000) for _ in range(rng.randint(16, 256))]
        engine.add_request(str(i), None, SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                                        top_k=args.top_k, max_tokens=args.steps + 8,
                                                        ignore_eos=True), prompt_token_ids=prompt)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    forward = []
    execute = engine.runner.execute

    def timed(*args):
        start = time.perf_counter()
        result = execute(*args)
        forward.append(time.perf_counter() - start)
        return result

    engine.runner.execute = timed
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) / args.steps
    inside = sum(forward) / len(forward)
    print(f"{args.model} batch {args.batch}: step {step * 1000:.1f} ms, forward {inside * 1000:.1f} ms, "
          f"outside the forward {(step - inside) * 1000:.1f} ms = {(step - inside) / step:.1%} of the step, "
          f"{args.batch / step:.1f} tok/s")


if __name__ == "__main__":
    main()
