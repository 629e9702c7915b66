"""What `--batch-invariant` buys and costs, in bf16: how many of N different greedy requests give another
output when sent together than when sent alone, in the default mode and in the batch-invariant one; and
decode tokens/s at batch 1 and 32 in both modes.

    .venv/bin/python benchmarks/batch_invariance.py [--requests 64] [--max-tokens 24] [--steps 16] [--threads N]

`--requests 0` times decode only. On a machine whose cores other work holds, every multi-threaded matmul
waits for a descheduled thread; `--threads 1` shows the kernels' own cost there.
"""

import argparse

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.bench.roofline import decode_step_time  # noqa: E402

SENTENCES = [
    "The cat sat on the warm mat by the window.", "Rivers carry water and sand down to the sea.",
    "In 1905 Einstein published four papers that changed physics.", "A good recipe needs fresh ingredients.",
    "The stock market fell sharply after the announcement.", "Photosynthesis turns light into chemical energy.",
    "She opened the old wooden door and saw", "def add(a, b):\n    return", "The meeting was moved to Thursday.",
    "Mountains form when tectonic plates collide.", "He poured the coffee and read the letter again.",
]


def prompts(count: int) -> list[str]:
    return [" ".join(SENTENCES[(i * 7 + j) % len(SENTENCES)] for j in range(1 + i % 8)) + f" ({i})"
            for i in range(count)]


def divergence(llm: LLM, texts: list[str], max_tokens: int) -> int:
    """How many requests' greedy tokens differ between one generate call for all and one call each."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    together = [out.outputs[0].token_ids for out in llm.generate(texts, params, use_tqdm=False)]
    alone = [llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids for text in texts]
    return sum(a != b for a, b in zip(together, alone))


def decode_rate(llm: LLM, batch: int, steps: int) -> float:
    """Decode tokens/s at `batch` running requests (`sobrio bench roofline`'s step timing)."""
    step_time = decode_step_time(llm, batch, prompt_len=96, steps=steps)[0]
    return batch / step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    texts, rates = prompts(args.requests), {}
    for invariant in (False, True):
        llm = LLM(args.model, dtype="bfloat16", batch_invariant=invariant, kv_cache_memory=512 << 20,
                  max_model_len=1024, num_threads=args.threads)
        mode = "batch-invariant" if invariant else "default"
        if texts:
            differ = divergence(llm, texts, args.max_tokens)
            print(f"{mode:>15}: {differ}/{len(texts)} greedy outputs differ together vs alone "
                  f"({args.max_tokens} tokens each)", flush=True)
        for batch in (1, 32):
            rates[invariant, batch] = decode_rate(llm, batch, args.steps)
            print(f"{mode:>15}: decode at batch {batch:2}: {rates[invariant, batch]:7.1f} tok/s", flush=True)
        del llm
    for batch in (1, 32):
        print(f"batch {batch:2}: batch-invariant / default = {rates[True, batch] / rates[False, batch]:.2f}")


if __name__ == "__main__":
    main()
