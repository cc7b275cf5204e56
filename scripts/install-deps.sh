#!/usr/bin/env bash
# Installs every Debian package sdmserve needs. Idempotent: packages already present are skipped,
# and apt is not touched at all when nothing is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config clang-format
  clang libclang-rt-14-dev
  libabsl-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libsentencepiece-dev sentencepiece
  nlohmann-json3-dev libopenblas-dev libcpp-httplib-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev libssl-dev openssl
  python3-torch python3-numpy python3-matplotlib
  # tests/deploy/ (replicas behind nginx, ownership in etcd; docs/replicas.md)
  nginx etcd-server jq curl python3-yaml
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
