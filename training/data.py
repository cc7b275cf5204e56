"""Training data: byte-level text from Debian's `fortunes` package, plus a synthetic recall task.

Corpus: every fortune file of /usr/share/games/fortunes (the package `fortunes`, installed by
scripts/train-demo.sh), split into single fortunes at the "%" lines. A fortune goes to the
held-out split when a hash of its text says so (1 in 20), so the split does not depend on file
order. Each split is the fortunes joined by a blank line.

Recall task: a fact is stated once ("The code word of Ruth is amber.\n"), corpus text follows for
a chosen number of bytes, then the question ("Q: What is the code word of Ruth?\nA: amber.\n").
When the distance exceeds the sliding window, only an SDM layer can carry the answer. A training
example states 1-3 facts about different names, so the model must bind the word to the name, not
just repeat the last code word it saw.

Every example starts with BOS (256), as a server session does.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

BOS = 256
FORTUNE_DIR = "/usr/share/games/fortunes"

NAMES = ("Ruth Adam Maria Omar Lena Victor Nora Felix Ida Hugo Clara Otto Mila Ivan Rosa Paul "
         "Greta Yusuf Alma Bruno Dora Emil Hanna Jonas Kira Leo Mina Nils Olga Pia Rafael Sara "
         "Tomas Una Vera Walter Zoe Anton Bea Carl").split()
# Every code word starts with a different letter: the first byte of the answer names the word, so
# recalling a fact is recalling one byte bound to a name (the rest of the word follows from the
# list, which the sliding-window layers learn). Chance is 1 in len(WORDS).
WORDS = ("amber bamboo cobalt dolphin ember falcon garnet harbor indigo jasmine kettle lantern "
         "maple nickel orchid pepper quartz raven saffron thunder umbrella velvet walnut yarrow "
         "zephyr").split()
assert len({w[0] for w in WORDS}) == len(WORDS)


def fact_text(name: str, word: str) -> str:
    return f"The code word of {name} is {word}.\n"


def question_text(name: str) -> str:
    """The question up to (not including) the answer."""
    return f"Q: What is the code word of {name}?\nA: "


def answer_text(word: str) -> str:
    return f"{word}.\n"


def load_fortunes(directory: str = FORTUNE_DIR) -> Tuple[bytes, bytes]:
    """(train, held-out) corpus bytes."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} not found: install the Debian package `fortunes` "
                                "(scripts/train-demo.sh does)")
    train, held = [], []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith((".dat", ".u8")) or not os.path.isfile(path) or os.path.islink(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        for chunk in text.split("\n%\n"):
            chunk = chunk.strip("%\n ")
            if len(chunk) < 8:
                continue
            h = hashlib.sha256(chunk.encode("utf-8")).digest()[0]
            (held if h % 20 == 0 else train).append(chunk)
    join = lambda xs: ("\n\n".join(xs) + "\n\n").encode("utf-8")  # noqa: E731
    return join(train), join(held)


@dataclass
class RecallItem:
    ids: List[int]  # BOS + text (answer included)
    answer_start: int  # index in ids of the answer's first byte
    answer_len: int  # bytes of the word (the "." after it not counted)
    distance: int  # bytes from the end of the fact to the start of the question


class Corpus:
    def __init__(self, text: bytes):
        self.text = text
        # fortune starts: after each blank line separator
        self.starts = [0] + [i + 2 for i in range(len(text) - 2) if text[i:i + 2] == b"\n\n"]

    def slice(self, rng: random.Random, n: int, at_start: bool = True) -> bytes:
        if at_start:
            i = self.starts[rng.randrange(len(self.starts))]
            if i + n > len(self.text):
                i = max(0, len(self.text) - n)
        else:
            i = rng.randrange(0, max(1, len(self.text) - n))
        return self.text[i:i + n]


def recall_example(rng: random.Random, corpus: Corpus, distance: int, n_facts: int = 1,
                   prefix: int = 0, total: Optional[int] = None) -> Tuple[List[int], List[Tuple[int, int]]]:
    """BOS, `prefix` bytes of text, the facts, `distance` bytes of text, then the questions with
    their answers (in random order, a little text between them), then text up to `total` ids.
    Returns (ids, [(answer_start, answer_len), ...])."""
    names = rng.sample(NAMES, n_facts)
    words = rng.sample(WORDS, n_facts)
    out = bytearray()
    out += corpus.slice(rng, prefix)
    for n, w in zip(names, words):
        out += fact_text(n, w).encode()
    out += corpus.slice(rng, distance)
    answers = []
    order = list(range(n_facts))
    rng.shuffle(order)
    for j, k in enumerate(order):
        if j:
            out += corpus.slice(rng, rng.randrange(0, 48))
        out += question_text(names[k]).encode()
        answers.append((1 + len(out), len(words[k])))
        out += answer_text(words[k]).encode()
    ids = [BOS] + list(out)
    if total is not None:
        if len(ids) < total:
            ids += list(corpus.slice(rng, total - len(ids)))
            ids += [ord(" ")] * (total - len(ids))
        ids = ids[:total]
        answers = [(s, n) for s, n in answers if s + n <= total]
    return ids, answers


class Batcher:
    """Random training batches of `seq + 1` ids and a loss weight per target.

    A fraction `recall_frac` of the rows are recall examples; the rest are corpus text. The
    recall distance is drawn log-uniformly from [min_distance, max_distance(step)], where the
    upper end grows linearly over the first `curriculum_steps` steps from `start_distance` to
    what fits in the sequence (a curriculum: nearby facts first). Answer bytes weigh
    `answer_weight` in the loss."""

    def __init__(self, corpus: Corpus, seq: int, batch: int, seed: int, recall_frac: float,
                 min_distance: int, start_distance: int, curriculum_steps: int,
                 answer_weight: float, fact_counts=(1, 2, 2, 3)):
        self.fact_counts = tuple(fact_counts)
        self.corpus, self.seq, self.batch = corpus, seq, batch
        self.recall_frac = recall_frac
        self.min_distance, self.start_distance = min_distance, start_distance
        self.curriculum_steps = curriculum_steps
        self.answer_weight = answer_weight
        self.seed = seed

    def max_distance(self, step: int) -> int:
        full = self.seq - 160  # room for a prefix, one fact and its question
        if self.curriculum_steps <= 0:
            return full
        f = min(1.0, step / self.curriculum_steps)
        return int(self.start_distance + f * (full - self.start_distance))

    def get(self, step: int):
        rng = random.Random(self.seed * 1_000_003 + step)  # a batch depends only on its step
        total = self.seq + 1
        rows, weights = [], []
        for _ in range(self.batch):
            w = torch.ones(self.seq)
            if rng.random() < self.recall_frac:
                hi = max(self.min_distance, self.max_distance(step))
                import math
                d = int(math.exp(rng.uniform(math.log(self.min_distance), math.log(hi))))
                n_facts = rng.choice(self.fact_counts)
                ids, answers = recall_example(rng, self.corpus, d, n_facts,
                                              prefix=rng.randrange(0, 64), total=total)
                for s, n in answers:
                    w[s - 1:s - 1 + n] = self.answer_weight  # targets at s.. predicted from s-1..
            else:
                ids = [BOS] + list(self.corpus.slice(rng, total - 1))
                ids += [ord(" ")] * (total - len(ids))
            rows.append(torch.tensor(ids[:total], dtype=torch.long))
            weights.append(w)
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:], torch.stack(weights)


def heldout_batches(text: bytes, seq: int, batch: int, n_batches: int):
    """Fixed held-out rows: BOS + consecutive windows of the held-out text (no overlap)."""
    rows = []
    step = seq  # BOS + seq bytes: targets are the seq bytes
    for i in range(0, len(text) - step, step):
        rows.append(torch.tensor([BOS] + list(text[i:i + step]), dtype=torch.long))
        if len(rows) == batch * n_batches:
            break
    for b in range(0, len(rows), batch):
        x = torch.stack(rows[b:b + batch])
        yield x[:, :-1], x[:, 1:]


def recall_eval_set(corpus: Corpus, distances: List[int], per_distance: int, seed: int):
    """Fixed recall examples with one fact each: {distance: [RecallItem]}."""
    out = {}
    for d in distances:
        rng = random.Random(seed * 7919 + d)
        items = []
        for _ in range(per_distance):
            ids, answers = recall_example(rng, corpus, d, 1, prefix=rng.randrange(0, 64))
            s, n = answers[0]
            items.append(RecallItem(ids, s, n, d))
        out[d] = items
    return out
