#!/usr/bin/env bash
# Downloads (here, where Debian's registry is reachable) the Debian packages the engine, kernels,
# tests and benchmarks need at build time into .devdeps/, for scripts/device-check.sh on the lent
# GPU machine, which reaches no registry and has CUDA, cmake and a compiler but not these
# libraries (nor, perhaps, a recent enough cmake). .devdeps/ is gitignored; name it in the device
# tool's `carry` list (about 30 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  libabsl-dev libabsl20220623 libgtest-dev libgmock-dev
  libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev libgfortran5 libquadmath0
  libxxhash-dev libxxhash0 nlohmann-json3-dev
  libsentencepiece-dev libsentencepiece0 libprotobuf-lite32
  pkgconf pkgconf-bin libpkgconf3
  # Used by device-check.sh only where the machine's own cmake is older than the project needs.
  cmake cmake-data libjsoncpp25 librhash0 libuv1 libarchive13
)
mkdir -p .devdeps
cd .devdeps
# Afresh: packages left by an earlier run would count below, and device-check.sh unpacks every
# .deb here (two versions of one package would mix).
rm -f ./*.deb
# apt-get download writes into the current directory; _apt may not be able to, which only warns.
status=0
apt-get download "${packages[@]}" >download.log 2>&1 || status=$?
grep -v "^W: Download is performed unsandboxed" download.log || true
if [[ "$status" -ne 0 ]]; then
  echo "fetch-device-deps: apt-get download failed (exit $status)" >&2
  exit 1
fi
count=$(find . -maxdepth 1 -name '*.deb' | wc -l)
if [[ "$count" -lt "${#packages[@]}" ]]; then
  echo "fetch-device-deps: expected ${#packages[@]} packages, have $count" >&2
  exit 1
fi
echo "fetch-device-deps: $count packages, $(du -sh . | cut -f1) in .devdeps/"
