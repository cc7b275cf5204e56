#!/usr/bin/env bash
# One command for a lent CUDA machine (issue 6): builds the engine, kernels, tests and
# benchmarks without gRPC, runs every CUDA test (each kernel against its CPU twin; CPU vs CUDA
# logits on tiny, debug_sdm and debug_hybrid; resume-after-offload exactness), then the kernel
# and decode benchmarks, and prints a short table last. Budget: about 8 minutes on an H200.
#
# The machine reaches no package registry: first run scripts/fetch-device-deps.sh here, then
# call the device tool with carry [".devdeps"] and the command `bash scripts/device-check.sh`.
# Logs and JSON go to $OUT (the device tool brings them back) or ./device-check-out.
#
# Environment: SDM_DEVICE_CHECK_QUICK=1 skips the decode benchmark (build and tests only);
# SDM_DEVICE_CHECK_FORCE_DEPS=1 uses the carried packages even where the system has them, and
# SDM_DEVICE_CHECK_STOP_AFTER=configure stops after CMake (both for trying the script here).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT_DIR=${OUT:-$ROOT/device-check-out}
mkdir -p "$OUT_DIR"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[device-check $(elapsed)s] $*"; }
declare -A RESULT

# ---- dependencies: the carried Debian packages, unpacked under a private prefix ----------------
DEPS=/tmp/sdm-deps
if [[ "${SDM_DEVICE_CHECK_FORCE_DEPS:-0}" == 1 ]] ||
   { ! pkg-config --exists absl_status 2>/dev/null && [[ ! -d $DEPS/usr ]]; }; then
  if ! ls .devdeps/*.deb >/dev/null 2>&1; then
    echo "device-check: no .devdeps/*.deb: run scripts/fetch-device-deps.sh first and carry .devdeps" >&2
    exit 2
  fi
  mkdir -p $DEPS
  for f in .devdeps/*.deb; do dpkg -x "$f" $DEPS; done
fi
ARCH_LIB=$DEPS/usr/lib/x86_64-linux-gnu
CMAKE_EXTRA=()
if [[ -d $DEPS/usr ]]; then
  export PKG_CONFIG_PATH=$ARCH_LIB/pkgconfig:$DEPS/usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$DEPS
  export LD_LIBRARY_PATH=$ARCH_LIB:$ARCH_LIB/openblas-pthread:${LD_LIBRARY_PATH:-}
  PKGCONF=$(command -v pkg-config || echo $DEPS/usr/bin/pkgconf)
  CMAKE_EXTRA+=(-DCMAKE_PREFIX_PATH="$DEPS/usr;$ARCH_LIB/cmake"
                -DPKG_CONFIG_EXECUTABLE="$PKGCONF"
                -DOPENBLAS_LIB="$ARCH_LIB/openblas-pthread/libopenblas.so"
                -DOPENBLAS_INCLUDE="$DEPS/usr/include/x86_64-linux-gnu/openblas-pthread")
fi

log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
log "nvcc: $(/usr/local/cuda/bin/nvcc --version | tail -1)"

# ---- build ---------------------------------------------------------------------------------------
BUILD=/tmp/sdm-device-build
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if ! cmake -S . -B $BUILD "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DSDM_SERVER=OFF \
    "${CMAKE_EXTRA[@]}" >"$OUT_DIR/configure.log" 2>&1; then
  tail -30 "$OUT_DIR/configure.log"; log "configure FAILED"; exit 1
fi
log "configured ($(grep -c "" "$OUT_DIR/configure.log") lines of log)"
[[ "${SDM_DEVICE_CHECK_STOP_AFTER:-}" == configure ]] && exit 0
if ! cmake --build $BUILD -j"$(nproc)" >"$OUT_DIR/build.log" 2>&1; then
  grep -E "error|Error" "$OUT_DIR/build.log" | head -40; log "build FAILED"; exit 1
fi
log "built"
RESULT[build]=ok

# ---- tests: every CUDA test, then the CPU kernel and engine suites ---------------------------
run_tests() {  # name, ctest args...
  local name=$1; shift
  if (cd $BUILD && timeout 300 ctest --output-on-failure --timeout 240 "$@") \
      >"$OUT_DIR/ctest-$name.log" 2>&1; then
    RESULT[$name]="pass ($(grep -Eo '[0-9]+ tests? failed out of [0-9]+' "$OUT_DIR/ctest-$name.log" | sed 's/.* out of /all of /'))"
  else
    RESULT[$name]="FAIL: $(grep -Eo '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$OUT_DIR/ctest-$name.log")"
    grep -E "Failed|FAILED|\*\*\*" "$OUT_DIR/ctest-$name.log" | head -20
  fi
  log "tests $name: ${RESULT[$name]}"
}
run_tests cuda -R "[Cc]uda" -j4
# Skipped tests print "Skipped"; a CUDA test that skipped on this machine is a failure here.
skipped=$(grep -c "Skipped" "$OUT_DIR/ctest-cuda.log" || true)
RESULT[cuda_skipped]=$skipped
run_tests kernel_tests -L kernels -j8
run_tests engine -L engine -j8

# ---- benchmarks ----------------------------------------------------------------------------------
BENCH=$(find $BUILD -name sdm-bench -type f -perm -u+x | head -1)
if [[ -n "$BENCH" ]]; then
  if timeout 150 "$BENCH" kernels --json "$OUT_DIR/kernels.json" >"$OUT_DIR/kernels.txt" 2>&1; then
    RESULT[kernels]=ok
  else
    RESULT[kernels]="FAIL (exit $?)"; tail -20 "$OUT_DIR/kernels.txt"
  fi
  log "kernel benchmark: ${RESULT[kernels]}"
  if [[ "${SDM_DEVICE_CHECK_QUICK:-0}" != 1 ]]; then
    # Short contexts keep the prefill of 64 sessions per model inside the budget; the 32k
    # comparison at batch 64 is a longer run (docs/benchmarks.md, CUDA section), and the kernel
    # benchmark above already measures attention decode at 32k.
    if timeout 240 "$BENCH" decode --device cuda --pair flagship --contexts 1024,8192 \
        --batches 1,8,64 --max_batch 64 --steps 20 --json "$OUT_DIR/decode.json" \
        >"$OUT_DIR/decode.txt" 2>&1; then
      RESULT[decode]=ok
    else
      RESULT[decode]="FAIL (exit $?)"; tail -20 "$OUT_DIR/decode.txt"
    fi
    log "decode benchmark: ${RESULT[decode]}"
  fi
fi

# ---- the table (last) ----------------------------------------------------------------------------
echo
echo "== sdmserve device check, $(date -u +%Y-%m-%dT%H:%MZ), $(elapsed) s =="
printf "%-28s %s\n" "build" "${RESULT[build]:-}" "CUDA tests" "${RESULT[cuda]:-}" \
  "CUDA tests skipped" "${RESULT[cuda_skipped]:-}" "kernel tests" "${RESULT[kernel_tests]:-}" \
  "engine tests" "${RESULT[engine]:-}"
if [[ -f $OUT_DIR/kernels.txt ]]; then
  echo "-- sdm-bench kernels"; grep -v "^#" "$OUT_DIR/kernels.txt" | tail -20
fi
if [[ -f $OUT_DIR/decode.txt ]]; then
  echo "-- sdm-bench decode (flagship pair)"; tail -25 "$OUT_DIR/decode.txt"
fi
exit 0
