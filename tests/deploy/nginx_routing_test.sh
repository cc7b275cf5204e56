#!/usr/bin/env bash
# nginx (deploy/nginx/nginx.conf) in front of 3 sdm-server replicas sharing one --state_dir:
#  - every call of a session goes to one replica (the nginx access log names the upstream of
#    every call), and the sessions spread over more than one replica;
#  - calls without a session spread over more than one replica;
#  - each session's greedy tokens through nginx equal a control run on one server directly.
# Exit 77 (skipped) without nginx.
#
#   tests/deploy/nginx_routing_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD_DIR=$1
SOURCE_DIR=$2
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
cluster_test_begin nginx

make_model
ports=()
for i in 0 1 2; do start_replica "r$i"; ports+=("$REPLICA_PORT"); done
nginx_port=$(free_port)
start_nginx "$nginx_port" "${ports[@]}"
mkdir -p "$work/control_state"
"$server_bin" --model "$work/model" --host 127.0.0.1 --port 0 --metrics_port -1 --threads 1 \
  --state_dir "$work/control_state" >"$work/control.out" 2>"$work/control.err" &
echo $! >>"$work/pids"; disown
for _ in $(seq 1 600); do grep -q "^listening on" "$work/control.out" && break; sleep 0.1; done
control_port=$(sed -n 's/^listening on [^ ]*:\([0-9]*\) .*/\1/p' "$work/control.out" | head -1)
[ -n "$control_port" ] || fail "control server did not start"

sessions=12
turns=3
# turn HOST SESSION K: one greedy turn; prints its token ids.
turn() {
  "$client_bin" generate --host "$1" --session "$2" --prompt "turn $3 of $2" --max_tokens 4 \
    --json 2>>"$work/client.err" | jq -c '.token_ids'
}
for s in $(seq -w 1 $sessions); do
  id="s$s"
  "$client_bin" sessions create "$id" --host "127.0.0.1:$nginx_port" >/dev/null ||
    fail "create $id through nginx"
  "$client_bin" sessions create "$id" --host "127.0.0.1:$control_port" >/dev/null ||
    fail "create $id on the control server"
  for k in $(seq 1 $turns); do
    via=$(turn "127.0.0.1:$nginx_port" "$id" "$k") || fail "turn $k of $id through nginx"
    direct=$(turn "127.0.0.1:$control_port" "$id" "$k") || fail "turn $k of $id on the control"
    [ "$via" = "$direct" ] || fail "$id turn $k: through nginx $via, control $direct"
  done
done
one_shots=12
for k in $(seq 1 $one_shots); do
  "$client_bin" generate --host "127.0.0.1:$nginx_port" --prompt "one shot $k" --max_tokens 2 2>>"$work/client.err" \
    --json >/dev/null || fail "one-shot $k through nginx"
done

log="$work/nginx/logs/access.log"
for _ in $(seq 1 1200); do  # nginx writes a log line as each call ends (calls without a session log "-")
  [ "$(grep -c 'session="-"' "$log" || true)" -ge $one_shots ] && break
  sleep 0.1
done
[ "$(grep -c 'session="s' "$log")" -eq $((sessions * (turns + 1))) ] ||
  { cat "$log"; fail "expected $((sessions * (turns + 1))) session calls in the access log"; }
replicas_used=""
for s in $(seq -w 1 $sessions); do
  upstreams=$(grep "session=\"s$s\"" "$log" | sed 's/.* upstream=\([^ ]*\) .*/\1/' | sort -u)
  [ "$(echo "$upstreams" | wc -l)" -eq 1 ] || fail "session s$s went to several replicas: $upstreams"
  replicas_used+="$upstreams"$'\n'
done
n_session_replicas=$(echo -n "$replicas_used" | sort -u | wc -l)
[ "$n_session_replicas" -ge 2 ] || fail "all sessions hashed to one replica"
n_oneshot_replicas=$(grep 'session="-"' "$log" | sed 's/.* upstream=\([^ ]*\) .*/\1/' | sort -u | wc -l)
[ "$n_oneshot_replicas" -ge 2 ] || fail "calls without a session all went to one replica"
echo "ok: $sessions sessions x $turns turns stick to their replica ($n_session_replicas replicas" \
  "used) and equal the control run; $one_shots one-shot calls spread over $n_oneshot_replicas"
