#!/usr/bin/env bash
# The part scripts/crash-test.sh and scripts/soak.sh share: makes the tiny random model under
# WORK (once) and runs scripts/lib/crash_test.py on the built server and client with the rest of
# the arguments.   run-crash-driver.sh WORK DRIVER-ARGS...   (environment: SDM_BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${SDM_BUILD_DIR:-build}
WORK=$1
shift
mkdir -p "$WORK"
MODEL="$WORK/model-tiny"
[ -f "$MODEL/config.json" ] ||
  "$BUILD_DIR/tools/sdm_model/sdm-model" init --preset tiny --seed 0 --out "$MODEL" >/dev/null
exec python3 scripts/lib/crash_test.py --server "$BUILD_DIR/server/sdm-server" \
  --client "$BUILD_DIR/client/sdm-client" --model "$MODEL" --workdir "$WORK/run" "$@"
