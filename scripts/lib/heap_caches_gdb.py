# gdb script for scripts/heap-caches.sh: glibc malloc's per-thread caches (tcache) of every thread
# of the attached process, and mallinfo2() at the same instant. Needs glibc's debug symbols
# (Debian: libc6-dbg) for the `tcache` thread-local variable.
import gdb

# glibc on 64-bit: bin i holds chunks of 32 + 16 i bytes, 64 bins (chunks up to 1,040 bytes).
BINS = 64


def chunk_bytes(i):
    return 32 + 16 * i


rows = []
without = 0
for thread in gdb.selected_inferior().threads():
    thread.switch()
    cache = gdb.parse_and_eval("tcache")
    if int(cache) == 0:
        without += 1
        continue
    counts = [int(cache["counts"][i]) for i in range(BINS)]
    held = sum(c * chunk_bytes(i) for i, c in enumerate(counts))
    rows.append((held, thread.name or "?", sum(1 for c in counts if c > 0), counts))
rows.sort(key=lambda r: -r[0])
total = sum(r[0] for r in rows)
info = gdb.parse_and_eval("mallinfo2()")
in_use = int(info["uordblks"]) + int(info["hblkhd"])
print(f"threads with a tcache: {len(rows)}, without: {without}")
print(f"bytes in tcaches: {total}")
print(f"bytes in use (mallinfo2 uordblks + hblkhd): {in_use}; without the tcaches: {in_use - total}")
for held, name, used_bins, counts in rows:
    full = sum(1 for c in counts if c >= 7)
    print(f"  {name:24s} {held:9d} bytes in {used_bins:2d} bins ({full} full)")
