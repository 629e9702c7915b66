"""Structured output's cost: (a) time per output token with 32 requests in flight, JSON-schema constrained vs
not, same prompts, same engine, same run; (b) grammar compile time over the property tests' schemas.

    .venv/bin/python benchmarks/structured_output.py [--model smollm2-135m] [--rounds 3] [--num-schemas 200]
        [--engine-arg structured_outputs_fast_forward=false]

(a) A realistic 10-field schema (strings with maxLength, a pattern, integers with bounds, an enum, a bool, an
array of strings, a nested object). Each round generates the 32 constrained requests (temperature 1.0, a seed
each), then the same 32 prompts unconstrained, each with ignore_eos and max_tokens set to the length its
constrained twin produced: both runs decode exactly the same number of tokens per request, in the same
batches. A warm-up round goes first (it compiles and caches the grammar, as a server that has seen the schema
before). Printed: milliseconds per output token of each, per round, and the ratio structured / unstructured:
the median of the rounds' ratios, and the best round of each (steadier on a busy machine); the target is at
most 1.05. With fast-forward on (the default), the tokens a grammar forces (keys, punctuation) are emitted
without sampling, so the structured run may well be the faster; `--engine-arg
structured_outputs_fast_forward=false` measures the mask alone.

(b) The schemas of tests/model/test_structured_properties.py (tests/model/schema_strategies.py), each
compiled cold (a compiler without a cache) against the model's tokenizer by sobrio.structured.backend's
GrammarCompiler, one after another, as the engine core compiles them (the llguidance tokenizer is built once
before, and reported apart). Printed: p50, p99 and max in milliseconds.

Figures are indicative on a shared machine: run it alone.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.model

from sobrio import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from sobrio.structured.backend import GrammarCompiler  # noqa: E402
from tests.model.schema_strategies import draw_schemas  # noqa: E402

IN_FLIGHT = 32
USER_RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "email": {"type": "string", "pattern": r"^[a-z]{1,12}@[a-z]{2,10}\.(com|org|net)$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "country": {"enum": ["France", "Germany", "Japan", "Brazil", "Canada", "India", "Kenya", "Other"]},
        "premium": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 32},
                           "city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": r"^\d{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "signup_year": {"type": "integer", "minimum": 2000, "maximum": 2025},
        "orders": {"type": "integer", "minimum": 0, "maximum": 10000},
        "status": {"enum": ["active", "suspended", "closed"]},
    },
    "required": ["name", "email", "age", "country", "premium", "tags", "address", "signup_year", "orders",
                 "status"],
    "additionalProperties": False,
}
PROMPT_SUBJECTS = ["a customer", "a new user", "a teacher", "a pilot", "a chef", "a student", "a retired nurse",
                   "an engineer"]


def prompts() -> list[str]:
    return [f"Customer database, record {i + 1}, describing {PROMPT_SUBJECTS[i % len(PROMPT_SUBJECTS)]}, as JSON:"
            for i in range(IN_FLIGHT)]


def _timed(llm: LLM, texts: list[str], params: list[SamplingParams]):
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outputs]


def per_token_overhead(args) -> None:
    engine_args = dict(args.engine_arg, **({"dtype": args.dtype} if args.dtype else {}))
    llm = LLM(args.model, max_num_seqs=IN_FLIGHT, **engine_args)
    texts = prompts()
    spec = StructuredOutputsParams(json=USER_RECORD)
    structured = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
                  for i in range(IN_FLIGHT)]
    ratios, per_token, invalid = [], {"structured": [], "unstructured": []}, 0
    shown = ", ".join(f"{k}={v}" for k, v in engine_args.items())
    print(f"(a) {args.model}: {IN_FLIGHT} requests in flight, a 10-field schema vs none"
          f"{f' ({shown})' if shown else ''}")
    for r in range(-1, max(args.rounds, 1)):  # round 0: a warm-up (the compile, its cache, the shapes)
        t_struct, outs = _timed(llm, texts, structured)
        lengths = [len(o.token_ids) for o in outs]
        for o in outs:
            try:
                value = json.loads(o.text)
                invalid += o.finish_reason != "stop" or set(value) != set(USER_RECORD["required"])
            except ValueError:
                invalid += 1
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                 for i, n in enumerate(lengths)]
        t_plain, plain_outs = _timed(llm, texts, plain)
        assert [len(o.token_ids) for o in plain_outs] == lengths
        tokens = sum(lengths)
        print(f"    round {r + 1}{' (warm-up)' if r < 0 else ''}: {tokens} output tokens; structured "
              f"{1e3 * t_struct / tokens:.2f} ms/token, unstructured {1e3 * t_plain / tokens:.2f} ms/token, "
              f"ratio {t_struct / t_plain:.3f}")
        if r >= 0:
            ratios.append(t_struct / t_plain)
            per_token["structured"].append(t_struct / tokens)
            per_token["unstructured"].append(t_plain / tokens)
    best = min(per_token["structured"]) / min(per_token["unstructured"])
    print(f"    structured / unstructured time per output token: median of the rounds' ratios "
          f"{statistics.median(ratios):.3f}, best round of each {best:.3f} (target <= 1.05); outputs that are not "
          f"complete valid records: {invalid}")


def compile_times(args) -> None:
    schemas = draw_schemas(args.num_schemas)
    llm_tokenizer = _hf_tokenizer(args.model)
    compiler = GrammarCompiler(lambda: llm_tokenizer, cache_size=0)  # no cache: every compile is cold
    eos = [llm_tokenizer.eos_token_id]
    start = time.perf_counter()
    compiler.submit(StructuredOutputsParams(json={"type": "boolean"}), eos).future.result()
    tokenizer_seconds = time.perf_counter() - start
    seconds = []
    for schema in schemas:
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        compiler.submit(params, eos).future.result()
        seconds.append(time.perf_counter() - start)
    compiler.shutdown()
    ms = sorted(1e3 * s for s in seconds)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    print(f"(b) grammar compile, cold, {len(ms)} property-test schemas against the {args.model} tokenizer: "
          f"p50 {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, max {ms[-1]:.2f} ms, mean {statistics.mean(ms):.2f} "
          f"ms (the llguidance tokenizer, built once first: {1e3 * tokenizer_seconds:.0f} ms)")


def _hf_tokenizer(model: str):
    from sobrio.loader.load import load_model_files

    return load_model_files(model).tokenizer


def _engine_arg(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: the engine's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-schemas", type=int, default=200)
    parser.add_argument("--engine-arg", type=_engine_arg, action="append", default=[], metavar="NAME=JSON",
                        help="an engine argument for (a), e.g. structured_outputs_fast_forward=false (repeatable)")
    parser.add_argument("--skip", choices=["overhead", "compile"], help="run only the other part")
    args = parser.parse_args()
    if args.skip != "compile":
        compile_times(args)
    if args.skip != "overhead":
        per_token_overhead(args)


if __name__ == "__main__":
    main()
