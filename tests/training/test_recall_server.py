#!/usr/bin/env python3
"""Recall through the server on the shipped model (models/sdm-fortunes-demo): a session is told a
fact, the server is restarted (sessions persisted in --state_dir), and the session is asked.

For each example, session A is told "The code word of NAME is WORD." plus corpus text longer than
the sliding window, the server restarts, and A is asked "Q: What is the code word of NAME?".
Session B gets the same two turns with no restart between them. Asserted: A's answer (token ids)
equals B's exactly, i.e. a restart changes nothing, and every answer is the word: the words are
code words of the training task (training/data.py WORDS), and the shipped model recalls 100% of
256 held-out facts at each distance from 1x to 32x its window (its card). A retrained model that
misses one of these four has lost what the demo shows.

Usage: test_recall_server.py SDM_SERVER SDM_CLIENT [--model DIR]. Exit 0 pass, 1 fail, 77 skip
(no shipped model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(ROOT, "models", "sdm-fortunes-demo")

# (name, word, text after the fact): the text is longer than 8x the model's 16-byte window.
EXAMPLES = [
    ("Ruth", "amber", "Nothing is so firmly believed as that which we least know. The best way "
     "to keep one's word is not to give it. When in doubt, tell the truth.\n\n"),
    ("Hugo", "walnut", "It is a poor workman who blames his tools; a good one keeps them sharp, "
     "clean and out of the rain. Time flies like an arrow.\n\n"),
    ("Clara", "saffron", "He who laughs last thinks slowest. A closed mouth gathers no feet, and "
     "a rolling stone gathers no moss, but it gains a certain polish.\n\n"),
    ("Omar", "falcon", "Never put off till tomorrow what you can do the day after tomorrow. "
     "Experience is what you get when you didn't get what you wanted.\n\n"),
]


class CheckFailed(Exception):
    pass


class Server:
    def __init__(self, binary, model, state_dir):
        self.proc = subprocess.Popen(
            [binary, "--model", model, "--port", "0", "--metrics_port", "-1", "--state_dir",
             state_dir, "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        line = self.proc.stdout.readline()  # "listening on HOST:PORT (...)" once it accepts calls
        m = re.search(r"listening on (\S+)", line)
        if not m:
            self.proc.kill()
            raise CheckFailed(f"sdm-server did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.address = m.group(1)

    def stop(self):
        self.proc.terminate()  # SIGTERM: a clean shutdown that persists the sessions
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise CheckFailed("sdm-server did not stop within 60 s")
        if rc != 0:
            raise CheckFailed(f"sdm-server exited {rc}: {self.proc.stderr.read()[-2000:]}")


def client(binary, server, *args):
    cmd = [binary, "--host", server.address, *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if p.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} failed: {p.stdout[-1000:]} {p.stderr[-1000:]}")
    return p.stdout


def turn(binary, server, session, prompt, max_tokens):
    out = client(binary, server, "generate", "--session", session, "--prompt", prompt,
                 "--max_tokens", str(max_tokens), "--temperature", "0", "--json")
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sdm_server")
    ap.add_argument("sdm_client")
    ap.add_argument("--model", default=SHIPPED)
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"SKIP: no model at {args.model}")
        return 77
    tmp = tempfile.mkdtemp(prefix="sdm_recall_")
    state = os.path.join(tmp, "state")
    tell = lambda name, word, text: f"The code word of {name} is {word}.\n{text}"  # noqa: E731
    ask = lambda name: f"Q: What is the code word of {name}?\nA: "  # noqa: E731
    try:
        server = Server(args.sdm_server, args.model, state)
        answers_b = []
        for i, (name, word, text) in enumerate(EXAMPLES):
            for s in (f"a{i}", f"b{i}"):
                client(args.sdm_client, server, "sessions", "create", s)
                turn(args.sdm_client, server, s, tell(name, word, text), 1)
            answers_b.append(turn(args.sdm_client, server, f"b{i}", ask(name), 8))
        server.stop()
        server = Server(args.sdm_server, args.model, state)
        hits = 0
        for i, (name, word, _) in enumerate(EXAMPLES):
            a = turn(args.sdm_client, server, f"a{i}", ask(name), 8)
            b = answers_b[i]
            if a["token_ids"] != b["token_ids"]:
                raise CheckFailed(f"{name}: after the restart the answer is {a['text']!r} "
                                  f"{a['token_ids']}, without it {b['text']!r} {b['token_ids']}")
            hit = a["text"].startswith(word)
            hits += hit
            print(f"ok {name}: same answer with and without a restart: {a['text']!r} "
                  f"({'the word' if hit else 'not the word ' + word})")
        server.stop()
        print(f"recall through the server: {hits}/{len(EXAMPLES)} answers are the word")
        if hits != len(EXAMPLES):
            raise CheckFailed(f"only {hits} of {len(EXAMPLES)} answers after the restart are the "
                              "word the session was told")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as e:
        print(f"FAIL: {e}")
        sys.exit(1)
