#!/usr/bin/env bash
# The README's main command: installs missing dependencies, builds, creates the default model if
# there is none, starts sdm-server on it, shows a completion, then a session that is parked,
# survives a server restart and resumes without re-reading its history.
#
# Ends with the same model over the OpenAI-compatible HTTP API (docs/api.md, HTTP API): a curl
# call that streams a chat completion, printed and run.
#
#   scripts/run.sh [PROMPT]   (environment: SDM_MODEL_DIR, SDM_PRESET, SDM_BUILD_DIR, SDM_PORT,
#                              SDM_HTTP_PORT)
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Sparse delta memory keeps a whole conversation in a fixed-size state, so"}
BUILD_DIR=${SDM_BUILD_DIR:-build}
PRESET=${SDM_PRESET:-debug_sdm}
MODEL_DIR=${SDM_MODEL_DIR:-models/$PRESET}
PORT=${SDM_PORT:-50051}
HTTP_PORT=${SDM_HTTP_PORT:-8080}
STATE_DIR=${SDM_STATE_DIR:-sdm-state}

bash scripts/install-deps.sh
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR" -j"$(nproc)" --target sdm-model sdm-cli sdm-server sdm-client

if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "run: creating a randomly initialised $PRESET model in $MODEL_DIR (no trained weights ship"
  echo "     with the project; convert one with tools/convert_reference_checkpoint.py)"
  "$BUILD_DIR/tools/sdm_model/sdm-model" init --preset "$PRESET" --seed 0 --out "$MODEL_DIR"
fi

SERVER="$BUILD_DIR/server/sdm-server"
CLIENT=("$BUILD_DIR/client/sdm-client" --host "127.0.0.1:$PORT")
server_pid=""
start_server() {
  "$SERVER" --model "$MODEL_DIR" --port "$PORT" --metrics_port 0 --http_port "$HTTP_PORT" \
    --state_dir "$STATE_DIR" &
  server_pid=$!
  for _ in $(seq 1 120); do
    "${CLIENT[@]}" info >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "run: the server did not come up" >&2
  return 1
}
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill -TERM "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT

start_server
echo
echo "== a completion (random weights: the text is noise, the mechanics are real)"
"${CLIENT[@]}" generate --prompt "$PROMPT" --max_tokens 32 --temperature 0
echo
SESSION="demo-$(date +%s)"
echo "== session $SESSION: first turn"
"${CLIENT[@]}" sessions create "$SESSION"
"${CLIENT[@]}" generate --session "$SESSION" --prompt "$PROMPT" --max_tokens 16 --temperature 0
echo
echo "== restarting the server (sessions are persisted to $STATE_DIR)"
stop_server
start_server
echo "== session $SESSION resumed: its history is carried by the state, not re-read"
"${CLIENT[@]}" generate --session "$SESSION" --prompt " and then" --max_tokens 16 --temperature 0
"${CLIENT[@]}" sessions get "$SESSION"
echo
echo "== the same server over the OpenAI-compatible HTTP API (http://127.0.0.1:$HTTP_PORT/v1):"
CURL=(curl -sN "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" -H 'Content-Type: application/json'
      -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "stream": true}')
echo "curl -N http://127.0.0.1:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "  -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 16, \"stream\": true}'"
"${CURL[@]}" | head -n 8 || true  # head closes the stream early
echo "..."
echo "web console: http://127.0.0.1:$HTTP_PORT/ (while sdm-server runs with --http_port $HTTP_PORT:"
echo "  $SERVER --model $MODEL_DIR --http_port $HTTP_PORT)"
