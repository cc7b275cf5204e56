#!/usr/bin/env bash
# Prints, for every CUDA kernel of kernels/cuda/*.cu, what ptxas reports for the build's target
# (registers per thread, static shared memory, stack frame and spill stores): the first thing to
# read about a kernel's occupancy, and it needs no GPU. Recompiles each file with -Xptxas -v from
# the build's compile_commands.json (into a temporary object; the build is not touched).
#
#   scripts/ptxas-report.sh [BUILD_DIR]      (default: build; configured with CUDA on)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DB=$BUILD/compile_commands.json
[[ -f $DB ]] || { echo "ptxas-report: no $DB (configure $BUILD first)" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "| kernel | file | registers | static smem (B) | stack / spill stores (B) |"
echo "|---|---|---:|---:|---:|"
for cu in kernels/cuda/*.cu; do
  cmd=$(python3 - "$DB" "$PWD/$cu" "$TMP/out.o" <<'EOF'
import json, shlex, sys
db, src, out = sys.argv[1:]
for e in json.load(open(db)):
    if e["file"] == src:
        args = shlex.split(e["command"])
        if args[0].endswith("ccache"):
            args = args[1:]
        i = args.index("-o")
        args[i + 1] = out
        print(shlex.join(args + ["-Xptxas", "-v"]))
        break
EOF
)
  [[ -n $cmd ]] || { echo "ptxas-report: $cu is not in $DB (CUDA off?)" >&2; exit 2; }
  (cd "$BUILD" && eval "$cmd") 2>&1 | python3 -c '
import re, subprocess, sys
file, name, stack = sys.argv[1], None, ("?", "?")
for line in sys.stdin:
    m = re.search(r"Compiling entry function \x27([^\x27]+)\x27", line)
    if m:
        name = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
        name = re.sub(r"sdm::kernels::cuda::(\(anonymous namespace\)::)?", "", name)
        name = re.sub(r"\(.*", "", name).replace("void ", "")
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
    if m and name:
        stack = m.groups()
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        smem = re.search(r"(\d+) bytes smem", line)
        print(f"| {name} | {file} | {m.group(1)} | {smem.group(1) if smem else 0} | "
              f"{stack[0]} / {stack[1]} |")
        name = None
' "$(basename "$cu")"
done
