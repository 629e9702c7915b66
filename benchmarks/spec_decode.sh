#!/usr/bin/env bash
# Speculative decoding against the same server without it, same client, same prompts (issue 14):
# one request at a time through HTTP on input-grounded chat prompts (summarise, rewrite, repeat a given
# text; fix or comment a given snippet: benchmarks/data/grounded_prompts.jsonl), and 32 in flight on random
# prompts (80 in / 128 out). Each server is fresh, with a quiet gap between runs.
#   benchmarks/spec_decode.sh [MODEL] [SPECULATIVE_CONFIG_JSON] [PROMPTS.jsonl] [TAG]
#   -> results/spec-TAG-{off,on}-{one,batch32}.json, results/spec-TAG-on-metrics.txt, and a summary with ratios
# SOBRIO_ARGS adds flags to both servers (e.g. SOBRIO_ARGS="--quantization gguf": the drafts verified on the
# packed kernels).
# Draft heads on open chat prompts (held out from `sobrio train-draft`'s):
#   .venv/bin/sobrio train-draft --method medusa smollm2-135m results/heads-smollm2   # about 10 minutes on 2 cores
#   benchmarks/spec_decode.sh smollm2-135m '{"method": "medusa", "model": "results/heads-smollm2",
#     "num_speculative_tokens": 3}' benchmarks/data/open_chat_prompts.jsonl medusa
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
SPEC=${2:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'}
PROMPTS=${3:-benchmarks/data/grounded_prompts.jsonl}
TAG=${4:-ngram}
PORT=8011
URL=http://127.0.0.1:$PORT
mkdir -p results
SERVER=
stop_server() { if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; SERVER=; fi; }
trap stop_server EXIT INT TERM
wait_for() {  # URL: until it answers, the server exits (its log says why), or 300 s pass
  for _ in $(seq 300); do
    curl -sf "$1" >/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || { echo "the server exited; see results/spec-$TAG-*-serve.log" >&2; return 1; }
    sleep 1
  done
  echo "no answer from $1 in 300 s" >&2; return 1
}

run() {  # NAME [serve flags...]
  local name=$1; shift
  # shellcheck disable=SC2086
  .venv/bin/sobrio serve "$MODEL" --port $PORT ${SOBRIO_ARGS:-} "$@" > "results/spec-$TAG-$name-serve.log" 2>&1 &
  SERVER=$!
  wait_for "$URL/health"; sleep 3
  .venv/bin/sobrio bench serve --base-url "$URL" --model "$MODEL" --endpoint chat --no-progress \
    --dataset "$PROMPTS" --num-prompts 20 --output-len 256 --max-concurrency 1 \
    --result-json "results/spec-$TAG-$name-one.json" > /dev/null
  .venv/bin/sobrio bench serve --base-url "$URL" --model "$MODEL" --no-progress --dataset random \
    --num-prompts 128 --input-len 80 --output-len 128 --ignore-eos --max-concurrency 32 --seed 908 \
    --result-json "results/spec-$TAG-$name-batch32.json" > /dev/null
  curl -sf "$URL/metrics" | grep '^sobrio:spec_decode' > "results/spec-$TAG-$name-metrics.txt" || true
  stop_server; sleep 10
}

run off
run on --speculative-config "$SPEC"
.venv/bin/python - "$TAG" "$PROMPTS" <<'PY'
import json, sys
tag, prompts = sys.argv[1], sys.argv[2]
r = {(s, w): json.load(open(f"results/spec-{tag}-{s}-{w}.json")) for s in ("off", "on") for w in ("one", "batch32")}
for w, label in (("one", f"1 in flight, {prompts}"), ("batch32", "32 in flight, random prompts")):
    off, on = r["off", w], r["on", w]
    print(f"{label}: output {off['output_throughput']:.1f} -> {on['output_throughput']:.1f} tok/s "
          f"({on['output_throughput'] / off['output_throughput']:.2f}x), TPOT p50 {off['median_tpot_ms']:.1f} -> "
          f"{on['median_tpot_ms']:.1f} ms, output tokens {off['total_output_tokens']} / {on['total_output_tokens']}")
metrics = {}
for line in open(f"results/spec-{tag}-on-metrics.txt"):
    name, value = line.rsplit(" ", 1)
    metrics[name] = float(value)
drafted = sum(v for k, v in metrics.items() if k.startswith("sobrio:spec_decode_num_draft_tokens_total"))
accepted = sum(v for k, v in metrics.items() if k.startswith("sobrio:spec_decode_num_accepted_tokens_total"))
print(f"draft tokens {drafted:.0f}, accepted {accepted:.0f} ({accepted / max(drafted, 1):.0%})")
PY
