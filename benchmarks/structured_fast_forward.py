"""Structured output with and without fast-forward: output tokens/s on a JSON schema with long fixed keys.

    .venv/bin/python benchmarks/structured_fast_forward.py [--num-requests 32] [--fields 10] [--max-tokens 256]

One offline LLM, one batch of greedy requests constrained by a schema of `--fields` properties with long names
(most of an object's tokens are keys and punctuation, which the grammar forces). The same batch runs with
fast-forward off (every token sampled, one per step) and on (forced tokens emitted without sampling and
computed in one forward with the next step), after a warm-up that compiles the grammar, alternately for
`--rounds` rounds; the figures are output tokens/s of each one's fastest run, and their ratio.

The two runs pick the same tokens from the same logits, but a forced run is computed as one multi-token query
instead of one token per step, and in bfloat16 (`--dtype auto` on a CPU with AMX) that moves the logits by a
rounding, as a different batch or chunking does: a near tie can then go the other way. The outputs are
identical in float32, and with `--batch-invariant` in any dtype (asserted then); otherwise the count of
identical outputs is printed.
"""

import argparse
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams, StructuredOutputsParams

WORDS = ["customer", "shipping", "billing", "preferred", "primary", "secondary", "account", "contact", "delivery",
         "payment", "loyalty", "regional"]
KINDS = ["identification_number", "address_line_text", "method_name_value", "creation_timestamp_utc",
         "status_flag_enabled"]


def long_key_schema(num_fields: int) -> dict:
    """`num_fields` required properties with names of 30-40 characters: enums, bounded integers, booleans,
    short strings."""
    props = {}
    for i in range(num_fields):
        name = f"{WORDS[i % len(WORDS)]}_{WORDS[(i + 3) % len(WORDS)]}_{KINDS[i % len(KINDS)]}"
        props[name] = [{"enum": ["standard_option_value", "premium_option_value"]},
                       {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"},
                       {"type": "string", "maxLength": 12}][i % 4]
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def run(llm: LLM, prompts: list[str], params: SamplingParams, fast_forward: bool) -> tuple[float, list]:
    llm.engine.core.fast_forward = fast_forward  # what --[no-]structured-outputs-fast-forward sets
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--fields", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated (the fastest of each counts)")
    parser.add_argument("--batch-invariant", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.num_requests, 1),
              batch_invariant=args.batch_invariant)
    schema = long_key_schema(args.fields)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = [f"Record number {i} of the customer database, as JSON:" for i in range(args.num_requests)]
    run(llm, prompts[:2], params, fast_forward=True)  # warm-up: the tokenizer, the grammar (then cached)
    forced_before = llm.engine.core.structured.num_forced_tokens
    runs = [(run(llm, prompts, params, False), run(llm, prompts, params, True)) for _ in range(args.rounds)]
    (slow, off), (fast, on) = min(r[0] for r in runs), min(r[1] for r in runs)
    identical = sum(a == b for a, b in zip(off, on))
    assert identical == len(on) or not (args.batch_invariant or args.dtype == "float32"), "fast-forward changed output"
    print(f"{args.model} ({llm.engine.runner.dtype}, batch_invariant={args.batch_invariant}): {args.num_requests} "
          f"requests, {args.fields} long-key fields; identical outputs {identical}/{len(on)}")
    report(slow, off, fast, on, (llm.engine.core.structured.num_forced_tokens - forced_before) // args.rounds)


def report(slow: float, off: list, fast: float, on: list, forced: int) -> None:
    off_tokens, on_tokens = sum(map(len, off)), sum(map(len, on))
    print(f"fast-forward off  {off_tokens / slow:8.1f} output tok/s  ({off_tokens} tokens, {slow:.1f} s)")
    print(f"fast-forward on   {on_tokens / fast:8.1f} output tok/s  ({on_tokens} tokens, {forced} forced, "
          f"{fast:.1f} s)")
    print(f"ratio on/off      {(on_tokens / fast) / (off_tokens / slow):8.2f}x")

if __name__ == "__main__":
    main()
