#!/usr/bin/env python3
"""The trainable SDM layer's chunked (parallel) form equals its step-by-step recurrence.

training/sdm_torch.py trains with `SdmMemory.chunk` time steps at a time (a WY-style form whose
chunk length is a speed knob only). For chunk lengths that divide the sequence, leave a remainder,
equal it and exceed it, the logits, the final memory and every parameter's gradient must equal the
step-by-step form's (chunk = 1) to float32 rounding. Fixed seed and a fresh one (printed).

Usage: test_sdm_chunked.py. Exit 0 pass, 1 fail, 77 skip (no torch).
"""

from __future__ import annotations

import os
import random
import sys

try:
    import torch
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {sys.executable} lacks torch ({e})")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "training"))
import sdm_torch  # noqa: E402
import train  # noqa: E402

T = 45  # tokens: several chunks of 16 with a remainder
CHUNKS = (16, 7, 45, 64)


def run(model, ids, chunk):
    """(logits, {param: grad}) of the whole model with the given chunk length."""
    for m in model.modules():
        if isinstance(m, sdm_torch.SdmMemory):
            m.chunk = chunk
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    logits.pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def memories(model, ids, chunk):
    """The final memory of every SDM layer, fed the same random inputs."""
    torch.manual_seed(0)
    out = []
    for m in model.modules():
        if isinstance(m, sdm_torch.SdmMemory):
            m.chunk = chunk
            x = torch.randn(ids.shape[0], ids.shape[1], model.cfg.dim)
            with torch.no_grad():
                y, mem = m(x, return_state=True)
            out.append((y, mem))
    return out


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(seed: int) -> list[str]:
    torch.manual_seed(seed)
    model = sdm_torch.SdmLM(train.preset("smoke"))
    # beta_bias 0: writes strong enough that every chunk's history matters to the next.
    model.init_weights(seed, beta_bias=0.0)
    ids = torch.randint(0, 256, (2, T))
    want_logits, want_grads = run(model, ids, 1)
    want_mem = memories(model, ids, 1)
    errors = []
    for c in CHUNKS:
        logits, grads = run(model, ids, c)
        if rel(logits, want_logits) > 1e-5:
            errors.append(f"seed {seed} chunk {c}: logits differ by {rel(logits, want_logits):.2e}")
        for n, g in want_grads.items():
            if rel(grads[n], g) > 1e-4:
                errors.append(f"seed {seed} chunk {c}: grad of {n} differs by {rel(grads[n], g):.2e}")
        for (y, mem), (wy, wmem) in zip(memories(model, ids, c), want_mem):
            if rel(y, wy) > 1e-5 or rel(mem, wmem) > 1e-5:
                errors.append(f"seed {seed} chunk {c}: readings or final memory differ "
                              f"({rel(y, wy):.2e}, {rel(mem, wmem):.2e})")
    return errors


def main() -> int:
    torch.set_num_threads(1)
    fresh = random.SystemRandom().randrange(1 << 30)
    print(f"seeds: 1234 (fixed), {fresh} (fresh)")
    errors = check(1234) + check(fresh)
    if errors:
        print("FAIL:\n  " + "\n  ".join(errors[:20]))
        return 1
    print(f"ok chunked form == step by step for chunks {CHUNKS} over {T} tokens (logits, "
          "gradients, readings, final memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
