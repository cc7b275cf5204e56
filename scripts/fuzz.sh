#!/usr/bin/env bash
# Fuzzes the session-state decoders with libFuzzer, ASan and UBSan: the snapshot decoder
# (tests/fuzz/state_codec_fuzzer.cc) and the delta log's replay and scan
# (tests/fuzz/state_log_fuzzer.cc). Configures a separate clang build directory, builds only the
# fuzzers (and the state store library they need), writes a seed corpus of valid inputs and
# fuzzes each for SDM_FUZZ_SECONDS seconds (default 20). Fails on any crash, sanitizer report,
# leak, timeout or out-of-memory; the input that caused it is saved under
# $SDM_FUZZ_BUILD_DIR/fuzz/<fuzzer>/artifacts/.
#
#   SDM_FUZZ_SECONDS=60 scripts/fuzz.sh
#   SDM_FUZZER=state_log_fuzzer scripts/fuzz.sh build-fuzz/fuzz/state_log_fuzzer/artifacts/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

BUILD_DIR=${SDM_FUZZ_BUILD_DIR:-build-fuzz}
FUZZ_SECONDS=${SDM_FUZZ_SECONDS:-20}

CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSDM_FUZZ=ON -DSDM_CUDA=OFF -DSDM_SERVER=OFF -DSDM_BENCH=OFF >/dev/null
cmake --build "$BUILD_DIR" --target state_codec_fuzzer state_log_fuzzer

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

if [ $# -gt 0 ]; then
  # A saved input replays through the fuzzer named by SDM_FUZZER (default: the snapshot's).
  exec "$BUILD_DIR/tests/fuzz/${SDM_FUZZER:-state_codec_fuzzer}" "$@"
fi

for name in state_codec_fuzzer state_log_fuzzer; do
  fuzzer="$BUILD_DIR/tests/fuzz/$name"
  work="$BUILD_DIR/fuzz/$name"
  mkdir -p "$work/corpus" "$work/artifacts"
  rm -rf "$work/seeds"
  "$fuzzer" --write-seeds="$work/seeds"
  echo "fuzz: running $name for ${FUZZ_SECONDS}s"
  # New inputs go to corpus/ (kept between runs); seeds/ is read only.
  "$fuzzer" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "$work/seeds"
  echo "fuzz: $name: no crashes in ${FUZZ_SECONDS}s"
done
