#!/usr/bin/env bash
# Soak test (docs/robustness.md): sdm-server under multi-turn greedy traffic from twice as many
# clients as it admits, no kills; the server's RSS, open files and threads are sampled after
# every round and must stay flat after the warm-up round (RSS within 1%). Loopback only; builds
# nothing (run scripts/test.sh or build first).
#
#   scripts/soak.sh             the long run: 20 min in 60 s rounds, 50 sessions
#   scripts/soak.sh --short     the CI run: 60 s in 15 s rounds, 12 sessions (RSS within 5%)
#   extra flags go to scripts/lib/crash_test.py
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--duration 1200 --round 60 --sessions 50)
if [ "${1:-}" = "--short" ]; then
  shift
  args=(--duration 60 --round 15 --sessions 12 --max_rss_growth 0.05)
fi
exec bash scripts/lib/run-crash-driver.sh "${SDM_SOAK_DIR:-/tmp/sdm-soak-test}" --kill_every 0 "${args[@]}" "$@"
