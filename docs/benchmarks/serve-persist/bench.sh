#!/usr/bin/env bash
# Throughput with per-turn persistence on (--persist turn) against off (--persist shutdown), and
# the bytes written per turn (issue 11; docs/benchmarks.md "Per-turn persistence"). The servers
# stay up on ports they pick themselves (read from their "listening on" line, so that runs
# beside other jobs cannot collide); rounds alternate between them, every request continues one
# of 8 sessions (each turn is then persisted by a server with --persist turn).
#   docs/benchmarks/serve-persist/bench.sh        (results in $OUT, default /tmp/serve-persist)
# VARIANTS lists the servers as name:policy:binary[:flags] (default "off:shutdown:$SERVER
# on:turn:$SERVER"; flags: more server flags, commas for spaces); e.g. add
# "base:turn:/path/to/older/sdm-server" to compare an older build in the same sitting, or
# "w1:turn:$SERVER:--persist_writers=1". ORDER=rotate starts round r with the r-th server (the
# first run of a sitting is often the fastest; rotating spreads that over the servers); the
# default, fixed, runs them in the order listed.
# --noignore_eos: EOS may end a call, as in the figures recorded before 2026-12-07 and in servers
# built before SamplingParams.ignore_eos (docs/benchmarks.md, top).
set -uo pipefail
cd "$(dirname "$0")/../../.."
B=${OUT:-/tmp/serve-persist}
SERVER=${SERVER:-build/server/sdm-server}
BENCH=build/tools/sdm_bench/sdm-bench
MODEL=$B/models/debug_sdm
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-48}
VARIANTS=${VARIANTS:-"off:shutdown:$SERVER on:turn:$SERVER"}
ORDER=${ORDER:-fixed}
mkdir -p $B
[ -f $MODEL/config.json ] || build/tools/sdm_model/sdm-model init --preset debug_sdm --seed 0 --out $MODEL
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
declare -A port metrics
names=()
for v in $VARIANTS; do
  IFS=: read -r name policy binary flags <<< "$v"
  names+=("$name")
  rm -rf $B/state-$name
  # shellcheck disable=SC2046
  "$binary" --model $MODEL --threads 2 --port 0 --metrics_port 0 --state_dir $B/state-$name \
    --persist $policy $(tr , ' ' <<< "${flags:-}") > $B/server-$name.log 2>&1 & pids+=($!)
done
for name in "${names[@]}"; do
  for _ in $(seq 1 480); do
    line=$(grep -m1 "listening on" $B/server-$name.log 2>/dev/null) && break
    sleep 0.5
  done
  [ -n "${line:-}" ] || { echo "server $name did not start"; cat $B/server-$name.log; exit 1; }
  port[$name]=$(sed -E 's/.*listening on [^ ]*:([0-9]+).*/\1/' <<< "$line")
  metrics[$name]=$(sed -E 's/.*metrics: (http[^)]*)\).*/\1/' <<< "$line")
  line=""
done
for round in $(seq 1 $ROUNDS); do
  first=0
  [ "$ORDER" = rotate ] && first=$(( (round - 1) % ${#names[@]} ))
  for i in $(seq 0 $(( ${#names[@]} - 1 ))); do
    name=${names[$(( (first + i) % ${#names[@]} ))]}
    echo "== round $round $name $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    timeout 900 "$BENCH" serve --host 127.0.0.1:${port[$name]} --concurrency 8 \
      --requests $REQUESTS --warmup 2 --prompt_tokens uniform:16:64 --max_tokens 32 \
      --session_reuse 1 --sessions 8 --session_prefix $name-$round --keep_sessions --noignore_eos \
      --json $B/serve-$name-$round.json > $B/serve-$name-$round.txt 2>&1 || echo "bench failed: $?"
    grep -E "throughput|inter" $B/serve-$name-$round.txt
  done
done
for name in "${names[@]}"; do
  echo "== persistence counters of '$name'"
  curl -s ${metrics[$name]} | grep -E "^sdm_persist|^sdm_sessions_unpersisted|^sdm_sessions_unsynced|^sdm_snapshot_errors|^sdm_generated_tokens_total|^sdm_requests_total\{method=\"Generate\""
  ls -l $B/state-$name/*.sdmstate 2>/dev/null |
    awk '{s+=$5; n++} END {if (n) printf "%d snapshots, mean %.0f bytes\n", n, s/n}'
done
