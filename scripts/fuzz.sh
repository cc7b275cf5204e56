#!/usr/bin/env bash
# Fuzzes the session-state decoder (tests/fuzz/state_codec_fuzzer.cc) with libFuzzer, ASan and
# UBSan: configures a separate clang build directory, builds only the fuzzer (and the state store
# library it needs), writes a seed corpus of valid snapshots and fuzzes for SDM_FUZZ_SECONDS
# seconds (default 20). Fails on any crash, sanitizer report, leak, timeout or out-of-memory;
# the input that caused it is saved under $SDM_FUZZ_BUILD_DIR/fuzz/artifacts/.
#
#   SDM_FUZZ_SECONDS=60 scripts/fuzz.sh
#   scripts/fuzz.sh build-fuzz/fuzz/artifacts/crash-...   # replays one input
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

BUILD_DIR=${SDM_FUZZ_BUILD_DIR:-build-fuzz}
FUZZ_SECONDS=${SDM_FUZZ_SECONDS:-20}

CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSDM_FUZZ=ON -DSDM_CUDA=OFF -DSDM_SERVER=OFF -DSDM_BENCH=OFF >/dev/null
cmake --build "$BUILD_DIR" --target state_codec_fuzzer

fuzzer="$BUILD_DIR/tests/fuzz/state_codec_fuzzer"
work="$BUILD_DIR/fuzz"
mkdir -p "$work/corpus" "$work/artifacts"
rm -rf "$work/seeds"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

if [ $# -gt 0 ]; then
  exec "$fuzzer" "$@"
fi

"$fuzzer" --write-seeds="$work/seeds"
echo "fuzz: running state_codec_fuzzer for ${FUZZ_SECONDS}s"
# New inputs go to corpus/ (kept between runs); seeds/ is read only.
"$fuzzer" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "$work/seeds"
echo "fuzz: no crashes in ${FUZZ_SECONDS}s"
