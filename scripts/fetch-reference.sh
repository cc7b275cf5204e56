#!/usr/bin/env bash
# Extracts the reference implementation's code (facebookresearch/sparse-delta-memory) from a git
# mirror into .refcode/sparse-delta-memory/ (gitignored), for scripts/device/reference_decode.py,
# which imports it at run time on the lent GPU machine. The reference's license is
# non-commercial: its code is never committed here, only carried to the device (carry
# [".refcode", ...]).
#
# Usage: scripts/fetch-reference.sh [GIT_DIR]
#   GIT_DIR: the mirror's git directory (the search tool's `fetch` of
#   github:facebookresearch/sparse-delta-memory returns it); default: the first match of
#   /work/.mirror/facebookresearch+sparse-delta-memory*/repo (or the folder itself).
# Only what the model and its decode path need is extracted (lingua/ and apps/main/, the license
# and readme): no notebooks, images, other apps or data, so the folder stays under 1 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
git_dir=${1:-}
if [[ -z $git_dir ]]; then
  for d in /work/.mirror/facebookresearch+sparse-delta-memory*/repo \
           /work/.mirror/facebookresearch+sparse-delta-memory*; do
    if [[ -d $d ]] && git --git-dir="$d" rev-parse --verify -q HEAD >/dev/null; then
      git_dir=$d; break
    fi
  done
fi
if [[ -z $git_dir ]] || ! git --git-dir="$git_dir" rev-parse --verify -q HEAD >/dev/null; then
  echo "fetch-reference: no git mirror of facebookresearch/sparse-delta-memory found" \
       "(pass its git dir as \$1)" >&2
  exit 1
fi
dest=.refcode/sparse-delta-memory
rm -rf "$dest"
mkdir -p "$dest"
paths=(lingua apps/__init__.py apps/main LICENSE README.md)
git --git-dir="$git_dir" archive HEAD -- "${paths[@]}" | tar -x -C "$dest"
# Leave out anything large that the decode path does not read.
find "$dest" \( -name '*.png' -o -name '*.jpg' -o -name '*.svg' -o -name '*.ipynb' \) -delete
commit=$(git --git-dir="$git_dir" rev-parse HEAD)
echo "$commit" >.refcode/COMMIT
echo "fetch-reference: $git_dir @ $commit -> $dest" \
     "($(du -sh .refcode | cut -f1), $(find "$dest" -type f | wc -l) files)"
