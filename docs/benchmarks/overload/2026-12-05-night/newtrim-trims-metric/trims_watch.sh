#!/bin/bash
# Polls the overload bursts server's sdm_heap_trims_total every 0.25 s and prints each change: run beside
#   OUT=DIR ASYNC=1 docs/benchmarks/overload/bursts.sh   (same OUT)
for i in $(seq 1 200); do
  line=$(grep -m1 "listening on" ${OUT:-/tmp/tw}/server.log 2>/dev/null) && break; sleep 0.2
done
echo "$line"
URL=$(sed -E 's/.*metrics: ([^ )]*).*/\1/' <<< "$line")
echo "url $URL"
prev=""
while pgrep -f 'sdm-server.*${OUT:-/tmp/tw}' > /dev/null; do
  v=$(curl -s "$URL" | grep '^sdm_heap_trims_total' | awk '{print $2}')
  if [ "$v" != "$prev" ]; then echo "$(date +%T.%N | cut -c1-12) trims $v"; prev=$v; fi
  sleep 0.25
done
