#!/usr/bin/env bash
# Simon Willison's `llm` tool (PyPI `llm`) against a running `sobrio serve`, configured the way its docs
# say for OpenAI-compatible servers: an extra-openai-models.yaml in a temporary LLM_USER_PATH, one chat
# model and one completion model, both with `api_base` set (so llm asks for no key).
#
#   benchmarks/clients/llm_cli.sh BASE_URL [CHAT_MODEL]     e.g. http://127.0.0.1:8000/v1 smollm2-135m
#
# Uses .peers/clients/bin/llm (benchmarks/clients/setup.sh; LLM overrides the path). Checks that
# `llm models` lists the model, that `llm -m ID "Say hi"` prints text and exits 0 streamed and with
# --no-stream, with a system prompt, options, a completion model and the usage llm logs. Exits non-zero on
# any failure. benchmarks/clients/run_all.sh starts the server and runs this.
set -euo pipefail
BASE_URL=${1:?usage: llm_cli.sh BASE_URL [CHAT_MODEL]}
MODEL=${2:-smollm2-135m}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LLM=${LLM:-$ROOT/.peers/clients/bin/llm}
[ -x "$LLM" ] || { echo "no $LLM: run benchmarks/clients/setup.sh" >&2; exit 1; }

LLM_USER_PATH=$(mktemp -d)
export LLM_USER_PATH
trap 'rm -rf "$LLM_USER_PATH"' EXIT
unset OPENAI_API_KEY OPENAI_BASE_URL LLM_OPENAI_SHOW_RESPONSES
cat > "$LLM_USER_PATH/extra-openai-models.yaml" <<EOF
- model_id: sobrio-chat
  model_name: $MODEL
  api_base: "$BASE_URL"
- model_id: sobrio-completion
  model_name: $MODEL
  api_base: "$BASE_URL"
  completion: true
EOF

fail() { echo "llm_cli: $*" >&2; exit 1; }
nonempty() {  # NAME TEXT: the text has a non-space character
  [[ "$2" =~ [^[:space:]] ]] || fail "$1 printed no text"
  local flat=${2//$'\n'/ }
  echo "$1: ${flat:0:100}"
}

models=$("$LLM" models list) || fail "llm models list exited $?"
grep -q "sobrio-chat" <<<"$models" || fail "llm models does not list sobrio-chat"

out=$("$LLM" -m sobrio-chat "Say hi") || fail "llm -m sobrio-chat exited $?"
nonempty "llm -m sobrio-chat (streamed)" "$out"

out=$("$LLM" -m sobrio-chat --no-stream -o temperature 0 -o max_tokens 16 \
  -s "You are a terse assistant." "What is 2 + 2?") || fail "--no-stream with options exited $?"
nonempty "llm --no-stream -s ... -o max_tokens 16" "$out"

# A conversation: -c continues the last one, so the model is sent the earlier turns.
out=$("$LLM" -c -o max_tokens 16 "And 3 + 3?") || fail "llm -c exited $?"
nonempty "llm -c (continued conversation)" "$out"

out=$(echo "The capital of France is" | "$LLM" -m sobrio-completion -o max_tokens 12) \
  || fail "completion model exited $?"
nonempty "llm -m sobrio-completion (stdin prompt)" "$out"

# llm logs each prompt with the token counts the server reported; the continued conversation holds both
# of its turns.
PY="$(dirname "$LLM")/python"
read -r cid usage < <("$LLM" logs list -m sobrio-chat -n 1 --json | "$PY" -c "
import json, sys
r = json.load(sys.stdin)[0]
assert r['response'].strip() and r['input_tokens'] and r['output_tokens'], r
print(r['conversation_id'], r['input_tokens'], r['output_tokens'])") || fail "llm logs show no usage"
turns=$("$LLM" logs list --cid "$cid" --json | "$PY" -c "import json, sys; print(len(json.load(sys.stdin)))")
[ "$turns" = 2 ] || fail "the continued conversation has $turns logged turns, not 2"
echo "llm logs: last response used $usage (input, output) tokens; its conversation has $turns turns"
