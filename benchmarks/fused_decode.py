"""Decode steps through the fused C++ decoder (models/fused_decode.py) against the same steps through the
modules, in one process, alternating rounds of `--steps` so that both see the same host and contexts.

    .venv/bin/python benchmarks/fused_decode.py [--model M] [--batch 1] [--quantization gguf|none]
        [--kv-cache-dtype int8]

`--quantization none` runs the model in bf16 (oneDNN's packed copies, where the CPU has AVX512-BF16 or AMX).
"""

import argparse
import random
import statistics
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each way")
    parser.add_argument("--quantization", default="gguf", help="gguf, int4, ... or none (bf16)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(args.model, quantization=quantization, kv_cache_dtype=args.kv_cache_dtype,
              **({"dtype": "bfloat16"} if quantization is None else {}))
    engine, rng = llm.engine, random.Random(0)
    model = engine.runner.model.model
    fused = model.fused_decode
    assert fused is not None, "no fused decode for this model and mode (models/fused_decode.py says which)"
    for i in range(args.batch):
        prompt = [rng.randrange(200, 20000) for _ in range(rng.randint(16, 256))]
        engine.add_request(str(i), None, SamplingParams(temperature=0, ignore_eos=True,
                                                        max_tokens=2 * args.rounds * args.steps + 8),
                           prompt_token_ids=prompt)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    times: dict[str, list[float]] = {"fused": [], "modules": []}
    for _ in range(args.rounds):
        for way in times:
            model.fused_decode = fused if way == "fused" else None
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[way].append((time.perf_counter() - start) / args.steps)
    fused_ms, modules_ms = (statistics.median(times[w]) * 1000 for w in ("fused", "modules"))
    print(f"{args.model} --quantization {args.quantization} --kv-cache-dtype {args.kv_cache_dtype} batch "
          f"{args.batch}: decode step (median of {args.rounds} rounds of {args.steps}) modules {modules_ms:.2f} ms, "
          f"fused {fused_ms:.2f} ms: {modules_ms / fused_ms:.2f}x ({args.batch / fused_ms * 1000:.0f} tok/s)")


if __name__ == "__main__":
    main()
