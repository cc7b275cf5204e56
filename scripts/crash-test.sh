#!/usr/bin/env bash
# Crash test (docs/robustness.md): sdm-server with per-turn persistence under multi-turn greedy
# traffic from twice as many clients as it admits, killed with SIGKILL at random moments,
# restarted, and every session checked against its last completed turn and a control (a fork
# continued greedily before the kill): never lost, never diverged, rolled back at most by the
# turn in flight. Loopback only; builds nothing (run scripts/test.sh or build first).
#
#   scripts/crash-test.sh            the long run: 30 min, 50 sessions, a kill every ~10 s
#   scripts/crash-test.sh --short    the CI run: 75 s, 12 sessions, a kill every ~8 s
#   extra flags go to scripts/lib/crash_test.py (--duration, --sessions, --kill_every, --seed ...)
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--duration 1800 --sessions 50 --kill_every 10)
if [ "${1:-}" = "--short" ]; then
  shift
  args=(--duration 75 --sessions 12 --kill_every 8)
fi
exec bash scripts/lib/run-crash-driver.sh "${SDM_CRASH_DIR:-/tmp/sdm-crash-test}" "${args[@]}" "$@"
