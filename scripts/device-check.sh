#!/usr/bin/env bash
# One command for a lent CUDA machine (issue 6): builds the engine, kernels, tests and
# benchmarks without gRPC, runs every CUDA test (each kernel against its CPU twin; CPU vs CUDA
# logits on tiny, debug_sdm, debug_hybrid and two variants; resume-after-offload exactness),
# then the kernel and decode benchmarks, and prints a short table last. Budget: an overall deadline of 450 s
# (7.5 minutes) after the machine has started.
#
# The machine reaches no package registry: first run scripts/fetch-device-deps.sh here, then
# call the device tool with carry [".devdeps"] and the command `bash scripts/device-check.sh`.
# Logs and JSON are written to a work folder; on exit the key files (summary.txt with the table
# and the failed tests, kernels.json, decode.json, state.json, reference_decode.json,
# comparison.json, decode_launched.json) are copied to $OUT (the device tool brings back at most
# 8 files) and every log is packed into $OUT/device-check-logs.tar.gz.
# Without $OUT the work folder is ./device-check-out.
#
# It fails loudly (exit 3) when no GPU is visible or CMake did not enable CUDA, and exits 1 when
# a step failed or a CUDA test skipped; each test runs once with a 60 s timeout, results print as
# they arrive, and the table prints last even when a step hangs (an overall deadline, default
# 450 s, bounds every step: a step with less than 15 s left is not started and counts as failed,
# "not reached"). The order puts what only a GPU can answer first: the build (kept going past a
# failing file, so that one compiler difference costs one target, not the run), the CUDA tests,
# the kernel and decode benchmarks, the reference implementation's own decode step
# (scripts/device/reference_decode.py, where .refcode/ was fetched by scripts/fetch-reference.sh
# and carried: the reference's code is never committed, its license is non-commercial) and ours
# against it batch by batch (scripts/device/compare_decode.py), and last the CPU-only kernel and
# engine tests (CI runs those too; here they try the host's ISA: their failures count, their
# running out of the deadline does not).
#
# Environment: SDM_DEVICE_CHECK_QUICK=1 skips the decode benchmark (build and tests only);
# SDM_DEVICE_CHECK_DEADLINE=SECONDS changes the overall deadline;
# SDM_DEVICE_CHECK_FORCE_DEPS=1 uses the carried packages even where the system has them, and
# SDM_DEVICE_CHECK_STOP_AFTER=configure stops after CMake (both for trying the script here).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RETURN_DIR=${OUT:-}
OUT_DIR=$ROOT/device-check-out
[[ -n $RETURN_DIR ]] && OUT_DIR=/tmp/device-check-out
rm -rf "$OUT_DIR"; mkdir -p "$OUT_DIR"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[device-check $(elapsed)s] $*"; }
declare -A RESULT
DEADLINE=${SDM_DEVICE_CHECK_DEADLINE:-450}
# Seconds a step may take: its own limit, cut to what is left of the deadline (at least 5).
budget() { local left=$(( DEADLINE - $(elapsed) )); (( left < 5 )) && left=5; (( $1 < left )) && echo "$1" || echo "$left"; }
FAILED=0
# Whether step $1 may start: false, with its result "not reached", when under 15 s of the
# deadline are left; $2 = optional: then not reaching it is no failure.
may_start() {
  (( DEADLINE - $(elapsed) >= 15 )) && return 0
  RESULT[$1]="not reached (deadline ${DEADLINE}s)"
  [[ ${2:-} == optional ]] || FAILED=1
  log "$1: ${RESULT[$1]}"
  return 1
}
print_table() {
  echo
  echo "== sdmserve device check, $(date -u +%Y-%m-%dT%H:%MZ), $(elapsed) s =="
  local key
  for key in gpu host_compiler cuda_enabled build cuda cuda_skipped selection kernels decode \
             state reference vs_reference launched kernel_tests engine; do
    printf "%-20s %s\n" "$key" "${RESULT[$key]:-(not reached)}"
  done
  if [[ -s $OUT_DIR/selection.txt ]]; then
    echo "-- product-key selection and SDM state, CUDA against CPU"
    grep "^\[selection\]" "$OUT_DIR/selection.txt" | grep -v " layer " | head -20
    grep "^\[sdm-state\]" "$OUT_DIR/selection.txt" | head -12
    grep "^\[sdm-readings\]" "$OUT_DIR/selection.txt" | head -4
    grep "^\[batch64\]" "$OUT_DIR/selection.txt" | head -4
  fi
  if [[ -f $OUT_DIR/kernels.txt ]]; then
    echo "-- sdm-bench kernels"; grep -v "^#" "$OUT_DIR/kernels.txt" | tail -40
  fi
  if [[ -f $OUT_DIR/decode.txt ]]; then
    echo "-- sdm-bench decode (flagship pair)"; tail -25 "$OUT_DIR/decode.txt"
  fi
  if [[ -f $OUT_DIR/state.txt ]]; then
    echo "-- sdm-bench state (park and resume through the engine)"
    grep -vF '] ' "$OUT_DIR/state.txt" | tail -12  # not the progress lines ("[preset] ...")
  fi
  if [[ -f $OUT_DIR/decode_launched.txt ]]; then
    echo "-- sdm-bench decode, sdm_flagship without CUDA graphs"
    grep -E "^sdm_flagship|graphs" "$OUT_DIR/decode_launched.txt" | tail -6
  fi
  if [[ -f $OUT_DIR/reference.txt ]]; then
    echo "-- reference decode step (scripts/device/reference_decode.py)"
    tail -8 "$OUT_DIR/reference.txt"
  fi
  if [[ -f $OUT_DIR/comparison.txt ]]; then
    echo "-- ours vs the reference (scripts/device/compare_decode.py)"; cat "$OUT_DIR/comparison.txt"
  fi
  if [[ -s $OUT_DIR/failures.txt ]]; then
    echo "-- failed tests"; head -40 "$OUT_DIR/failures.txt"
  fi
  echo "== verdict: $([[ $FAILED == 0 ]] && echo PASS || echo FAIL)"
}
# Failed tests by name, the table, then everything back through $OUT (at most 8 files).
finish() {
  grep -h -E "^ *[0-9]+ - .*\((Failed|Timeout|Not Run|SEGFAULT|Subprocess aborted)" \
    "$OUT_DIR"/ctest-*.log >"$OUT_DIR/failures.txt" 2>/dev/null || true
  print_table | tee "$OUT_DIR/summary.txt"
  if [[ -n $RETURN_DIR ]]; then
    local f
    for f in summary.txt kernels.json decode.json state.json reference_decode.json \
        comparison.json decode_launched.json; do
      [[ -s $OUT_DIR/$f ]] && cp "$OUT_DIR/$f" "$RETURN_DIR/"
    done
    tar czf "$RETURN_DIR/device-check-logs.tar.gz" -C "$OUT_DIR" . 2>/dev/null || true
  fi
}
trap finish EXIT

# ---- dependencies: the carried Debian packages, unpacked under a private prefix ----------------
# Also where the system has the libraries but a CMake older than the project needs: the carried
# CMake then runs, with the carried libraries beside it.
DEPS=/tmp/sdm-deps
CMAKE_NEED=$(sed -n 's/^cmake_minimum_required(VERSION \([0-9.]*\)).*/\1/p' CMakeLists.txt)
CMAKE_HAVE=$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
cmake_too_old() {
  [[ -z "$CMAKE_HAVE" || "$(printf '%s\n%s\n' "$CMAKE_NEED" "$CMAKE_HAVE" | sort -V | head -1)" != "$CMAKE_NEED" ]]
}
if [[ "${SDM_DEVICE_CHECK_FORCE_DEPS:-0}" == 1 ]] || { cmake_too_old && [[ ! -x $DEPS/usr/bin/cmake ]]; } ||
   { ! pkg-config --exists absl_status 2>/dev/null && [[ ! -d $DEPS/usr ]]; }; then
  if ! ls .devdeps/*.deb >/dev/null 2>&1; then
    echo "device-check: no .devdeps/*.deb: run scripts/fetch-device-deps.sh first and carry .devdeps" >&2
    FAILED=1; exit 2
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

# ---- a GPU, and a CMake recent enough (else the carried one) ----------------------------------
if ! gpus=$(nvidia-smi -L 2>&1) || ! grep -q "^GPU " <<<"$gpus"; then
  RESULT[gpu]="NONE: $gpus"; FAILED=1
  log "FAIL: no GPU visible (nvidia-smi -L: $gpus)"; exit 3
fi
RESULT[gpu]=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
log "device: ${RESULT[gpu]}"
log "nvcc: $("$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | tail -1)"
RESULT[host_compiler]=$(c++ --version 2>/dev/null | head -1)
log "host compiler: ${RESULT[host_compiler]}"
nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
CMAKE=cmake
if cmake_too_old; then
  if [[ -x $DEPS/usr/bin/cmake ]]; then
    CMAKE=$DEPS/usr/bin/cmake
    export CMAKE_ROOT=$(ls -d $DEPS/usr/share/cmake-* | head -1)
  else
    log "FAIL: cmake ${CMAKE_HAVE:-missing} is older than $CMAKE_NEED and .devdeps holds none"
    FAILED=1; exit 3
  fi
fi
log "cmake: $($CMAKE --version | head -1)"

# ---- build ---------------------------------------------------------------------------------------
BUILD=/tmp/sdm-device-build
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if ! $CMAKE -S . -B $BUILD "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DSDM_SERVER=OFF -DSDM_CUDA=ON \
    -DSDM_WERROR=OFF "${CMAKE_EXTRA[@]}" >"$OUT_DIR/configure.log" 2>&1; then
  tail -30 "$OUT_DIR/configure.log"; log "configure FAILED"; FAILED=1; exit 1
fi
log "configured ($(grep -c "" "$OUT_DIR/configure.log") lines of log)"
# A tree that configured without CUDA would pass every CUDA test by skipping it.
# (CMakeLists.txt prints which; the cache keeps SDM_CUDA=ON even when nvcc was not found.)
if ! grep -q "sdmserve: CUDA backend ON" "$OUT_DIR/configure.log"; then
  RESULT[cuda_enabled]="NO"; FAILED=1
  log "FAIL: CMake did not enable CUDA (see $OUT_DIR/configure.log)"; exit 3
fi
RESULT[cuda_enabled]=yes
[[ "${SDM_DEVICE_CHECK_STOP_AFTER:-}" == configure ]] && exit 0
# Warnings are not errors here (the host compiler may be newer than CI's and warn about more);
# the build keeps going past a failing file, and the tests of what did build still run.
KEEP_GOING=(-k)
[[ ${#GEN[@]} -gt 0 ]] && KEEP_GOING=(-k 0)
if timeout "$(budget 300)" $CMAKE --build $BUILD -j"$(nproc)" -- "${KEEP_GOING[@]}" \
    >"$OUT_DIR/build.log" 2>&1; then
  log "built"
  RESULT[build]=ok
else
  status=$?
  grep -E -A3 "error|Error" "$OUT_DIR/build.log" | head -60
  if [[ $status == 124 ]]; then
    RESULT[build]="FAIL (timed out; tests of what was built run)"
  else
    RESULT[build]="FAIL ($(grep -c "^FAILED:" "$OUT_DIR/build.log") targets failed; tests of the rest run)"
  fi
  FAILED=1; log "build: ${RESULT[build]}"
fi
BENCH=$(find $BUILD -name sdm-bench -type f -perm -u+x | head -1)

# ---- tests: every CUDA test once (the CPU-only kernel and engine tests run last, below) ------
run_tests() {  # name, required|optional, ctest args... (optional: a timeout is no failure)
  local name=$1 kind=$2; shift 2
  may_start "$name" "$kind" || return 0
  (cd $BUILD && timeout "$(budget 240)" ctest --output-on-failure --timeout 60 "$@") 2>&1 |
    tee "$OUT_DIR/ctest-$name.log" | grep --line-buffered -E "Test +#[0-9]+:|tests passed"
  local status=${PIPESTATUS[0]}
  local counts
  counts=$(grep -Eo '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$OUT_DIR/ctest-$name.log")
  if [[ $status == 0 ]]; then
    RESULT[$name]="pass ($(sed 's/.* out of /all of /' <<<"$counts"))"
  elif [[ $status == 124 && $kind == optional ]]; then
    # ctest's marks of a failed test ("***Failed", "***Timeout", "SEGFAULT"), not test names.
    local failed_marks='\*\*\*(Failed|Timeout|Exception)|SEGFAULT'
    RESULT[$name]="cut by the deadline ($(grep -c "  Passed  " "$OUT_DIR/ctest-$name.log") passed, $(grep -Ec "$failed_marks" "$OUT_DIR/ctest-$name.log") failed before it)"
    grep -Eq "$failed_marks" "$OUT_DIR/ctest-$name.log" && FAILED=1
  else
    RESULT[$name]="FAIL: ${counts:-timed out}"
    FAILED=1
  fi
  log "tests $name: ${RESULT[$name]}"
}
# Verbose, so that the tests' measurement lines reach the log: "[selection]" (how often the
# device's product-key selection differs from the CPU's: kernels on identical scores, and the
# engines on the test models), "[sdm-state]" (SDM rows per layer against the CPU after a sync),
# "[sdm-readings]" (each SDM layer's readings against the CPU, pass by pass) and "[batch64]"
# (sessions of the 64-session decode batch beyond the logit tolerance).
run_tests cuda required -R "[Cc]uda" -j8 -V
if [[ -f $OUT_DIR/ctest-cuda.log ]]; then
  grep -ho "\[selection\].*\|\[sdm-state\].*\|\[sdm-readings\].*\|\[batch64\].*" "$OUT_DIR/ctest-cuda.log" \
    >"$OUT_DIR/selection.txt" || true
  RESULT[selection]="$(grep -c "" "$OUT_DIR/selection.txt") lines (selection.txt)"
  # A CUDA test that skipped on this machine (no device seen by the process) is a failure here.
  # Counted from ctest's own marks (with -V the log also holds gtest's "Skipped" lines), leaving
  # out the one test that skips on purpose where a device is present.
  skipped=$(grep -E "\*\*\*Skipped" "$OUT_DIR/ctest-cuda.log" |
            grep -vc "AskingForCudaWithoutADeviceIsAClearError" || true)
  RESULT[cuda_skipped]=$skipped
  [[ "$skipped" != 0 ]] && FAILED=1
fi

# ---- benchmarks ----------------------------------------------------------------------------------
if [[ -n "$BENCH" ]]; then
  if ! may_start kernels; then :
  elif timeout "$(budget 150)" "$BENCH" kernels --json "$OUT_DIR/kernels.json" 2>&1 |
      tee "$OUT_DIR/kernels.txt"; [[ ${PIPESTATUS[0]} == 0 ]]; then
    RESULT[kernels]=ok
  else
    RESULT[kernels]="FAIL"; FAILED=1
  fi
  log "kernel benchmark: ${RESULT[kernels]:-}"
  if [[ "${SDM_DEVICE_CHECK_QUICK:-0}" != 1 ]]; then
    # One context keeps the prefill of 64 sessions per model inside the budget; the 32k
    # comparison at batch 64 is a longer run (docs/benchmarks.md, CUDA section), and the kernel
    # benchmark above already measures attention decode at 32k.
    if ! may_start decode; then :
    elif timeout "$(budget 240)" "$BENCH" decode --device cuda --pair flagship --contexts 1024 \
        --batches 1,8,64 --max_batch 64 --steps 20 --json "$OUT_DIR/decode.json" 2>&1 |
        tee "$OUT_DIR/decode.txt"; [[ ${PIPESTATUS[0]} == 0 ]]; then
      RESULT[decode]=ok
    else
      RESULT[decode]="FAIL"; FAILED=1
    fi
    log "decode benchmark: ${RESULT[decode]}"
    # Park and resume through the engine's real path: an sdm_flagship session prefilled on the
    # device, its state synced to the host (device_to_host_s), written, read back and resumed
    # with one decode step: converted inside the step, and staged ahead (Engine::StageResume:
    # staging_s, first_step_after_staged_resume_s); then the same for a session whose SDM
    # tables hold every slot (--full_table: 1.61 GB of bf16 rows, park GB/s through SyncToHost;
    # its staged image copied to the device ahead, copy_ahead_wait_s, so the step only scatters).
    if ! may_start state; then :
    elif timeout "$(budget 150)" "$BENCH" state --device cuda --presets sdm_flagship --lengths 128 \
        --full_table \
        --dir /tmp/sdm-device-state --json "$OUT_DIR/state.json" 2>&1 |
        tee "$OUT_DIR/state.txt"; [[ ${PIPESTATUS[0]} == 0 ]]; then
      RESULT[state]=ok
    else
      RESULT[state]="FAIL"; FAILED=1
    fi
    log "state benchmark: ${RESULT[state]}"
  fi
else
  RESULT[kernels]="FAIL (sdm-bench not built)"; RESULT[decode]="FAIL (sdm-bench not built)"; FAILED=1
fi

# ---- the reference implementation's own decode step, where its code was carried ---------------
if [[ ! -d .refcode/sparse-delta-memory ]]; then
  RESULT[reference]="not carried (.refcode/: scripts/fetch-reference.sh)"
elif may_start reference optional; then
  ref_budget=$(budget 150)  # at least 15 here (may_start)
  if PYTHONUNBUFFERED=1 timeout "$ref_budget" python3 scripts/device/reference_decode.py \
      --ref .refcode/sparse-delta-memory --json "$OUT_DIR/reference_decode.json" \
      --time_limit_s "$(( ref_budget > 25 ? ref_budget - 15 : 10 ))" 2>&1 | tee "$OUT_DIR/reference.txt" |
      grep --line-buffered -v "^ *$"; [[ ${PIPESTATUS[0]} == 0 ]]; then
    RESULT[reference]=ok
  else
    RESULT[reference]="FAIL (see reference.txt)"  # informative; not a failure of ours
  fi
fi
log "reference: ${RESULT[reference]}"
# Ours against it, batch by batch (informative too: a reference that did not run compares
# nothing, and says why per batch).
if [[ -s $OUT_DIR/decode.json && -s $OUT_DIR/reference_decode.json ]]; then
  timeout 30 python3 scripts/device/compare_decode.py --ours "$OUT_DIR/decode.json" \
    --reference "$OUT_DIR/reference_decode.json" --json "$OUT_DIR/comparison.json" \
    >"$OUT_DIR/comparison.txt" 2>&1
  case $? in
    0 | 1) RESULT[vs_reference]=$(tail -1 "$OUT_DIR/comparison.txt") ;;  # 1: nothing compared
    *) RESULT[vs_reference]="compare_decode.py failed (see comparison.txt)" ;;
  esac
else
  RESULT[vs_reference]="not compared (decode.json or reference_decode.json missing)"
fi
log "ours vs the reference: ${RESULT[vs_reference]}"

# ---- decode without CUDA graphs: what the graphs save per step at small batch --------------------
# The decode benchmark above runs its steps as graphs (the default; its output says how many were
# captured and replayed); here the SDM model of the pair again with every kernel launched.
if [[ -n "$BENCH" && "${SDM_DEVICE_CHECK_QUICK:-0}" != 1 ]] && may_start launched; then
  if timeout "$(budget 90)" "$BENCH" decode --device cuda --presets sdm_flagship --contexts 1024 \
      --batches 1,8 --fit_batch=false --steps 20 --cuda_graphs=false \
      --json "$OUT_DIR/decode_launched.json" 2>&1 | tee "$OUT_DIR/decode_launched.txt"; \
      [[ ${PIPESTATUS[0]} == 0 ]]; then
    RESULT[launched]=ok
  else
    RESULT[launched]="FAIL"; FAILED=1
  fi
  log "decode without graphs: ${RESULT[launched]}"
fi

# ---- CPU-only tests last (CI runs them too; here they meet the host's ISA) ----------------------
run_tests kernel_tests optional -L kernels -E "[Cc]uda" -j8
run_tests engine optional -L engine -E "[Cc]uda" -j8

# The table prints on exit (trap above); the status says whether everything passed.
exit $FAILED
