#!/bin/bash
# Two checkouts of sobrio side by side on one host, alternating (A B A B): serving throughput at 16 in flight and
# offline throughput, so a refactor shows its cost as a ratio measured in one run.
#   bash benchmarks/redesign_ab.sh BEFORE_TREE AFTER_TREE [ROUNDS]
# e.g. `git worktree add /tmp/before 0f0b73d && bash benchmarks/redesign_ab.sh /tmp/before $PWD`.
# Serving: sobrio serve smollm2-135m, sobrio bench serve 64 prompts 128 in / 64 out, EOS ignored.
# Offline: LLM.generate of 32 random prompts, 256 in / 64 out. Both trees use this environment's Python (PY).
set -u
before=$1 after=$2 rounds=${3:-2}
PY=${PY:-$(pwd)/.venv/bin/python}
port=${PORT:-8011}
out=$(mktemp -d)
offline='
import random, time
import sobrio  # first: the OpenMP policy before torch
from sobrio import LLM, SamplingParams
llm = LLM("smollm2-135m")
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(256)]} for _ in range(32)]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], params, use_tqdm=False)
start = time.perf_counter()
done = llm.generate(prompts, params, use_tqdm=False)
print(f"{sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - start):.1f}")
'
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    tree=$before; [ "$side" = after ] && tree=$after
    PYTHONPATH=$tree "$PY" -m sobrio.cli serve smollm2-135m --port "$port" > "$out/serve_$side$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    PYTHONPATH=$tree "$PY" -m sobrio.cli bench serve --base-url "http://127.0.0.1:$port" --model smollm2-135m \
      --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 16 --ignore-eos --no-progress \
      > "$out/bench_$side$round.txt" 2>&1
    kill -INT $pid; wait $pid
    serving=$(awk '/Output token throughput/ {print $NF}' "$out/bench_$side$round.txt")
    offline_tps=$(cd "$tree" && PYTHONPATH=$tree "$PY" -c "$offline" 2>/dev/null | tail -1)
    echo "round $round $side: serving $serving tok/s, offline $offline_tps tok/s"
  done
done
echo "logs: $out"
