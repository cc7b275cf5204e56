#!/usr/bin/env bash
# Throughput with per-turn persistence on (--persist turn) against off (--persist shutdown), and
# the bytes written per turn (issue 11; docs/benchmarks.md "Per-turn persistence"). Both servers
# (the same binary) stay up on their own ports; runs alternate off, on, every request continues
# one of 8 sessions (each turn is then persisted by the "on" server).
#   docs/benchmarks/serve-persist/bench.sh        (results in $OUT, default /tmp/serve-persist)
set -uo pipefail
cd "$(dirname "$0")/../../.."
B=${OUT:-/tmp/serve-persist}
SERVER=${SERVER:-build/server/sdm-server}
BENCH=build/tools/sdm_bench/sdm-bench
MODEL=$B/models/debug_sdm
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-48}
mkdir -p $B
[ -f $MODEL/config.json ] || build/tools/sdm_model/sdm-model init --preset debug_sdm --seed 0 --out $MODEL
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
start() { # name persist port metrics_port
  rm -rf $B/state-$1
  "$SERVER" --model $MODEL --threads 2 --port $3 --metrics_port $4 --state_dir $B/state-$1 \
    --persist $2 > $B/server-$1.log 2>&1 & pids+=($!)
}
start off shutdown 50181 9181
start on turn 50182 9182
for port in 50181 50182; do for _ in $(seq 1 240); do build/client/sdm-client --host 127.0.0.1:$port info >/dev/null 2>&1 && break; sleep 0.5; done; done
for round in $(seq 1 $ROUNDS); do
  for which in off on; do
    port=$([ $which = off ] && echo 50181 || echo 50182)
    echo "== round $round $which $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    timeout 600 "$BENCH" serve --host 127.0.0.1:$port --concurrency 8 --requests $REQUESTS \
      --warmup 2 --prompt_tokens uniform:16:64 --max_tokens 32 --session_reuse 1 --sessions 8 \
      --session_prefix $which-$round --keep_sessions \
      --json $B/serve-$which-$round.json > $B/serve-$which-$round.txt 2>&1 || echo "bench failed: $?"
    grep -E "throughput|inter" $B/serve-$which-$round.txt
  done
done
echo "== persistence counters of the 'on' server"
curl -s http://127.0.0.1:9182/metrics | grep -E "^sdm_persist|^sdm_sessions_unpersisted|^sdm_snapshot_errors|^sdm_generated_tokens_total|^sdm_requests_total\{method=\"Generate\""
echo "== snapshot sizes (bytes) in the 'on' state directory"
ls -l $B/state-on/*.sdmstate | awk '{s+=$5; n++} END {printf "%d files, mean %.0f bytes\n", n, s/n}'
