#!/usr/bin/env bash
# Runs the CUDA kernel tests and the CUDA engine test on this CPU under the fiber emulator in
# tests/cuda_emulator/ (see its README.md for what the emulator models and what it cannot).
# A hand-run verification tool for machines without a GPU; NOT part of CI, and no substitute for
# scripts/device-check.sh on a real device. A CPU-only CMake tree configured with
# -DSDM_CUDA=OFF -DSDM_CUDA_EMULATOR=ON runs this script as the ctest label `cuda_emulator`
# (tests/cuda_emulator/CMakeLists.txt): `ctest -L cuda_emulator`.
#
# Usage: scripts/emulate-cuda.sh [options]
#   -b, --build-dir DIR   where to build (default /tmp/sdm-emu)
#   --cmake-build DIR     reuse an existing CPU-only CMake build (-DSDM_CUDA=OFF) for the
#                         project's libraries; default: configure and build DIR/cmake here
#   -t, --tests LIST      comma-separated subset of:
#                         selftest,streams,attention,sdm,elementwise,sampling,engine
#                         (default: all of them, or $EMU_TESTS); streams is the engine
#                         dialect's stream model checked in every EMU_STREAMS mode
#                         (tests/cuda_emulator/engine/streams_selftest.cc)
#   -f, --filter PATTERN  gtest filter for every test binary (replaces the defaults below;
#                         default: $EMU_FILTER)
#   --all                 run every engine test (default: the cheap ones and the CUDA-vs-CPU
#                         comparison for the tiny and debug_hybrid presets; the rest take ~8 min)
#   --order ORDER         sets EMU_ORDER=fwd|rev|rand:SEED (kernel tests; EMU_ORDER from the
#                         environment is passed through as well)
#   --coresident K        sets EMU_CORESIDENT (kernel tests): a launch without clusters runs its
#                         blocks in groups of K consecutive blocks whose warps interleave,
#                         switching at atomics, fences and __ldcg too; needs --order rand:SEED
#                         (ignored otherwise; tests/cuda_emulator/kernels/emu.cc)
#   --streams MODE        sets EMU_STREAMS (engine tests): deferred (the default: streams run
#                         their work only when the host or another stream waits for it, as late
#                         as CUDA allows), eager (when it is enqueued), others-first (deferred,
#                         and a wait for one stream runs every other stream's work first) or
#                         shuffle:SEED (deferred, and at random some pending work of every
#                         stream runs early, the streams interleaved)
#                         (tests/cuda_emulator/engine/emu.cc)
#   --no-asan             build the kernel tests without ASan/UBSan (faster; default is with,
#                         or $EMU_ASAN)
#   -j N                  parallel compile jobs (default: nproc)
#   --build-only          build the selected binaries, run nothing
#   --run-only            run the selected binaries built before (exit 77, "skipped", when one
#                         was not built)
# Exit status: 0 when every selected binary passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EMU="$ROOT/tests/cuda_emulator"
BUILD=/tmp/sdm-emu
CMAKE_BUILD=""
TESTS="${EMU_TESTS:-selftest,streams,attention,sdm,elementwise,sampling,engine}"
FILTER="${EMU_FILTER:-}"
BUILD_STEP=1
RUN_STEP=1
ALL=0
ASAN="${EMU_ASAN:-1}"
JOBS="$(nproc)"

while [[ $# -gt 0 ]]; do
  case "$1" in
    -b | --build-dir) BUILD="$2"; shift 2 ;;
    --cmake-build) CMAKE_BUILD="$2"; shift 2 ;;
    -t | --tests) TESTS="$2"; shift 2 ;;
    -f | --filter) FILTER="$2"; shift 2 ;;
    --all) ALL=1; shift ;;
    --order) export EMU_ORDER="$2"; shift 2 ;;
    --streams) export EMU_STREAMS="$2"; shift 2 ;;
    --coresident) export EMU_CORESIDENT="$2"; shift 2 ;;
    --no-asan) ASAN=0; shift ;;
    -j) JOBS="$2"; shift 2 ;;
    --build-only) RUN_STEP=0; shift ;;
    --run-only) BUILD_STEP=0; shift ;;
    -h | --help) sed -n '2,/^# Exit status/p' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done
want() { [[ ",$TESTS," == *",$1,"* ]]; }

mkdir -p "$BUILD"
BUILD="$(cd "$BUILD" && pwd)"
LOGS="$BUILD/logs"
# Kernel objects with and without the sanitizers apart: an object is rebuilt only when a source
# changes, so a switch of --no-asan must not reuse the other kind.
KO="$BUILD/obj-k$([[ $ASAN == 1 ]] && echo -asan)"
mkdir -p "$LOGS" "$BUILD/gen" "$KO" "$BUILD/obj-e" "$BUILD/bin"

KERNEL_TESTS=()
for t in attention sdm elementwise sampling; do want "$t" && KERNEL_TESTS+=("$t"); done
if [[ $BUILD_STEP == 1 ]]; then
# --- 1. CPU-only CMake build: the project's libraries and the link line of a test binary
# (the self-tests need neither). ---
LIBS=""
if [[ ${#KERNEL_TESTS[@]} -gt 0 ]] || want engine; then
if [[ -z "$CMAKE_BUILD" ]]; then
  CMAKE_BUILD="$BUILD/cmake"
  echo "== CPU-only CMake build in $CMAKE_BUILD (log: $LOGS/cmake.log)"
  if ! { cmake -S "$ROOT" -B "$CMAKE_BUILD" -DSDM_CUDA=OFF -DSDM_SERVER=OFF \
           -DCMAKE_BUILD_TYPE=Release &&
         cmake --build "$CMAKE_BUILD" --target engine_cuda_engine_test -j "$JOBS"; } \
       >"$LOGS/cmake.log" 2>&1; then
    tail -30 "$LOGS/cmake.log"
    echo "CMake build failed" >&2
    exit 1
  fi
fi
CMAKE_BUILD="$(cd "$CMAKE_BUILD" && pwd)"
# The link line of engine_cuda_engine_test: everything after the output name is the project's
# static libraries, absl, OpenBLAS and gtest_main. Makefile trees keep it in link.txt (paths
# relative to tests/), Ninja trees give it with `ninja -t commands` (relative to the tree).
LINK_TXT="$CMAKE_BUILD/tests/CMakeFiles/engine_cuda_engine_test.dir/link.txt"
if ! grep -q "SDM_CUDA:BOOL=ON" "$CMAKE_BUILD/CMakeCache.txt" 2>/dev/null; then
  if [[ -f "$LINK_TXT" ]]; then
    LIBS="$(sed -e 's/^.*-o engine_cuda_engine_test *//' -e "s#\.\./#$CMAKE_BUILD/#g" "$LINK_TXT")"
  elif [[ -f "$CMAKE_BUILD/build.ninja" && -x "$CMAKE_BUILD/tests/engine_cuda_engine_test" ]]; then
    LIBS="$(ninja -C "$CMAKE_BUILD" -t commands tests/engine_cuda_engine_test | tail -1 |
            sed -e 's/^.*-o tests\/engine_cuda_engine_test *//' -e 's/ *&&.*$//')"
    LIBS="$(for w in $LIBS; do [[ $w == /* || $w == -* ]] && echo "$w" || echo "$CMAKE_BUILD/$w"; done)"
  fi
fi
if [[ -z "$LIBS" ]]; then
  echo "$CMAKE_BUILD is not a CPU-only build with engine_cuda_engine_test built" >&2
  exit 1
fi
fi  # the project's libraries

# --- 2. Compile helpers (parallel, rebuild when the source or the emulator changed). ---
rm -f "$BUILD/compile-failed"
pids=()
CCACHE="$(command -v ccache || true)"  # reruns after an unrelated change cost little
compile() {  # compile OUT.o SRC FLAGS...; rebuilds when SRC or any header it may include
  local out="$1" src="$2"; shift 2  # (the emulator's or the project's) is newer
  if [[ -f "$out" && "$out" -nt "$src" && "$out" -nt "$0" ]] &&
     ! find "$EMU" "$ROOT"/{base,common,engine,kernels,state_store} -newer "$out" -name '*.h' \
         2>/dev/null | grep -q . ; then
    return 0
  fi
  # Runs in the background; a failure leaves a marker file (a subshell cannot set variables).
  { $CCACHE g++ "$@" -c "$src" -o "$out" >"$out.log" 2>&1 ||
    { echo "compile failed: $src (see $out.log)" >&2; tail -20 "$out.log" >&2;
      rm -f "$out"; touch "$BUILD/compile-failed"; }; } &
  pids+=($!)
  if [[ ${#pids[@]} -ge $JOBS ]]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
}
wait_all() { for p in "${pids[@]}"; do wait "$p"; done; pids=(); }
transform() {  # transform DIALECT(kernels|engine) CU OUT
  python3 "$EMU/$1/transform.py" "$2" "$3" 2>>"$LOGS/transform.log"
}

COMMON_DEFS=(-DSDM_HAVE_CUDA=1 -DGTEST_HAS_PTHREAD=1 "-DSDM_SOURCE_DIR=\"$ROOT\""
             "-DSDM_BINARY_DIR=\"$CMAKE_BUILD\"" -I"$ROOT"
             -I/usr/include/x86_64-linux-gnu/openblas-pthread)

# --- 3. Kernel tests: tests/cuda_emulator/kernels (fail-fast scheduler, EMU_ORDER), ASan. ---
SAN=()
[[ $ASAN == 1 ]] && SAN=(-fsanitize=address,undefined -fno-omit-frame-pointer
                         -fno-sanitize-recover=undefined)
KFL=(-std=c++20 -g -w "${COMMON_DEFS[@]}" -I"$EMU/kernels/include" -I"$EMU/include" "${SAN[@]}")
# Kernel translation units get FMA contraction, as nvcc contracts by default, and no
# strict-aliasing optimisation: the kernels' 16-byte accesses pun uint4 with __nv_bfloat162
# (kernels/cuda/sdm.cu LoadBf16/StoreBf16<8>), which nvcc compiles as meant but g++ -O2 may
# reorder (the 16-byte SDM step path then read stale values: CudaSdmTest.DecodeBatchWideGrid).
KERN_FL=("${KFL[@]}" -O2 -march=x86-64-v3 -ffp-contract=fast -fno-strict-aliasing)
if [[ ${#KERNEL_TESTS[@]} -gt 0 ]] || want selftest; then
  echo "== building kernel-emulator binaries in $BUILD (asan=$ASAN)"
  compile "$KO/emu.o" "$EMU/kernels/emu.cc" "${KFL[@]}" -O1
  if [[ ${#KERNEL_TESTS[@]} -gt 0 ]]; then
    for cu in "$ROOT"/kernels/cuda/*.cu; do
      name="$(basename "$cu" .cu)"
      # gemm.cu needs cuBLASLt; the kernel tests here do not test it; runtime_info is faked.
      [[ $name == gemm || $name == cuda_runtime_info ]] && continue
      transform kernels "$cu" "$BUILD/gen/k_$name.cc"
      compile "$KO/$name.o" "$BUILD/gen/k_$name.cc" "${KERN_FL[@]}"
    done
    for t in "${KERNEL_TESTS[@]}"; do
      compile "$KO/${t}_test.o" "$ROOT/tests/kernels/cuda_${t}_test.cc" "${KFL[@]}" -O1
    done
  fi
  if want selftest; then
    for s in selftest neg; do
      transform kernels "$EMU/kernels/$s.cu" "$BUILD/gen/$s.cc"
      compile "$KO/$s.o" "$BUILD/gen/$s.cc" "${KFL[@]}" -O1
    done
  fi
  wait_all
  [[ -f "$BUILD/compile-failed" ]] && exit 1
  if [[ ${#KERNEL_TESTS[@]} -gt 0 ]]; then
    rm -f "$KO/libemu_kernels.a"
    ar rcs "$KO/libemu_kernels.a" $(ls "$KO"/*.o | grep -v -e '_test.o$' -e '/emu.o$' \
                                      -e '/selftest.o$' -e '/neg.o$')
    for t in "${KERNEL_TESTS[@]}"; do
      # The emulator objects come first so that its DeviceCount() (1) is the one linked.
      g++ "${SAN[@]}" -o "$BUILD/bin/cuda_${t}_test" "$KO/${t}_test.o" "$KO/emu.o" \
        "$KO/libemu_kernels.a" $LIBS || exit 1
    done
  fi
  if want selftest; then
    for s in selftest neg; do g++ "${SAN[@]}" -o "$BUILD/bin/$s" "$KO/$s.o" "$KO/emu.o" || exit 1; done
  fi
fi

# --- 4. Engine test: tests/cuda_emulator/engine (allocation tracking, naive GEMM). ---
EO="$BUILD/obj-e"
EFL=(-std=c++20 -O2 -g -w -march=x86-64-v3 -fno-strict-aliasing "${COMMON_DEFS[@]}" -I"$EMU/engine/include" -I"$EMU/include")
if want engine; then
  echo "== building the emulated engine test in $BUILD"
  ESRCS=("$EMU/engine/emu.cc" "$EMU/engine/gemm_emu.cc" "$ROOT/engine/engine.cc"
         "$ROOT"/engine/cuda/*.cc "$ROOT/tests/engine/cuda_engine_test.cc")
  for cu in "$ROOT"/kernels/cuda/*.cu; do
    name="$(basename "$cu" .cu)"
    [[ $name == gemm ]] && continue  # replaced by gemm_emu.cc
    transform engine "$cu" "$BUILD/gen/e_$name.cc"
    ESRCS+=("$BUILD/gen/e_$name.cc")
  done
  EOBJS=()
  for s in "${ESRCS[@]}"; do
    o="$EO/$(basename "$s" .cc).o"
    EOBJS+=("$o")
    compile "$o" "$s" "${EFL[@]}"
  done
  wait_all
  [[ -f "$BUILD/compile-failed" ]] && exit 1
  # The recompiled engine.o (with SDM_HAVE_CUDA) precedes libsdm_engine.a, so it is the one used.
  g++ -o "$BUILD/bin/cuda_engine_test" "${EOBJS[@]}" $LIBS || exit 1
fi
# --- 4b. The engine dialect's stream model on its own (no project code). ---
if want streams; then
  echo "== building the stream-model self-test in $BUILD"
  compile "$EO/emu.o" "$EMU/engine/emu.cc" "${EFL[@]}"  # fresh already when engine was built
  compile "$EO/streams_selftest.o" "$EMU/engine/streams_selftest.cc" "${EFL[@]}"
  wait_all
  [[ -f "$BUILD/compile-failed" ]] && exit 1
  g++ -o "$BUILD/bin/streams_selftest" "$EO/streams_selftest.o" "$EO/emu.o" || exit 1
fi

fi  # BUILD_STEP
[[ $RUN_STEP == 1 ]] || exit 0

# --- 5. Run. ---
if [[ $BUILD_STEP == 0 ]]; then
  for b in $(want selftest && echo selftest neg) $(want streams && echo streams_selftest) \
           ${KERNEL_TESTS[@]/#/cuda_} \
           $(want engine && echo cuda_engine); do
    [[ $b == cuda_* ]] && b="${b}_test"
    [[ -x "$BUILD/bin/$b" ]] || { echo "$BUILD/bin/$b was not built"; exit 77; }
  done
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"  # fiber stacks are kept on purpose
ENGINE_DEFAULT="CudaEngineTest.ParsesDeviceNames:CudaEngineTest.AskingForCudaWithoutADeviceIsAClearError"
ENGINE_DEFAULT+=":TwoSessionDeviceTest.*:CudaEngineTest.AutoWithACpuStorageTypeRunsOnTheCpu"
ENGINE_DEFAULT+=":CudaEngineTest.AFaultPartWayThroughAPassMarksItsSessionsFailed"
# Every CUDA-vs-CPU test on tiny (logits, SDM rows per layer, write-selection agreement); on
# debug_hybrid the logits only (its state and selection tests add ~10 min here: --all or -f).
ENGINE_DEFAULT+=":Presets/CudaVsCpuTest.*/0:Presets/CudaVsCpuTest.PrefillThenBatchedDecodeMatchCpu/2"
SUMMARY=()
OVERALL=0
run_gtest() {  # run_gtest NAME BINARY FILTER
  local name="$1" bin="$2" filter="$3" log="$LOGS/$1.log" rc start
  echo "== running $name${filter:+ (filter $filter)}${EMU_ORDER:+ EMU_ORDER=$EMU_ORDER}"
  start=$SECONDS
  "$bin" ${filter:+--gtest_filter="$filter"} >"$log" 2>&1
  rc=$?
  local passed failed skipped
  passed="$(grep -oP '^\[  PASSED  \] \K[0-9]+' "$log" | tail -1)"
  failed="$(grep -oP '^\[  FAILED  \] \K[0-9]+(?= tests?, listed)' "$log" | tail -1)"
  skipped="$(grep -oP '^\[  SKIPPED \] \K[0-9]+(?= tests?, listed)' "$log" | tail -1)"
  local verdict=PASS
  [[ $rc != 0 ]] && verdict=FAIL && OVERALL=1
  [[ $rc != 0 ]] && grep -E 'EMU|FAILED|Failure|ERROR' "$log" | head -10
  SUMMARY+=("$(printf '%-5s %-22s passed=%-3s failed=%-3s skipped=%-3s %4ss  %s' "$verdict" \
    "$name" "${passed:-0}" "${failed:-0}" "${skipped:-0}" "$((SECONDS - start))" "$log")")
}
if want selftest; then
  log="$LOGS/selftest.log"
  "$BUILD/bin/selftest" >"$log" 2>&1
  rc=$?
  # Again with the blocks as co-resident groups (EMU_CORESIDENT): they must interleave.
  EMU_CORESIDENT=8 EMU_ORDER=rand:1 "$BUILD/bin/selftest" >>"$log" 2>&1 || rc=1
  # neg.cu plants one bug per mode; each must be caught ("EMU FAILURE", nonzero exit).
  caught=0
  for mode in 0 1 2 3 4 5 6; do
    # The subshell keeps bash's "Aborted" notice in the log.
    if ! ("$BUILD/bin/neg" "$mode"; exit $?) >"$log.neg$mode" 2>&1 && grep -q "EMU FAILURE" "$log.neg$mode"; then
      caught=$((caught + 1))
    fi
    cat "$log.neg$mode" >>"$log"
    rm -f "$log.neg$mode"
  done
  verdict=PASS
  [[ $rc != 0 || $caught != 7 ]] && verdict=FAIL && OVERALL=1
  SUMMARY+=("$(printf '%-5s %-22s intrinsics rc=%s, planted bugs caught %s/7  %s' "$verdict" \
    selftest "$rc" "$caught" "$log")")
fi
if want streams; then
  # Every mode, whatever EMU_STREAMS says: each scenario's outcomes are what that mode allows.
  log="$LOGS/streams_selftest.log"
  : >"$log"
  failed_modes=()
  for mode in eager deferred others-first shuffle:1 shuffle:2 shuffle:3; do
    EMU_STREAMS="$mode" "$BUILD/bin/streams_selftest" >>"$log" 2>&1 || failed_modes+=("$mode")
    # The page-locked race check (any mode): the unordered copies abort, the ordered ones pass.
    if (EMU_STREAMS="$mode" "$BUILD/bin/streams_selftest" race; exit $?) >"$log.race" 2>&1 ||
       ! grep -q "EMU HOST FAILURE.*race" "$log.race"; then
      cat "$log.race" >>"$log"; failed_modes+=("$mode(race not caught)")
    fi
    EMU_STREAMS="$mode" "$BUILD/bin/streams_selftest" race-ordered >>"$log" 2>&1 ||
      failed_modes+=("$mode(false race)")
  done
  rm -f "$log.race"
  verdict=PASS
  [[ ${#failed_modes[@]} -gt 0 ]] && verdict=FAIL && OVERALL=1
  SUMMARY+=("$(printf '%-5s %-22s modes failing: %s  %s' "$verdict" streams_selftest \
    "${failed_modes[*]:-none}" "$log")")
fi
for t in "${KERNEL_TESTS[@]}"; do run_gtest "cuda_${t}_test" "$BUILD/bin/cuda_${t}_test" "$FILTER"; done
if want engine; then
  f="$FILTER"
  [[ -z $f && $ALL == 0 ]] && f="$ENGINE_DEFAULT"
  run_gtest cuda_engine_test "$BUILD/bin/cuda_engine_test" "$f"
fi

echo
echo "== emulate-cuda summary (EMU_ORDER=${EMU_ORDER:-fwd}, EMU_STREAMS=${EMU_STREAMS:-deferred}, asan=$ASAN)"
printf '%s\n' "${SUMMARY[@]}"
[[ $OVERALL == 0 ]] && echo "ALL PASSED" || echo "SOME FAILED"
exit $OVERALL
