#!/usr/bin/env bash
# Issue 10's serving workloads (serving_workloads.sh) on sobrio and on vLLM's CPU build, alternating, each
# run on a fresh server started for it, with quiet gaps between: a server started right after the other
# one is killed measured up to 10% slow here. One seed per pair (same prompts and arrivals for both):
#   benchmarks/peers/ab_serving.sh 908 909        -> results/{sobrio,vllm}-SEED-{batch32,batch1,poisson}.json
# SOBRIO_ARGS adds flags to sobrio's server (e.g. SOBRIO_ARGS="--quantization int8"; vLLM stays bf16).
# MODEL serves another model folder on both (default smollm2-135m; benchmarks/peers/real_shapes.sh sets it).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-smollm2-135m}
export SERVED=${SERVED:-$(basename "$MODEL")} TOKENIZER=${TOKENIZER:-$MODEL}
source benchmarks/peers/servers.sh  # SERVER, its kill on exit, wait_for, port_free
summary() {
  .venv/bin/python - "$1" <<'PY'
import json, sys
r = {w: json.load(open(f"results/{sys.argv[1]}-{w}.json")) for w in ("batch32", "batch1", "poisson")}
p = r["poisson"]
print(f"{sys.argv[1]}: batch32 {r['batch32']['output_throughput']:.0f} tok/s | batch1 {r['batch1']['output_throughput']:.1f} "
      f"tok/s | poisson TTFT p50/p99 {p['p50_ttft_ms']:.0f}/{p['p99_ttft_ms']:.0f} ms, "
      f"TPOT p50/p99 {p['p50_tpot_ms']:.1f}/{p['p99_tpot_ms']:.1f} ms")
PY
}
for SEED in "$@"; do
  port_free http://127.0.0.1:8000/health
  # shellcheck disable=SC2086
  .venv/bin/sobrio serve "$MODEL" --served-model-name "$SERVED" --port 8000 ${SOBRIO_ARGS:-} > "results/sobrio-$SEED-serve.log" 2>&1 &
  SERVER=$!
  wait_for http://127.0.0.1:8000/health; sleep 5
  benchmarks/peers/serving_workloads.sh http://127.0.0.1:8000 "sobrio-$SEED" "$SEED" > /dev/null
  kill "$SERVER"; wait "$SERVER" || true; sleep 10
  port_free http://127.0.0.1:8100/v1/models
  benchmarks/peers/vllm_server.sh "$MODEL" 8100 > "results/vllm-$SEED-serve.log" 2>&1 &
  SERVER=$!
  wait_for http://127.0.0.1:8100/v1/models; sleep 5
  benchmarks/peers/serving_workloads.sh http://127.0.0.1:8100 "vllm-$SEED" "$SEED" > /dev/null
  kill "$SERVER"; wait "$SERVER" || true; sleep 15
  summary "sobrio-$SEED"; summary "vllm-$SEED"
done
