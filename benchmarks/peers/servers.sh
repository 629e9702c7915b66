# Sourced by the side-by-side scripts (ab_serving.sh, ab_llamacpp.sh, ab_at_size.sh): one server at a time in
# $SERVER, killed on exit so an interrupted run leaves no server behind, and bounded waits.
SERVER=
trap 'if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; fi' EXIT
# wait_for URL [SECONDS] [PID]: until URL answers (default 300 s; a model that compiles or loads 8B needs more),
# or at once when the server's process PID has exited (a peer that refuses a model fails in its start)
wait_for() {
  for _ in $(seq "${2:-300}"); do
    curl -sf "$1" >/dev/null && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then echo "the server for $1 exited before answering" >&2; return 1; fi
    sleep 1
  done
  echo "no answer from $1" >&2
  return 1
}
# settled LOG [SECONDS]: until a sobrio server's log says where its weights ended (huge pages or 4 KB pages, the
# start's last background work: docs/memory.md, "Weights in huge pages"), so a run measures the steady server
settled() {
  for _ in $(seq "${2:-120}"); do grep -q "weights of .* \(in huge pages\|stay in 4 KB pages\)" "$1" && return 0; sleep 1; done
  echo "no word on the weights' pages in $1 after ${2:-120} s: timing anyway" >&2
}
# port_free URL: a server left on the port would answer for the one started next (and hold its prompts in its
# prefix cache): stop here instead
port_free() { if curl -s -o /dev/null "$1"; then echo "something already answers on $1: stop it first" >&2; exit 1; fi; }
# start_at_size NAME PORT LOG: one of issue 43's servers on $MODEL in the background (its pid in $!): sobrio,
# sobrio-int8 (`--quantization int8`), vllm (vLLM's CPU build, $MAX_MODEL_LEN tokens of context, default 8,192:
# it refuses to start when its 2 GB of KV cache hold less, e.g. Phi-3.5-mini's 32 KV heads take 5,000),
# llamacpp (llama.cpp's server on $LLAMACPP_GGUF, 32 slots of 4,200 tokens)
start_at_size() {
  case "$1" in
    sobrio) .venv/bin/sobrio serve "$MODEL" --port "$2" > "$3" 2>&1 & ;;
    sobrio-int8) .venv/bin/sobrio serve "$MODEL" --port "$2" --quantization int8 > "$3" 2>&1 & ;;
    vllm) MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192} benchmarks/peers/vllm_server.sh "$MODEL" "$2" > "$3" 2>&1 & ;;
    llamacpp) .peers/llamacpp/bin/python benchmarks/peers/llamacpp_server.py --model "${LLAMACPP_GGUF:?a GGUF file}" \
                --port "$2" --parallel 32 --ctx-per-slot 4200 > "$3" 2>&1 & ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
}
# workload_args WORKLOAD: issue 43's serving workloads as `sobrio bench serve` flags (inflight16-top-p: the
# 16-in-flight one sampled as many clients ask, temperature 1 and top-p 0.9, where the others are greedy);
# workload_offset WORKLOAD: what each adds to the run's seed (its own prompts)
workload_args() {
  case "$1" in
    inflight16) echo "--num-prompts 48 --input-len 128 --output-len 64 --max-concurrency 16" ;;
    inflight32) echo "--num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 32" ;;
    inflight16-top-p) echo "--num-prompts 48 --input-len 128 --output-len 64 --max-concurrency 16 --temperature 1 --top-p 0.9" ;;
    ttft1000) echo "--num-prompts 2 --input-len 1000 --output-len 2 --max-concurrency 1" ;;
    ttft4000) echo "--num-prompts 2 --input-len 4000 --output-len 2 --max-concurrency 1" ;;
    *) echo "unknown workload $1" >&2; exit 2 ;;
  esac
}
workload_offset() {
  case "$1" in inflight16) echo 0 ;; inflight32) echo 1 ;; ttft1000) echo 2 ;; ttft4000) echo 3 ;;
    inflight16-top-p) echo 4 ;;
    *) echo "unknown workload $1" >&2; exit 2 ;; esac
}
