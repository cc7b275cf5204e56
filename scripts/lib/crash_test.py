#!/usr/bin/env python3
"""Crash and soak driver for sdm-server (scripts/crash-test.sh, scripts/soak.sh).

Runs an sdm-server on loopback with per-turn persistence and drives it with multi-turn greedy
traffic on many sessions from more workers than the server admits (so some turns are refused with
RESOURCE_EXHAUSTED and retried). Every `kill_every` seconds (randomised) it kills the server with
SIGKILL in the middle of the traffic, restarts it on the same state directory and checks every
session:

  - lost:       the session is gone although its creation had completed;
  - rolled back: its position is behind its last completed turn (more than the turn in flight);
  - diverged:   a fork of it continued greedily does not give the tokens a fork gave when the
                session was at that position before the kill (the control).

A session may be exactly at its last completed turn, or ahead of it when a turn was in flight at
the kill (that turn's write finished before the kill; counted as "in-flight turn kept"). With
kill_every 0 nothing is killed: the soak mode, which samples the server's RSS, open files and
threads after every round and reports their growth after the warm-up round.

Uses only the standard library and the sdm-client binary. Exit status 0 when no session was
lost, rolled back or diverged (and, in soak mode, RSS grew less than --max_rss_growth), else 1.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


class Server:
    def __init__(self, args, workdir):
        self.args = args
        self.workdir = workdir
        self.proc = None
        self.log_path = os.path.join(workdir, "server.log")
        self.bound = False  # args.port holds the port this server printed
        self.requested_port = args.port

    def start(self):
        a = self.args
        self.bound = False
        a.port = self.requested_port
        self.metrics_port = None
        cmd = [a.server, "--model", a.model, "--port", str(a.port),
               "--metrics_host", "127.0.0.1", "--metrics_port", "0" if a.kill_every <= 0 else "-1",
               "--state_dir", os.path.join(self.workdir, "state"), "--threads", "1",
               "--max_running", str(a.max_running), "--max_waiting", str(a.max_waiting),
               "--persist", a.persist, "--device", "cpu", *a.server_flag]
        out = open(self.log_path, "ab")
        start = out.tell()
        env = dict(os.environ)
        env.update(e.split("=", 1) for e in a.server_env)
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"crash-test: the server exited with {self.proc.returncode}; "
                                 f"see {self.log_path}")
            if self.args.port == 0 or not self.bound:
                # Port 0: the server picks a free one and prints it (never another run's port).
                with open(self.log_path, "rb") as f:
                    f.seek(start)
                    m = re.search(rb"listening on [^ ]*:(\d+)", f.read())
                if m is None:
                    time.sleep(0.1)
                    continue
                self.args.port = int(m.group(1))
                self.bound = True
                with open(self.log_path, "rb") as f:
                    f.seek(start)
                    mm = re.search(rb"metrics: http://[^ ]*:(\d+)/metrics", f.read())
                self.metrics_port = int(mm.group(1)) if mm else None
            if client(self.args, "info").returncode == 0:
                return
            time.sleep(0.2)
        raise SystemExit("crash-test: the server did not come up in 120 s")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def resources(self):
        """A sample of the server process: RSS and its parts (KiB), fds, threads, state bytes."""
        pid = self.proc.pid
        r = {}
        keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem",
                "Threads:": "threads"}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = line.split(":")[0] + ":"
                if k in keys:
                    r[keys[k]] = int(line.split()[1])
        r["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        r["own_threads"] = own_threads(pid)
        r["mappings"] = mappings(pid)
        r.update(self.metrics())
        return r

    def metrics(self):
        """Session state bytes and sessions by tier from /metrics ({} when it is off)."""
        if self.metrics_port is None:
            return {}
        import urllib.request
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as f:
                text = f.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            m = re.match(r'(sdm_heap_in_use_bytes|sdm_heap_system_bytes) (\S+)', line)
            if m:
                out[m.group(1)[4:]] = int(float(m.group(2)))
            m = re.match(r'(sdm_state_bytes|sdm_sessions)\{tier="(\w+)"\} (\S+)', line)
            if m:
                name = "state" if m.group(1) == "sdm_state_bytes" else "sessions"
                out[f"{name}_{m.group(2)}"] = int(float(m.group(3)))
        return out


def client(args, *cmd, timeout=120):
    full = [args.client, "--host", f"127.0.0.1:{args.port}", *cmd]
    try:
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(full, 124, e.stdout or "", "timeout")


def position(args, sid):
    """The session's position, None when it does not exist, or raises on another error."""
    r = client(args, "sessions", "get", sid)
    if r.returncode != 0:
        if "NOT_FOUND" in r.stderr:
            return None
        raise RuntimeError(f"get {sid}: {r.stderr.strip()}")
    for line in r.stdout.splitlines():
        if line.startswith("position:"):
            return int(line.split()[1])
    raise RuntimeError(f"get {sid}: no position in {r.stdout!r}")


def control(args, sid, tag):
    """Greedy tokens of a fork of `sid` continued by a fixed probe: what its state says."""
    fork = f"ctl-{tag}-{sid}"
    r = client(args, "sessions", "fork", sid, fork)
    if r.returncode != 0:
        return None
    try:
        g = client(args, "generate", "--session", fork, "--prompt", "?", "--max_tokens",
                   str(args.control_tokens), "--json")
        if g.returncode != 0:
            return None
        return json.loads(g.stdout)["token_ids"]
    finally:
        client(args, "sessions", "delete", fork)


class Session:
    def __init__(self, sid):
        self.sid = sid
        self.created = False      # its creation completed
        self.confirmed = 0        # position after its last completed turn
        self.inflight = False     # a call that may change it had no answer when the server died
        self.controls = {}        # position -> control tokens
        self.turns = 0
        self.busy = False


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.turns = 0
        self.refused = 0
        self.failed_calls = 0
        self.lost = []
        self.rolled_back = []
        self.diverged = []
        self.inflight_kept = 0
        self.inflight_dropped = 0
        self.checked = 0
        self.unchecked = 0


def worker(args, sessions, stats, stop, rng_seed, lock):
    rng = random.Random(rng_seed)
    while not stop.is_set():
        with lock:
            free = [s for s in sessions if not s.busy]
            if not free:
                s = None
            else:
                s = rng.choice(free)
                s.busy = True
        if s is None:
            time.sleep(0.01)
            continue
        try:
            turn(args, s, stats, rng, stop)
        finally:
            with lock:
                s.busy = False


def turn(args, s, stats, rng, stop):
    if not s.created:
        s.inflight = True
        r = client(args, "sessions", "create", s.sid)
        if r.returncode != 0:
            if "ALREADY_EXISTS" not in r.stderr:
                with stats.lock:
                    stats.failed_calls += 1
                return  # stays in flight: it may exist or not after a kill
        s.created = True
        s.inflight = False
        s.confirmed = 0
        s.controls[0] = control(args, s.sid, "c")
        return
    words = " ".join(rng.choice(["delta", "memory", "rows", "keys", "state", "turn", "fork",
                                 "tier", "disk", "host"]) for _ in range(rng.randint(2, 12)))
    s.inflight = True
    r = client(args, "generate", "--session", s.sid, "--prompt", f"{s.sid} {s.turns}: {words}",
               "--max_tokens", str(rng.randint(2, args.max_tokens)), "--json")
    if r.returncode != 0:
        if "RESOURCE_EXHAUSTED" in r.stderr:
            s.inflight = False  # refused before it ran: no effect
            with stats.lock:
                stats.refused += 1
        else:
            with stats.lock:
                stats.failed_calls += 1
        return
    try:
        p = position(args, s.sid)
    except RuntimeError:
        return  # the server died: the turn completed, but its position is unknown (in flight)
    if p is None:
        return
    s.confirmed = p
    s.inflight = False
    s.turns += 1
    with stats.lock:
        stats.turns += 1
    if not stop.is_set():
        s.controls[p] = control(args, s.sid, "t")


def check(args, sessions, stats):
    """After a restart: every session against its last completed turn and its control."""
    for s in sessions:
        try:
            p = position(args, s.sid)
        except RuntimeError as e:
            log(f"check: {e}")
            stats.lost.append(s.sid)
            continue
        if p is None:
            if s.created:
                stats.lost.append(s.sid)
                log(f"LOST: {s.sid} (created, {s.turns} turns, last at position {s.confirmed})")
            s.inflight = False
            continue
        s.created = True
        if p < s.confirmed:
            stats.rolled_back.append(s.sid)
            log(f"ROLLED BACK: {s.sid} at {p}, its last completed turn ended at {s.confirmed}")
        elif p > s.confirmed:
            if s.inflight:
                stats.inflight_kept += 1
                s.confirmed = p
            else:
                stats.diverged.append(s.sid)
                log(f"AHEAD: {s.sid} at {p}, but its last turn ended at {s.confirmed}")
        elif s.inflight:
            stats.inflight_dropped += 1
        s.inflight = False
        want = s.controls.get(p)
        got = control(args, s.sid, "k")
        if want is None or got is None:
            stats.unchecked += 1
            s.controls[p] = got
        elif got != want:
            stats.diverged.append(s.sid)
            log(f"DIVERGED: {s.sid} at {p}: control {want}, after restart {got}")
        else:
            stats.checked += 1
    # Forks left by controls cut short by the kill.
    r = client(args, "sessions", "list")
    for line in r.stdout.splitlines()[1:]:
        sid = line.split()[0] if line.split() else ""
        if sid.startswith("ctl-"):
            client(args, "sessions", "delete", sid)


def state_kib(sample):
    """Session state held in memory (resident and host tiers) in KiB; None without /metrics."""
    if "state_resident" not in sample:
        return None
    return (sample["state_resident"] + sample.get("state_host", 0)) / 1024


def warmed_up(samples):
    """Index of the sample that ends the warm-up: the first round (from the second on) in which
    the session state held in memory grew by less than 1%, i.e. once the sessions' caches are
    full (the tiny model's sliding-window rings take a second KV page once a session passes 256
    tokens: hundreds of turns with 50 sessions). The second round's sample when state bytes are
    not sampled or never settle."""
    for i in range(1, len(samples)):
        s0, s1 = state_kib(samples[i - 1]), state_kib(samples[i])
        if s0 is None:
            break
        if s1 <= s0 * 1.01:
            return i
    return 1


def own_threads(pid):
    """The server's own threads: those named "sdm-..." (base/thread_name.h: the step loop, the
    kernel pool, the state store's threads, ...) or carrying the process's name (its main thread,
    and threads it starts unnamed). gRPC names the threads of its pools (event engine, executors,
    timers, pollers), which it starts and stops with the load, so only the server's own threads
    are expected to stay flat."""
    with open(f"/proc/{pid}/comm") as f:
        name = f.read().strip()
    count = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                thread = f.read().strip()
        except OSError:  # the thread exited meanwhile
            continue
        count += thread == name or thread.startswith("sdm-")
    return count


def mappings(pid):
    """{start address: (size KiB, Rss KiB, name)} of every mapping in /proc/PID/smaps ({} when
    unreadable): where RSS grows, by mapping (soak_verdict prints the largest growths)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps") as f:
            start, name, size = None, "", 0
            for line in f:
                head = line.split(None, 5)
                if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                    lo, hi = head[0].split("-")
                    start = int(lo, 16)
                    size = (int(hi, 16) - start) // 1024
                    name = head[5].strip() if len(head) > 5 else ""
                elif head[0] == "Rss:" and start is not None:
                    out[start] = (size, int(head[1]), name)
    except OSError:
        return {}
    return out


def mapping_kind(start, size_kib, name):
    """A guess at what an anonymous mapping is: glibc gives each thread an 8 MiB stack (the
    default RLIMIT_STACK) and each malloc arena beyond the main one heaps of at most 64 MiB
    aligned to 64 MiB (HEAP_MAX_SIZE), whose used part is a mapping of its own."""
    if name:
        return name
    if size_kib == 8192:
        return "anonymous 8 MiB (a thread stack)"
    if start % (64 << 20) == 0 and size_kib <= 65536:
        return "anonymous at a 64 MiB boundary (a malloc arena's heap)"
    return "anonymous"


def rss_growth_by_mapping(base, last, top=6):
    """The mappings whose Rss grew most from `base` to `last` (samples), as a text line."""
    a, b = base.get("mappings") or {}, last.get("mappings") or {}
    if not a or not b:
        return ""
    deltas = []
    for start in set(a) | set(b):
        size, _, name = b.get(start) or a.get(start)
        deltas.append((b.get(start, (0, 0, ""))[1] - a.get(start, (0, 0, ""))[1], start, size,
                       name))
    deltas.sort(reverse=True)
    by_kind = {}
    for d, start, size, name in deltas:
        k = mapping_kind(start, size, name)
        by_kind[k] = by_kind.get(k, 0) + d
    parts = [f"{d:+d} KiB at {start:#x} ({mapping_kind(start, size, name)}, {size} KiB mapped)"
             for d, start, size, name in deltas[:top] if d > 0]
    kinds = ", ".join(f"{k} {v:+d}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
                      if v)
    return (f"soak: RSS growth by mapping kind (KiB): {kinds or 'none'}; largest: "
            f"{'; '.join(parts) or 'none'}")


def soak_verdict(args, server, samples):
    """Failures (0 or 1) of the soak's resource bounds after the warm-up (warmed_up()).

    RSS is bounded net of session state: what the store holds in memory (sdm_state_bytes,
    resident and host tiers) may still grow legitimately, so the bound applies to RSS growth
    minus state growth, as a fraction of RSS at the end of the warm-up (docs/robustness.md, Soak
    test). Open fds and the server's own threads must not end above the warm-up's; gRPC's
    named pool threads grow and shrink with the load (own_threads()), so they are reported only.
    """
    w = warmed_up(samples)
    if len(samples) - w < 2:
        log(f"soak: warm-up took {w + 1} of {len(samples)} rounds (session state still growing): "
            "too few rounds after it for a verdict on RSS; bounding from the second round")
        w = 1
    base, last = samples[w], samples[-1]
    growth = (last["rss"] - base["rss"]) / base["rss"]
    s0, s1 = state_kib(base), state_kib(last)
    net = growth if s0 is None else (last["rss"] - base["rss"] - (s1 - s0)) / base["rss"]
    if s0 is not None:
        state_note = f"state {s0:.0f} -> {s1:.0f} KiB"
    else:
        state_note = "state bytes not sampled"
    heap = ""
    if "heap_in_use_bytes" in base and "heap_in_use_bytes" in last:
        heap = (f"; heap in use {base['heap_in_use_bytes'] // 1024} -> "
                f"{last['heap_in_use_bytes'] // 1024} KiB, held "
                f"{base['heap_system_bytes'] // 1024} -> {last['heap_system_bytes'] // 1024} KiB")
    log(f"soak: warm-up {w + 1} rounds ({base['turns']} turns); then {last['turns'] - base['turns']} "
        f"turns: RSS {base['rss']} -> {last['rss']} KiB ({100 * growth:+.2f}%; anon "
        f"{base.get('anon')} -> {last.get('anon')}, file {base.get('file')} -> "
        f"{last.get('file')}); {state_note}; RSS net of state {100 * net:+.2f}%{heap}; "
        f"fds {base['fds']} -> {last['fds']}, own threads {base['own_threads']} -> "
        f"{last['own_threads']} (all threads {base['threads']} -> {last['threads']})")
    where = rss_growth_by_mapping(base, last)
    if where:
        log(where)
    bad = 0
    if net > args.max_rss_growth:
        log(f"FAIL: RSS net of session state grew more than {100 * args.max_rss_growth:.1f}%")
        bad = 1
    if last["fds"] > base["fds"] or last["own_threads"] > base["own_threads"]:
        # A connection the last client closed may not have been reaped yet: look again.
        for _ in range(10):
            time.sleep(0.5)
            again = server.resources()
            if again["fds"] <= base["fds"] and again["own_threads"] <= base["own_threads"]:
                break
        else:
            log(f"FAIL: fds {again['fds']} / own threads {again['own_threads']} above the "
                f"warm-up's {base['fds']} / {base['own_threads']}")
            bad = 1
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="build/server/sdm-server")
    ap.add_argument("--client", default="build/client/sdm-client")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", default="/tmp/sdm-crash-test")
    ap.add_argument("--port", type=int, default=0, help="gRPC port; 0: a free one each start")
    ap.add_argument("--duration", type=float, default=1800, help="seconds of traffic in all")
    ap.add_argument("--kill_every", type=float, default=10,
                    help="mean seconds between kills (uniform 0.5x-1.5x); 0: soak, no kills")
    ap.add_argument("--round", type=float, default=10, help="soak: seconds per sampled round")
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--max_running", type=int, default=4)
    ap.add_argument("--max_waiting", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0,
                    help="concurrent clients; 0: twice the admission capacity")
    ap.add_argument("--max_tokens", type=int, default=12)
    ap.add_argument("--control_tokens", type=int, default=6)
    ap.add_argument("--persist", default="turn")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max_rss_growth", type=float, default=0.01,
                    help="soak: allowed RSS growth after the warm-up round (fraction)")
    ap.add_argument("--settle", type=float, default=13,
                    help="soak: idle seconds before each sample (longer than the server's "
                    "--malloc_trim_interval plus its sampling, 1 s: it trims only once the "
                    "bytes in use have been flat for an interval)")
    ap.add_argument("--server_flag", action="append", default=[],
                    help="an extra sdm-server flag (repeatable), e.g. --server_flag=--threads=2")
    ap.add_argument("--server_env", action="append", default=[],
                    help="NAME=VALUE in the server's environment (repeatable)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    workers = args.workers or 2 * (args.max_running + args.max_waiting)
    soak = args.kill_every <= 0
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    log(f"{'soak' if soak else 'crash'} test: seed {seed}, {args.sessions} sessions, {workers} "
        f"workers against {args.max_running} running + {args.max_waiting} waiting, "
        f"{args.duration:.0f} s, persist {args.persist}, work dir {args.workdir}")
    rng = random.Random(seed)
    server = Server(args, args.workdir)
    sessions = [Session(f"s{i:03d}") for i in range(args.sessions)]
    stats = Stats()
    lock = threading.Lock()
    samples = []
    cycle = 0
    try:
        # Inside the try: a first start that fails (did not come up) still stops the process.
        server.start()
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            cycle += 1
            stop = threading.Event()
            threads = [threading.Thread(target=worker,
                                        args=(args, sessions, stats, stop, rng.random(), lock))
                       for _ in range(workers)]
            for t in threads:
                t.start()
            wait = args.round if soak else args.kill_every * rng.uniform(0.5, 1.5)
            time.sleep(max(0.0, min(wait, end - time.monotonic())))
            if soak:
                stop.set()
                for t in threads:
                    t.join()
                # At rest: after the server's next heap trim (--malloc_trim_interval after the
                # load stopped, base/heap.h HeapTrimSchedule), so that the sample is what it
                # keeps, not what the last calls had in flight.
                time.sleep(args.settle)
                r = server.resources()
                r["turns"] = stats.turns
                samples.append(r)
                log(f"round {cycle}: {stats.turns} turns, RSS {r['rss']} KiB (anon "
                    f"{r.get('anon')}, file {r.get('file')}, shmem {r.get('shmem')}), "
                    f"{r['fds']} fds, {r['threads']} threads ({r['own_threads']} own); state bytes resident "
                    f"{r.get('state_resident')}, host {r.get('state_host')}, disk "
                    f"{r.get('state_disk')}; heap in use {r.get('heap_in_use_bytes')}, held "
                    f"{r.get('heap_system_bytes')}")
                continue
            server.kill()
            stop.set()
            for t in threads:
                t.join()
            server.start()
            check(args, sessions, stats)
            log(f"kill {cycle}: {stats.turns} turns so far; lost {len(stats.lost)}, rolled back "
                f"{len(stats.rolled_back)}, diverged {len(stats.diverged)}; in-flight turns kept "
                f"{stats.inflight_kept}, dropped {stats.inflight_dropped}; checked "
                f"{stats.checked}, unchecked {stats.unchecked}")
        # Before the server stops: the verdict may sample it again.
        soak_bad = soak_verdict(args, server, samples) if soak and len(samples) >= 3 else 0
    finally:
        server.stop()
    bad = soak_bad + len(stats.lost) + len(stats.rolled_back) + len(stats.diverged)
    print(json.dumps({
        "mode": "soak" if soak else "crash", "seed": seed, "cycles": cycle,
        "turns": stats.turns, "refused": stats.refused, "failed_calls": stats.failed_calls,
        "lost": stats.lost, "rolled_back": stats.rolled_back, "diverged": stats.diverged,
        "inflight_kept": stats.inflight_kept, "inflight_dropped": stats.inflight_dropped,
        "checked": stats.checked, "unchecked": stats.unchecked,
        "resources": [{k: v for k, v in r.items() if k != "mappings"}  # mappings: too long
                      for r in samples]}, indent=None))
    if stats.turns == 0:
        log("FAIL: no turn completed")
        bad += 1
    log("PASS" if bad == 0 else "FAIL")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
