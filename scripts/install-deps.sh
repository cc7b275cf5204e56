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
  libxxhash-dev libssl-dev openssl curl
  chromium  # headless, for the web console's test (tests/http_clients/console_test.mjs)
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

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The HTTP client tests (tests/http_clients/) drive the server with the official openai npm SDK:
# Node.js from Debian when there is none, then the locked packages (npm ci) when they are not
# installed yet or the lock file changed since.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "install-deps: installing nodejs npm"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends nodejs npm
fi
CLIENTS="$(cd "$(dirname "$0")/.." && pwd)/tests/http_clients"
if [ ! -f "$CLIENTS/node_modules/.package-lock.json" ] ||
   [ "$CLIENTS/package-lock.json" -nt "$CLIENTS/node_modules/.package-lock.json" ]; then
  echo "install-deps: npm ci in tests/http_clients"
  (cd "$CLIENTS" && npm ci --no-audit --no-fund --loglevel=error)
fi
