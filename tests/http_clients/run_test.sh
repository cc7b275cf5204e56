#!/usr/bin/env bash
# Real HTTP clients against a real sdm-server: the official `openai` npm SDK (sdk_test.mjs),
# `curl -N` reading server-sent events, and in headless chromium the web console
# (console_test.mjs; SDM_CONSOLE_SCREENSHOT=PATH saves its screenshot) and calls from another
# origin (cors_test.mjs). Registered in ctest (tests/CMakeLists.txt) as
# http_clients.openai_sdk; exits 77 (skipped) when node, the SDK (npm ci, done by
# scripts/install-deps.sh) or curl is missing.
#
#   tests/http_clients/run_test.sh BUILD_DIR
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD_DIR=$(cd "${1:?usage: run_test.sh BUILD_DIR}" && pwd)
skip() { echo "SKIP: $*"; exit 77; }
command -v node >/dev/null || skip "node is not installed (scripts/install-deps.sh installs it)"
command -v curl >/dev/null || skip "curl is not installed"
[ -f "$HERE/node_modules/openai/package.json" ] ||
  skip "the openai npm package is not installed: run scripts/install-deps.sh (npm ci in $HERE)"

WORK=$(mktemp -d)
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill -TERM "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

"$BUILD_DIR/tools/sdm_model/sdm-model" init --preset tiny --seed 3 --out "$WORK/model" >/dev/null
KEY=sk-http-clients-test-0001
echo "$KEY node-tests" >"$WORK/keys.txt"
# The output files exist before the server's (backgrounded) redirections open them: the loop
# below may read out.txt first, and a missing file ended the script (set -e) on a loaded machine.
: >"$WORK/out.txt"
: >"$WORK/err.txt"
# The origin cors_test.mjs serves its pages from, allowed by the server (a free port now; the
# page server binds it later).
PAGE_PORT=$(node -e "const s = require('net').createServer();
  s.listen(0, '127.0.0.1', () => { console.log(s.address().port); s.close(); });")
"$BUILD_DIR/server/sdm-server" --model "$WORK/model" --port 0 --metrics_port -1 --http_port 0 \
  --state_dir "" --threads 1 --api_keys "$WORK/keys.txt" \
  --http_cors_origins "http://127.0.0.1:$PAGE_PORT" >"$WORK/out.txt" 2>"$WORK/err.txt" &
server_pid=$!
BASE=""
for _ in $(seq 1 600); do
  BASE=$(sed -n 's|^OpenAI-compatible HTTP API on \(http://[^ ]*\) .*$|\1|p' "$WORK/out.txt")
  [ -n "$BASE" ] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$WORK/err.txt"; echo "sdm-server exited"; exit 1; }
  sleep 0.1
done
[ -n "$BASE" ] || { cat "$WORK/err.txt"; echo "sdm-server did not start"; exit 1; }

node "$HERE/sdk_test.mjs" "$BASE" "$KEY"

# curl -N: server-sent events, one data line per chunk, ending with [DONE].
curl -sSN "$BASE/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": true,
       "stream_options": {"include_usage": true}}' >"$WORK/sse.txt"
grep -v '^:' "$WORK/sse.txt" | grep -v '^$' >"$WORK/events.txt"
if grep -qv '^data: ' "$WORK/events.txt"; then
  cat "$WORK/sse.txt"; echo "curl: a line that is not an SSE data line"; exit 1
fi
[ "$(tail -n 1 "$WORK/events.txt")" = "data: [DONE]" ] || { cat "$WORK/sse.txt"; echo "curl: no [DONE]"; exit 1; }
grep -q '"usage":{"completion_tokens":' "$WORK/events.txt" ||
  { cat "$WORK/sse.txt"; echo "curl: no usage chunk"; exit 1; }
echo "curl -N: $(wc -l <"$WORK/events.txt") events, ends with [DONE]"

# The web console in headless chromium (Debian's), when it is installed.
CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
if [ -n "$CHROMIUM" ] && [ -f "$HERE/node_modules/puppeteer-core/package.json" ]; then
  node "$HERE/console_test.mjs" "${BASE%/v1}" "$KEY" "$CHROMIUM" "${SDM_CONSOLE_SCREENSHOT:-}"
  node "$HERE/cors_test.mjs" "$BASE" "$KEY" "$CHROMIUM" "$PAGE_PORT"
else
  echo "console, cors: not tested (needs Debian's chromium and puppeteer-core: scripts/install-deps.sh)"
fi

kill -TERM "$server_pid"
wait "$server_pid"
server_pid=""
echo "http_clients: ok"
