#!/usr/bin/env python3
"""Smoke run of the training tool (training/train.py) on a tiny model and a synthetic corpus:

  1. 40 steps of the `smoke` preset: the training loss falls (mean of the last 10 logged steps
     well below the first 10).
  2. Resume: the same run stopped at step 20 (--stop-after, as an interruption) and rerun ends with
     exactly the same weights as the uninterrupted run.
  3. The bf16 export loads in the engine: `sdm-cli logits --all` equals the float64 reference
     (training/sdm_reference_model.py) on the exported files, and the trainable float32 model
     (training/sdm_torch.py, the chunked SDM form) on the same bf16 weights, within 1e-4 relative.
  4. --precision bf16 (matrix products under bf16 autocast): the loss falls as well, and the SDM
     layer still computes in float32 under autocast (its output equals, bit for bit, its output
     without autocast).

Usage: test_train_smoke.py SDM_MODEL SDM_CLI. Exit 0 pass, 1 fail, 77 skip (no numpy/torch).
The corpus is generated here, so the test needs neither network nor the `fortunes` package.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {sys.executable} lacks numpy/torch ({e})")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "training"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import sdm_reference_model as ref  # noqa: E402
import sdm_torch  # noqa: E402
from test_engine_logits import CheckFailed, compare, engine_logits  # noqa: E402

TRAIN = os.path.join(ROOT, "training", "train.py")
STEPS = 40


def write_corpus(directory):
    """A few hundred 'fortunes' in the package's format (text, a '%' line, text, ...)."""
    rng = random.Random(7)
    words = ("the cat dog sat on a mat and ran far away while old men sing of gold "
             "ships sail home at night").split()
    os.makedirs(directory)
    for f in range(3):
        items = [" ".join(rng.choice(words) for _ in range(rng.randrange(6, 30))).capitalize() + "."
                 for _ in range(150)]
        with open(os.path.join(directory, f"file{f}"), "w") as out:
            out.write("\n%\n".join(items) + "\n%\n")


def train(run_dir, corpus, *extra):
    cmd = [sys.executable, TRAIN, "--preset", "smoke", "--run", run_dir, "--steps", str(STEPS),
           "--batch", "4", "--seq", "64", "--lr", "1e-2", "--warmup", "5", "--log-every", "1",
           "--ckpt-every", "100", "--fortunes", corpus, "--threads", "1", *extra]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if p.returncode != 0:
        raise CheckFailed(f"train.py failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return p.stderr


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    cli = sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="sdm_train_smoke_")
    try:
        corpus = os.path.join(tmp, "corpus")
        write_corpus(corpus)

        # 1. The loss falls.
        full = os.path.join(tmp, "full")
        export_dir = os.path.join(tmp, "model")
        train(full, corpus, "--export", export_dir, "--eval-batches", "2",
              "--recall-per-distance", "2", "--recall-distances", "8,32")
        with open(os.path.join(full, "log.jsonl")) as f:
            losses = [json.loads(line)["loss"] for line in f]
        if len(losses) != STEPS:
            raise CheckFailed(f"{len(losses)} log lines, expected {STEPS}")
        first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
        if not last < first - 1.0:
            raise CheckFailed(f"the loss did not fall: first 10 steps {first:.3f}, "
                              f"last 10 {last:.3f}")
        print(f"ok loss falls: {first:.3f} -> {last:.3f} nats/byte over {STEPS} steps")
        with open(os.path.join(full, "eval.json")) as f:
            ev = json.load(f)
        for key in ("heldout_bits_per_byte", "recall_accuracy", "params", "train_wall_s"):
            if key not in ev:
                raise CheckFailed(f"eval.json lacks {key}")

        # 2. Interrupted and resumed == uninterrupted, bit for bit.
        part = os.path.join(tmp, "part")
        out = train(part, corpus, "--stop-after", "20", "--no-eval")
        if "stopped at step 20" not in out:
            raise CheckFailed("--stop-after 20 did not stop the run")
        part_export = os.path.join(tmp, "part-export")
        out = train(part, corpus, "--no-eval", "--export", part_export)
        if "resumed from" not in out:
            raise CheckFailed("the second run did not resume from the checkpoint")
        # --no-eval skips the evaluation, not the export (it wrote nothing before).
        if not os.path.exists(os.path.join(part_export, "model.safetensors")):
            raise CheckFailed("--no-eval --export wrote no model")
        a = torch.load(os.path.join(full, "checkpoint.pt"))["model"]
        b = torch.load(os.path.join(part, "checkpoint.pt"))["model"]
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        if differ:
            raise CheckFailed(f"resumed run differs from the uninterrupted one in {differ[:5]}")
        with open(os.path.join(part, "log.jsonl")) as f:
            steps = [json.loads(line)["step"] for line in f]
        if steps != list(range(1, STEPS + 1)):
            raise CheckFailed(f"resumed log has steps {steps}")
        print("ok resume: stopped at 20 and resumed, weights identical to the uninterrupted run")

        # 3. The export in the engine, the float64 reference and the trainable model.
        model = ref.ReferenceModel.load(export_dir)
        with open(os.path.join(export_dir, "config.json")) as f:
            config = json.load(f)
        tokens = [256] + list(b"The cat sat on a mat and ran far away. Old men sing of gold.")
        want = model.logits_all(tokens)
        got = engine_logits(cli, export_dir, tokens)
        diff, tol = compare("engine_vs_reference", got, want, 1e-4)
        print(f"ok engine == reference on the export: max diff {diff:.2e} (tol {tol:.2e})")
        m = sdm_torch.SdmLM(config)
        m.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32))
                           for k, (_, v) in ref.load_safetensors(
                               os.path.join(export_dir, "model.safetensors")).items()},
                          strict=True)
        with torch.no_grad():
            trained = m(torch.tensor([tokens]))[0].double().numpy()
        diff, tol = compare("trainable_vs_reference", trained, want, 1e-4)
        print(f"ok trainable model == reference on the export: max diff {diff:.2e}")

        # 4. bf16 autocast: the loss falls; the SDM layer is untouched by it.
        half = os.path.join(tmp, "bf16")
        train(half, corpus, "--precision", "bf16", "--no-eval")
        with open(os.path.join(half, "log.jsonl")) as f:
            losses = [json.loads(line)["loss"] for line in f]
        first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
        if not last < first - 1.0:
            raise CheckFailed(f"bf16: the loss did not fall: first 10 steps {first:.3f}, "
                              f"last 10 {last:.3f}")
        memory = next(x for x in m.modules() if isinstance(x, sdm_torch.SdmMemory))
        x = torch.randn(2, 40, config["dim"], generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            plain = memory(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = memory(x)
        if autocast.dtype != torch.float32 or not torch.equal(plain, autocast):
            raise CheckFailed(f"the SDM layer under bf16 autocast: {autocast.dtype}, max diff "
                              f"{(plain - autocast.float()).abs().max().item():.3g}")
        print(f"ok bf16: loss falls {first:.3f} -> {last:.3f}; the SDM layer stays float32")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as e:
        print(f"FAIL: {e}")
        sys.exit(1)
