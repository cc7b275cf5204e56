#!/usr/bin/env bash
# Prints how many bytes glibc malloc's per-thread caches (tcache) hold in a running process,
# thread by thread, beside mallinfo2()'s bytes in use: the check that told a slow rise of
# sdm_heap_in_use_bytes apart from a leak (docs/benchmarks.md, "The bytes in use that were
# per-thread caches"). Attaches gdb for a moment (the process is paused while it reads).
#
#   scripts/heap-caches.sh PID
#
# Needs gdb and glibc's debug symbols (Debian: apt-get install gdb libc6-dbg), and permission to
# attach (root, or the same user with kernel.yama.ptrace_scope 0). In an sdm-server started with
# the default --malloc_tcache_count=0 every thread's cache holds 0 bytes.
set -euo pipefail
[[ $# == 1 && $1 =~ ^[0-9]+$ ]] || { echo "usage: $0 PID" >&2; exit 2; }
command -v gdb >/dev/null || { echo "heap-caches: gdb is not installed" >&2; exit 2; }
SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib/heap_caches_gdb.py"
out=$(timeout 120 gdb -q -batch -p "$1" -ex "set pagination off" -ex "source $SCRIPT" 2>&1) || true
if grep -q "^bytes in tcaches" <<<"$out"; then
  grep -E "^(threads with|bytes in|  )" <<<"$out"
else
  echo "heap-caches: could not read the caches of process $1 (need libc6-dbg and ptrace rights):" >&2
  grep -iE "error|no symbol|denied|not permitted" <<<"$out" | head -5 >&2
  exit 1
fi
