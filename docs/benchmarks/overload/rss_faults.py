#!/usr/bin/env python3
"""Samples an sdm-server's page faults and RSS every 20 ms and prints each change of more than
256 KiB or 500 faults (docs/benchmarks.md, "Overload rejection latency", 2026-12-05 night):
which bursts fault memory back in, and when the server hands memory back.

    python3 docs/benchmarks/overload/rss_faults.py /tmp/overload > faults.log &
    OUT=/tmp/overload docs/benchmarks/overload/bursts.sh

The argument is a string of the server's command line (bursts.sh's $OUT); it waits up to a
minute for such a server, then samples it until it exits. Times are Unix seconds.
"""
import os
import sys
import time

needle = sys.argv[1].encode()
pid = None
start = time.time()
while pid is None and time.time() - start < 60:
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if b"sdm-server" in cmdline and needle in cmdline:
            pid = int(p)
    time.sleep(0.05)
if pid is None:
    sys.exit("no sdm-server with that argument")
previous = None
while True:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        rss = int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        break
    minflt = int(fields[7])
    if previous is None or abs(rss - previous[1]) > 256 << 10 or minflt - previous[0] > 500:
        added = minflt - (previous[0] if previous else 0)
        print(f"{time.time():.3f} minflt {minflt} (+{added}) rss {rss / 2**20:.1f}MB", flush=True)
        previous = (minflt, rss)
    time.sleep(0.02)
