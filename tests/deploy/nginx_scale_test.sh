#!/usr/bin/env bash
# Scale 3 -> 4 -> 3 under traffic (docs/replicas.md, "Handoff"): etcd + nginx + 3 replicas on one
# shared directory; a client loop runs turns of every session through nginx, each compared with
# the same turn on a control server, while the test adds a 4th replica to nginx's ring (nginx -s
# reload), then takes it out again and drains it (SIGTERM). Sessions whose hash moves are handed
# over on request: the new replica asks the live owner through etcd, the owner parks the session
# and releases it. Asserts: every turn equals the control's (moved sessions continue bit-exactly);
# every failed call failed with a retryable status and a retry hint, or was ended by nginx's own
# reload (UNAVAILABLE "GOAWAY received", no hint), and its retry then succeeded; the 4th replica served sessions and handoffs happened both ways. Prints the counts.
# Waits are on observable conditions (turns done, log lines, process exit), bounded generously.
# Exit 77 without nginx or etcd.
#
#   tests/deploy/nginx_scale_test.sh BUILD_DIR SOURCE_DIR [SESSIONS]
set -euo pipefail
BUILD_DIR=$1
SOURCE_DIR=$2
sessions=${3:-9}
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
cluster_test_begin nginx etcd
# On failure, what the CI log needs to tell a retried call that had already run (a GOAWAY from
# nginx's reload) from a handoff that lost or repeated a turn: the calls that failed and were
# retried, and what each replica logged about sessions and handoffs.
report_failure() {
  echo "-- calls that failed and were retried ($work/failures):"
  cat "$work/failures" 2>/dev/null || echo "(none)"
  echo "-- sessions whose call nginx's reload ended (GOAWAY): $(sort -u "$work/goaway" 2>/dev/null |
    tr '\n' ' ')"
  for err in "$work"/r*.err; do
    [ -f "$err" ] || continue
    echo "-- $(basename "$err") (lines naming a session, handoff or park, last 15):"
    grep -iE "session|handoff|hand|park|claim" "$err" | tail -15 || true
  done
}
cluster_test_on_exit() {
  touch "$work/stop"
  if [ "$1" -ne 0 ]; then report_failure; fi
}

make_model
start_etcd
# Leases of 15 s (keepalive every 5 s): nothing here waits for one to expire (a drained replica
# revokes its own), and a live replica stalled by a loaded machine for less keeps its sessions.
flags=(--etcd "$ETCD_URL" --etcd_lease_ttl 15s)
ports=()
for i in 0 1 2; do
  start_replica "r$i" "${flags[@]}" --replica_id "r$i"
  ports+=("$REPLICA_PORT")
done
nginx_port=$(free_port)
start_nginx "$nginx_port" "${ports[@]}"
start_control
via="127.0.0.1:$nginx_port"
control="127.0.0.1:$CONTROL_PORT"
log="$work/nginx/logs/access.log"

# route_of ID: calls GetSession(ID) through nginx and prints the upstream that nginx's access log
# gives for that call (waiting for its line: nginx may write it just after the client has its
# answer). ID need not exist.
route_of() {
  local before deadline=$(($(date +%s) + 120))
  before=$(grep -c "session=\"$1\"" "$log" 2>/dev/null || true)
  "$client_bin" sessions get "$1" --host "$via" >/dev/null 2>&1 || true
  until [ "$(grep -c "session=\"$1\"" "$log" 2>/dev/null || true)" -gt "$before" ]; do
    [ "$(date +%s)" -lt $deadline ] || { echo "none"; return 0; }
    sleep 0.05
  done
  grep "session=\"$1\"" "$log" | tail -1 | sed 's/.* upstream=\([^ ]*\) .*/\1/'
}

# The 4th replica runs from here on, out of nginx's ring until step 1. The session names: m1..mN,
# with the last replaced, if need be, by a name that the ring with the 4th replica hashes to it
# (probed with calls for names that do not exist yet), so that the 3 -> 4 step always moves a
# session: the ring depends on the replicas' ports, free ports picked at start, and with N names
# and no probe about (3/4)^N of the runs would move none.
start_replica r3 "${flags[@]}" --replica_id r3
port_3=$REPLICA_PORT
names=()
for s in $(seq 1 "$sessions"); do names+=("m$s"); done

# One turn of session $1 (prompt $2) through nginx, retried while it fails with a retryable
# status and a retry hint (each failure logged in $work/failures); then on the control.
turn_checked() {
  local id=$1 prompt=$2 got want err deadline
  deadline=$(($(date +%s) + 120))
  while true; do
    err="$work/turn.err"
    if got=$("$client_bin" generate --host "$via" --session "$id" --prompt "$prompt" \
      --max_tokens 4 --json 2>"$err" | jq -c '.token_ids'); then
      [ -n "$got" ] && break
    fi
    echo "$id '$prompt': $(grep 'sdm-client' "$err" | tr '\n' ' ')" >>"$work/failures"
    # nginx itself ends calls in flight on a connection its reload closes: UNAVAILABLE "GOAWAY
    # received", with no hint (no server answered). Retried like the rest; the retry must still
    # equal the control, so a turn that had run before the GOAWAY would show as a divergence.
    if grep -q "UNAVAILABLE: GOAWAY received" "$err"; then
      echo "$id" >>"$work/goaway"
    elif ! grep -q "UNAVAILABLE\|ABORTED" "$err" || ! grep -q "retry after" "$err"; then
      echo "$id '$prompt': not retryable: $(cat "$err")" >>"$work/bad"
      return 1
    fi
    [ "$(date +%s)" -lt $deadline ] || { echo "$id: gave up" >>"$work/bad"; return 1; }
    sleep 0.2
  done
  want=$("$client_bin" generate --host "$control" --session "$id" --prompt "$prompt" \
    --max_tokens 4 --json 2>>"$work/control.client.err" | jq -c '.token_ids') ||
    { echo "control turn of $id failed" >>"$work/bad"; return 1; }
  if [ "$got" != "$want" ]; then
    echo "$id '$prompt': $got vs control $want" >>"$work/bad"
    return 1
  fi
  echo "$id" >>"$work/turns"
}

# The traffic: rounds over every session until $work/stop exists.
traffic() {
  local round=0
  while [ ! -e "$work/stop" ]; do
    round=$((round + 1))
    for id in "${names[@]}"; do
      turn_checked "$id" "round $round of $id" || return 1
    done
  done
}
turns_done() { [ -f "$work/turns" ] && [ "$(wc -l <"$work/turns")" -ge "$1" ]; }
traffic_failed() { [ -s "$work/bad" ]; }
wait_turns() {  # wait_turns N: until N turns are done (fails at once when the traffic failed)
  local deadline=$(($(date +%s) + 300))
  until turns_done "$1"; do
    traffic_failed && fail "traffic: $(cat "$work/bad")"
    kill -0 "$traffic_pid" 2>/dev/null || fail "the traffic loop exited"
    [ "$(date +%s)" -lt $deadline ] || fail "gave up waiting for $1 turns"
    sleep 0.1
  done
}
set_upstreams() {  # set_upstreams PORT...: nginx's ring, reloaded
  : >"$work/nginx/conf/sdm-upstreams.conf.new"
  for p in "$@"; do
    echo "server 127.0.0.1:$p max_fails=1 fail_timeout=5s;" >>"$work/nginx/conf/sdm-upstreams.conf.new"
  done
  mv "$work/nginx/conf/sdm-upstreams.conf.new" "$work/nginx/conf/sdm-upstreams.conf"
  nginx -p "$work/nginx" -c conf/nginx.conf -e "$work/nginx/logs/error.log" -s reload ||
    fail "nginx reload"
}

set_upstreams "${ports[@]}" "$port_3"
to_r3_name=""
for k in $(seq 1 200); do
  if [ "$(route_of "m$k")" = "127.0.0.1:$port_3" ]; then
    to_r3_name="m$k"
    break
  fi
done
[ -n "$to_r3_name" ] || fail "none of 200 session names hashes to the 4th replica"
if ! printf '%s\n' "${names[@]}" | grep -qx "$to_r3_name"; then
  names[$((sessions - 1))]=$to_r3_name
fi
# wait_ring yes|no: until nginx routes $to_r3_name to the 4th replica (yes) or elsewhere (no).
# A reload is asynchronous: the calls that follow set_upstreams may still meet the old ring, and
# the phases below assert on what the new one does.
wait_ring() {
  local deadline=$(($(date +%s) + 120)) route
  while :; do
    route=$(route_of "$to_r3_name")
    if [ "$1" = yes ]; then
      [ "$route" = "127.0.0.1:$port_3" ] && return 0
    else
      [ "$route" != "127.0.0.1:$port_3" ] && return 0
    fi
    [ "$(date +%s)" -lt $deadline ] || fail "nginx's ring did not change after its reload ($1)"
    sleep 0.1
  done
}
set_upstreams "${ports[@]}"
wait_ring no  # so that no session is created on the 4th replica
for id in "${names[@]}"; do
  "$client_bin" sessions create "$id" --host "$via" >/dev/null || fail "create $id"
  "$client_bin" sessions create "$id" --host "$control" >/dev/null || fail "create control $id"
done

traffic &
traffic_pid=$!
phase() {  # phase: waits until the traffic has run 2 more rounds over every session
  local at
  at=$(wc -l <"$work/turns")
  wait_turns $((at + 2 * sessions))
}
count() { grep -c "$1" "$2" 2>/dev/null || true; }
wait_turns "$sessions"
# 1. Scale up: the 4th replica joins the ring; about a quarter of the sessions (at least one, by
# the choice of names) hash to it and are handed over on request by their live owners.
set_upstreams "${ports[@]}" "$port_3"
wait_ring yes
phase
to_r3=$(cat "$work"/r[012].err | grep -c "asked by 'r3'" || true)
[ "$to_r3" -gt 0 ] || fail "no session was handed over to the 4th replica"
# 2. Out of the ring, still running: its sessions are asked for by the others and handed back.
set_upstreams "${ports[@]}"
wait_ring no
phase
from_r3=$(count "handed session" "$work/r3.err")
[ "$from_r3" -gt 0 ] || fail "the 4th replica handed nothing back on request"
# 3. Into the ring again, then drained (SIGTERM, as a scale-down's preStop) while still in it:
# calls reaching it are refused (retryable, with a hint) or, once its port closes, go to the
# next replica; its lease is revoked after it wrote every session.
set_upstreams "${ports[@]}" "$port_3"
wait_ring yes
phase
stop_replica r3 TERM
phase
set_upstreams "${ports[@]}"
wait_ring no
phase
touch "$work/stop"
wait "$traffic_pid" || fail "traffic: $(cat "$work/bad" 2>/dev/null)"
traffic_failed && fail "traffic: $(cat "$work/bad")"
on_r3=$(count "upstream=127.0.0.1:$port_3 " "$log")
to_r3=$(cat "$work"/r[012].err | grep -c "asked by 'r3'" || true)
from_r3=$(count "handed session" "$work/r3.err")
failures=0
[ -f "$work/failures" ] && failures=$(wc -l <"$work/failures")
goaways=0
[ -f "$work/goaway" ] && goaways=$(wc -l <"$work/goaway")
moved=$(for id in "${names[@]}"; do
  grep "session=\"$id\"" "$log" | grep -v 'grpc_status=5$' | sed 's/.* upstream=\([^ ]*\) .*/\1/' | sort -u | wc -l
done | awk '$1 > 1' | wc -l)
echo "ok: scale 3 -> 4 -> 3 -> 4, drain 4 -> 3 under traffic: $(wc -l <"$work/turns") turns of" \
  "$sessions sessions, all equal to the control; $moved sessions changed replica; handed over" \
  "to r3 on request: $to_r3, by r3 on request: $from_r3; calls failed and retried: $failures" \
  "(all retryable with a retry hint, but $goaways ended by nginx's reload: GOAWAY, no hint);" \
  "calls that reached r3: $on_r3"
if [ "$failures" -gt 0 ]; then
  sed 's/^/  /' "$work/failures" | head -20
fi
