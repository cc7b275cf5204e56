#!/usr/bin/env bash
# Fails when a tracked C/C++/CUDA file differs from what clang-format (the repository's
# .clang-format) would write. Fix with:
#   git ls-files -z '*.h' '*.cc' '*.cu' '*.cuh' | xargs -0 clang-format -i
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -d '' files < <(git ls-files -z '*.h' '*.cc' '*.cu' '*.cuh')
if [ ${#files[@]} -eq 0 ]; then
  echo "check-format: no files" >&2
  exit 2
fi
if clang-format --dry-run -Werror "${files[@]}"; then
  echo "check-format: ${#files[@]} files formatted"
else
  echo "check-format: files above are not clang-formatted (see the command in $0)" >&2
  exit 1
fi
