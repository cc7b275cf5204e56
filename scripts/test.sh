#!/usr/bin/env bash
# The README's test command: installs missing dependencies, configures, builds and runs every
# test. Extra arguments go to ctest (e.g. scripts/test.sh -R Sdm).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${SDM_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)"
cd "$BUILD_DIR"
# A test without a TIMEOUT of its own (every unit test) that runs 5 minutes has hung (the slowest
# takes about 11 s on CI's 2 cores): it fails naming itself rather than stalling the run until the
# CI job's own limit. A --timeout among the extra arguments comes later and wins.
ctest --output-on-failure -j"$(nproc)" --timeout 300 "$@"
