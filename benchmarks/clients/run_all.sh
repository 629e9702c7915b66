#!/usr/bin/env bash
# Third-party OpenAI clients against one `sobrio serve`: the official `openai` client
# (openai_client.py), LangChain's ChatOpenAI and OpenAIEmbeddings (langchain_client.py) and the `llm`
# tool (llm_cli.sh). Starts the server on a free loopback port with smollm2-135m and all-minilm-l6-v2,
# waits for /health (bounded), runs each client, prints one PASS/FAIL line per client, stops the server
# whatever happens, and exits 1 if any client failed (2 if the server never became healthy).
#
#   benchmarks/clients/run_all.sh                  (runs benchmarks/clients/setup.sh first if needed)
#
# Environment: SOBRIO (default .venv/bin/sobrio), CLIENTS_VENV (default .peers/clients), HEALTH_TIMEOUT
# (seconds, default 180), CLIENT_TIMEOUT (seconds per client, default 600), KEEP_LOG=1 to print the
# server's whole log at the end. Nothing is downloaded while it runs; it works offline.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
SOBRIO=${SOBRIO:-$ROOT/.venv/bin/sobrio}
CLIENTS_VENV=${CLIENTS_VENV:-$ROOT/.peers/clients}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-180}
CLIENT_TIMEOUT=${CLIENT_TIMEOUT:-600}
CHAT_MODEL=smollm2-135m
EMBED_MODEL=all-minilm-l6-v2

if ! "$CLIENTS_VENV/bin/python" -c "import openai, langchain_openai, llm" 2>/dev/null; then
  echo "client venv $CLIENTS_VENV missing or incomplete: running setup.sh"
  "$HERE/setup.sh" || { echo "FAIL setup.sh"; exit 2; }
fi
[ -x "$SOBRIO" ] || { echo "no $SOBRIO (make install)"; exit 2; }

PORT=$("$CLIENTS_VENV/bin/python" -c "
import socket
s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
BASE=http://127.0.0.1:$PORT
LOG=$(mktemp -t sobrio-clients-server.XXXXXX.log)
SERVER_PID=

CLIENT_PID=
stop_server() {
  if [ -n "$CLIENT_PID" ]; then kill -TERM "$CLIENT_PID" 2>/dev/null; wait "$CLIENT_PID" 2>/dev/null; fi
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "server $SERVER_PID still up 30 s after SIGTERM: SIGKILL"
      kill -KILL "$SERVER_PID" 2>/dev/null
    fi
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=
  if [ "${KEEP_LOG:-0}" = 1 ]; then cat "$LOG"; fi
  rm -f "$LOG"
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "starting sobrio serve on $BASE ($CHAT_MODEL, $EMBED_MODEL)"
"$SOBRIO" serve --model "$CHAT_MODEL" --model "$EMBED_MODEL" --host 127.0.0.1 --port "$PORT" \
  --kv-cache-memory 67108864 --max-model-len 1024 >"$LOG" 2>&1 &
SERVER_PID=$!

healthy=0
deadline=$((SECONDS + HEALTH_TIMEOUT))
while [ $SECONDS -lt $deadline ]; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "server exited before it was healthy; its log:"; tail -n 40 "$LOG"; exit 2
  fi
  if curl -sf -m 2 "$BASE/health" >/dev/null 2>&1; then healthy=1; break; fi
  sleep 1
done
if [ $healthy != 1 ]; then
  echo "server not healthy after ${HEALTH_TIMEOUT}s; its log:"; tail -n 40 "$LOG"; exit 2
fi
echo "server healthy after ${SECONDS}s"

declare -a RESULTS=()
failed=0
run_client() {  # NAME COMMAND...
  local name=$1; shift
  local out rc start=$SECONDS
  out=$(mktemp)
  # In the background, so that a signal to this script is handled at once (wait is interruptible), not
  # after the client ends.
  timeout "$CLIENT_TIMEOUT" "$@" >"$out" 2>&1 &
  CLIENT_PID=$!
  wait "$CLIENT_PID"
  rc=$?
  CLIENT_PID=
  sed "s/^/  [$name] /" "$out"
  rm -f "$out"
  if [ $rc = 0 ]; then
    RESULTS+=("PASS $name ($((SECONDS - start))s)")
  else
    RESULTS+=("FAIL $name (exit $rc, $((SECONDS - start))s)")
    failed=1
  fi
}

run_client openai "$CLIENTS_VENV/bin/python" "$HERE/openai_client.py" --base-url "$BASE/v1" \
  --chat-model "$CHAT_MODEL" --embedding-model "$EMBED_MODEL"
run_client langchain "$CLIENTS_VENV/bin/python" "$HERE/langchain_client.py" --base-url "$BASE/v1" \
  --chat-model "$CHAT_MODEL" --embedding-model "$EMBED_MODEL"
run_client llm env LLM="$CLIENTS_VENV/bin/llm" "$HERE/llm_cli.sh" "$BASE/v1" "$CHAT_MODEL"

# Any answer the server refused or failed is worth seeing, even when the clients passed.
if grep -E "sobrio.access: .* [45][0-9][0-9] [0-9.]+s$" "$LOG" | grep -v " /health " >/dev/null; then
  echo "server answers other than 2xx:"
  grep -E "sobrio.access: .* [45][0-9][0-9] [0-9.]+s$" "$LOG" | sed 's/^/  /'
fi
if grep -E " (ERROR|CRITICAL) " "$LOG" >/dev/null; then
  echo "server errors:"; grep -E " (ERROR|CRITICAL) " "$LOG" | sed 's/^/  /'
fi

if [ $failed = 1 ]; then echo "the server's last log lines:"; tail -n 30 "$LOG" | sed 's/^/  /'; fi

for r in "${RESULTS[@]}"; do echo "$r"; done
exit $failed
