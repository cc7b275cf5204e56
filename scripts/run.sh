#!/usr/bin/env bash
# The README's main command: installs missing dependencies, builds, creates the default model if
# there is none, and generates a completion with it.
#
#   scripts/run.sh [PROMPT]             (environment: SDM_MODEL_DIR, SDM_PRESET, SDM_BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Sparse delta memory keeps a whole conversation in a fixed-size state, so"}
BUILD_DIR=${SDM_BUILD_DIR:-build}
PRESET=${SDM_PRESET:-debug_sdm}
MODEL_DIR=${SDM_MODEL_DIR:-models/$PRESET}

bash scripts/install-deps.sh
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR" -j"$(nproc)" --target sdm-model sdm-cli

if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "run: creating a randomly initialised $PRESET model in $MODEL_DIR (no trained weights ship"
  echo "     with the project; convert one with tools/convert_reference_checkpoint.py)"
  "$BUILD_DIR/tools/sdm_model/sdm-model" init --preset "$PRESET" --seed 0 --out "$MODEL_DIR"
fi
"$BUILD_DIR/tools/sdm_model/sdm-model" info "$MODEL_DIR"
echo
echo "run: sdm-cli generate --model $MODEL_DIR --prompt \"$PROMPT\" --max_tokens 48"
"$BUILD_DIR/tools/sdm_cli/sdm-cli" generate --model "$MODEL_DIR" --prompt "$PROMPT" \
  --max_tokens 48 --temperature 0.8 --top_p 0.95 --seed 1
