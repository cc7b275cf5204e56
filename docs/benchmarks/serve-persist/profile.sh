#!/usr/bin/env bash
# bench.sh with `perf record -g` on every server while the rounds run (not during start-up or the
# shutdown's writes), then per-variant throughput, on/off per round and CPU per generated token
# (docs/benchmarks.md, "Per-turn persistence", 2026-12-04). Needs perf and
# kernel.perf_event_paranoid <= 0 (sysctl -w kernel.perf_event_paranoid=-1, as root).
#   OUT=/tmp/persist-prof ROUNDS=3 VARIANTS="off:shutdown:BIN on:turn:BIN" \
#     docs/benchmarks/serve-persist/profile.sh
set -u
cd "$(dirname "$0")/../../.."
O=${OUT:-/tmp/persist-prof}
V=${VARIANTS:-"off:shutdown:build/server/sdm-server on:turn:build/server/sdm-server"}
mkdir -p $O
OUT=$O VARIANTS="$V" docs/benchmarks/serve-persist/bench.sh > $O/bench.txt 2>&1 &
bp=$!
for _ in $(seq 1 2400); do grep -q "== round 1" $O/bench.txt 2>/dev/null && break; sleep 0.5; done
perfpids=()
names=()
for v in $V; do
  name=${v%%:*}
  names+=("$name")
  pid=$(pgrep -f -- "--state_dir $O/state-$name " | head -1)
  perf record -F 499 -g -p "$pid" -o $O/perf-$name.data > $O/perf-$name.log 2>&1 & perfpids+=($!)
done
for _ in $(seq 1 7200); do grep -q "== persistence counters" $O/bench.txt 2>/dev/null && break; sleep 0.5; done
for p in "${perfpids[@]}"; do kill -INT "$p"; done
wait
grep -v "MB/s" $O/bench.txt
python3 docs/benchmarks/serve-persist/profile_summary.py $O "${names[*]}"
