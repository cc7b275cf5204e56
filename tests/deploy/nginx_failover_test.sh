#!/usr/bin/env bash
# kill -9 of one of 3 replicas behind nginx (deploy/nginx/nginx.conf), sharing one --state_dir
# with --persist turn (the default): every session is served again, by another replica, from
# what the dead one persisted. Every turn before the kill was acknowledged, so on disk (a turn's
# final chunk waits for its write): a session whose position then differs from the control's
# (behind: a turn lost; ahead: one applied twice) fails the test, and every session continues
# token for token like a control server that never failed. Prints the failover figures.
# With `drain`, the replica gets SIGTERM instead (a scale-down or a rolling upgrade): it writes
# every session before it exits, so no turn may be lost; prints how long the drain took. With
# `drain-busy`, one of its sessions is in an endless generation when the SIGTERM comes (the
# replicas run with --shutdown_grace 1h and no practical max_tokens limit): its other sessions must be served by the other replicas
# while it still drains (its port closed: nginx re-hashes them), and the generation goes on until
# its client leaves, which ends the drain.
# With `etcd` as 4th argument, the replicas own their sessions in etcd (--etcd, started by the
# test): after a kill -9 the dead replica's sessions are refused (UNAVAILABLE) until its lease
# expires (10 s), and calls are retried until then; after a drain its lease is revoked at once.
# Their etcd requests may take 30 s (--etcd_request_timeout; 2 s by default) so that an etcd
# stalled by a loaded disk does not fail them. A call that failed all the same is retried, unless
# its turn ran (sdm-client --json says error.turn_in_session "yes": docs/api.md), which counts as
# done and is never sent again; a create retried after a failure that created the session
# (ALREADY_EXISTS) counts as done too.
# Exit 77 (skipped) without nginx (or etcd, when asked for).
#
# SESSIONS (default 20) sessions run two turns each before the failure (more while the last one
# ran unsaved), all compared with the control.
#
#   tests/deploy/nginx_failover_test.sh BUILD_DIR SOURCE_DIR [kill|drain|drain-busy] [etcd|-] [SESSIONS]
set -euo pipefail
BUILD_DIR=$1
SOURCE_DIR=$2
mode=${3:-kill}
with_etcd=${4:-}
[ "$with_etcd" != - ] || with_etcd=
sessions=${5:-20}
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
cluster_test_begin nginx ${with_etcd:+etcd}

make_model
extra=()
[ "$mode" != drain-busy ] || extra+=(--shutdown_grace 1h --max_tokens_limit 100000000)
if [ -n "$with_etcd" ]; then
  start_etcd
  extra+=(--etcd "$ETCD_URL" --etcd_request_timeout 30s)
fi
ports=()
for i in 0 1 2; do
  if [ -n "$with_etcd" ]; then
    start_replica "r$i" "${extra[@]}" --replica_id "r$i"
  else
    start_replica "r$i" "${extra[@]}"
  fi
  ports+=("$REPLICA_PORT")
done
nginx_port=$(free_port)
start_nginx "$nginx_port" "${ports[@]}"
"$server_bin" --model "$work/model" --host 127.0.0.1 --port 0 --metrics_port -1 --threads 1 \
  --state_dir "$work/control_state" >"$work/control.out" 2>"$work/control.err" &
echo $! >>"$work/pids"; disown
for _ in $(seq 1 600); do grep -q "^listening on" "$work/control.out" && break; sleep 0.1; done
control_port=$(sed -n 's/^listening on [^ ]*:\([0-9]*\) .*/\1/p' "$work/control.out" | head -1)
[ -n "$control_port" ] || fail "control server did not start"
via="127.0.0.1:$nginx_port"
control="127.0.0.1:$control_port"

# create HOST SESSION: creates the session, retrying a failure (retry); ALREADY_EXISTS on a retry
# is success (the call that failed created it: its answer was lost or came too late).
create() {
  : >"$work/create_tried"
  retry create_once "$@"
}
create_once() {
  local err
  err=$("$client_bin" sessions create "$2" --host "$1" 2>&1 >/dev/null) && return 0
  echo "$err" >>"$work/client.err"
  [ -s "$work/create_tried" ] && [[ "$err" == *ALREADY_EXISTS* ]] && return 0
  echo >>"$work/create_tried"
  return 1
}

# last_upstream: for each nginx access log line on stdin, the replica that answered: the last
# address of $upstream_addr ("A, B" when nginx retried the request on another replica).
last_upstream() { sed -n 's/.* upstream=\(.*\) status=.*/\1/p' | sed 's/.*[,:] //'; }

for s in $(seq -w 1 $sessions); do
  id="s$s"
  create "$via" "$id" || fail "create $id"
  "$client_bin" sessions create "$id" --host "$control" >/dev/null || fail "create control $id"
  # Two turns, the last one acknowledged (saved): after a turn that ran unsaved, one more (the
  # session's next turn writes the unsaved one before it is acknowledged).
  k=1
  while :; do
    unsaved_before=$(ran_unsaved)
    a=$(retry turn "$via" "$id" $k) || fail "turn $k of $id"
    b=$(turn "$control" "$id" $k) || fail "control turn $k of $id"
    [ "$a" = "$b" ] || fail "$id turn $k: $a vs control $b"
    [ $k -ge 2 ] && [ "$(ran_unsaved)" = "$unsaved_before" ] && break
    k=$((k + 1))
  done
done
# The victim is the replica that holds the most sessions (at least a third of them: the hash
# spread over ports chosen at random could leave a given replica one session or none).
log="$work/nginx/logs/access.log"
on_victim=()
victim=-1
for i in 0 1 2; do
  held=()
  for s in $(seq -w 1 $sessions); do
    [ "$(grep "session=\"s$s\"" "$log" | tail -1 | last_upstream)" = "127.0.0.1:${ports[$i]}" ] &&
      held+=("s$s")
  done
  if [ ${#held[@]} -gt ${#on_victim[@]} ]; then
    on_victim=("${held[@]}")
    victim=$i
  fi
done
[ $victim -ge 0 ] || fail "no session was on any replica (the access log names none)"
victim_port=${ports[$victim]}

# Baseline: the same get + get + turn for a session on a live replica, before anything fails
# (each is an sdm-client process: most of these milliseconds are process start-up).
for s in $(seq -w 1 $sessions); do
  [[ " ${on_victim[*]} " == *" s$s "* ]] && continue
  start_ns=$(date +%s%N)
  position "$via" "s$s" >/dev/null
  position "$control" "s$s" >/dev/null
  turn "$via" "s$s" 3 >/dev/null
  baseline_ms=$((($(date +%s%N) - start_ns) / 1000000))
  turn "$control" "s$s" 3 >/dev/null
  baseline_session="s$s"
  break
done
victim_pid=$(cat "$work/r$victim.pid")
if [ "$mode" = drain-busy ]; then
  # One of the victim's sessions generates until its client leaves; it is not compared with the
  # control (where that stream ends is not the control's), only checked to go on after the drain.
  busy=${on_victim[0]}
  on_victim=("${on_victim[@]:1}")
  [ ${#on_victim[@]} -gt 0 ] || fail "one session only on the replica to drain (hash spread)"
  busy_position=$(position "$via" "$busy")
  "$client_bin" generate --host "$via" --session "$busy" --prompt "endless" --max_tokens 100000000 --ignore_eos \
    >"$work/busy.out" 2>"$work/busy.err" &
  busy_pid=$!
  echo $busy_pid >>"$work/pids"
  for _ in $(seq 1 600); do [ -s "$work/busy.out" ] && break; sleep 0.1; done
  [ -s "$work/busy.out" ] || { cat "$work/busy.err"; fail "the endless generation printed nothing"; }
fi
drain_ms=n/a
if [ "$mode" = drain-busy ]; then
  term_ns=$(date +%s%N)
  kill -TERM "$victim_pid"
elif [ "$mode" = drain ]; then
  term_ns=$(date +%s%N)
  kill -TERM "$victim_pid"
  for _ in $(seq 1 2400); do kill -0 "$victim_pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$victim_pid" 2>/dev/null && fail "the drained replica did not exit"
  drain_ms=$((($(date +%s%N) - term_ns) / 1000000))
else
  kill -9 "$victim_pid"
fi
killed_ns=$(date +%s%N)
lost=0
failed=0
first_ok_ms=""
max_turn_ms=0
for id in "${on_victim[@]}"; do
  start_ns=$(date +%s%N)
  got_position=$(retry position "$via" "$id") || { failed=$((failed + 1)); continue; }
  want_position=$(position "$control" "$id")
  if [ "$got_position" != "$want_position" ]; then
    lost=$((lost + 1))  # an acknowledged turn was not on disk at the kill, or applied twice
    echo "$id: position $got_position after the failover, control $want_position" >&2
    continue
  fi
  a=$(retry turn "$via" "$id" 3) || { failed=$((failed + 1)); continue; }
  end_ns=$(date +%s%N)
  b=$(turn "$control" "$id" 3) || fail "control turn 3 of $id"
  [ "$a" = "$b" ] || fail "$id after failover: $a vs control $b"
  ms=$(((end_ns - start_ns) / 1000000))
  [ $ms -gt $max_turn_ms ] && max_turn_ms=$ms
  [ -n "$first_ok_ms" ] || first_ok_ms=$(((end_ns - killed_ns) / 1000000))
done
[ $failed -eq 0 ] || fail "$failed sessions of the dead replica were not served again"
[ $lost -eq 0 ] || fail "$lost sessions are not at the control's position after the $mode"
if [ "$mode" = drain-busy ]; then
  # Served elsewhere while it drained: it is still running, its stream too.
  kill -0 "$victim_pid" 2>/dev/null || fail "the drained replica exited before the end of its stream"
  kill -0 "$busy_pid" 2>/dev/null || { cat "$work/busy.err"; fail "the endless generation ended during the drain"; }
  kill -TERM "$busy_pid"  # the client leaves: the stream is cancelled, so the drain ends
  for _ in $(seq 1 2400); do kill -0 "$victim_pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$victim_pid" 2>/dev/null && fail "the drained replica did not exit after its stream ended"
  drain_ms=$((($(date +%s%N) - term_ns) / 1000000))
  # The busy session was written at the drain with what it generated, and goes on elsewhere.
  after=$(retry position "$via" "$busy") || fail "$busy was not served after the drain"
  [ "$after" -gt "$busy_position" ] || fail "$busy: position $after after the drain, $busy_position before"
  retry turn "$via" "$busy" 3 >/dev/null || fail "a turn of $busy after the drain"
fi
# Every other session is untouched.
for s in $(seq -w 1 $sessions); do
  id="s$s"
  [[ " ${on_victim[*]} " == *" $id "* ]] && continue
  [ "$id" = "$baseline_session" ] && continue  # its turn 3 ran before
  [ "$id" = "${busy:-}" ] && continue
  a=$(turn "$via" "$id" 3) || fail "turn 3 of $id (not on the dead replica)"
  b=$(turn "$control" "$id" 3) || fail "control turn 3 of $id"
  [ "$a" = "$b" ] || fail "$id: $a vs control $b"
done
moved_upstreams=$(for id in "${on_victim[@]}"; do grep "session=\"$id\"" "$log" | tail -1; done |
  last_upstream | sort -u | tr '\n' ' ')
echo "ok: $mode ${with_etcd:+(etcd ownership) }of 1 of 3 replicas (drain took $drain_ms ms): ${#on_victim[@]} of $sessions" \
  "sessions were on it; requests failed: $failed; turns lost: $lost; first session served again" \
  "${first_ok_ms:-n/a} ms after it was gone; slowest get+get+turn of a moved session: $max_turn_ms ms" \
  "(the same on a live replica before: $baseline_ms ms); calls retried: $(cat "$work/retries" 2>/dev/null | wc -l);" \
  "turns that ran but were reported unsaved: $(ran_unsaved);" \
  "last upstreams of the moved sessions: $moved_upstreams"
