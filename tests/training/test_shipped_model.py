#!/usr/bin/env python3
"""The shipped trained model (models/sdm-fortunes-demo): the C++ engine equals the float64 PyTorch
reference (training/sdm_reference_model.py) on its bf16 weights.

  1. `sdm-cli logits --all` over a few hundred tokens of real text (BOS, a fortune-like passage,
     a fact, text, a question) vs the reference's logits: |engine - reference| <= 1e-4 *
     (1 + max|reference|) at every position (the issue's bound; the measured figure is printed).
  2. Greedy generation: `sdm-cli generate --temperature 0` from a prompt; the reference's argmax
     at every generated position, fed the same tokens, is the token the engine chose.

Usage: test_shipped_model.py SDM_MODEL SDM_CLI [--model DIR]. Exit 0 pass, 1 fail, 77 skip (no
numpy/torch, or no shipped model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

try:
    import numpy as np
    import torch  # noqa: F401  (needed by the reference)
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {sys.executable} lacks numpy/torch ({e})")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "training"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import sdm_reference_model as ref  # noqa: E402
from test_engine_logits import CheckFailed, compare, engine_logits  # noqa: E402

SHIPPED = os.path.join(ROOT, "models", "sdm-fortunes-demo")
REL_TOL = 1e-4
MIN_ADDRESS_GAP = 1e-4
BOS = 256

TEXTS = [
    "A man who carries a cat by the tail learns something he can learn in no other way.\n\n"
    "The code word of Ruth is amber.\n"
    "Nothing is so firmly believed as that which we least know. The best way to keep one's word "
    "is not to give it. When in doubt, tell the truth; it will confound your enemies and "
    "astound your friends.\n\nQ: What is the code word of Ruth?\nA: amber.\n",
    "Q: What do you call a fish with no eyes?\nA: A fsh.\n\n"
    "The code word of Hugo is walnut.\n"
    "It is a poor workman who blames his tools; a good one keeps them sharp, clean and out of "
    "the rain. Time flies like an arrow; fruit flies like a banana.\n\n"
    "Q: What is the code word of Hugo?\nA: walnut.\n",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sdm_model")
    ap.add_argument("sdm_cli")
    ap.add_argument("--model", default=SHIPPED)
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"SKIP: no model at {args.model}")
        return 77
    model = ref.ReferenceModel.load(args.model)

    # 1. Logits at every position, on the first text free of addressing near-ties (where fp32
    #    and float64 could legitimately pick different slots).
    for text in TEXTS:
        tokens = [BOS] + list(text.encode("utf-8"))
        model.stats = ref.AddressStats()
        want = model.logits_all(tokens)
        if model.stats.min_gap >= MIN_ADDRESS_GAP:
            break
    else:
        raise CheckFailed("every text has an addressing near-tie")
    got = engine_logits(args.sdm_cli, args.model, tokens)
    diff, tol = compare("shipped_logits", got, want, REL_TOL)
    rel = diff / (1.0 + float(np.max(np.abs(want))))
    print(f"ok logits: {len(tokens)} tokens, max |engine - reference| {diff:.3e} "
          f"({rel:.2e} relative; bound {REL_TOL:g}), min addressing gap {model.stats.min_gap:.2e}")
    agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"ok argmax agreement {agree:.3f}")
    if agree != 1.0:
        raise CheckFailed("engine and reference disagree on an argmax")

    # 2. Greedy generation.
    prompt = "The code word of Ruth is amber.\nA penny saved is"
    n = 48
    p = subprocess.run([args.sdm_cli, "generate", "--model", args.model, "--prompt", prompt,
                        "--max_tokens", str(n), "--temperature", "0"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    if p.returncode != 0:
        raise CheckFailed(f"sdm-cli generate failed: {p.stderr.decode(errors='replace')}")
    # The reference's greedy continuation, token by token (the whole sequence each time).
    seq = [BOS] + list(prompt.encode())
    ref_tokens = []
    for _ in range(n):
        nxt = int(np.argmax(model.logits_all(seq)[-1]))
        if nxt >= 256:  # BOS/EOS: no text; the engine stops at EOS
            break
        ref_tokens.append(nxt)
        seq.append(nxt)
    want_text = bytes(ref_tokens)
    try:
        want_text.decode("utf-8")
    except UnicodeDecodeError as e:  # the engine prints U+FFFD for invalid bytes: compare before
        want_text = want_text[:e.start]
    if not p.stdout.startswith(want_text) or (len(want_text) == len(ref_tokens) == n
                                              and p.stdout != want_text):
        raise CheckFailed(f"greedy text: engine {p.stdout!r} != reference {bytes(ref_tokens)!r}")
    print(f"ok greedy: {len(want_text)} tokens identical: {want_text!r}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as e:
        print(f"FAIL: {e}")
        sys.exit(1)
