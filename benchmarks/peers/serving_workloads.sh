#!/usr/bin/env bash
# Issue 10's three serving workloads against one OpenAI-compatible server, with the same client
# (`sobrio bench serve`), results as JSON under results/LABEL-*.json:
#   batch32: 128 requests of 80 prompt tokens, 128 output tokens, 32 in flight
#   batch1:  8 requests one at a time (80 in, 128 out)
#   poisson: 60 requests at 3 req/s (Poisson), prompts of 64-448 random tokens, exactly 128 output tokens
# Run it once per server, each on a fresh server (the same prompts would hit a prefix cache):
#   benchmarks/peers/serving_workloads.sh http://127.0.0.1:8000 sobrio
#   benchmarks/peers/serving_workloads.sh http://127.0.0.1:8100 vllm
# SERVED and TOKENIZER name another model (default smollm2-135m for both), e.g. a real_shapes.py folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
URL=${1:?base url}
LABEL=${2:?label}
SEED=${3:-$RANDOM}
mkdir -p results
MIXED=results/poisson-prompts-$SEED.jsonl
.venv/bin/python - "$MIXED" "$SEED" <<'PY'
import json, random, sys
rng = random.Random(int(sys.argv[2]))
with open(sys.argv[1], "w") as f:
    for _ in range(60):
        ids = [rng.randrange(200, 28000) for _ in range(rng.randint(64, 448))]
        f.write(json.dumps({"prompt": ids, "max_tokens": 128}) + "\n")
PY
bench() { .venv/bin/sobrio bench serve --base-url "$URL" --model "${SERVED:-smollm2-135m}" \
  --tokenizer "${TOKENIZER:-smollm2-135m}" \
  --ignore-eos --no-progress "$@"; }
bench --num-prompts 128 --input-len 80 --output-len 128 --max-concurrency 32 --seed "$SEED" \
  --result-json "results/$LABEL-batch32.json"
bench --num-prompts 8 --input-len 80 --output-len 128 --max-concurrency 1 --seed "$((SEED + 1))" \
  --result-json "results/$LABEL-batch1.json"
bench --dataset "$MIXED" --num-prompts 60 --request-rate 3 --seed "$((SEED + 2))" \
  --result-json "results/$LABEL-poisson.json"
