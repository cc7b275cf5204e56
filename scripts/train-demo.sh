#!/usr/bin/env bash
# Retrains the shipped demo model from scratch on the CPU (no network once the Debian packages are
# installed): the SDM hybrid and, on the same batches for the same steps, its sliding-window twin
# (the comparison in the model card; not shipped). The two runs use one torch thread each and run
# side by side on a 2-core machine. An interrupted run resumes from its checkpoint when the script
# is rerun. Results land in models/sdm-fortunes-demo (bf16 weights + README.md card + plots).
#
#   scripts/train-demo.sh            (environment: SDM_TRAIN_STEPS, SDM_TRAIN_RUNS, SDM_TRAIN_OUT,
#                                     SDM_TRAIN_PRESET: wide (the shipped model), or demo (the
#                                     0.9M model shipped before); SDM_TRAIN_FLAGS: training/train.py
#                                     flags, replacing the shipped recipe's below)
#
# The shipped recipe: preset `wide` (5.2M parameters), 4,500 steps, peak learning rate 2e-3 after
# 100 warm-up steps, matrix products in bf16 (CPU autocast: about twice as fast where the CPU has
# AVX512-BF16; docs/benchmarks.md, "The shipped model at 5.2M parameters"). The earlier 0.9M model:
#   SDM_TRAIN_PRESET=demo SDM_TRAIN_STEPS=4000 SDM_TRAIN_FLAGS="--precision fp32" scripts/train-demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${SDM_TRAIN_STEPS:-4500}
PRESET=${SDM_TRAIN_PRESET:-wide}
FLAGS=${SDM_TRAIN_FLAGS:---lr 2e-3 --warmup 100 --precision bf16}
# One thread per trainer: Debian's PyTorch multiplies in OpenBLAS (fp32) and oneDNN (bf16), whose
# own threads ignore --threads and would spin against the other trainer.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
RUNS=${SDM_TRAIN_RUNS:-runs}
OUT=${SDM_TRAIN_OUT:-models/sdm-fortunes-demo}
PY=/usr/bin/python3

bash scripts/install-deps.sh  # python3-torch, python3-numpy, python3-matplotlib among them
if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q "install ok installed"; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends fortunes  # the training text
fi

mkdir -p "$RUNS"
train() {  # preset
  # exec: the background job's pid is the trainer's own (the trap below can stop it).
  # shellcheck disable=SC2086  # FLAGS: several flags, split on spaces
  exec nice -n 10 "$PY" training/train.py --preset "$1" --run "$RUNS/$1" --steps "$STEPS" \
    --threads 1 --export "$RUNS/$1/model" $FLAGS
}
train "$PRESET" 2> >(tee "$RUNS/$PRESET.log" >&2) &
sdm_pid=$!
train "${PRESET}_twin" 2> "$RUNS/${PRESET}_twin.log" &
twin_pid=$!
# A trainer that fails ends the script (set -e at its wait): the other one goes with it.
trap 'kill "$sdm_pid" "$twin_pid" 2>/dev/null || true' EXIT
wait "$sdm_pid"
wait "$twin_pid"
trap - EXIT
tail -n 2 "$RUNS/${PRESET}_twin.log"

mkdir -p "$OUT"
cp "$RUNS/$PRESET/model/config.json" "$RUNS/$PRESET/model/model.safetensors" "$OUT/"
notes=()  # the shipped model's card carries the notes written for it
if [ "$PRESET" = wide ]; then notes=(--notes training/card-notes.md); fi
"$PY" training/card.py --run "$RUNS/$PRESET" --twin "$RUNS/${PRESET}_twin" --model "$OUT" \
  "${notes[@]}"
echo "train-demo: the model is in $OUT; scripts/run.sh serves it"
