"""Speculative decoding offline, one request at a time: output tokens per second of each speculative config
against the same engine without drafts, on the same chat prompts, greedy (the outputs must be equal, and the
script says so). Quicker than `benchmarks/spec_decode.sh` (no HTTP, no 32-in-flight run) for choosing a
config; the issue's figures come from that script.

    .venv/bin/python benchmarks/spec_offline.py --model smollm2-135m \\
        --config '{"method": "eagle", "model": "results/eagle-m", "num_speculative_tokens": 3}' \\
        --config '{"method": "eagle", "model": "results/eagle-m", "num_speculative_tokens": 5,
                   "min_draft_confidence": 0.2}'
"""

import argparse
import json
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, conversations: list[list[dict]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for the conversations one at a time (after one warm-up request), and their output ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat(conversations[0], params, use_tqdm=False)
    start, outputs = time.perf_counter(), []
    for messages in conversations:
        outputs.append(list(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids))
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--config", action="append", required=True, help="a --speculative-config JSON (repeatable)")
    parser.add_argument("--prompts", default="benchmarks/data/open_chat_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    with open(args.prompts) as f:
        conversations = [json.loads(line)["messages"] for line in f][:args.num_prompts]
    plain = LLM(args.model, quantization=args.quantization)
    base_seconds, expected = run(plain, conversations, args.max_tokens)
    tokens = sum(len(o) for o in expected)
    print(f"no drafts: {tokens / base_seconds:.1f} tok/s ({tokens} tokens, {base_seconds:.1f} s)")
    del plain
    for config in args.config:
        llm = LLM(args.model, quantization=args.quantization, speculative_config=json.loads(config))
        seconds, outputs = run(llm, conversations, args.max_tokens)
        stats = llm.engine.core.stats()["spec_decode"]
        steps = stats["num_drafts"]
        print(f"{config}: {tokens / seconds:.1f} tok/s ({base_seconds / seconds:.2f}x), "
              f"{'same output' if outputs == expected else 'OUTPUT DIFFERS'}; {steps} verifying steps, "
              f"{stats['num_draft_tokens']} drafts, accepted by position {stats['accepted_per_position']}, "
              f"{(steps + stats['num_accepted_tokens']) / max(steps, 1):.2f} tokens a verifying step")
        del llm


if __name__ == "__main__":
    main()
