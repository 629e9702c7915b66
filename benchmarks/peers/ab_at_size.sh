#!/usr/bin/env bash
# Issue 43's serving figures at a real size, sobrio against vLLM's CPU build on the same bf16 folder, each server
# fresh, one after the other with quiet gaps, the same client and prompts (`sobrio bench serve`, random tokens,
# EOS ignored):
#   inflight16: 48 requests of 128 prompt tokens, 64 output tokens, 16 in flight (the issue's workload)
#   inflight32: 64 requests of 128 / 64, 32 in flight
#   ttft1000, ttft4000: 2 requests one at a time of 1,000 / 4,000 prompt tokens, 2 output tokens
#   benchmarks/peers/ab_at_size.sh MODEL_FOLDER SEED...  -> results/at-size-{LABEL}-SEED-{workload}.json + a table
# SERVERS lists the servers in the order run (default "sobrio sobrio-int8 vllm"); sobrio-int8 is
# `--quantization int8` (its first start fills the quantization cache: start it once before timing); llamacpp is
# llama.cpp's server (benchmarks/peers/setup_llamacpp.sh) on LLAMACPP_GGUF, the same weights as a GGUF
# (`real_shapes.py write NAME --gguf BF16`), 32 slots of 4,200 tokens.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?model folder}
shift
SERVED=$(basename "$MODEL")
SERVERS=${SERVERS:-sobrio sobrio-int8 vllm}
mkdir -p results
source benchmarks/peers/servers.sh  # SERVER, its kill on exit, wait_for, port_free, start_at_size, workload_*
bench() {  # URL LABEL WORKLOAD SEED FLAGS...
  local url=$1 out="results/at-size-$2-$4-$3.json" seed=$4
  shift 4
  .venv/bin/sobrio bench serve --base-url "$url" --model "$SERVED" --tokenizer "$MODEL" --ignore-eos --no-progress \
    --seed "$seed" --result-json "$out" "$@" > /dev/null
}
start() {  # NAME PORT
  start_at_size "$1" "$2" "results/at-size-$1-serve.log"
  SERVER=$!
}
for SEED in "$@"; do
  for NAME in $SERVERS; do
    PORT=8000; [ "$NAME" = vllm ] && PORT=8100; [ "$NAME" = llamacpp ] && PORT=8080
    port_free "http://127.0.0.1:$PORT/"
    T0=$(date +%s)
    start "$NAME" "$PORT"
    wait_for "http://127.0.0.1:$PORT/v1/models" 900 "$SERVER"
    echo "$NAME ready in $(($(date +%s) - T0)) s"
    case "$NAME" in sobrio*) settled "results/at-size-$NAME-serve.log" ;; esac
    sleep 5
    URL=http://127.0.0.1:$PORT
    for W in inflight16 inflight32 ttft1000 ttft4000; do
      # shellcheck disable=SC2046  # the flags are words
      bench "$URL" "$NAME" "$W" "$((SEED + $(workload_offset "$W")))" $(workload_args "$W")
    done
    kill "$SERVER"; wait "$SERVER" || true; SERVER=; sleep 15
  done
  .venv/bin/python - "$SEED" $SERVERS <<'PY'
import json, sys
seed, names = sys.argv[1], sys.argv[2:]
offsets = {"inflight16": 0, "inflight32": 1, "ttft1000": 2, "ttft4000": 3}  # each workload's seed, as run
load = lambda n, w: json.load(open(f"results/at-size-{n}-{int(seed) + offsets[w]}-{w}.json"))
print(f"seed {seed}: output tok/s at 16 and 32 in flight, TTFT p50 at 1,000 and 4,000 prompt tokens")
rows = {n: (load(n, "inflight16")["output_throughput"], load(n, "inflight32")["output_throughput"],
            load(n, "ttft1000")["p50_ttft_ms"], load(n, "ttft4000")["p50_ttft_ms"]) for n in names}
for n, (a, b, c, d) in rows.items():
    print(f"  {n:12s} {a:7.1f} {b:7.1f} tok/s | TTFT {c:7.0f} {d:7.0f} ms")
for peer in ("vllm", "llamacpp"):
    if peer in rows:
        v = rows[peer]
        for n, r in rows.items():
            if n.startswith("sobrio"):
                print(f"  {n} / {peer}: {r[0] / v[0]:.2f}x {r[1] / v[1]:.2f}x tok/s | TTFT {r[2] / v[2]:.2f}x {r[3] / v[3]:.2f}x")
PY
done
