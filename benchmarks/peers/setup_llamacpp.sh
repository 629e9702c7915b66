#!/usr/bin/env bash
# llama.cpp's own server for side-by-side runs: the PyPI package xllamacpp embeds a prebuilt llama-server.
# It lives in a venv of its own (.peers/llamacpp) so it never touches sobrio's environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .peers/llamacpp
.peers/llamacpp/bin/pip install -q xllamacpp
echo "start it with: .peers/llamacpp/bin/python benchmarks/peers/llamacpp_server.py --model PATH.gguf --port 8080"
