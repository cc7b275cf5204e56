#!/usr/bin/env bash
# Fuzzes every parser at the edge with libFuzzer, ASan and UBSan (tests/fuzz/):
#   state_codec_fuzzer, state_log_fuzzer   session snapshots and delta logs (state directory)
#   safetensors_fuzzer                     safetensors headers (model directory)
#   model_config_fuzzer                    config.json and sdm-model's --set overrides
#   tokenizer_fuzzer                       the byte tokenizer, streaming detokenizer, UTF-8 repair
#   server_files_fuzzer                    API key file, authorization metadata, tenant limits
#   request_fuzzer                         sdm.v1 requests and OpenAI JSON bodies through the
#                                          service's validation (no transport)
# Configures a separate clang build directory, builds only the fuzzers (and the libraries they
# need), writes each a seed corpus of valid inputs and fuzzes it briefly: the state decoders for
# 20 seconds each, the others for 5 (SDM_FUZZ_SECONDS sets one duration for all; SDM_FUZZERS
# selects some). Fails on any crash, sanitizer report, property violation, leak, timeout or
# out-of-memory; the input that caused it is saved under $SDM_FUZZ_BUILD_DIR/fuzz/<fuzzer>/artifacts/.
#
#   SDM_FUZZ_SECONDS=60 scripts/fuzz.sh
#   SDM_FUZZERS="request_fuzzer safetensors_fuzzer" scripts/fuzz.sh
#   SDM_FUZZER=state_log_fuzzer scripts/fuzz.sh build-fuzz/fuzz/state_log_fuzzer/artifacts/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

BUILD_DIR=${SDM_FUZZ_BUILD_DIR:-build-fuzz}
# name:seconds (the default duration of each).
ALL_FUZZERS="state_codec_fuzzer:20 state_log_fuzzer:20 safetensors_fuzzer:5 model_config_fuzzer:5
  tokenizer_fuzzer:5 server_files_fuzzer:5 request_fuzzer:5"
FUZZERS=()
for entry in $ALL_FUZZERS; do
  name=${entry%%:*}
  if [ -n "${SDM_FUZZERS:-}" ] && [[ " $SDM_FUZZERS " != *" $name "* ]]; then continue; fi
  FUZZERS+=("$name:${SDM_FUZZ_SECONDS:-${entry##*:}}")
done

LAUNCHER=()
if command -v ccache >/dev/null; then
  LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSDM_FUZZ=ON -DSDM_CUDA=OFF -DSDM_BENCH=OFF "${LAUNCHER[@]}" >/dev/null
targets=()
for entry in "${FUZZERS[@]}"; do targets+=("${entry%%:*}"); done
if [ $# -gt 0 ]; then targets=("${SDM_FUZZER:-state_codec_fuzzer}"); fi
cmake --build "$BUILD_DIR" --target "${targets[@]}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

if [ $# -gt 0 ]; then
  # A saved input replays through the fuzzer named by SDM_FUZZER (default: the snapshot's).
  exec "$BUILD_DIR/tests/fuzz/${SDM_FUZZER:-state_codec_fuzzer}" "$@"
fi

for entry in "${FUZZERS[@]}"; do
  name=${entry%%:*}
  seconds=${entry##*:}
  fuzzer="$BUILD_DIR/tests/fuzz/$name"
  work="$BUILD_DIR/fuzz/$name"
  mkdir -p "$work/corpus" "$work/artifacts"
  rm -rf "$work/seeds"
  "$fuzzer" --write-seeds="$work/seeds"
  echo "fuzz: running $name for ${seconds}s"
  # New inputs go to corpus/ (kept between runs); seeds/ is read only.
  "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "$work/seeds"
  echo "fuzz: $name: no crashes in ${seconds}s"
done
