#!/usr/bin/env bash
# The README's main command: installs missing dependencies, builds, starts sdm-server on the
# trained demo model that ships in models/sdm-fortunes-demo (scripts/train-demo.sh retrains it),
# shows a sampled completion, then a session that is told a fact, is parked, survives a server
# restart, and answers a question about the fact from its saved state alone.
#
# Ends with the same model over the OpenAI-compatible HTTP API (docs/api.md, HTTP API): a curl
# call that streams a chat completion, printed and run.
#
#   scripts/run.sh [PROMPT]   (environment: SDM_MODEL_DIR, SDM_PRESET, SDM_BUILD_DIR, SDM_PORT,
#                              SDM_HTTP_PORT, SDM_STATE_DIR: the sessions' state, default
#                              ./sdm-state)
#
# SDM_PRESET=NAME serves a randomly initialised preset model instead (models/NAME, created on
# first use; the text is then noise, the mechanics the same).
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"A man who carries a cat by the tail"}
BUILD_DIR=${SDM_BUILD_DIR:-build}
PRESET=${SDM_PRESET:-}
if [ -n "$PRESET" ]; then
  MODEL_DIR=${SDM_MODEL_DIR:-models/$PRESET}
else
  MODEL_DIR=${SDM_MODEL_DIR:-models/sdm-fortunes-demo}
fi
PORT=${SDM_PORT:-50051}
HTTP_PORT=${SDM_HTTP_PORT:-8080}
STATE_DIR=${SDM_STATE_DIR:-sdm-state}

bash scripts/install-deps.sh
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR" -j"$(nproc)" --target sdm-model sdm-cli sdm-server sdm-client

if [ ! -f "$MODEL_DIR/config.json" ]; then
  if [ -z "$PRESET" ]; then
    echo "run: no model in $MODEL_DIR (scripts/train-demo.sh trains the demo model; SDM_PRESET=NAME"
    echo "     serves a randomly initialised preset)" >&2
    exit 1
  fi
  echo "run: creating a randomly initialised $PRESET model in $MODEL_DIR"
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
    # Ours, not another server on the port: a server that exited (its port in use, a bad model)
    # ends the wait at once with its own message above.
    if ! kill -0 "$server_pid" 2>/dev/null; then
      wait "$server_pid" 2>/dev/null || true
      server_pid=""
      echo "run: the server exited while starting (see its message above)" >&2
      return 1
    fi
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
echo "== a sampled completion (temperature 0.8) of: $PROMPT"
"${CLIENT[@]}" generate --prompt "$PROMPT" --max_tokens 160 --temperature 0.8 --seed 7
echo
SESSION="demo-$(date +%s)"
FACT="The code word of Ruth is amber."
TEXT="Nothing is so firmly believed as that which we least know. The best way to keep one's word \
is not to give it. When in doubt, tell the truth."
echo "== session $SESSION: told a fact, then text that pushes it far outside the sliding window"
"${CLIENT[@]}" sessions create "$SESSION"
printf '%s\n%s\n\n' "$FACT" "$TEXT"
"${CLIENT[@]}" generate --session "$SESSION" --prompt "$FACT"$'\n'"$TEXT"$'\n\n' \
  --max_tokens 60 --temperature 0.8 --seed 7 --stop $'\n'
echo
echo "== restarting the server (sessions are persisted to $STATE_DIR)"
stop_server
start_server
QUESTION=$'\n'"Q: What is the code word of Ruth?"$'\n'"A: "
echo "== session $SESSION resumed from its saved state, asked:${QUESTION}"
"${CLIENT[@]}" generate --session "$SESSION" --prompt "$QUESTION" --max_tokens 12 \
  --temperature 0 --stop $'\n'
echo
echo "(after the restart only the question was processed: the session's saved state stands for"
echo " everything before it. The attention layers see 16 bytes back, so only the SDM memory could"
echo " carry the fact. The demo model recalled 100% of 256 held-out facts at this distance, its"
echo " sliding-window twin at chance: see models/sdm-fortunes-demo/README.md)"
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
