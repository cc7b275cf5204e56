#!/usr/bin/env python3
"""bench.sh with each server's CPU time sampled per thread, by the threads' names
(base/thread_name.h), from /proc: CPU per generated token of the decode threads (sdm-step,
sdm-kernel), of persistence (sdm-writer, sdm-store, sdm-syncer) and of the rest (gRPC, the main
thread), for every variant (docs/benchmarks.md, "Per-turn persistence", 2026-12-05).

    OUT=/tmp/persist-cpu ROUNDS=3 VARIANTS="off:shutdown:BIN on:turn:BIN" \\
      python3 docs/benchmarks/serve-persist/thread_cpu.py

The environment is bench.sh's. CPU is counted from the start of the first round (start-up, i.e.
loading the model, is left out) to the last round's end, while the servers are still up; tokens
are each server's sdm_generated_tokens_total (warm-up requests included, as in the CPU).
"""
import json
import os
import re
import subprocess
import sys
import time

GROUPS = {
    "decode": ("sdm-step", "sdm-kernel"),
    "persistence": ("sdm-writer", "sdm-store", "sdm-syncer"),
}
TICK = os.sysconf("SC_CLK_TCK")


def server_pids(out_dir):
    """{variant: pid} of the bench's servers (their --state_dir names the variant)."""
    pids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        for i, a in enumerate(args[:-1]):
            if a == b"--state_dir" and args[i + 1].startswith(f"{out_dir}/state-".encode()):
                pids[args[i + 1].decode().rsplit("state-", 1)[1]] = int(pid)
    return pids


def thread_cpu(pid):
    """{thread name: CPU seconds} of the process's live threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def sample(out_dir):
    r = {}
    for variant, pid in server_pids(out_dir).items():
        try:
            r[variant] = thread_cpu(pid)
        except OSError:
            pass
    return r


def group_of(name):
    for group, names in GROUPS.items():
        if name in names:
            return group
    return "rest"


def main():
    out_dir = os.environ.get("OUT", "/tmp/serve-persist")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OUT=out_dir)
    log_path = os.path.join(out_dir, "bench.txt")
    bench = subprocess.Popen(
        ["bash", "docs/benchmarks/serve-persist/bench.sh"], env=env,
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
        cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
    first, last = None, None
    while bench.poll() is None:
        with open(log_path) as f:
            text = f.read()
        s = sample(out_dir)
        if first is None and "== round 1" in text:
            first = s
        if first is not None and "== persistence counters" not in text:
            last = s  # the servers stop after the counters are printed
        time.sleep(1)
    with open(log_path) as f:
        text = f.read()
    print("\n".join(l for l in text.splitlines() if "MB/s" not in l))
    tokens = {}
    for m in re.finditer(r"== persistence counters of '([^']+)'\n(?:.*\n)*?sdm_generated_tokens_total (\d+)",
                         text):
        tokens[m.group(1)] = int(m.group(2))
    if first is None or last is None:
        sys.exit("no sample of the rounds (did the bench run?)")
    table = {}
    print(f"\n{'server':10} {'tokens':>7} {'CPU ms/token':>13} {'decode':>8} {'persistence':>12} {'rest':>8}")
    for variant in tokens:
        if variant not in first or variant not in last:
            continue
        per_group = {"decode": 0.0, "persistence": 0.0, "rest": 0.0}
        for name, cpu in last[variant].items():
            per_group[group_of(name)] += cpu - first[variant].get(name, 0.0)
        n = tokens[variant]
        ms = {g: 1000 * v / n for g, v in per_group.items()}
        total = sum(ms.values())
        table[variant] = {"tokens": n, "cpu_ms_per_token": total, **{g + "_ms_per_token": v
                                                                   for g, v in ms.items()}}
        print(f"{variant:10} {n:7d} {total:13.2f} {ms['decode']:8.2f} {ms['persistence']:12.2f} "
              f"{ms['rest']:8.2f}")
    with open(os.path.join(out_dir, "thread_cpu.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "variants": table}, f, indent=1)


if __name__ == "__main__":
    main()
