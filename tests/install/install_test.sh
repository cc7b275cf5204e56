#!/usr/bin/env bash
# Installs the build tree into a fresh prefix (cmake --install) and checks the result as
# deploy/ uses it: every binary is in <prefix>/bin and runs, and the installed sdm-cli loads the
# SentencePiece shim installed next to it (not the build tree's copy, which the engine would also
# find). The shim check needs spm_train (Debian: sentencepiece) and is skipped without it.
#
#   tests/install/install_test.sh BUILD_DIR
set -euo pipefail
BUILD_DIR=$1
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT

cmake --install "$BUILD_DIR" --prefix "$prefix" >/dev/null
bin="$prefix/bin"
installed=(sdm-server sdm-cli sdm-model libsdm_sentencepiece_shim.so)
# sdm-bench only where it is built (-DSDM_BENCH=ON, the default).
grep -q '^SDM_BENCH:BOOL=OFF' "$BUILD_DIR/CMakeCache.txt" || installed+=(sdm-bench)
for f in "${installed[@]}"; do
  [ -e "$bin/$f" ] || { echo "FAIL: $bin/$f not installed"; exit 1; }
done
"$bin/sdm-server" --help >"$prefix/help.txt" 2>&1 || true  # absl's --help exits 1
grep -q -- "--model" "$prefix/help.txt" || { echo "FAIL: sdm-server --help:"; cat "$prefix/help.txt"; exit 1; }
echo "ok: installed binaries in $bin; sdm-server --help runs"

if ! command -v spm_train >/dev/null; then
  echo "skip: spm_train not installed, the shim lookup is not checked"
  exit 0
fi
work="$prefix/work"
mkdir -p "$work/model"
for i in $(seq 1 200); do echo "hello world session state delta memory hello state"; done >"$work/train.txt"
# Byte fallback needs 256 byte pieces plus the specials: 300 pieces.
spm_train --input="$work/train.txt" --model_prefix="$work/tokenizer" --vocab_size=300 \
  --model_type=bpe --byte_fallback=true --hard_vocab_limit=false --minloglevel=2 \
  >"$work/spm_train.log" 2>&1 || { echo "FAIL: spm_train"; cat "$work/spm_train.log"; exit 1; }
"$bin/sdm-model" init --preset tiny --seed 1 --out "$work/model" --force \
  --set vocab_size=1000 --set tokenizer.name=sp --set tokenizer.path=tokenizer.model \
  >"$work/sdm-model.log" 2>&1 || { echo "FAIL: sdm-model init"; cat "$work/sdm-model.log"; exit 1; }
cp "$work/tokenizer.model" "$work/model/"
unset SDM_SENTENCEPIECE_SHIM
# LD_DEBUG=libs names every library as it is initialised: the installed shim must be the one.
LD_DEBUG=libs "$bin/sdm-cli" generate --model "$work/model" --prompt "hello" --max_tokens 1 \
  >"$work/out.txt" 2>"$work/ld.txt" || { echo "FAIL: sdm-cli generate"; cat "$work/out.txt"; tail -20 "$work/ld.txt"; exit 1; }
if grep -q "calling init: $bin/libsdm_sentencepiece_shim.so" "$work/ld.txt"; then
  echo "ok: the installed sdm-cli loaded $bin/libsdm_sentencepiece_shim.so"
else
  echo "FAIL: the installed shim was not loaded:"
  grep sentencepiece_shim "$work/ld.txt" || true
  exit 1
fi
