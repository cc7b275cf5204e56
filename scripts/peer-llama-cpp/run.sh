#!/usr/bin/env bash
# sdmserve's CPU decode against llama.cpp on the same model, interleaved in one sitting
# (docs/benchmarks.md, "Peer comparison with llama.cpp").
#
#   scripts/peer-llama-cpp/run.sh [--preset debug] [--contexts 512,2048] [--batches 1,8]
#       [--rounds 2] [--steps 10] [--warmup 2] [--threads 2] [--kv f32|f16] [--flash off|on|auto]
#       [--weights f32|f16|bf16] [--sdm_dtype fp32|bf16] [--json FILE]
#       [--seed 1] [--build build] [--work /tmp/sdm-peer-llama-cpp]
#
# 16-bit runs: --sdm_dtype bf16 runs sdmserve with bf16 matrices and KV rows (sdm-bench decode
# --cpu_dtype bf16; the byte model then counts 2 bytes per matrix and KV value), --weights f16 (or
# bf16) writes llama.cpp's GGUF with 16-bit matrices, and --kv f16 --flash auto are llama.cpp's
# defaults. --json FILE also writes every round and the medians as JSON.
#
# 1. Installs node-llama-cpp (pinned in package.json; its prebuilt CPU libraries come from the npm
#    registry) into this folder, once.
# 2. Writes the preset with random fp32 weights (sdm-model init --seed) and the same weights as a
#    GGUF (write-gguf.mjs): full-attention presets only (debug, baseline_1.4B, ...); checks that
#    both engines give the same logits for 64 random tokens (compare-logits.mjs).
# 3. For each context and batch, `rounds` rounds, the engine that goes first alternating: llama.cpp
#    (bench.mjs) and sdmserve (sdm-bench decode --presets PRESET), each with the same protocol
#    (B sessions prefilled with random tokens to the context, warm-up steps, timed steps of one
#    token per session; median step time). Prints each engine's tokens/s and GB/s (the step's
#    bytes from sdm-bench's byte model: fp32 weights plus the visible KV rows, the same bytes for
#    llama.cpp with --kv f32) against the streaming-read bandwidth sdm-bench measured in the
#    round, and the ratio sdmserve / llama.cpp per round and of the medians.
# Needs: node and npm, and a build with sdm-model, sdm-cli and sdm-bench (cmake --build build
# --target sdm-model sdm-cli sdm-bench).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
preset=debug contexts=512,2048 batches=1,8 rounds=2 steps=10 warmup=2 threads=2 kv=f32 flash=off
weights=f32 sdm_dtype=fp32 json=
seed=1 build=$root/build work=/tmp/sdm-peer-llama-cpp
while [ $# -gt 0 ]; do
  case $1 in
    --preset) preset=$2 ;; --contexts) contexts=$2 ;; --batches) batches=$2 ;;
    --rounds) rounds=$2 ;; --steps) steps=$2 ;; --warmup) warmup=$2 ;; --threads) threads=$2 ;;
    --kv) kv=$2 ;; --flash) flash=$2 ;; --seed) seed=$2 ;; --build) build=$2 ;; --work) work=$2 ;;
    --weights) weights=$2 ;; --sdm_dtype) sdm_dtype=$2 ;; --json) json=$2 ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
for tool in "$build/tools/sdm_model/sdm-model" "$build/tools/sdm_bench/sdm-bench" \
  "$build/tools/sdm_cli/sdm-cli"; do
  [ -x "$tool" ] || { echo "run.sh: $tool not built" >&2; exit 2; }
done
if [ ! -d "$here/node_modules/node-llama-cpp" ]; then
  (cd "$here" && npm install --no-audit --no-fund --ignore-scripts >/dev/null)
fi
mkdir -p "$work"
model=$work/$preset-seed$seed
if [ ! -f "$model/model.safetensors" ]; then
  "$build/tools/sdm_model/sdm-model" init --preset "$preset" --seed "$seed" --out "$model" \
    --dtype fp32 >/dev/null
fi
gguf=$model.gguf
[ "$weights" = f32 ] || gguf=$model.$weights.gguf
[ -f "$gguf" ] || node "$here/write-gguf.mjs" "$model" "$gguf" --weights "$weights"
vocab=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
  "$model/config.json")

echo "# peer comparison: $preset, threads $threads, sdmserve $sdm_dtype;" \
  "llama.cpp weights $weights, KV $kv, flash attention $flash;" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ); load average $(cut -d' ' -f1-3 /proc/loadavg)"
# The same model on both sides: the last position's logits after 64 random tokens.
echo "# logits, sdmserve against llama.cpp: $(node "$here/compare-logits.mjs" "$gguf" "$model" \
  "$build/tools/sdm_cli/sdm-cli" --tokens 64 --vocab "$vocab" --threads "$threads" 2>/dev/null |
  tail -1)"
results=$work/results.tsv
: > "$results"
IFS=, read -ra ctx_list <<< "$contexts"
IFS=, read -ra batch_list <<< "$batches"
for c in "${ctx_list[@]}"; do
  for b in "${batch_list[@]}"; do
    for ((r = 0; r < rounds; ++r)); do
      run_llama() {
        node "$here/bench.mjs" "$gguf" "$c" "$b" --steps "$steps" --warmup "$warmup" \
          --threads "$threads" --kv "$kv" --flash "$flash" --seed "$((seed + r))" \
          --vocab "$vocab" 2>/dev/null |
          tail -1 | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["tokens_per_s"])' \
          > "$work/llama.tok"
      }
      run_sdm() {
        "$build/tools/sdm_bench/sdm-bench" decode --device cpu --presets "$preset" \
          --seed "$seed" --contexts "$c" --batches "$b" --fit_batch=false --steps "$steps" \
          --warmup "$warmup" --threads "$threads" --bandwidth_mb 256 --state_budget_gb 64 \
          --cpu_dtype "$sdm_dtype" \
          --json "$work/sdm.json" >/dev/null 2>&1
      }
      if ((r % 2 == 0)); then run_llama; run_sdm; else run_sdm; run_llama; fi
      python3 - "$work/sdm.json" "$(cat "$work/llama.tok")" "$c" "$b" "$r" >> "$results" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
row = [r for r in doc["results"] if "tokens_per_s" in r][0]
bw = doc["bandwidth"]["reference_gbps"]
print("\t".join(str(x) for x in [sys.argv[3], sys.argv[4], sys.argv[5], row["tokens_per_s"],
                                 sys.argv[2], row["bytes_per_step"], row["ms_per_step_median"], bw]))
PY
    done
  done
done
python3 - "$results" "$json" "$preset" "$threads" "$sdm_dtype" "$weights" "$kv" "$flash" \
  "$steps" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, statistics, sys, time
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
record = {"tool": "scripts/peer-llama-cpp/run.sh", "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "preset": sys.argv[3], "threads": int(sys.argv[4]), "sdm_dtype": sys.argv[5],
          "llama_weights": sys.argv[6], "llama_kv": sys.argv[7], "llama_flash": sys.argv[8],
          "steps": int(sys.argv[9]), "load_average_at_end": sys.argv[10], "rounds": [], "medians": []}
print(f"{'context':>8} {'batch':>6} {'round':>6} {'sdmserve tok/s':>15} {'llama.cpp tok/s':>16} "
      f"{'ratio':>7} {'sdm GB/s':>9} {'llama GB/s':>11} {'read GB/s':>10}")
points = {}
for c, b, r, sdm, llama, bytes_, ms, bw in rows:
    sdm, llama, bytes_, bw = float(sdm), float(llama), float(bytes_), float(bw)
    sdm_gbps = bytes_ * sdm / int(b) / 1e9
    llama_gbps = bytes_ * llama / int(b) / 1e9
    print(f"{c:>8} {b:>6} {r:>6} {sdm:15.2f} {llama:16.2f} {sdm / llama:6.2f}x {sdm_gbps:9.1f} "
          f"{llama_gbps:11.1f} {bw:10.1f}")
    record["rounds"].append({"context": int(c), "batch": int(b), "round": int(r),
                             "sdmserve_tokens_per_s": sdm, "llama_tokens_per_s": llama,
                             "ratio": sdm / llama, "bytes_per_step": bytes_,
                             "sdmserve_gbps": sdm_gbps, "llama_gbps": llama_gbps,
                             "read_gbps": bw})
    points.setdefault((int(c), int(b)), []).append((sdm, llama))
print("# medians over rounds: sdmserve / llama.cpp")
for (c, b), v in sorted(points.items()):
    s = statistics.median(x for x, _ in v)
    l = statistics.median(y for _, y in v)
    print(f"# context {c:>6} batch {b:>3}: {s:.2f} / {l:.2f} tok/s = {s / l:.2f}x")
    record["medians"].append({"context": c, "batch": b, "sdmserve_tokens_per_s": s,
                              "llama_tokens_per_s": l, "ratio": s / l})
if sys.argv[2]:
    with open(sys.argv[2], "w") as f:
        json.dump(record, f, indent=1)
PY
