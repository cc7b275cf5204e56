#!/usr/bin/env bash
# Builds deploy/Dockerfile with podman and no registry: the Debian 12 base images it names
# (debian:12, debian:12-slim) are made from a Debian mirror with mmdebstrap and imported into
# podman's local store under those names, so that FROM finds them without pulling from Docker Hub
# (`--pull=never`). For machines that reach a Debian mirror but no container registry.
#
#   deploy/build-image.sh [TAG]        (default sdmserve:dev; DEBIAN_MIRROR, ISOLATION,
#                                       BUILD_STAGE_IMAGE)
#
# Needs podman and mmdebstrap (Debian 12: apt-get install podman mmdebstrap). Run as root or as a
# user with subordinate ids (rootless podman). The build stage compiles the whole project inside
# the container (tens of minutes on a small machine). The base is `--variant=minbase`, which is
# what debian:12-slim is; debian:12 gets the same (the build stage installs what it needs).
set -euo pipefail
tag=${1:-sdmserve:dev}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
src=$(cd "$(dirname "$0")/.." && pwd)
for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "build-image: $tool is not installed" >&2; exit 1; }
done
base=docker.io/library/debian:12
if ! podman image exists "$base"; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "build-image: making a Debian 12 root file system from $mirror"
  mmdebstrap --variant=minbase bookworm "$work/rootfs.tar" "$mirror"
  podman import --change 'CMD ["bash"]' "$work/rootfs.tar" "$base"
fi
podman tag "$base" docker.io/library/debian:12-slim
# --network=host: the build's apt-get reaches the mirror the way this machine does.
# --isolation=chroot (ISOLATION): RUN steps run chrooted, not through an OCI runtime, which needs
# cgroups and resource limits a sandboxed machine may refuse (here: crun "cgroups in hybrid mode
# not supported", setrlimit RLIMIT_NPROC not permitted).
isolation=${ISOLATION:-chroot}
dockerfile=$src/deploy/Dockerfile
if [ -n "${BUILD_STAGE_IMAGE:-}" ]; then
  # Reuse an image of the build stage built before (its id, from `podman images -a`): only the
  # runtime stage is built, e.g. after a change to it (the build stage takes tens of minutes).
  dockerfile=$(mktemp)
  { echo "FROM $BUILD_STAGE_IMAGE AS build"; sed -n '/^FROM debian:12-slim/,$p' "$src/deploy/Dockerfile"; } \
    >"$dockerfile"
fi
podman build --pull=never --network=host --isolation="$isolation" -f "$dockerfile" -t "$tag" "$src"
# Smoke test through the same isolation: the installed server starts and knows its flags.
smoke=$(mktemp -d)
printf 'FROM %s\nRUN sdm-server --help | grep -q -- --shared_state_dir && id -u | grep -qx 10001\n' \
  "$tag" >"$smoke/Dockerfile"
podman build --pull=never --network=host --isolation="$isolation" -t "$tag-smoke" "$smoke"
podman rmi "$tag-smoke" >/dev/null
rm -rf "$smoke"
echo "build-image: built $tag (sdm-server --help runs in it, as uid 10001)"
