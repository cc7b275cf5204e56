#!/usr/bin/env bash
# Fencing end to end (docs/replicas.md, "Fencing"): a replica frozen with SIGSTOP past its etcd
# lease, while it holds a turn of a session not yet written, loses the session to another
# replica, which serves further turns; resumed (SIGCONT) and drained, the frozen replica tries to
# write its stale copy: the write is refused and logged, the committed snapshot in etcd stays the
# newer one, and the session continues token for token like a control server that never saw the
# frozen replica's turn. Every wait is on an observable condition (an etcd key, a log line, a
# process exit) with a generous bound; nothing is asserted on elapsed time.
#
# The refusal must come from etcd's transaction, not from the replica's own bookkeeping: by
# default a resumed replica whose keepalive finds its lease expired forgets its claims and its
# store refuses the commit before asking etcd; r0 runs with --testing_etcd_keep_stale_claims, so
# its commit (under its stale claim) always reaches etcd, and the test asserts the logged refusal
# is etcd's (it names r1 as the owner, which only etcd's answer can tell r0) and that no local
# refusal happened.
#
# Replicas: rA (creates the session and its first turn, then drains: the snapshot is committed
# and its lease revoked), r0 (--persist shutdown: its turn stays in memory until it drains; the
# replica that is frozen), r1 (takes over). All with --etcd_lease_ttl 15s: long enough that a live
# replica stalled by a loaded machine keeps its lease, while the frozen one's expires within the
# wait for it. Exit 77 without etcd.
#
#   tests/deploy/etcd_fencing_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD_DIR=$1
SOURCE_DIR=$2
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
# (A frozen process is killed by cluster_cleanup too: kill -9 ends a stopped process.)
cluster_test_begin etcd

make_model
start_etcd
ttl=15s
flags=(--etcd "$ETCD_URL" --etcd_lease_ttl "$ttl")
start_replica rA "${flags[@]}" --replica_id rA
port_a=$REPLICA_PORT
start_replica r0 "${flags[@]}" --replica_id r0 --persist shutdown --testing_etcd_keep_stale_claims
port_0=$REPLICA_PORT
start_replica r1 "${flags[@]}" --replica_id r1
port_1=$REPLICA_PORT
start_control
control="127.0.0.1:$CONTROL_PORT"

id=fenced
# Its keys in etcd: the tenant-qualified id (state_store/session_key.h; no API keys: "default").
owner_key=/sdmserve/sessions/7-default-$id
snapshot_key=/sdmserve/snapshots/7-default-$id
turn() {  # turn PORT PROMPT: one greedy turn of the session; prints its token ids
  local out  # (a failed call prints its JSON too, which a retry must not collect)
  out=$("$client_bin" generate --host "$1" --session "$id" --prompt "$2" --max_tokens 4 --json \
    2>>"$work/client.err") || return
  jq -c '.token_ids' <<<"$out"
}
both() {  # both PORT PROMPT: the turn on a replica and on the control; they must agree
  local got want
  got=$(retry_unavailable turn "127.0.0.1:$1" "$2") || fail "turn '$2' on port $1"
  want=$(turn "$control" "$2") || fail "control turn '$2'"
  [ "$got" = "$want" ] || fail "turn '$2': $got vs control $want"
}
# retry_unavailable CMD...: CMD until it succeeds, for up to 60 s (a claim refused while the
# session's previous owner still holds it answers UNAVAILABLE).
retry_unavailable() {
  local deadline=$(($(date +%s) + 60))
  until "$@"; do
    [ "$(date +%s)" -lt $deadline ] || return 1
    sleep 0.2
  done
}

"$client_bin" sessions create "$id" --host "127.0.0.1:$port_a" >/dev/null || fail "create on rA"
"$client_bin" sessions create "$id" --host "$control" >/dev/null || fail "create on control"
both "$port_a" "the first turn"
committed_1=$(etcd_get "$snapshot_key")
[ -n "$committed_1" ] || fail "rA's turn is acknowledged but no snapshot is committed"
stop_replica rA TERM  # drained: its lease is revoked, the session is free

# r0 takes the session and runs a turn it does not write (--persist shutdown).
stale=$(retry_unavailable turn "127.0.0.1:$port_0" "a turn that is lost") || fail "turn on r0"
[ "$(etcd_get "$owner_key")" = r0 ] || fail "r0 does not own the session after its turn"
[ "$(etcd_get "$snapshot_key")" = "$committed_1" ] || fail "r0 wrote its turn (--persist shutdown)"
r0_pid=$(cat "$work/r0.pid")
kill -STOP "$r0_pid"
# Its lease expires (no keepalive from a stopped process): the ownership key disappears.
wait_for "r0's ownership key to expire" 120 key_absent "$owner_key"

# A file of the session that was written but never committed (as a replica that crashed between
# its write and its commit leaves it): the next replica to claim the session removes it.
orphan="$work/state/generations/7-default-$id.$(printf '0%.0s' $(seq 32)).sdmstate"
echo "never committed" >"$orphan"
both "$port_1" "the second turn"  # r1 claims the session and continues the committed state
[ ! -e "$orphan" ] || fail "r1 did not remove the uncommitted file when it claimed the session"
both "$port_1" "the third turn"
[ "$(etcd_get "$owner_key")" = r1 ] || fail "r1 does not own the session"
committed_3=$(etcd_get "$snapshot_key")
[ "$committed_3" != "$committed_1" ] || fail "r1's turns were not committed"

kill -CONT "$r0_pid"
# Resumed, r0 still holds its copy with the lost turn; draining writes it: refused and logged.
kill -TERM "$r0_pid"
wait_for "r0 to log its refused write" 120 grep -q "write of session '$id' refused" "$work/r0.err"
wait_for "r0 to exit" 120 not_running "$r0_pid"
# etcd refused it: the transaction's comparison of the ownership key failed, and its failure
# branch told r0 who owns the session now (r1); r0's own bookkeeping refused nothing.
grep -q "write of session '$id' refused.*etcd refused the transaction: ownership lost.*owner now: r1)" \
  "$work/r0.err" || { grep refused "$work/r0.err"; fail "the refusal of r0's write is not etcd's"; }
if grep -q "hold a claim" "$work/r0.err"; then fail "r0 refused its write locally"; fi
[ "$(etcd_get "$snapshot_key")" = "$committed_3" ] || fail "the committed snapshot changed"
[ -f "$work/state/generations/$committed_3" ] || fail "the committed snapshot file is gone"
refused=$(grep -c "refused" "$work/r0.err" || true)

# The session is the newer state: it continues exactly like the control, on r1 and after r1
# drains, on a fresh replica reading it from the shared directory.
both "$port_1" "the fourth turn"
stop_replica r1 TERM
start_replica r2 "${flags[@]}" --replica_id r2
both "$REPLICA_PORT" "the fifth turn"
# No garbage: the generations directory holds the committed snapshot only.
gens=$(ls "$work/state/generations")
[ "$gens" = "$(etcd_get "$snapshot_key")" ] || fail "generations/ holds more than the committed file: $gens"
echo "ok: fencing: r0 frozen past its lease (TTL $ttl) lost session '$id' to r1, which served 2" \
  "turns; resumed and drained, r0's write of its stale turn was refused by etcd ($refused log lines:" \
  "$(grep "refused" "$work/r0.err" | head -1 | sed 's/.*refused/refused/' | cut -c1-160));" \
  "the committed snapshot stayed r1's and the session continued exactly (r0's lost turn: $stale)"
