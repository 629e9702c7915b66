#!/usr/bin/env bash
# One request at a time through HTTP on the same GGUF file: `sobrio serve FILE --quantization gguf` (the
# file's blocks kept packed) against llama.cpp's server (xllamacpp, benchmarks/peers/setup_llamacpp.sh),
# alternating fresh servers with quiet gaps, the same client and prompts (`sobrio bench serve`, 8 requests
# of 80 random prompt tokens, 128 output tokens, EOS ignored):
#   benchmarks/peers/ab_llamacpp.sh 908 909     -> results/{sobrio-gguf,llamacpp}-SEED-batch1.json
# SOBRIO_ARGS adds flags to sobrio's server (e.g. SOBRIO_ARGS="--quantization int4" on the same file).
set -euo pipefail
cd "$(dirname "$0")/../.."
# GGUF (a file) and TOKENIZER (a model name or folder) run another model: benchmarks/peers/real_shapes.sh sets them.
GGUF=${GGUF:-$(.venv/bin/python -c "from sobrio.loader.resolve import resolve_model as r; print(r('smollm2-135m').path)")}
TOKENIZER=${TOKENIZER:-smollm2-135m}
SOBRIO_ARGS=${SOBRIO_ARGS:---quantization gguf}
mkdir -p results
source benchmarks/peers/servers.sh  # SERVER, its kill on exit, wait_for, port_free
batch1() {
  .venv/bin/sobrio bench serve --base-url "$1" --model smollm2-135m --tokenizer "$TOKENIZER" --ignore-eos \
    --no-progress --num-prompts 8 --input-len 80 --output-len 128 --max-concurrency 1 --seed "$2" \
    --result-json "results/$3-$2-batch1.json" > /dev/null
  .venv/bin/python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], f\"{r['output_throughput']:.1f} tok/s, TPOT p50 {r['p50_tpot_ms']:.2f} ms\")" \
    "results/$3-$2-batch1.json" "$3 seed $2:"
}
for SEED in "$@"; do
  port_free http://127.0.0.1:8000/health
  # shellcheck disable=SC2086
  .venv/bin/sobrio serve "$GGUF" $SOBRIO_ARGS --served-model-name smollm2-135m --port 8000 > "results/sobrio-gguf-$SEED-serve.log" 2>&1 &
  SERVER=$!
  wait_for http://127.0.0.1:8000/health; sleep 5
  batch1 http://127.0.0.1:8000 "$SEED" sobrio-gguf
  kill "$SERVER"; wait "$SERVER" || true; sleep 10
  port_free http://127.0.0.1:8080/health
  .peers/llamacpp/bin/python benchmarks/peers/llamacpp_server.py --model "$GGUF" --port 8080 --parallel 1 \
    > "results/llamacpp-$SEED-serve.log" 2>&1 &
  SERVER=$!
  wait_for http://127.0.0.1:8080/health; sleep 5
  batch1 http://127.0.0.1:8080 "$SEED" llamacpp
  kill "$SERVER"; wait "$SERVER" || true; sleep 10
done
