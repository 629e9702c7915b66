#!/usr/bin/env bash
# Issue 43's serving figures as ab_at_size.sh measures them, but with every server started once and kept up,
# and the workloads run in ROUNDS: each round runs each workload on every server in turn (the order rotated a
# round), on prompts of that round's own seed (so no round finds the last one's prompts in a prefix cache).
# On a shared host whose speed drifts by 2x within minutes (docs/benchmarks.md), one server after the other
# compares two different hosts; a ratio within one round compares the same one, and the median of the
# rounds' ratios is the figure to quote. An idle server must not spin: the script prints each one's CPU
# seconds over a quiet minute before the first round (vLLM's and sobrio's engines block when idle).
#   SERVERS="sobrio vllm" ROUNDS=5 benchmarks/peers/ab_rounds.sh MODEL_FOLDER SEED
#     -> results/rounds-{LABEL}-{SEED}-r{ROUND}-{workload}.json and a table
# SERVERS as ab_at_size.sh (sobrio, sobrio-int8, vllm, llamacpp); WORKLOADS (default "inflight16 inflight32
# ttft1000 ttft4000") as ab_at_size.sh names them. All servers together must fit in memory: each sobrio takes
# its default KV cache (at most 2 GB), vLLM 2 GB.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?model folder}
SEED=${2:?seed}
SERVED=$(basename "$MODEL")
SERVERS=${SERVERS:-sobrio sobrio-int8 vllm}
ROUNDS=${ROUNDS:-5}
WORKLOADS=${WORKLOADS:-inflight16 inflight32 ttft1000 ttft4000}
mkdir -p results
source benchmarks/peers/servers.sh  # wait_for, port_free, start_at_size, workload_*
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
port() { case "$1" in sobrio) echo 8000 ;; sobrio-int8) echo 8001 ;; vllm) echo 8100 ;; llamacpp) echo 8080 ;;
  *) echo "unknown server $1" >&2; exit 2 ;; esac; }
start() {  # NAME PORT
  start_at_size "$1" "$2" "results/rounds-$1-serve.log"
  PIDS+=($!)
}
bench() {  # NAME WORKLOAD ROUND
  # shellcheck disable=SC2046  # the flags are words
  .venv/bin/sobrio bench serve --base-url "http://127.0.0.1:$(port "$1")" --model "$SERVED" --tokenizer "$MODEL" \
    --ignore-eos --no-progress --seed "$((SEED + 10 * $3 + $(workload_offset "$2")))" \
    --result-json "results/rounds-$1-$SEED-r$3-$2.json" $(workload_args "$2") > /dev/null
}
for W in $WORKLOADS; do workload_offset "$W" > /dev/null; done  # an unknown one stops here, before any start
read -ra NAMES <<< "$SERVERS"
for NAME in "${NAMES[@]}"; do  # one at a time, so no start competes with another's
  port_free "http://127.0.0.1:$(port "$NAME")/"
  T0=$(date +%s)
  start "$NAME" "$(port "$NAME")"
  wait_for "http://127.0.0.1:$(port "$NAME")/v1/models" 900 "${PIDS[-1]}"
  echo "$NAME ready in $(($(date +%s) - T0)) s"
  case "$NAME" in sobrio*) settled "results/rounds-$NAME-serve.log" ;; esac  # before the next start competes
done
.venv/bin/python - "${NAMES[@]}" -- "${PIDS[@]}" <<'PY'
import sys, time, psutil  # each server's CPU seconds over a quiet minute, its whole process tree
names, pids = sys.argv[1:sys.argv.index("--")], [int(p) for p in sys.argv[sys.argv.index("--") + 1:]]
def cpu(pid):
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)
before = [cpu(p) for p in pids]
time.sleep(60)
for name, pid, b in zip(names, pids, before):
    print(f"{name} idle: {cpu(pid) - b:.1f} CPU s over 60 s")
PY
for ROUND in $(seq 0 $((ROUNDS - 1))); do
  for W in $WORKLOADS; do
    for j in "${!NAMES[@]}"; do
      bench "${NAMES[$(((j + ROUND) % ${#NAMES[@]}))]}" "$W" "$ROUND"
    done
  done
  echo "round $ROUND done at $(date -u +%H:%M:%S) UTC"
done
.venv/bin/python benchmarks/peers/rounds_summary.py --seed "$SEED" --rounds "$ROUNDS" --servers $SERVERS \
  --workloads $WORKLOADS
