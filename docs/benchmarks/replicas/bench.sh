#!/usr/bin/env bash
# Replica figures for docs/benchmarks.md ("Replicas", issue 14). Not a test: prints figures.
# Every process runs on loopback with free ports and a temporary directory (the helpers of
# tests/deploy/replica_cluster.sh); --threads 1 per replica.
#
#   docs/benchmarks/replicas/bench.sh BUILD_DIR handoff PRESET HISTORY_CHARS SESSIONS
#       etcd + 2 replicas (r0, r1). Per session: created on r0, a prompt of HISTORY_CHARS
#       characters, then a 4-token turn on r0 (the owner: baseline), a 4-token turn on r1
#       (a handoff: r1 asks r0 through etcd, r0 parks and releases, r1 reads the committed
#       snapshot and decodes) and another on r1 (steady). Handoff cost = handoff turn - steady
#       turn (each the call's own time as sdm-client measures it, no process start-up).
#       SDM_REPLICA_FLAGS (space-separated) adds flags to both replicas, e.g.
#       SDM_REPLICA_FLAGS="--cpu_dtype bf16" for sdm_flagship on a small machine.
#   docs/benchmarks/replicas/bench.sh BUILD_DIR failover TTL SESSIONS
#       etcd + 2 replicas with --etcd_lease_ttl TTL; SESSIONS sessions with 2 turns on r0, then
#       kill -9 r0 and each session's position read and a turn run on r1, retried while it fails
#       (UNAVAILABLE with a retry hint until r0's lease expires): time from the kill to each
#       session's first successful turn, turns lost (position before against after), failures.
#   docs/benchmarks/replicas/bench.sh BUILD_DIR throughput PRESET CONCURRENCY REQUESTS
#       the same sdm-bench-serve load (every call a turn of one of 12 sessions) through nginx in
#       front of 1 replica and in front of 3 (with etcd), alternately twice; output tokens/s.
#       With --noignore_eos (EOS may end a call), as in the figures recorded before 2026-12-07
#       (docs/benchmarks.md, top).
set -euo pipefail
BUILD_DIR=$(cd "$1" && pwd)
SOURCE_DIR=$(cd "$(dirname "$0")/../../.." && pwd)
what=$2
shift 2
work=$(mktemp -d)
read -r -a extra_flags <<<"${SDM_REPLICA_FLAGS:-}"
# shellcheck source=tests/deploy/replica_cluster.sh
source "$SOURCE_DIR/tests/deploy/replica_cluster.sh"
stop_all() {
  for n in "$work"/n1 "$work"/n3; do
    [ -f "$n/nginx/nginx.pid" ] && kill "$(cat "$n/nginx/nginx.pid")" 2>/dev/null
  done
  cluster_cleanup
  rm -rf "$work"
}
trap stop_all EXIT

seconds_of() { sed -n 's/.* seconds=\([0-9.]*\).*/\1/p' "$1" | tail -1; }
turn_timed() {  # turn_timed PORT SESSION PROMPT MAX: prints the call's seconds
  "$client_bin" generate --host "127.0.0.1:$1" --session "$2" --prompt "$3" --max_tokens "$4" \
    --json >/dev/null 2>"$work/t.err" || { cat "$work/t.err" >&2; return 1; }
  seconds_of "$work/t.err"
}
ms() { awk -v s="$1" 'BEGIN { printf "%.0f", s * 1000 }'; }
stats() {  # stats FILE: median and max of the numbers in FILE
  sort -n "$1" | awk '{ v[NR] = $1 } END { printf "median %.0f, max %.0f (n=%d)", v[int((NR + 1) / 2)], v[NR], NR }'
}

case "$what" in
handoff)
  preset=$1 history=$2 sessions=$3
  SDM_PRESET=$preset make_model
  start_etcd
  start_replica r0 --etcd "$ETCD_URL" --replica_id r0 "${extra_flags[@]}"
  p0=$REPLICA_PORT
  start_replica r1 --etcd "$ETCD_URL" --replica_id r1 "${extra_flags[@]}"
  p1=$REPLICA_PORT
  prompt=$(head -c "$history" /dev/zero | tr '\0' 'a' | sed 's/aaaaaaa/the cat /g')
  : >"$work/base"; : >"$work/hand"; : >"$work/steady"; : >"$work/cost"
  for i in $(seq 1 "$sessions"); do
    id="h$i"
    "$client_bin" sessions create "$id" --host "127.0.0.1:$p0" >/dev/null
    turn_timed "$p0" "$id" "$prompt" 1 >/dev/null
    history_tokens=$(sed -n 's/.*prompt_tokens=\([0-9]*\).*/\1/p' "$work/t.err")
    base=$(turn_timed "$p0" "$id" "one more" 4)
    hand=$(turn_timed "$p1" "$id" "one more" 4)
    steady=$(turn_timed "$p1" "$id" "one more" 4)
    { ms "$base"; echo; } >>"$work/base"
    { ms "$hand"; echo; } >>"$work/hand"
    { ms "$steady"; echo; } >>"$work/steady"
    awk -v a="$hand" -v b="$steady" 'BEGIN { printf "%.0f\n", (a - b) * 1000 }' >>"$work/cost"
  done
  bytes=$(find "$work/state/generations" -name '*h1.*' -printf '%s\n' | head -1)
  echo "handoff $preset: history $history_tokens tokens, snapshot $(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1e6 }') MB;" \
    "turn on the owner: $(stats "$work/base") ms; handoff turn on the new replica: $(stats "$work/hand") ms;" \
    "next turn there: $(stats "$work/steady") ms; handoff cost (difference): $(stats "$work/cost") ms;" \
    "handoffs logged by r0: $(grep -c 'handed session' "$work/r0.err" || true)"
  ;;
failover)
  ttl=$1 sessions=$2
  make_model
  start_etcd
  start_replica r0 --etcd "$ETCD_URL" --replica_id r0 --etcd_lease_ttl "$ttl"
  p0=$REPLICA_PORT
  start_replica r1 --etcd "$ETCD_URL" --replica_id r1 --etcd_lease_ttl "$ttl"
  p1=$REPLICA_PORT
  for i in $(seq 1 "$sessions"); do
    "$client_bin" sessions create "f$i" --host "127.0.0.1:$p0" >/dev/null
    turn_timed "$p0" "f$i" "first turn of f$i" 4 >/dev/null
    turn_timed "$p0" "f$i" "second turn of f$i" 4 >/dev/null
    "$client_bin" sessions get "f$i" --host "127.0.0.1:$p0" --json | jq -r .position >"$work/pos$i"
  done
  kill -9 "$(cat "$work/r0.pid")"
  killed=$(date +%s%N)
  : >"$work/after"
  failed=0 lost=0 bad=0
  for i in $(seq 1 "$sessions"); do
    # What r1 finds (Get needs no claim: it reads the committed snapshot) against what r0 had.
    got=$("$client_bin" sessions get "f$i" --host "127.0.0.1:$p1" --json | jq -r .position)
    [ "$got" = "$(cat "$work/pos$i")" ] || lost=$((lost + 1))
    until "$client_bin" generate --host "127.0.0.1:$p1" --session "f$i" --prompt "third" \
      --max_tokens 4 --json >/dev/null 2>"$work/f.err"; do
      failed=$((failed + 1))
      grep -q "UNAVAILABLE" "$work/f.err" && grep -q "retry after" "$work/f.err" || bad=$((bad + 1))
      sleep 0.1
    done
    echo $((($(date +%s%N) - killed) / 1000000)) >>"$work/after"
  done
  echo "failover after kill -9, lease TTL $ttl: first turn served by r1 after the kill:" \
    "$(stats "$work/after") ms; calls failed and retried: $failed (without UNAVAILABLE +" \
    "retry hint: $bad); sessions with turns lost: $lost of $sessions"
  ;;
throughput)
  preset=$1 concurrency=$2 requests=$3
  SDM_PRESET=$preset make_model
  start_etcd
  ports=()
  for i in 0 1 2; do
    start_replica "r$i" --etcd "$ETCD_URL" --replica_id "r$i"
    ports+=("$REPLICA_PORT")
  done
  bench_bin="$BUILD_DIR/tools/sdm_bench/sdm-bench-serve"
  one=$(free_port)
  three=$(free_port)
  # Two nginx instances: one in front of r0 only, one in front of all three.
  mkdir -p "$work/n1" "$work/n3"
  work_saved=$work
  work="$work_saved/n1"; start_nginx "$one" "${ports[0]}"
  work="$work_saved/n3"; start_nginx "$three" "${ports[@]}"
  work=$work_saved
  run() {  # run PORT PREFIX: output tokens/s of one sdm-bench-serve run
    "$bench_bin" --host "127.0.0.1:$1" --concurrency "$concurrency" --requests "$requests" \
      --warmup "$concurrency" --prompt_tokens 16 --max_tokens 16 --session_reuse 1 --sessions 12 \
      --session_prefix "$2" --noignore_eos --json "$work/$2.json" >"$work/$2.log" 2>&1 ||
      { cat "$work/$2.log" >&2; return 1; }
    jq -c '.requests.errors' "$work/$2.json" >>"$work/errors"
    jq -r '.throughput.output_tokens_per_s | . * 10 | round / 10' "$work/$2.json"
  }
  a1=$(run "$one" one-a); a3=$(run "$three" three-a)
  b1=$(run "$one" one-b); b3=$(run "$three" three-b)
  echo "throughput $preset, concurrency $concurrency, $requests requests, 12 sessions:" \
    "1 replica $a1, $b1 tok/s; 3 replicas $a3, $b3 tok/s; ratio 3/1:" \
    "$(awk -v a="$a3" -v b="$a1" 'BEGIN { printf "%.2f", a / b }'), $(awk -v a="$b3" -v b="$b1" 'BEGIN { printf "%.2f", a / b }');" \
    "failed calls by code, per run: $(tr '\n' ' ' <"$work/errors")"
  ;;
*)
  echo "usage: bench.sh BUILD_DIR handoff|failover|throughput ..." >&2
  exit 2
  ;;
esac
