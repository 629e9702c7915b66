#!/usr/bin/env bash
# Issue 43's comparisons at real sizes, one command each, on random-weight checkpoints of real shapes
# (benchmarks/peers/real_shapes.py writes them once under $OUT, default /tmp/sobrio-shapes):
#   benchmarks/peers/real_shapes.sh SHAPE sobrio            sobrio alone: start time, engine-core resident memory,
#                                                           batch-1 tok/s, time to first token at 1,000 and 4,000
#                                                           prompt tokens, `sobrio bench roofline --batch 1,16,32`
#   benchmarks/peers/real_shapes.sh SHAPE vllm SEED...      against vLLM's CPU build, bf16, the same folder
#                                                           (ab_serving.sh: batch32, batch1, poisson)
#   benchmarks/peers/real_shapes.sh SHAPE llamacpp-Q8_0 SEED...   against llama.cpp's server on the same GGUF
#   benchmarks/peers/real_shapes.sh SHAPE llamacpp-Q4_0 SEED...   (ab_llamacpp.sh: batch 1)
# SHAPE: a name in real_shapes.py's SHAPES (llama3.2-1b, qwen2.5-3b, llama3.1-8b, qwen3-1.7b, gemma3-1b, ...).
# SOBRIO_ARGS adds flags to sobrio's server (e.g. --quantization int8 for 8B, which does not fit in 24 GB in bf16
# beside its KV cache). Peers: setup_vllm.sh, setup_llamacpp.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHAPE=${1:?shape: a name in benchmarks/peers/real_shapes.py SHAPES, e.g. llama3.2-1b}
WHAT=${2:?sobrio, vllm, llamacpp-Q8_0 or llamacpp-Q4_0}
shift 2
OUT=${OUT:-/tmp/sobrio-shapes}
shapes() { .venv/bin/python benchmarks/peers/real_shapes.py "$@" --out "$OUT"; }
FOLDER=$(shapes write "$SHAPE" | tail -1)
mkdir -p results
case "$WHAT" in
  sobrio)
    # shellcheck disable=SC2086
    .venv/bin/python benchmarks/peers/sobrio_at_size.py "$FOLDER" --result-json "results/sobrio-$SHAPE.json" ${SOBRIO_ARGS:-}
    ;;
  vllm)
    MODEL=$FOLDER MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192} benchmarks/peers/ab_serving.sh "$@"
    ;;
  llamacpp-*)
    QTYPE=${WHAT#llamacpp-}
    GGUF=$(shapes write "$SHAPE" --gguf "$QTYPE" | tail -1)
    GGUF=$GGUF TOKENIZER=$FOLDER benchmarks/peers/ab_llamacpp.sh "$@"
    ;;
  *) echo "unknown comparison $WHAT" >&2; exit 2 ;;
esac
