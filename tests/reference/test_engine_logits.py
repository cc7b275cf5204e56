#!/usr/bin/env python3
"""Engine logits vs the independent float64 reference (docs/model-spec.md §11).

usage: /usr/bin/python3 test_engine_logits.py PATH/TO/sdm-model PATH/TO/sdm-cli [-k SUBSTRING] [--keep]

For every case: `sdm-model init` writes a model directory (config from a preset plus --set
overrides); its tensor names and shapes are checked against the reference's own list; then every
tensor is overwritten with random values chosen so that nothing is trivial (biases, BatchNorm
statistics, norm weights, A_log, dt_bias, M0 all random) while activations stay O(1); then
`sdm-cli logits --all` on a random token sequence longer than the SWA window is compared with
sdm_reference_model.py.

Tolerance: |engine - reference| <= 2e-4 * (1 + max|reference logit|) for every logit. The engine
computes in fp32 (unit roundoff 6e-8); with dim 64, a handful of layers and a few dozen tokens of
recurrence, accumulated relative error stays around 1e-6..1e-5, so 2e-4 leaves a wide margin while
any real mistake (a wrong sign, a missed bias, a swapped half, an off-by-one in the window) moves
logits by O(1e-2) or more. Top-K addressing is discontinuous: when two candidate pair sums are
within the engine's rounding error of each other, fp32 and float64 may pick different slots, so a
token sequence whose smallest K-th/(K+1)-th gap is below 1e-4 is replaced by another (the gap is
measured by the reference).

Exits 0 when every check passes, 1 otherwise, 77 (skip) when torch or numpy is missing.
Prints "N passed, N failed" last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

try:
    import numpy as np
    import torch  # noqa: F401  (needed by the reference)
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {sys.executable} lacks numpy/torch ({e})")
    sys.exit(77)

# The reference model lives in training/ (the training code builds on it too).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "training"))
import sdm_reference_model as ref  # noqa: E402

REL_TOL = 2e-4
MIN_ADDRESS_GAP = 1e-4
CMD_TIMEOUT_S = 120


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

CASES = [
    # name, preset, seed, --set overrides, options
    ("tiny", "tiny", 1, [], {"tokens": 32, "extra_checks": True}),
    ("tiny_sdm_options_flipped", "tiny", 2, [
        "sdm_args.output_gate=false", "sdm_args.normalize_readings=false",
        "sdm_args.query_batchnorm=true", "sdm_args.key_weighted_decay=true",
        "sdm_args.backprop_on_memory=false", "sdm_args.read_act_scale=0.5",
        "sdm_args.write_act_scale=2.5",
        "sdm_args.num_writes=12",  # > s = 8: the first stage keeps all 8 of each half
        "sdm_args.num_reads=5", "sdm_args.update_rule=slot_residual",
    ], {"tokens": 28}),
    ("tiny_identity_l2_normalize", "tiny", 3, [
        "sdm_args.read_act=Identity", "sdm_args.write_act=l2_normalize",
        "sdm_args.num_writes=4", "sdm_args.num_reads=6", "sdm_args.query_batchnorm=true",
    ], {"tokens": 24}),
    ("tiny_sigmoid_relu", "tiny", 4, [
        # Unnormalised write weights: W = 2 keeps sum k_i^2 <= 2, so the delta rule stays stable.
        "sdm_args.read_act=ReLU", "sdm_args.write_act=Sigmoid",
        "sdm_args.num_writes=2", "sdm_args.num_reads=3", "sdm_args.key_weighted_decay=true",
    ], {"tokens": 24}),
    ("tiny_dense_k_eq_slots", "tiny", 5, [
        # K = s^2 = 16: every slot written and read (the dense gated delta rule); 4 heads of 16.
        "sdm_args.num_heads=4", "sdm_args.slots_per_head=16",
        "sdm_args.num_writes=16", "sdm_args.num_reads=16",
    ], {"tokens": 20}),
    ("tiny_attn_gate", "tiny", 6, ["attn_gate=true"], {"tokens": 24}),
    ("tiny_weight_tying", "tiny", 7, ["weight_tying=true"], {"tokens": 24}),
    ("tiny_mha_one_sdm_head", "tiny", 8, [
        "n_kv_heads=4", "sdm_args.num_heads=1", "sdm_args.slots_per_head=36",
        "sdm_args.num_writes=5", "sdm_args.num_reads=7", "swa_window=5", "rope_theta=500",
    ], {"tokens": 20}),
    ("tiny_bf16_weights", "tiny", 9, [], {"tokens": 24, "weights_dtype": "BF16"}),
    # sdm-model's own initialisation, written in bf16 (zero biases, unit norms: a weaker test of
    # the computation, but it checks the files init writes as they are).
    ("tiny_init_weights_bf16", "tiny", 12, ["--dtype=bf16"], {"tokens": 20,
                                                                 "keep_init_weights": True}),
    ("hybrid_attn_swa_sdm", "debug_hybrid", 10, [
        # debug_hybrid (attn [4,6], swa [0,2], sdm [1,3,5,7]) shrunk to test size; each override
        # keeps the config valid on its own. SWA: 4 heads / 2 kv heads of width 24 (4*24 != dim);
        # full attention: 4 heads of width 32 (MHA); FFN hidden 224.
        "dim=64", "n_heads=4", "head_dim=32", "swa_n_heads=4", "swa_n_kv_heads=2",
        "swa_head_dim=24", "swa_window=5", "sdm_args.slots_per_head=16",
        "sdm_args.num_writes=6", "sdm_args.num_reads=6", "sdm_args.num_heads=2",
        "multiple_of=32", "ffn_dim_multiplier=1.3", "rope_theta=100000",
    ], {"tokens": 20}),
    ("full_attention_only", "debug", 11, [
        "dim=64", "n_heads=4", "n_kv_heads=1", "multiple_of=64", "rope_theta=100000",
    ], {"tokens": 20}),
]


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


class CheckFailed(Exception):
    pass


def run(cmd, timeout=CMD_TIMEOUT_S):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise CheckFailed(f"command failed (rc={p.returncode}): {' '.join(cmd)}\n"
                          f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p.stdout


def random_weights(shapes, seed):
    """Random, non-trivial values for every tensor, keyed by its role (by name)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if name == "tok_embeddings.weight":  # also the output matrix under weight_tying
            a = rng.normal(0.0, 0.3, shape)
        elif leaf == "memory":  # M0
            a = rng.normal(0.0, 0.5, shape)
        elif leaf == "A_log":  # A in [0.2, 3]
            a = np.log(rng.uniform(0.2, 3.0, shape))
        elif leaf == "dt_bias":  # softplus(dt_bias) around 0.1..0.8
            a = rng.normal(-1.0, 0.5, shape)
        elif leaf == "running_var":
            a = rng.uniform(0.5, 2.0, shape)
        elif leaf == "running_mean":
            a = rng.normal(0.0, 0.3, shape)
        elif len(shape) == 1 and leaf == "weight":  # RMSNorm, LayerNorm, BatchNorm scales
            a = 1.0 + rng.normal(0.0, 0.1, shape)
        elif len(shape) == 1:  # biases
            a = rng.normal(0.0, 0.1, shape)
        else:  # [out, in] matrices: std in^-1/2 keeps outputs O(1)
            a = rng.normal(0.0, shape[1] ** -0.5, shape)
        out[name] = a.astype(np.float32)
    return out


def engine_logits(cli, model_dir, tokens, all_positions=True):
    cmd = [cli, "logits", "--model", model_dir, "--tokens", ",".join(map(str, tokens))]
    if all_positions:
        cmd.append("--all")
    text = run(cmd)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckFailed(f"sdm-cli logits did not print one JSON object ({e}): {text[:500]}")
    if obj.get("tokens") != list(tokens):
        raise CheckFailed(f"sdm-cli echoed tokens {obj.get('tokens')} != {list(tokens)}")
    return np.asarray(obj["logits"], dtype=np.float64)


def compare(name, got, want, rel_tol):
    if got.shape != want.shape:
        raise CheckFailed(f"{name}: shape {got.shape} != reference {want.shape}")
    if not np.all(np.isfinite(got)):
        raise CheckFailed(f"{name}: non-finite engine logits")
    scale = 1.0 + float(np.max(np.abs(want)))
    diff = np.abs(got - want)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    tol = rel_tol * scale
    if diff[worst] > tol:
        raise CheckFailed(f"{name}: max |diff| {diff[worst]:.3e} at {tuple(int(i) for i in worst)} "
                          f"(engine {got[worst]:.9g}, reference {want[worst]:.9g}) > tol "
                          f"{tol:.3e}")
    return float(diff[worst]), tol


def choose_tokens(model, n, seed):
    """A random token sequence of length n without near-ties at any top-K addressing boundary,
    and the reference logits for it."""
    rng = np.random.default_rng(seed)
    for _ in range(8):
        tokens = [int(t) for t in rng.integers(0, model.config.vocab_size, n)]
        model.stats = ref.AddressStats()
        want = model.logits_all(tokens)
        if model.stats.min_gap >= MIN_ADDRESS_GAP:
            return tokens, want
    raise CheckFailed("could not find a token sequence free of addressing near-ties")


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


def run_case(args, name, preset, seed, sets, opts, results):
    workdir = tempfile.mkdtemp(prefix=f"sdm-logits-{name}-")
    model_dir = os.path.join(workdir, "model")
    try:
        cmd = [args.sdm_model, "init", "--preset", preset, "--seed", str(seed), "--out", model_dir,
               "--force"]
        for s in sets:
            cmd += [s] if s.startswith("--") else ["--set", s]
        run(cmd)
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        cfg = ref.RefConfig.from_dict(config)

        # The tensors sdm-model writes must be exactly the reference's state dict.
        header, _ = ref.read_safetensors_header(os.path.join(model_dir, "model.safetensors"))
        written = {k: tuple(v["shape"]) for k, v in header.items()}
        expected = ref.expected_tensor_shapes(cfg)
        if written != expected:
            missing = sorted(set(expected) - set(written))
            extra = sorted(set(written) - set(expected))
            shapes = sorted(k for k in set(written) & set(expected) if written[k] != expected[k])
            raise CheckFailed(f"sdm-model wrote tensors that differ from the reference's state "
                              f"dict: missing {missing}, unexpected {extra}, shape differs "
                              f"{[(k, written[k], expected[k]) for k in shapes]}")

        if not opts.get("keep_init_weights"):
            weights = random_weights(expected, seed * 7919 + 17)
            dtype = opts.get("weights_dtype", "F32")
            ref.save_safetensors(os.path.join(model_dir, "model.safetensors"), weights,
                                 dtype=dtype)
        model = ref.ReferenceModel.load(model_dir)

        tokens, want = choose_tokens(model, opts["tokens"], seed)

        got = engine_logits(args.sdm_cli, model_dir, tokens)
        diff, tol = compare(name, got, want, REL_TOL)
        results.ok(name, f"T={len(tokens)} max|diff| {diff:.2e} (tol {tol:.1e}, "
                         f"max|logit| {np.max(np.abs(want)):.2f}, min address gap "
                         f"{model.stats.min_gap:.1e})")

        if opts.get("extra_checks"):
            # Last position only == the last row of --all.
            check = f"{name}/last_position_vs_all"
            try:
                last = engine_logits(args.sdm_cli, model_dir, tokens, all_positions=False)
                d, t = compare(check, last, got[-1:], 1e-6)
                results.ok(check, f"max|diff| {d:.2e}")
            except CheckFailed as e:
                results.fail(check, str(e))
            # Causality: a prefix gives the first rows of the full run.
            check = f"{name}/prefix_is_causal"
            try:
                n = len(tokens) // 2 + 1
                prefix = engine_logits(args.sdm_cli, model_dir, tokens[:n])
                d, t = compare(check, prefix, got[:n], 1e-5)
                results.ok(check, f"first {n} rows, max|diff| {d:.2e}")
            except CheckFailed as e:
                results.fail(check, str(e))
            # The reference's two addressing methods agree (product keys == brute force).
            check = f"{name}/reference_product_keys_vs_brute_force"
            brute = model.logits_all(tokens, addressing="brute")
            d = float(np.max(np.abs(brute - want)))
            if d <= 1e-12 * (1.0 + float(np.max(np.abs(want)))):
                results.ok(check, f"max|diff| {d:.1e}")
            else:
                results.fail(check, f"max|diff| {d:.3e}")
    except CheckFailed as e:
        results.fail(name, str(e))
    except subprocess.TimeoutExpired as e:
        results.fail(name, f"timed out: {e}")
    except Exception:  # a bug in the test itself must still be reported, not crash the run
        results.fail(name, traceback.format_exc())
    finally:
        if args.keep:
            print(f"  kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


class Results:
    def __init__(self):
        self.passed = 0
        self.failed = []

    def ok(self, name, detail=""):
        self.passed += 1
        print(f"PASS {name}: {detail}", flush=True)

    def fail(self, name, detail):
        self.failed.append(name)
        print(f"FAIL {name}: {detail}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description="engine logits vs the float64 reference")
    ap.add_argument("sdm_model")
    ap.add_argument("sdm_cli")
    ap.add_argument("-k", dest="filter", default="", help="run only cases containing this")
    ap.add_argument("--keep", action="store_true", help="keep the model directories")
    args = ap.parse_args(argv)
    for tool in (args.sdm_model, args.sdm_cli):
        if not (os.path.isfile(tool) and os.access(tool, os.X_OK)):
            print(f"ERROR: {tool} is not an executable file")
            return 1

    torch.set_num_threads(1)
    results = Results()
    start = time.time()
    problems = ref.self_test()
    if problems:
        results.fail("reference_self_test", "; ".join(problems))
    else:
        results.ok("reference_self_test", "two-slot example, product keys == brute force, "
                   "K = s^2 == dense delta rule")
    for name, preset, seed, sets, opts in CASES:
        if args.filter and args.filter not in name:
            continue
        run_case(args, name, preset, seed, sets, opts, results)
    print(f"({time.time() - start:.1f} s)")
    print(f"{results.passed} passed, {len(results.failed)} failed")
    if results.failed:
        print("failed: " + ", ".join(results.failed))
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
