# Sourced by the side-by-side scripts (ab_serving.sh, ab_llamacpp.sh, ab_at_size.sh): one server at a time in
# $SERVER, killed on exit so an interrupted run leaves no server behind, and bounded waits.
SERVER=
trap 'if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; fi' EXIT
# wait_for URL [SECONDS]: until URL answers (default 300 s; a model that compiles or loads 8B needs more)
wait_for() {
  for _ in $(seq "${2:-300}"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "no answer from $1" >&2
  return 1
}
# port_free URL: a server left on the port would answer for the one started next (and hold its prompts in its
# prefix cache): stop here instead
port_free() { if curl -s -o /dev/null "$1"; then echo "something already answers on $1: stop it first" >&2; exit 1; fi; }
