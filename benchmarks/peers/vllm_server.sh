#!/usr/bin/env bash
# Start vLLM's CPU build (benchmarks/peers/setup_vllm.sh) on the same weights sobrio serves: the dense
# safetensors folder sobrio prepares from the GGUF, in bf16, 2 OpenMP threads.
#   benchmarks/peers/vllm_server.sh [ALIAS_OR_FOLDER] [PORT]     (defaults: smollm2-135m 8100)
# MAX_MODEL_LEN sets --max-model-len (default 2048). Start-up takes a minute or two (torch.compile); ready when /v1/models answers.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-smollm2-135m}
PORT=${2:-8100}
SERVED=$(basename "$MODEL")
if [ ! -d "$MODEL" ]; then
  MODEL=$(.venv/bin/python -c "
from sobrio.loader.gguf import prepared_folder
from sobrio.loader.resolve import resolve_model
print(prepared_folder(resolve_model('$MODEL').path))")
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
exec .peers/vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$SERVED" \
  --dtype bfloat16 --max-model-len "${MAX_MODEL_LEN:-2048}" --max-num-seqs 32 --host 127.0.0.1 --port "$PORT"
