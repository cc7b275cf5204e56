#!/usr/bin/env bash
# Overload rejection latency (issue 11; docs/benchmarks.md "Overload rejection latency"): one
# sdm-server on debug_sdm with 8 running + 16 waiting, then ten bursts of 224 calls at once (about
# 200 refused with RESOURCE_EXHAUSTED); prints each burst's "failed E2E" (the client's time from
# the call to its refusal) and a summary per burst. Results in $OUT (default /tmp/overload).
# ASYNC=1 makes each burst's calls from one client thread (sdm-bench serve --async) rather than
# 224 threads, which otherwise compete with the server for the same cores. DECODE_NICE=N passes
# --decode_nice N to the server (its decode threads N nicer than its front end); SERVER_FLAGS
# adds any other flags. --noignore_eos: EOS may end a call, as in the figures recorded before
# 2026-12-07 (docs/benchmarks.md, top).
#   docs/benchmarks/overload/bursts.sh
#   ASYNC=1 docs/benchmarks/overload/bursts.sh
#   ASYNC=1 DECODE_NICE=5 docs/benchmarks/overload/bursts.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/overload}
M=$OUT/models/debug_sdm
mkdir -p $OUT
[ -f $M/config.json ] || build/tools/sdm_model/sdm-model init --preset debug_sdm --seed 0 --out $M
rm -rf $OUT/state
build/server/sdm-server --model $M --threads 2 --port 0 --metrics_port 0 --max_running 8 --max_waiting 16 \
  --state_dir $OUT/state ${DECODE_NICE:+--decode_nice $DECODE_NICE} ${SERVER_FLAGS:-} > $OUT/server.log 2>&1 &
SP=$!
for _ in $(seq 1 240); do line=$(grep -m1 "listening on" $OUT/server.log) && break; sleep 0.5; done
PORT=$(sed -E 's/.*listening on [^ ]*:([0-9]+).*/\1/' <<< "$line")
for n in $(seq 1 10); do
  echo "== burst $n $(date +%T.%N) load $(cut -d' ' -f1 /proc/loadavg)"
  build/tools/sdm_bench/sdm-bench serve --host 127.0.0.1:$PORT --concurrency 224 --requests 224 \
    --prompt_tokens 32 --max_tokens 32 --seed $n --noignore_eos --json $OUT/burst-$n.json \
    $([ "${ASYNC:-0}" = 1 ] && echo --async) > $OUT/burst-$n.txt 2>&1
  grep -E "failed E2E|throughput" $OUT/burst-$n.txt
  sleep 2
done
kill -TERM $SP; wait
OUT=$OUT python3 - <<'P'
import json, os
for n in range(1,11):
    d=json.load(open(f'{os.environ["OUT"]}/burst-{n}.json'))
    def find(x,k):
        if isinstance(x,dict):
            for kk,v in x.items():
                if kk==k: return v
                r=find(v,k)
                if r is not None: return r
    f=find(d,'failed_e2e_ms')
    print(n, {k:(round(v,1) if isinstance(v,float) else v) for k,v in f.items()} if f else None)
P
