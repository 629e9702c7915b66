"""oneDNN's shape-keyed caches in a busy engine: resident memory and speed with their default capacity and smaller.

    python benchmarks/onednn_cache.py                          # default (1024) against 128, 2 rounds
    python benchmarks/onednn_cache.py --capacities 1024 256 64 --passes 4

A bf16 matmul of more than a few rows goes to oneDNN (`layers/linear.py`), which builds a primitive for each
row count it meets and keeps it in two caches, oneDNN's (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's
(`LRU_CACHE_CAPACITY`), 1024 entries each by default. A serving engine meets a new row count at almost every
step that mixes a prompt chunk with decodes, so both fill up over minutes. Each setting runs in a child
process (the capacities are read once, at the first matmul): `smollm2-135m` offline, `--passes` batches of
`--prompts` prompts of mixed lengths (new prompts each pass), greedy. Prints each pass's output tokens per
second and the RSS after it (after malloc_trim), then per setting the mean speed against the default's (same
run, settings alternated) and the growth of RSS from the first pass to the last.
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import ctypes, json, random, sys, time
from sobrio import LLM
from sobrio.types.params import SamplingParams
words = "the sea river mountain city train coffee music garden winter light story robot cloud".split()
llm = LLM("smollm2-135m", max_model_len=1024)
libc, out = ctypes.CDLL("libc.so.6"), []
def rss():
    libc.malloc_trim(0)
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
for p in range(PASSES):
    rng = random.Random(p)
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 200))) for _ in range(PROMPTS)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 48), ignore_eos=True) for _ in prompts]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    out.append((tokens / (time.perf_counter() - start), rss()))
print("RESULT " + json.dumps(out))
"""


def run_child(capacity: int, passes: int, prompts: int) -> list[tuple[float, float]]:
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(capacity), "LRU_CACHE_CAPACITY": str(capacity),
           "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}
    code = CHILD.replace("PASSES", str(passes)).replace("PROMPTS", str(prompts))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"capacity {capacity} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1024, 128],
                        help="cache capacities to compare, the first the baseline (default 1024 128)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternated (default 2)")
    parser.add_argument("--passes", type=int, default=3, help="batches of prompts per run (default 3)")
    parser.add_argument("--prompts", type=int, default=48, help="prompts per batch (default 48)")
    args = parser.parse_args()
    runs: dict[int, list] = {c: [] for c in args.capacities}
    for r in range(args.rounds):
        for capacity in args.capacities:
            passes = run_child(capacity, args.passes, args.prompts)
            runs[capacity].append(passes)
            print(f"round {r} capacity {capacity}: " + ", ".join(f"{tps:.1f} tok/s RSS {mb:.0f} MB"
                                                                   for tps, mb in passes), flush=True)
    base = None
    for capacity, results in runs.items():
        speed = sum(tps for passes in results for tps, _ in passes) / sum(len(p) for p in results)
        growth = sum(p[-1][1] - p[0][1] for p in results) / len(results)
        base = base or speed
        print(f"capacity {capacity}: {speed:.1f} tok/s ({speed / base:.2f}x of {args.capacities[0]}), RSS "
              f"{growth:+.0f} MB from the first pass to the last")
    return 0


if __name__ == "__main__":
    sys.exit(main())
