#!/usr/bin/env python3
"""tools/convert_reference_checkpoint.py against checkpoints laid out as the reference saves them.

usage: /usr/bin/python3 test_convert_reference_checkpoint.py PATH/TO/sdm-model PATH/TO/sdm-cli

A small stand-in of the reference's module tree (same attribute names and torch module types:
nn.Linear with [out, in] weights and biases, nn.BatchNorm1d with its int64 num_batches_tracked,
nn.LayerNorm, bare Parameters A_log / dt_bias / memory, a TiedLinear-style `output.tied_module`,
a non-persistent RoPE buffer) produces the state dict, so names and layout are what
`model.state_dict()` gives in the reference. It is filled with random values (some modules in
bf16), saved with torch.save as {"model": state_dict} in `<step>/consolidated/consolidated.pth`
next to a params.json in the reference's training-config shape, converted, and checked:
  * every output tensor equals its input (bf16 kept bit-exact, or widened exactly with --dtype
    fp32; --dtype bf16 rounds like torch), config.json carries the model section + tokenizer;
  * `sdm-cli logits --all` on the converted model matches sdm_reference_model.py on the same
    directory (same tolerance and near-tie rule as test_engine_logits.py);
  * negative cases fail with a message naming the problem (missing tensor, missing .pth, bad
    params.json, unknown config field, non-float tensor, tied weights that differ), and a tensor
    removed from a converted model makes the engine's loader fail naming it.
`sdm-model info` must accept every converted model (config and weight file).

Exits 0 on success, 1 on failure, 77 (skip) without numpy/torch. Prints "N passed, N failed".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import OrderedDict

try:
    import numpy as np
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {sys.executable} lacks numpy/torch ({e})")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "training"))
import sdm_reference_model as ref  # noqa: E402
from test_engine_logits import (CheckFailed, Results, choose_tokens, compare,  # noqa: E402
                                engine_logits, random_weights, REL_TOL)

CONVERTER = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools",
                         "convert_reference_checkpoint.py")
_spec = importlib.util.spec_from_file_location("convert_reference_checkpoint", CONVERTER)
converter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(converter)

# ----------------------------------------------------------------------------------------------
# A stand-in for the reference's module tree (structure only: no forward pass is needed).
# ----------------------------------------------------------------------------------------------


class RMSNormStandIn(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class AttentionStandIn(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, gate):
        super().__init__()
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        if gate:
            self.w_gate = nn.Linear(dim, n_heads * head_dim, bias=False)


class SdmStandIn(nn.Module):
    def __init__(self, dim, a):
        super().__init__()
        H, sph = a["num_heads"], a["slots_per_head"]
        key = H * 2 * int(round(sph ** 0.5))
        self.Wq_read = nn.Linear(dim, key)
        self.Wk_write = nn.Linear(dim, key)
        self.Wv_write = nn.Linear(dim, dim)
        self.query_bn = nn.BatchNorm1d(key) if a.get("query_batchnorm") else None
        self.key_bn = nn.BatchNorm1d(key) if a.get("query_batchnorm") else None
        self.a_proj = nn.Linear(dim, H)
        self.b_proj = nn.Linear(dim, H)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.Wo = nn.Linear(dim, dim)
        self.Wog = nn.Linear(dim, dim) if a.get("output_gate") else None
        self.memory = (nn.Parameter(torch.zeros(H * sph, dim // H))
                       if a.get("backprop_on_memory", True) else None)
        self.readings_norm = (nn.LayerNorm(dim // H, eps=a.get("norm_eps", 1e-6))
                              if a.get("normalize_readings") else None)


class FeedForwardStandIn(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


class BlockStandIn(nn.Module):
    def __init__(self, cfg: ref.RefConfig, i):
        super().__init__()
        d = cfg.dim
        if cfg.layer_types[i] == "sdm":
            self.attention = SdmStandIn(d, cfg.sdm_args)
        else:
            g = cfg.attn[i]
            self.attention = AttentionStandIn(d, g.n_heads, g.n_kv_heads, g.head_dim,
                                              cfg.attn_gate)
        self.feed_forward = FeedForwardStandIn(d, cfg.ffn_hidden)
        self.attention_norm = RMSNormStandIn(d)
        self.ffn_norm = RMSNormStandIn(d)


class TiedLinearStandIn(nn.Module):
    def __init__(self, tied_module):
        super().__init__()
        self.tied_module = tied_module


class RopeStandIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("freqs_cis", torch.zeros(4, 2, 2, 2), persistent=False)


class LMStandIn(nn.Module):
    def __init__(self, cfg: ref.RefConfig):
        super().__init__()
        self.rope_embeddings = RopeStandIn()
        self.layers = nn.ModuleList(BlockStandIn(cfg, i) for i in range(cfg.n_layers))
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.norm = RMSNormStandIn(cfg.dim)
        if cfg.weight_tying:
            self.output = TiedLinearStandIn(self.tok_embeddings)
        else:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)


def make_model(model_section: dict, seed: int, bf16_prefixes=()):
    """Builds the stand-in, fills it with random values and returns (model, state_dict), with the
    state-dict entries under `bf16_prefixes` cast to bf16 (as a bf16-trained model saves them)."""
    cfg_dict = dict(model_section)
    if cfg_dict.get("vocab_size", -1) <= 0:
        cfg_dict["vocab_size"] = 258
    cfg = ref.RefConfig.from_dict(cfg_dict)
    torch.manual_seed(seed)
    model = LMStandIn(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()
              if t.is_floating_point()}
    values = random_weights(shapes, seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name in values:
                t.copy_(torch.from_numpy(values[name]))
            elif name.endswith("num_batches_tracked"):
                t.fill_(1234)
    sd = model.state_dict()
    for name in list(sd):
        if any(name.startswith(p) for p in bf16_prefixes) and sd[name].is_floating_point():
            sd[name] = sd[name].to(torch.bfloat16)
    if cfg.weight_tying:  # the tied output is the same tensor as the embedding
        sd["output.tied_module.weight"] = sd["tok_embeddings.weight"]
    return model, sd


# ----------------------------------------------------------------------------------------------
# Configs (the reference's params.json: the whole training config)
# ----------------------------------------------------------------------------------------------

HYBRID_MODEL = {
    "dim": 64, "n_layers": 4, "head_dim": None, "n_heads": 4, "n_kv_heads": 2,
    "ffn_dim_multiplier": None, "multiple_of": 64, "norm_eps": 1e-5, "rope_theta": 10000.0,
    "init_base_std": None, "init_std_factor": "disabled", "max_seqlen": 1024,
    "attn_at": [3], "swa_at": "0,2", "sdm_at": [1],
    "swa_window": 6, "swa_n_heads": None, "swa_n_kv_heads": None, "swa_head_dim": None,
    "attn_gate": True,
    "sdm_args": {
        "dim": 64, "num_writes": 6, "num_reads": 5, "slots_per_head": 36,
        "memory_block_size": 16, "read_act": "Softmax", "write_act": "Softmax",
        "read_act_scale": 1.5, "write_act_scale": 1.0, "normalize_readings": True,
        "norm_eps": 1e-6, "dt_bias_init": 0.0, "A_init_range": [0.0, 16.0],
        "backprop_on_memory": True, "output_gate": True, "query_batchnorm": True,
        "log_memory_access_stats": False, "log_memory_norms": False, "num_heads": 2,
        "key_weighted_decay": False, "snapshot_quant": "none",
    },
    "seed": 42, "vocab_size": -1, "weight_tying": True,
    "sliding_window": None,  # legacy Lingua field, off: dropped and reported
}

UNTIED_MODEL = {
    "dim": 64, "n_layers": 2, "n_heads": 2, "multiple_of": 32, "rope_theta": 500.0,
    "swa_at": [0], "sdm_at": [1], "swa_window": 4, "swa_n_heads": 4, "swa_n_kv_heads": 1,
    "swa_head_dim": 8, "weight_tying": False, "vocab_size": 300,
    "sdm_args": {"num_heads": 1, "slots_per_head": 25, "num_writes": 3, "num_reads": 4,
                 "backprop_on_memory": False, "write_act": "l2_normalize",
                 "read_act": "Sigmoid", "key_weighted_decay": True},
}


def params_json(model_section, tokenizer=None):
    return {
        "name": "test_run", "dump_dir": "/checkpoints/test_run", "seed": 777, "steps": 1000,
        "optim": {"lr": 3e-4, "warmup": 200, "clip": 1.0},
        "distributed": {"fsdp_type": "full_shard", "compile": True, "model_dtype": "bf16"},
        "model": model_section,
        "data": {"root_dir": "data", "seq_len": 2048,
                 "tokenizer": tokenizer or {"name": "bytes", "path": None}},
        "checkpoint": {"dump": {"every": 500, "keep": 1}},
    }


def write_checkpoint(root, state_dict, params, layout="step", wrap=True):
    """layout 'step': root/0000001000/consolidated/{consolidated.pth, params.json} (returns the
    step dir); 'file': root/ckpt/consolidated.pth with params.json in root (returns the file)."""
    obj = {"model": state_dict} if wrap else state_dict
    if layout == "step":
        d = os.path.join(root, "0000001000", "consolidated")
        os.makedirs(d)
        torch.save(obj, os.path.join(d, "consolidated.pth"))
        with open(os.path.join(d, "params.json"), "w") as f:
            json.dump(params, f)
        return os.path.dirname(d)
    d = os.path.join(root, "ckpt")
    os.makedirs(d)
    torch.save(obj, os.path.join(d, "consolidated.pth"))
    with open(os.path.join(root, "params.json"), "w") as f:
        json.dump(params, f)
    return os.path.join(d, "consolidated.pth")


def convert(src, out, *extra, subprocess_run=False):
    """Runs the converter: in this process (fast: torch is already imported) or, for the checks
    of the command line itself, as `python3 tools/convert_reference_checkpoint.py`."""
    argv = [src, out] + list(extra)
    if subprocess_run:
        p = subprocess.run([sys.executable, CONVERTER] + argv, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120)
        return p.returncode, p.stdout + p.stderr
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = converter.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:
            buf.write(traceback.format_exc())
            rc = 1
    return rc, buf.getvalue()


def expect_ok(src, out, *extra, subprocess_run=False):
    rc, text = convert(src, out, *extra, subprocess_run=subprocess_run)
    if rc != 0:
        raise CheckFailed(f"conversion failed (rc={rc}): {text}")
    return text


def expect_fail(src, out, must_mention, *extra):
    rc, text = convert(src, out, *extra)
    if rc == 0:
        raise CheckFailed(f"conversion should have failed: {text}")
    if "Traceback" in text:
        raise CheckFailed(f"conversion failed with a traceback instead of a message: {text}")
    for word in must_mention:
        if word not in text:
            raise CheckFailed(f"error message does not mention '{word}': {text.strip()}")
    return text.strip()


def check_tensors(out_dir, state_dict, mode, weight_tying):
    """Every converted tensor equals its source under the dtype rule of `mode`."""
    got = ref.load_safetensors(os.path.join(out_dir, "model.safetensors"))
    want_names = [n for n in state_dict if not n.endswith("num_batches_tracked")
                  and not (weight_tying and n.startswith("output."))]
    if sorted(got) != sorted(want_names):
        raise CheckFailed(f"converted names differ: missing {sorted(set(want_names) - set(got))}, "
                          f"extra {sorted(set(got) - set(want_names))}")
    n_bf16 = 0
    for name in want_names:
        src = state_dict[name]
        dtype, arr = got[name]
        if mode == "keep":
            want_dtype = "BF16" if src.dtype == torch.bfloat16 else "F32"
            want = src.float().numpy()
        elif mode == "fp32":
            want_dtype, want = "F32", src.float().numpy()
        else:
            want_dtype, want = "BF16", src.to(torch.bfloat16).float().numpy()
        if dtype != want_dtype:
            raise CheckFailed(f"{name}: dtype {dtype}, expected {want_dtype} (source {src.dtype})")
        if arr.shape != want.shape or not np.array_equal(arr, want):
            raise CheckFailed(f"{name}: values differ from the source")
        n_bf16 += dtype == "BF16"
    return len(want_names), n_bf16


# ----------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------


def engine_accepts(args, out_dir):
    """`sdm-model info DIR` parses config.json and checks the weight file against it."""
    p = subprocess.run([args.sdm_model, "info", out_dir], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=60)
    if p.returncode != 0:
        raise CheckFailed(f"sdm-model info rejects the converted model: {p.stdout[-800:]} "
                          f"{p.stderr[-800:]}")


def logits_check(args, out_dir, seed, n_tokens=20):
    model = ref.ReferenceModel.load(out_dir)
    tokens, want = choose_tokens(model, n_tokens, seed)
    got = engine_logits(args.sdm_cli, out_dir, tokens)
    d, tol = compare("logits", got, want, REL_TOL)
    return f"engine vs reference on the converted model: max|diff| {d:.2e} (tol {tol:.1e})"


def run_checks(args, work, results):
    def check(name, fn):
        try:
            detail = fn()
            results.ok(name, detail or "")
        except CheckFailed as e:
            results.fail(name, str(e))
        except Exception:
            results.fail(name, traceback.format_exc())

    # --- 1. Hybrid, tied, BatchNorm, bf16 parts, torch.compile prefix, step-dir layout. ---
    bf16_parts = ("tok_embeddings", "layers.0.feed_forward", "layers.1.attention.Wv_write",
                  "layers.1.attention.memory", "layers.1.attention.readings_norm")
    model, sd = make_model(HYBRID_MODEL, seed=21, bf16_prefixes=bf16_parts)
    names = list(sd)

    def layout_is_reference():
        must = ["output.tied_module.weight", "layers.1.attention.query_bn.num_batches_tracked",
                "layers.1.attention.key_bn.running_var", "layers.1.attention.memory",
                "layers.1.attention.A_log", "layers.1.attention.readings_norm.bias",
                "layers.3.attention.w_gate.weight"]
        missing = [n for n in must if n not in names]
        if missing or any("freqs_cis" in n for n in names):
            raise CheckFailed(f"stand-in state dict is not reference-shaped: missing {missing}")
        if sd["layers.1.attention.query_bn.num_batches_tracked"].dtype != torch.int64:
            raise CheckFailed("num_batches_tracked is not int64")
        return f"{len(names)} entries"
    check("stand_in_state_dict_layout", layout_is_reference)

    compiled = {"_orig_mod." + k: v for k, v in sd.items()}
    step_dir = write_checkpoint(os.path.join(work, "hybrid"), compiled, params_json(HYBRID_MODEL))
    out_keep = os.path.join(work, "out_keep")

    def convert_keep():
        text = expect_ok(step_dir, out_keep, subprocess_run=True)  # the command line itself
        n, n_bf16 = check_tensors(out_keep, sd, "keep", weight_tying=True)
        if n_bf16 == 0:
            raise CheckFailed("no bf16 tensor kept")
        with open(os.path.join(out_keep, "config.json")) as f:
            cfg = json.load(f)
        if cfg.get("vocab_size") != 258 or cfg.get("tokenizer") != {"name": "bytes"}:
            raise CheckFailed(f"config.json vocab_size/tokenizer wrong: {cfg.get('vocab_size')}, "
                              f"{cfg.get('tokenizer')}")
        for key, value in HYBRID_MODEL.items():
            if key in ("vocab_size", "sliding_window"):
                continue
            if cfg.get(key) != value:
                raise CheckFailed(f"config.json {key} = {cfg.get(key)!r}, params.json has "
                                  f"{value!r}")
        if "sliding_window" in cfg or "sliding_window" not in text:
            raise CheckFailed("the null legacy key sliding_window was not dropped and reported")
        for word in ("tensors", "parameters", "bytes", "output.tied_module.weight",
                     "num_batches_tracked"):
            if word not in text:
                raise CheckFailed(f"summary does not mention {word}: {text}")
        if any(n.endswith(".tmp") for n in os.listdir(out_keep)):
            raise CheckFailed("temporary file left behind")
        engine_accepts(args, out_keep)
        return f"{n} tensors ({n_bf16} bf16 kept bit-exact), sdm-model info accepts it"
    check("convert_hybrid_keep_dtype", convert_keep)
    check("convert_hybrid_engine_vs_reference", lambda: logits_check(args, out_keep, seed=5))

    def convert_fp32():
        out = os.path.join(work, "out_fp32")
        expect_ok(step_dir, out, "--dtype", "fp32")
        n, n_bf16 = check_tensors(out, sd, "fp32", weight_tying=True)
        return f"{n} tensors, bf16 widened exactly"
    check("convert_hybrid_fp32", convert_fp32)

    def convert_bf16():
        out = os.path.join(work, "out_bf16")
        expect_ok(step_dir, out, "--dtype", "bf16")
        n, n_bf16 = check_tensors(out, sd, "bf16", weight_tying=True)
        engine_accepts(args, out)
        return f"{n} tensors, all BF16 rounded as torch rounds"
    check("convert_hybrid_bf16", convert_bf16)

    def tied_output_weight_name():
        # Some exporters save the tied output as output.weight: dropped after the same check.
        s2 = OrderedDict((("output.weight" if k == "output.tied_module.weight" else k), v)
                         for k, v in sd.items())
        src = write_checkpoint(os.path.join(work, "tied_name"), s2, params_json(HYBRID_MODEL))
        out = os.path.join(work, "out_tied_name")
        expect_ok(src, out)
        n, _ = check_tensors(out, sd, "keep", weight_tying=True)
        return f"{n} tensors"
    check("convert_tied_output_named_output_weight", tied_output_weight_name)

    def refuse_overwrite():
        expect_fail(step_dir, out_keep, ["--force"])
        expect_ok(step_dir, out_keep, "--force")
        return "existing model kept without --force"
    check("convert_refuses_overwrite", refuse_overwrite)

    # --- 2. Untied output, DDP/FSDP1 prefixes, no M0, .pth path given directly. ---
    _, sd2 = make_model(UNTIED_MODEL, seed=22)
    wrapped = {}
    for k, v in sd2.items():
        parts = k.split(".")
        if parts[0] == "layers":  # FSDP1 wraps each block: layers.i._fsdp_wrapped_module.<...>
            parts = parts[:2] + ["_fsdp_wrapped_module", "_checkpoint_wrapped_module"] + parts[2:]
        wrapped["module." + ".".join(parts)] = v
    pth = write_checkpoint(os.path.join(work, "untied"), wrapped, params_json(UNTIED_MODEL),
                           layout="file")
    out_untied = os.path.join(work, "out_untied")

    def convert_untied():
        expect_ok(pth, out_untied)
        n, _ = check_tensors(out_untied, sd2, "keep", weight_tying=False)
        engine_accepts(args, out_untied)
        return f"{n} tensors"
    check("convert_untied_prefixed_file_path", convert_untied)
    check("convert_untied_engine_vs_reference", lambda: logits_check(args, out_untied, seed=6))

    def interrupted_reconversion():
        # A --force re-conversion of another model into a directory, interrupted after its
        # weights: the old config must not be left to describe the new weights.
        out = os.path.join(work, "out_reconverted")
        expect_ok(step_dir, out)  # the hybrid model

        def crash(path, text):
            raise OSError("simulated crash before config.json")
        real = converter.write_text_atomic
        converter.write_text_atomic = crash
        try:
            rc, text = convert(pth, out, "--force")  # the untied model
        finally:
            converter.write_text_atomic = real
        if rc == 0:
            raise CheckFailed(f"the interrupted conversion succeeded: {text}")
        if os.path.exists(os.path.join(out, "config.json")):
            raise CheckFailed("the old config.json was left beside the new weights")
        p = subprocess.run([args.sdm_model, "info", out], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        if p.returncode == 0 or "config.json" not in p.stdout + p.stderr:
            raise CheckFailed(f"loading it did not fail naming config.json: {p.stderr.strip()}")
        expect_ok(pth, out, "--force")
        n, _ = check_tensors(out, sd2, "keep", weight_tying=False)
        engine_accepts(args, out)
        return "no config left by the interruption; the rerun completes"
    check("convert_interrupted_reconversion_leaves_no_config", interrupted_reconversion)

    # --- 3. SentencePiece tokenizer: the model file is copied. ---
    def sentencepiece():
        spm = os.path.join(work, "spm.model")
        with open(spm, "wb") as f:
            f.write(b"\x0a\x03abc")  # content is not interpreted by the converter
        m = dict(UNTIED_MODEL)
        src = write_checkpoint(os.path.join(work, "sp"), sd2,
                               params_json(m, {"name": "sp", "path": spm}))
        out = os.path.join(work, "out_sp")
        expect_ok(src, out)
        with open(os.path.join(out, "config.json")) as f:
            tok = json.load(f)["tokenizer"]
        if tok != {"name": "sp", "path": "tokenizer.model"}:
            raise CheckFailed(f"tokenizer entry {tok}")
        with open(os.path.join(out, "tokenizer.model"), "rb") as f:
            if f.read() != b"\x0a\x03abc":
                raise CheckFailed("tokenizer.model is not a copy")
        os.unlink(spm)
        expect_fail(src, os.path.join(work, "out_sp2"), ["spm.model", "--tokenizer-model"])
        return "copied; a missing file is reported"
    check("convert_sentencepiece_tokenizer", sentencepiece)

    # --- 3b. null config values: the reference's "unset", so the default: dropped and reported. ---
    def null_values():
        # The engine takes null only for the fields documented "or null" and rejected a converted
        # config that kept another ("sdm_args": expected an object).
        no_sdm = dict(UNTIED_MODEL, attn_at=[1], sdm_at=None, sdm_args=None, max_seqlen=None)
        _, sd3 = make_model(no_sdm, seed=23)
        # In an SDM model: null where the default is the value the stand-in was made with.
        sdm_nulls = dict(HYBRID_MODEL, seed=None, norm_eps=None,
                         sdm_args=dict(HYBRID_MODEL["sdm_args"], dt_bias_init=None,
                                       snapshot_quant=None, A_init_range=None))
        cases = [("null_no_sdm", sd3, no_sdm, ["model.sdm_args", "model.sdm_at",
                                               "model.max_seqlen"]),
                 ("null_sdm_fields", sd, sdm_nulls, ["model.seed", "model.norm_eps",
                                                     "model.sdm_args.dt_bias_init",
                                                     "model.sdm_args.snapshot_quant",
                                                     "model.sdm_args.A_init_range"])]
        for name, state_dict, model_section, nulls in cases:
            src = write_checkpoint(os.path.join(work, name), state_dict, params_json(model_section))
            out = os.path.join(work, "out_" + name)
            text = expect_ok(src, out)
            engine_accepts(args, out)
            with open(os.path.join(out, "config.json")) as f:
                cfg = json.load(f)
            for key in nulls:
                section = cfg
                for part in key.split(".")[1:-1]:
                    section = section[part]
                if key.split(".")[-1] in section:
                    raise CheckFailed(f"{name}: config.json keeps {key}: {cfg}")
                if f"{key}=null" not in text:
                    raise CheckFailed(f"{name}: the dropped {key}=null is not reported: {text}")
        return "null keys dropped and reported; sdm-model info accepts both"
    check("convert_null_values_as_defaults", null_values)

    def unknown_off_flag():
        # An unknown feature flag that is off computes nothing: dropped, and reported.
        src = write_checkpoint(os.path.join(work, "off_flag"), sd,
                               params_json(dict(HYBRID_MODEL, use_fancy_feature=False)))
        out = os.path.join(work, "out_off_flag")
        text = expect_ok(src, out)
        with open(os.path.join(out, "config.json")) as f:
            if "use_fancy_feature" in json.load(f):
                raise CheckFailed("config.json keeps the unknown flag")
        if "model.use_fancy_feature=false" not in text:
            raise CheckFailed(f"the dropped flag is not reported: {text}")
        return "dropped and reported"
    check("convert_unknown_false_flag_dropped", unknown_off_flag)

    # --- 4. Negative cases. ---
    def neg(name, mutate_sd=None, params=None, must=(), layout="step", model=HYBRID_MODEL):
        def fn():
            s = dict(sd)
            if mutate_sd:
                mutate_sd(s)
            src = write_checkpoint(os.path.join(work, name), s, params or params_json(model),
                                   layout=layout)
            msg = expect_fail(src, os.path.join(work, "out_" + name), must)
            if os.path.exists(os.path.join(work, "out_" + name, "model.safetensors")):
                raise CheckFailed("a failed conversion left model.safetensors behind")
            return msg.splitlines()[-1][:160]
        check("reject_" + name, fn)

    neg("missing_tensor", lambda s: s.pop("layers.1.attention.Wk_write.bias"),
        must=["missing", "layers.1.attention.Wk_write.bias"])
    neg("unexpected_tensor", lambda s: s.__setitem__("layers.0.attention.bogus.weight",
                                                     torch.zeros(2)),
        must=["unexpected", "layers.0.attention.bogus.weight"])
    neg("wrong_shape", lambda s: s.__setitem__("layers.1.attention.A_log", torch.zeros(3)),
        must=["layers.1.attention.A_log", "shape"])
    neg("integer_tensor", lambda s: s.__setitem__("norm.weight",
                                                  torch.ones(64, dtype=torch.int32)),
        must=["norm.weight", "dtype"])
    neg("tied_weight_differs", lambda s: s.__setitem__("output.tied_module.weight",
                                                       s["tok_embeddings.weight"] + 1),
        must=["output.tied_module.weight", "tok_embeddings.weight"])
    bad_model = dict(HYBRID_MODEL, mixer_kind="mamba")
    neg("unknown_config_field", params=params_json(bad_model), must=["mixer_kind"])
    # false turns a negated feature on: not the "off" that an unknown false key is dropped as.
    neg("unknown_negated_false_field", params=params_json(dict(HYBRID_MODEL, no_qk_norm=False)),
        must=["no_qk_norm"])
    bad_sdm = dict(HYBRID_MODEL, sdm_args=dict(HYBRID_MODEL["sdm_args"], read_act="GELU"))
    neg("unknown_activation", params=params_json(bad_sdm), must=["read_act", "GELU"])
    neg("vocab_mismatch", params=params_json(dict(HYBRID_MODEL, vocab_size=300)),
        must=["vocab_size", "300"])

    def missing_pth():
        d = os.path.join(work, "empty_ckpt")
        os.makedirs(d)
        return expect_fail(d, os.path.join(work, "out_empty"), ["consolidated.pth"])
    check("reject_missing_consolidated_pth", missing_pth)

    def bad_params():
        src = write_checkpoint(os.path.join(work, "badparams"), sd, {})
        with open(os.path.join(src, "consolidated", "params.json"), "w") as f:
            f.write("{not json")
        msg = expect_fail(src, os.path.join(work, "out_badparams"), ["params.json", "JSON"])
        with open(os.path.join(src, "consolidated", "params.json"), "w") as f:
            json.dump({"name": "x"}, f)
        msg2 = expect_fail(src, os.path.join(work, "out_badparams"), ["model"])
        return msg.splitlines()[-1][:100] + " | " + msg2.splitlines()[-1][:100]
    check("reject_bad_params_json", bad_params)

    # --- 5. The engine's loader names a tensor missing from a converted model. ---
    def loader_missing_tensor():
        d = os.path.join(work, "out_loader")
        shutil.copytree(out_untied, d)
        st = ref.load_safetensors(os.path.join(d, "model.safetensors"))
        victim = "layers.1.attention.Wq_read.weight"
        tensors = {k: a for k, (_, a) in st.items() if k != victim}
        ref.save_safetensors(os.path.join(d, "model.safetensors"), tensors)
        p = subprocess.run([args.sdm_cli, "logits", "--model", d, "--tokens", "1,2,3"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
        if p.returncode == 0:
            raise CheckFailed("sdm-cli accepted a model with a missing tensor")
        if victim not in p.stdout + p.stderr:
            raise CheckFailed(f"sdm-cli's error does not name {victim}: {p.stderr.strip()[:400]}")
        return (p.stderr.strip().splitlines() or [""])[-1][:160]
    check("engine_loader_names_missing_tensor", loader_missing_tensor)


def main(argv=None):
    ap = argparse.ArgumentParser(description="reference-checkpoint converter tests")
    ap.add_argument("sdm_model")
    ap.add_argument("sdm_cli")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    if not (os.path.isfile(args.sdm_cli) and os.access(args.sdm_cli, os.X_OK)):
        print(f"ERROR: {args.sdm_cli} is not an executable file")
        return 1
    torch.set_num_threads(1)
    results = Results()
    start = time.time()
    work = tempfile.mkdtemp(prefix="sdm-convert-test-")
    try:
        run_checks(args, work, results)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"({time.time() - start:.1f} s)")
    print(f"{results.passed} passed, {len(results.failed)} failed")
    if results.failed:
        print("failed: " + ", ".join(results.failed))
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
