#!/usr/bin/env bash
# Before/after serve benchmark of the mixed step (issue 10; docs/benchmarks.md "Mixed step").
# Both servers stay up on their own ports; runs alternate before, after at each concurrency.
#   BEFORE=/path/to/old/sdm-server docs/benchmarks/serve-mixed-step/bench.sh
# (the old binary: build commit 5e583c7 in another tree). Results go to $OUT. --noignore_eos: EOS
# may end a call in both servers, as in the recorded figures (5e583c7 predates
# SamplingParams.ignore_eos; docs/benchmarks.md, top).
set -uo pipefail
cd "$(dirname "$0")/../../.."
B=${OUT:-/tmp/serve-mixed-step}
BEFORE=${BEFORE:?set BEFORE to the sdm-server built before the change}
AFTER=${AFTER:-build/server/sdm-server}
BENCH=build/tools/sdm_bench/sdm-bench
MODEL=$B/models/debug_sdm
mkdir -p $B
[ -f $MODEL/config.json ] || build/tools/sdm_model/sdm-model init --preset debug_sdm --seed 0 --out $MODEL
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
start() { rm -rf $B/state-$1; "$2" --model $MODEL --threads 2 --port $3 --metrics_port 0 --state_dir $B/state-$1 > $B/server-$1.log 2>&1 & pids+=($!); }
start before "$BEFORE" 50171
start after "$AFTER" 50172
for port in 50171 50172; do for _ in $(seq 1 240); do build/client/sdm-client --host 127.0.0.1:$port info >/dev/null 2>&1 && break; sleep 0.5; done; done
for round in 1 2 3 4; do
  for c in 8 32; do
    n=$([ $c = 8 ] && echo 64 || echo 96)
    for which in before after; do
      port=$([ $which = before ] && echo 50171 || echo 50172)
      echo "== round $round c$c $which $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
      timeout 400 "$BENCH" serve --host 127.0.0.1:$port --concurrency $c --requests $n --warmup 2 \
        --prompt_tokens uniform:16:64 --max_tokens 32 --noignore_eos \
        --json $B/serve-c$c-$which-$round.json \
        > $B/serve-c$c-$which-$round.txt 2>&1 || echo "bench failed: $?"
      grep -E "throughput|TTFT|inter" $B/serve-c$c-$which-$round.txt
    done
  done
done
