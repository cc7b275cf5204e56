#!/usr/bin/env bash
# Checks the project's C++ with clang's thread-safety analysis (-Wthread-safety): every access to
# an ABSL_GUARDED_BY member without its mutex, every call to an ABSL_EXCLUSIVE_LOCKS_REQUIRED
# function without the lock, is an error. Runs clang++ -fsyntax-only on every project .cc in the
# build directory's compile_commands.json, with that file's own flags (GCC-only flags and warning
# options dropped). Generated code (the build tree, e.g. protoc output) and CUDA sources (.cu) are
# skipped; headers are checked through the sources that include them.
#
#   scripts/check-thread-safety.sh [BUILD_DIR [FILE...]]
#     BUILD_DIR: default build (configured by scripts/test.sh); FILE...: check only these sources
#
# Exits non-zero, printing clang's diagnostics, when any file has a thread-safety error. Needs a
# built tree (generated headers such as the protoc output must exist): CI runs it after
# scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
DB="$BUILD_DIR/compile_commands.json"
if [ ! -f "$DB" ]; then
  echo "check-thread-safety: $DB not found; configure first (scripts/test.sh or cmake -S . -B $BUILD_DIR)" >&2
  exit 2
fi
shift || true
exec python3 - "$PWD" "$DB" "${SDM_CHECK_JOBS:-$(nproc)}" "$@" <<'PY'
import concurrent.futures, json, os, shlex, subprocess, sys, time

src_root, db_path, jobs = os.path.realpath(sys.argv[1]), sys.argv[2], int(sys.argv[3])
only = {os.path.realpath(f) for f in sys.argv[4:]}
build_root = os.path.realpath(os.path.dirname(db_path))

def project_source(entry):
    path = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    if not path.endswith(".cc"):
        return None  # .cu (nvcc) and anything else
    if not path.startswith(src_root + os.sep) or path.startswith(build_root + os.sep):
        return None  # generated or outside the repository
    return path

def clang_command(entry, path):
    args = entry.get("arguments") or shlex.split(entry["command"])
    out, skip = ["clang++"], False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD") or a.startswith("-W") or a == "-w":
            continue
        if a.startswith("-fdiagnostics-color") or a.startswith("-fno-fat-lto"):
            continue
        out.append(a)
    return out + ["-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
                  "-Wno-unknown-warning-option"]

def check(entry, path):
    r = subprocess.run(clang_command(entry, path), cwd=entry["directory"],
                       capture_output=True, text=True)
    return path, r.returncode, r.stderr

entries = []
for e in json.load(open(db_path)):
    p = project_source(e)
    if p is not None and (not only or p in only):
        entries.append((e, p))
seen, unique = set(), []
for e, p in entries:  # a source compiled into two targets needs one check
    if p not in seen:
        seen.add(p)
        unique.append((e, p))

start = time.monotonic()
failed = []
with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    for path, rc, err in pool.map(lambda ep: check(*ep), unique):
        if rc != 0:
            failed.append(os.path.relpath(path, src_root))
            print(f"--- {failed[-1]}\n{err}", end="", flush=True)
elapsed = time.monotonic() - start
print(f"check-thread-safety: {len(unique)} files, {len(failed)} failing, {elapsed:.0f}s")
for f in failed:
    print(f"  {f}")
sys.exit(1 if failed else 0)
PY
