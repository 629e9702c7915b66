"""Resident memory of the engine core's grammar state alone: llguidance matchers, masks and the compiled cache.

    python benchmarks/grammar_memory.py                 # 500 requests, a new schema each, 25 at a time
    python benchmarks/grammar_memory.py --repeat        # the same schema every time

No model: a StructuredOutputManager (as the engine core holds it) compiles each request's json_schema, fills
its masks in batches (llguidance's threads), advances it by random allowed tokens for up to `--tokens`, and
frees it. Prints RSS (before and after malloc_trim) every `--every` requests: flat means the per-request
grammar state is released and the cache bounded, so a growing core lies elsewhere.
"""

import argparse
import ctypes
import gc
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sobrio.bench.datasets import load_tokenizer  # noqa: E402
from sobrio.structured.backend import GrammarCompiler  # noqa: E402
from sobrio.structured.manager import StructuredOutputManager  # noqa: E402
from sobrio.types.params import SamplingParams, StructuredOutputsParams  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def allowed(row) -> list[int]:
    out = []
    for w in row.nonzero().flatten().tolist():
        bits = int(row[w]) & 0xFFFFFFFF
        out += [32 * w + b for b in range(32) if bits >> b & 1]
    return out


def run_batch(manager, reqs, rng, tokens: int) -> None:
    for req in reqs:
        manager.submit(req)
    while manager.has_pending():
        manager.wait(30)
        manager.ready()
    live = [r for r in reqs if manager.is_constrained(r.request_id)]
    for _ in range(tokens):
        if not live:
            break
        masks = manager.allowed_tokens(live).bits
        still = []
        for req, row in zip(live, masks):
            (still.append(req) if manager.accept(req, rng.choice(allowed(row))) is None
             else manager.free(req.request_id))
        live = still
    for req in reqs:
        manager.free(req.request_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="requests in all (default 500)")
    parser.add_argument("--batch", type=int, default=25, help="requests alive at once (default 25)")
    parser.add_argument("--tokens", type=int, default=40, help="tokens each request advances at most (default 40)")
    parser.add_argument("--every", type=int, default=50, help="requests between RSS lines (default 50)")
    parser.add_argument("--repeat", action="store_true", help="the same schema every time (default: a new one)")
    args = parser.parse_args()
    tokenizer = load_tokenizer("smollm2-135m")
    manager = StructuredOutputManager(GrammarCompiler(lambda: tokenizer))
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    rng, done, first = random.Random(0), 0, None
    while done < args.requests:
        reqs = []
        for i in range(done, min(done + args.batch, args.requests)):
            name = "name" if args.repeat else f"f{rng.randrange(10**6)}"
            schema = {"type": "object", "properties": {name: {"type": "string", "maxLength": 16},
                                                       "n": {"type": "integer"}}, "required": [name, "n"]}
            reqs.append(SimpleNamespace(request_id=f"r{i}", eos_token_ids=frozenset({tokenizer.eos_token_id}),
                                        sampling_params=SamplingParams(
                                            structured_outputs=StructuredOutputsParams(json=schema))))
        run_batch(manager, reqs, rng, args.tokens)
        done += len(reqs)
        if done % args.every == 0 or done == args.requests:
            gc.collect()
            before = rss_mb()
            trim(0)
            after = rss_mb()
            first = first or after
            print(f"{done:6d} requests  RSS {before:7.1f} MB  after malloc_trim {after:7.1f} MB  "
                  f"cache {len(manager.compiler._cache)}  tables {manager.table_sizes()}", flush=True)
    print(f"growth after the first {args.every} requests: {after - first:+.1f} MB "
          f"({(after - first) / max(1, done - args.every) * 1024:.1f} kB a request)")
    manager.shutdown()


if __name__ == "__main__":
    main()
