#!/usr/bin/env bash
# Session ownership on a real 3-member etcd cluster whose leader is killed (kill -9) under
# traffic: two replicas behind nginx take every member's URL (--etcd m0,m1,m2), claim and commit
# through the leader, and must go on through the new one. Every session continues token for
# token like a control server that never used etcd, at the control's position (no turn lost, none
# applied twice), and both replicas stay up. A call may fail while the members elect a new leader
# (a second or two): it is retried, unless it failed after its turn ran (sdm-client --json says
# error.turn_in_session "yes": the turn is in the session, docs/api.md Errors), which counts as
# done and is never sent again. Exit 77 without nginx or etcd.
#
#   tests/deploy/etcd_cluster_test.sh BUILD_DIR SOURCE_DIR [SESSIONS]
set -euo pipefail
BUILD_DIR=$1
SOURCE_DIR=$2
sessions=${3:-8}
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
cluster_test_begin nginx etcd

make_model
start_etcd_cluster 3
ports=()
for i in 0 1; do
  start_replica "r$i" --etcd "$ETCD_URLS" --replica_id "r$i"
  ports+=("$REPLICA_PORT")
done
nginx_port=$(free_port)
start_nginx "$nginx_port" "${ports[@]}"
start_control
via="127.0.0.1:$nginx_port"
control="127.0.0.1:$CONTROL_PORT"

for s in $(seq -w 1 "$sessions"); do
  "$client_bin" sessions create "s$s" --host "$via" >/dev/null || fail "create s$s"
  "$client_bin" sessions create "s$s" --host "$control" >/dev/null || fail "create control s$s"
  a=$(turn "$via" "s$s" 1) || fail "turn 1 of s$s"
  b=$(turn "$control" "s$s" 1) || fail "control turn 1 of s$s"
  [ "$a" = "$b" ] || fail "s$s turn 1: $a vs control $b"
done

leader=$(etcd_leader_index)
[ -n "$leader" ] || fail "no member says it is the leader"
kill -9 "$(cat "$work/etcd-m$leader.pid")"
killed_ns=$(date +%s%N)
first_ok_ms=""
for k in 2 3; do
  for s in $(seq -w 1 "$sessions"); do
    a=$(retry turn "$via" "s$s" $k) || fail "turn $k of s$s was not served after the leader died"
    [ -n "$first_ok_ms" ] || first_ok_ms=$((($(date +%s%N) - killed_ns) / 1000000))
    b=$(turn "$control" "s$s" $k) || fail "control turn $k of s$s"
    [ "$a" = "$b" ] || fail "s$s turn $k after the leader died: $a vs control $b"
  done
done
for s in $(seq -w 1 "$sessions"); do
  got=$(retry position "$via" "s$s") || fail "s$s: no position after the leader died"
  want=$(position "$control" "s$s")
  [ "$got" = "$want" ] || fail "s$s: position $got, control $want (a turn lost or applied twice)"
done
for i in 0 1; do
  kill -0 "$(cat "$work/r$i.pid")" 2>/dev/null || { cat "$work/r$i.err"; fail "replica r$i exited"; }
done
new_leader=$(etcd_leader_index)
if [ -z "$new_leader" ] || [ "$new_leader" = "$leader" ]; then
  fail "no new leader (had m$leader, now '$new_leader')"
fi
echo "ok: etcd leader m$leader killed under traffic of $sessions sessions on 2 replicas; new leader" \
  "m$new_leader; first turn served $first_ok_ms ms after the kill; every turn equal to the control;" \
  "calls retried: $(cat "$work/retries" 2>/dev/null | wc -l); turns that ran but were reported" \
  "unsaved: $(ran_unsaved)"
