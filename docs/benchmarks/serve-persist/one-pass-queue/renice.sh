#!/bin/bash
# renice.sh OUTDIR VARIANT NICE: renice the persistence threads of that bench server once it runs
for i in $(seq 1 600); do
  pid=$(pgrep -f -- "--state_dir $1/state-$2 " | head -1)
  if [ -n "$pid" ] && [ -d /proc/$pid/task ]; then
    n=0
    for t in /proc/$pid/task/*; do
      c=$(cat $t/comm 2>/dev/null)
      case "$c" in sdm-writer|sdm-store|sdm-syncer) if [ "$3" = batch ]; then chrt -b -p 0 ${t##*/} && n=$((n+1)); else renice -n $3 -p ${t##*/} >/dev/null && n=$((n+1)); fi;; esac
    done
    if [ $n -ge 4 ]; then echo "reniced $n threads of $pid"; exit 0; fi
  fi
  sleep 0.5
done
echo "no server"
