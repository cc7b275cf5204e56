#!/usr/bin/env bash
# The HTTP API (sdm-server --http_port) through nginx (deploy/nginx/nginx.conf's HTTP front) in
# front of 3 sdm-server replicas sharing one --state_dir:
#  - sessions created through nginx (POST /v1/sessions with X-Session-Id and "session_id"), then
#    two greedy chat turns each with X-Session-Id, equal a control server's same turns (text,
#    finish reason, usage, the session's position; GET /v1/sessions/{id} alike afterwards);
#  - every request of a session went to one replica (nginx's HTTP access log names the key it
#    hashed and the upstream), and the sessions spread over more than one replica;
#  - GET /v1/sessions/{id} and POST /v1/sessions/{id}/fork without the header go where the header
#    sent the session (the path's id is the key);
#  - a streamed turn ("stream": true) arrives through nginx as several SSE events ending with
#    [DONE], with the control's text;
#  - requests naming no session (GET /v1/models) spread over more than one replica.
# Exit 77 (skipped) without nginx.
#
#   tests/deploy/nginx_http_routing_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD_DIR=$1
SOURCE_DIR=$2
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
cluster_test_begin nginx

make_model
ports=()
http_ports=()
for i in 0 1 2; do
  start_replica "r$i" --http_port 0
  ports+=("$REPLICA_PORT")
  http_ports+=("$REPLICA_HTTP_PORT")
done
nginx_port=$(free_port)
NGINX_HTTP_PORT=$(free_port)
REPLICA_HTTP_PORTS="${http_ports[*]}"
start_nginx "$nginx_port" "${ports[@]}"
start_control --http_port 0
via="http://127.0.0.1:$NGINX_HTTP_PORT"
direct="http://127.0.0.1:$CONTROL_HTTP_PORT"

# call BASE METHOD PATH BODY [curl args...]: the response body on stdout; fails the test unless
# the status is 200. BODY "" sends none.
call() {
  local base=$1 method=$2 path=$3 body=$4 status
  shift 4
  local args=(-sS -X "$method" -o "$work/response" -w '%{http_code}' "$@")
  [ -z "$body" ] || args+=(-H 'Content-Type: application/json' -d "$body")
  status=$(curl "${args[@]}" "$base$path") || fail "$method $base$path: curl failed"
  [ "$status" = 200 ] || { cat "$work/response"; echo; fail "$method $base$path: HTTP $status"; }
  cat "$work/response"
}
sent=0  # requests sent through nginx (each writes one access log line)


# turn_body ID K: a greedy chat turn of session ID.
turn_body() {
  jq -cn --arg m "turn $2 of $1" \
    '{messages: [{role: "user", content: $m}], max_tokens: 6, temperature: 0, seed: 7}'
}
# What two answers of one turn must share (the text is the tokens: byte-level model).
outcome='{text: .choices[0].message.content, finish: .choices[0].finish_reason, usage: .usage,
          session: .session}'

sessions=8
for s in $(seq 1 $sessions); do
  id="h$s"
  create=$(jq -cn --arg id "$id" '{session_id: $id}')
  got=$(call "$via" POST /v1/sessions "$create" -H "X-Session-Id: $id" | jq -r .id)
  sent=$((sent + 1))
  [ "$got" = "$id" ] || fail "create $id through nginx answered id '$got'"
  call "$direct" POST /v1/sessions "$create" >/dev/null
  for k in 1 2; do
    a=$(call "$via" POST /v1/chat/completions "$(turn_body "$id" "$k")" -H "X-Session-Id: $id" |
      jq -c "$outcome")
    sent=$((sent + 1))
    b=$(call "$direct" POST /v1/chat/completions "$(turn_body "$id" "$k")" -H "X-Session-Id: $id" |
      jq -c "$outcome")
    [ "$a" = "$b" ] || fail "$id turn $k: through nginx $a, control $b"
    [ "$(jq -r .session.id <<<"$a")" = "$id" ] || fail "$id turn $k: not a turn of the session: $a"
  done
  # No header: nginx hashes the id in the path.
  a=$(call "$via" GET "/v1/sessions/$id" "" | jq -c '{id, position}')
  sent=$((sent + 1))
  b=$(call "$direct" GET "/v1/sessions/$id" "" | jq -c '{id, position}')
  [ "$a" = "$b" ] || fail "GET /v1/sessions/$id through nginx $a, control $b"
done

# A fork without the header goes to its source's replica.
call "$via" POST /v1/sessions/h1/fork '{"new_session_id": "h1-fork"}' >/dev/null
sent=$((sent + 1))

# A streamed turn: SSE events as the server writes them, then [DONE].
stream_body=$(jq -cn '{messages: [{role: "user", content: "a streamed turn"}], max_tokens: 8,
                       temperature: 0, seed: 7, stream: true}')
call "$via" POST /v1/chat/completions "$stream_body" -N -H "X-Session-Id: h2" \
  -D "$work/stream.headers" >"$work/stream.via"
sent=$((sent + 1))
call "$direct" POST /v1/chat/completions "$stream_body" -N -H "X-Session-Id: h2" >"$work/stream.direct"
grep -qi '^content-type: text/event-stream' "$work/stream.headers" ||
  { cat "$work/stream.headers"; fail "the stream through nginx is not text/event-stream"; }
events=$(grep -c '^data: ' "$work/stream.via" || true)
[ "$events" -ge 3 ] || { cat "$work/stream.via"; fail "the stream through nginx has $events events"; }
[ "$(grep '^data: ' "$work/stream.via" | tail -1)" = "data: [DONE]" ] ||
  { cat "$work/stream.via"; fail "the stream through nginx does not end with [DONE]"; }
# stream_text FILE: the streamed text and the final chunk's finish reason and session.
stream_text() {
  grep '^data: {' "$1" | sed 's/^data: //' |
    jq -rs '[.[].choices[0].delta.content // empty] | join("")' &&
    grep '^data: {' "$1" | sed 's/^data: //' | jq -c 'select(.choices[0].finish_reason != null) |
      {finish: .choices[0].finish_reason, session}'
}
[ "$(stream_text "$work/stream.via")" = "$(stream_text "$work/stream.direct")" ] ||
  fail "the streamed turn through nginx differs from the control: $(stream_text "$work/stream.via")" \
    "vs $(stream_text "$work/stream.direct")"

one_shots=12
for _ in $(seq 1 $one_shots); do call "$via" GET /v1/models "" >/dev/null; done
sent=$((sent + one_shots))

log="$work/nginx/logs/http-access.log"
log_complete() { [ "$(wc -l <"$log")" -ge $sent ]; }
wait_for "nginx to log $sent requests" 60 log_complete
[ "$(wc -l <"$log")" -eq $sent ] || { cat "$log"; fail "expected $sent lines in the access log"; }
upstream_of() { sed 's/.* upstream=\([^ ]*\) .*/\1/'; }
replicas_used=""
for s in $(seq 1 $sessions); do
  id="h$s"
  lines=$(grep "key=\"$id\" " "$log" || true)
  # create, 2 turns, the GET (h1: the fork, h2: the stream)
  case $id in h1 | h2) expected=5 ;; *) expected=4 ;; esac
  [ "$(wc -l <<<"$lines")" -eq $expected ] || { cat "$log"; fail "$id: not $expected requests keyed on it"; }
  upstreams=$(upstream_of <<<"$lines" | sort -u)
  [ "$(wc -l <<<"$upstreams")" -eq 1 ] || fail "session $id went to several replicas: $upstreams"
  grep -q "session=\"-\" key=\"$id\" .* request=\"GET /v1/sessions/$id\"" <<<"$lines" ||
    fail "$id: no GET without the header keyed on the path's id"
  replicas_used+="$upstreams"$'\n'
done
grep -q 'session="-" key="h1" .* request="POST /v1/sessions/h1/fork"' "$log" ||
  fail "the fork without the header was not keyed on its source"
n_session_replicas=$(echo -n "$replicas_used" | sort -u | wc -l)
[ "$n_session_replicas" -ge 2 ] || fail "all sessions hashed to one replica"
n_oneshot_replicas=$(grep 'request="GET /v1/models"' "$log" | upstream_of | sort -u | wc -l)
[ "$n_oneshot_replicas" -ge 2 ] || fail "requests without a session all went to one replica"
echo "ok: $sessions HTTP sessions x 2 turns through nginx stick to their replica" \
  "($n_session_replicas replicas used) and equal the control; GET and fork without the header" \
  "follow the path's id; a stream of $events SSE events ends with [DONE];" \
  "$one_shots requests without a session spread over $n_oneshot_replicas"
