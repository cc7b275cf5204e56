#!/usr/bin/env python3
"""Convert a reference (facebookresearch/sparse-delta-memory, Meta Lingua) checkpoint into an
sdmserve model directory.

usage: /usr/bin/python3 tools/convert_reference_checkpoint.py SRC OUT_DIR
           [--dtype keep|fp32|bf16] [--force] [--tokenizer bytes|sp] [--tokenizer-model FILE]
           [--allow-pickle]

SRC is one of
  * a consolidated checkpoint file (`consolidated.pth`), with `params.json` beside it or one
    directory up;
  * a directory holding `consolidated.pth` (+ `params.json`), e.g. `<step>/consolidated/`;
  * a checkpoint step directory holding `consolidated/consolidated.pth` (params.json in
    `consolidated/` or in the step directory).
A checkpoint still in the distributed (DCP) format must first be consolidated with the
reference's `lingua.checkpoint.consolidate_checkpoints(step_dir)`.

OUT_DIR receives
  * config.json (written last, after the old one is removed: a conversion interrupted part-way
    leaves no config, never one that does not belong to the weights): the params.json `model`
    section (every field the engine understands is kept,
    training-only fields included, so the config round-trips; null ones are dropped, below),
    with vocab_size taken from tok_embeddings when unset, and "tokenizer" built from params.json
    `data.tokenizer`;
  * model.safetensors: the state dict under the same tensor names, in the order the engine lists
    them; written to a temporary name, fsynced and renamed;
  * tokenizer.model: a copy of the SentencePiece model, for "sp" tokenizers.

State-dict handling: the dict may be nested under "model" (as the reference's checkpointing
saves it); wrapper components `_orig_mod` (torch.compile), `module` (DDP), `_fsdp_wrapped_module`
and `_checkpoint_wrapped_module` (FSDP1 / activation checkpointing) are stripped from names;
BatchNorm `num_batches_tracked` counters and RoPE tables (`freqs_cis`, non-persistent in the
reference) are dropped; with weight_tying the tied output weight (`output.tied_module.weight` or
`output.weight`) is dropped after checking it equals tok_embeddings. Any other missing,
unexpected or mis-shaped tensor is an error naming it.

dtype: `keep` writes bf16 tensors as BF16 and every other floating tensor as F32 (fp16 widens
exactly; fp64 is rounded to fp32); `fp32` / `bf16` convert everything (bf16: round to nearest
even). Non-floating tensors other than the dropped counters are an error.

Config keys whose value is null (the reference's "unset", so the default), known to the engine or
not, are dropped and reported: the engine takes null only for the fields documented "or null" (not,
say, for sdm_args or multiple_of) and an absent key for all, with the same defaults. Config keys
the engine does not know: a key whose value is false (a feature that is off; but not a negated
name such as no_bias or disable_norm, whose false turns a feature on), or whose name marks it as
training-only (logging, init, probing, checkpointing, kernel chunking, dropout), is dropped and
reported; any other unknown key is an error, because it may change what the model computes.

Needs torch (CPU) to read the .pth (Debian's python3-torch is enough); nothing else.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import shutil
import struct
import sys
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

try:
    import torch
except ImportError:  # pragma: no cover
    sys.stderr.write("error: this converter needs PyTorch to read consolidated.pth "
                     "(e.g. apt-get install python3-torch)\n")
    sys.exit(2)


class ConversionError(Exception):
    pass


# ---- What the engine's config parser accepts (engine/model_config.cc: ParseModelConfig) ----

ACCEPTED_MODEL_KEYS = {
    "dim", "n_layers", "head_dim", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of",
    "norm_eps", "rope_theta", "vocab_size", "weight_tying", "attn_at", "swa_at", "sdm_at",
    "swa_window", "swa_n_heads", "swa_n_kv_heads", "swa_head_dim", "attn_gate", "sdm_args",
    "init_base_std", "init_std_factor", "max_seqlen", "seed",
}
ACCEPTED_SDM_KEYS = {
    "dim", "num_heads", "slots_per_head", "num_writes", "num_reads", "read_act", "write_act",
    "read_act_scale", "write_act_scale", "normalize_readings", "norm_eps", "backprop_on_memory",
    "output_gate", "query_batchnorm", "key_weighted_decay", "update_rule", "memory_block_size",
    "dt_bias_init", "A_init_range", "snapshot_quant", "log_memory_access_stats",
    "log_memory_norms",
}
# Names that only matter for training (an unknown key matching one is dropped, and reported).
TRAINING_ONLY_KEY = re.compile(
    r"^(log_|init_|probe|compile|checkpoint|activation_checkpoint|snapshot_|use_(triton|cuda|"
    r"fused|kernel))|(_init|_init_range|block_size|chunk_size|dropout)$")
# A negated name ("no_bias", "disable_norm"): false then turns a feature on, so it is not dropped.
NEGATED_KEY = re.compile(r"^(no|not|disable|disabled|skip|without)_")
ACTIVATIONS = {"Softmax", "l2_normalize", "Identity", "Sigmoid", "ReLU"}

WRAPPER_COMPONENTS = {"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


# ---- Locating the inputs ----

def locate(src: str) -> Tuple[str, str]:
    """Returns (path of consolidated .pth, path of params.json)."""
    if not os.path.exists(src):
        raise ConversionError(f"{src} does not exist")
    if os.path.isfile(src):
        pth = src
    else:
        candidates = [os.path.join(src, "consolidated.pth"),
                      os.path.join(src, "consolidated", "consolidated.pth")]
        pth = next((c for c in candidates if os.path.isfile(c)), None)
        if pth is None:
            hint = ""
            if any(n.endswith(".distcp") for n in os.listdir(src)):
                hint = (" (this looks like a distributed checkpoint: consolidate it first with "
                        "lingua.checkpoint.consolidate_checkpoints)")
            raise ConversionError(f"no consolidated.pth in {src} or {src}/consolidated{hint}")
    here = os.path.dirname(os.path.abspath(pth))
    for d in (here, os.path.dirname(here)) + ((os.path.abspath(src),) if os.path.isdir(src) else ()):
        p = os.path.join(d, "params.json")
        if os.path.isfile(p):
            return pth, p
    raise ConversionError(f"no params.json next to {pth} or in its parent directory")


def load_params(path: str) -> dict:
    try:
        with open(path) as f:
            params = json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON: {e}")
    if not isinstance(params, dict):
        raise ConversionError(f"{path} must hold a JSON object (the training config)")
    if "model" not in params:
        raise ConversionError(f"{path} has no 'model' section (expected the reference's training "
                              f"config: {{\"model\": {{...}}, \"data\": {{\"tokenizer\": ...}}}})")
    if not isinstance(params["model"], dict):
        raise ConversionError(f"{path}: 'model' must be an object")
    return params


def filter_keys(section: dict, accepted: set, where: str, dropped: List[str]) -> dict:
    out = OrderedDict()
    for key, value in section.items():
        if value is None:
            # Unset: the default, which the engine gives an absent key (it takes null for only
            # some fields).
            dropped.append(f"{where}{key}={json.dumps(value)}")
        elif key in accepted:
            out[key] = value
        elif (value is False and not NEGATED_KEY.search(key)) or TRAINING_ONLY_KEY.search(key):
            dropped.append(f"{where}{key}={json.dumps(value)}")
        else:
            raise ConversionError(
                f"params.json {where}{key} = {json.dumps(value)} is not a field sdmserve knows and "
                f"may change what the model computes; remove it from params.json if it only "
                f"affects training")
    return out


def build_config(params: dict, args, dropped: List[str]) -> Tuple[dict, Optional[str]]:
    """Returns (config.json dict, SentencePiece model file to copy or None)."""
    model = filter_keys(params["model"], ACCEPTED_MODEL_KEYS, "model.", dropped)
    if isinstance(model.get("sdm_args"), dict):
        model["sdm_args"] = filter_keys(model["sdm_args"], ACCEPTED_SDM_KEYS, "model.sdm_args.",
                                        dropped)
    elif model.get("sdm_args") is not None:
        raise ConversionError("params.json model.sdm_args must be an object")
    for key in ("dim", "n_layers"):
        if not isinstance(model.get(key), int) or isinstance(model.get(key), bool):
            raise ConversionError(f"params.json model.{key} must be an integer, "
                                  f"got {json.dumps(model.get(key))}")

    # Tokenizer: --tokenizer / --tokenizer-model override params.json data.tokenizer.
    tok = (params.get("data") or {}).get("tokenizer") if isinstance(params.get("data"), dict) else None
    name = args.tokenizer or (tok or {}).get("name")
    if name is None:
        raise ConversionError("params.json has no data.tokenizer.name; pass --tokenizer bytes or "
                              "--tokenizer sp --tokenizer-model FILE")
    sp_file = None
    if name == "bytes":
        model["tokenizer"] = {"name": "bytes"}
    elif name in ("sp", "sentencepiece"):
        sp_file = args.tokenizer_model or (tok or {}).get("path")
        if not sp_file:
            raise ConversionError("SentencePiece tokenizer without a model file: pass "
                                  "--tokenizer-model FILE")
        if not os.path.isfile(sp_file):
            raise ConversionError(f"SentencePiece model file {sp_file} not found (pass "
                                  f"--tokenizer-model FILE)")
        model["tokenizer"] = {"name": "sp", "path": "tokenizer.model"}
    else:
        raise ConversionError(f"tokenizer '{name}' is not supported by sdmserve (bytes or sp)")
    return model, sp_file


# ---- Geometry: the tensors a config needs (the reference's LMTransformer state dict) ----

def _layer_list(spec, n_layers, name):
    if spec is None:
        return []
    if isinstance(spec, bool):
        raise ConversionError(f"model.{name}: a boolean is not a layer spec")
    if isinstance(spec, str):
        s = spec.strip()
        if not s:
            return []
        if s.lower() == "all":
            return list(range(n_layers))
        try:
            return [int(p) for p in s.split(",")]
        except ValueError:
            raise ConversionError(f"model.{name}: invalid layer spec {spec!r}")
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, list):
        return [int(v) for v in spec]
    raise ConversionError(f"model.{name}: invalid layer spec {spec!r}")


def expected_tensors(cfg: dict) -> "OrderedDict[str, Tuple[int, ...]]":
    dim, n_layers, vocab = cfg["dim"], cfg["n_layers"], cfg["vocab_size"]
    types = [None] * n_layers
    for t in ("attn", "swa", "sdm"):
        for i in _layer_list(cfg.get(t + "_at"), n_layers, t + "_at"):
            if not 0 <= i < n_layers:
                raise ConversionError(f"model.{t}_at: layer {i} out of range for n_layers={n_layers}")
            if types[i] is not None:
                raise ConversionError(f"layer {i} appears in both {types[i]}_at and {t}_at")
            types[i] = t
    if any(t is None for t in types):
        raise ConversionError(f"layers {[i for i, t in enumerate(types) if t is None]} are in none "
                              f"of attn_at/swa_at/sdm_at")
    mult = cfg.get("multiple_of", 256)
    hidden = int(2 * (4 * dim) / 3)
    if cfg.get("ffn_dim_multiplier") is not None:
        hidden = int(cfg["ffn_dim_multiplier"] * hidden)
    hidden = mult * ((hidden + mult - 1) // mult)
    n_heads, head_dim, n_kv = cfg.get("n_heads"), cfg.get("head_dim"), cfg.get("n_kv_heads")
    sdm = cfg.get("sdm_args") or {}

    def sdm_get(key, default):
        v = sdm.get(key)
        return default if v is None else v

    out = OrderedDict()
    out["tok_embeddings.weight"] = (vocab, dim)
    for i, t in enumerate(types):
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = (dim,)
        a = p + "attention."
        if t == "sdm":
            H = sdm_get("num_heads", 1)
            sph = sdm_get("slots_per_head", 10000)
            s = int(round(math.sqrt(sph)))
            if s * s != sph:
                raise ConversionError(f"sdm_args.slots_per_head={sph} is not a perfect square")
            if dim % H:
                raise ConversionError(f"dim={dim} is not divisible by sdm_args.num_heads={H}")
            key = H * 2 * s
            for name, rows in (("Wq_read", key), ("Wk_write", key), ("Wv_write", dim),
                               ("a_proj", H), ("b_proj", H)):
                out[a + name + ".weight"] = (rows, dim)
                out[a + name + ".bias"] = (rows,)
            out[a + "A_log"] = (H,)
            out[a + "dt_bias"] = (H,)
            out[a + "Wo.weight"] = (dim, dim)
            out[a + "Wo.bias"] = (dim,)
            if sdm_get("output_gate", False):
                out[a + "Wog.weight"] = (dim, dim)
                out[a + "Wog.bias"] = (dim,)
            if sdm_get("backprop_on_memory", True):
                out[a + "memory"] = (H * sph, dim // H)
            if sdm_get("normalize_readings", False):
                out[a + "readings_norm.weight"] = (dim // H,)
                out[a + "readings_norm.bias"] = (dim // H,)
            if sdm_get("query_batchnorm", False):
                for bn in ("query_bn", "key_bn"):
                    for leaf in ("weight", "bias", "running_mean", "running_var"):
                        out[a + bn + "." + leaf] = (key,)
        else:
            if n_heads is None and head_dim is None:
                raise ConversionError(f"layer {i} ({t}) needs model.n_heads or model.head_dim")
            if t == "attn":
                hd = head_dim if head_dim is not None else dim // n_heads
                nh = n_heads if n_heads is not None else dim // head_dim
                nkv = n_kv if n_kv is not None else nh
            else:
                nh = cfg["swa_n_heads"] if cfg.get("swa_n_heads") is not None else (
                    n_heads or dim // head_dim)
                if cfg.get("swa_n_kv_heads") is not None:
                    nkv = cfg["swa_n_kv_heads"]
                elif cfg.get("swa_n_heads") is not None:
                    nkv = nh
                else:
                    nkv = n_kv or nh
                hd = cfg["swa_head_dim"] if cfg.get("swa_head_dim") is not None else dim // nh
            out[a + "wq.weight"] = (nh * hd, dim)
            out[a + "wk.weight"] = (nkv * hd, dim)
            out[a + "wv.weight"] = (nkv * hd, dim)
            out[a + "wo.weight"] = (dim, nh * hd)
            if cfg.get("attn_gate"):
                out[a + "w_gate.weight"] = (nh * hd, dim)
        out[p + "ffn_norm.weight"] = (dim,)
        out[p + "feed_forward.w1.weight"] = (hidden, dim)
        out[p + "feed_forward.w3.weight"] = (hidden, dim)
        out[p + "feed_forward.w2.weight"] = (dim, hidden)
    out["norm.weight"] = (dim,)
    if not cfg.get("weight_tying"):
        out["output.weight"] = (vocab, dim)
    return out


def check_config_values(cfg: dict) -> None:
    sdm = cfg.get("sdm_args") or {}
    for key in ("read_act", "write_act"):
        if sdm.get(key) is not None and sdm[key] not in ACTIVATIONS:
            raise ConversionError(f"sdm_args.{key}={sdm[key]!r} is not supported "
                                  f"({', '.join(sorted(ACTIVATIONS))})")
    if cfg["tokenizer"]["name"] == "bytes" and cfg["vocab_size"] < 258:
        raise ConversionError(f"the bytes tokenizer needs vocab_size >= 258, got {cfg['vocab_size']}")


# ---- The state dict ----

def load_state_dict(pth: str, allow_pickle: bool):
    kwargs = {"map_location": "cpu"}
    params = inspect.signature(torch.load).parameters
    if "weights_only" in params:
        kwargs["weights_only"] = not allow_pickle
    elif not allow_pickle:
        raise ConversionError("this torch cannot load with weights_only=True; pass --allow-pickle "
                              "only if you trust the checkpoint")
    if "mmap" in params:
        kwargs["mmap"] = True
    try:
        obj = torch.load(pth, **kwargs)
    except Exception as e:  # torch raises many types here (pickle, zip, runtime)
        raise ConversionError(f"cannot read {pth}: {type(e).__name__}: {e}"
                              + ("" if allow_pickle else
                                 " (if it holds non-tensor Python objects and you trust it, "
                                 "retry with --allow-pickle)"))
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not obj:
        raise ConversionError(f"{pth} does not hold a state dict (or {{'model': state_dict}})")
    # A flattened {"model": {...}} (every key "model.<name>") is accepted too.
    flattened = all(isinstance(k, str) and k.startswith("model.") for k in obj)
    sd = OrderedDict()
    for key, value in obj.items():
        if not isinstance(key, str):
            raise ConversionError(f"{pth}: state-dict key {key!r} is not a string")
        if not torch.is_tensor(value):
            raise ConversionError(f"{pth}: entry '{key}' is not a tensor ({type(value).__name__}); "
                                  f"expected {{'model': state_dict}}")
        parts = key.split(".")[1:] if flattened else key.split(".")
        parts = [c for c in parts if c not in WRAPPER_COMPONENTS]
        name = ".".join(parts)
        if name in sd:
            raise ConversionError(f"{pth}: two entries map to '{name}' after stripping wrapper "
                                  f"prefixes")
        sd[name] = value
    return sd


def convert(args) -> dict:
    pth, params_path = locate(args.src)
    params = load_params(params_path)
    dropped_keys: List[str] = []
    cfg, sp_file = build_config(params, args, dropped_keys)

    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConversionError(f"{out} exists and is not a directory")
    if os.path.isdir(out) and not args.force:
        existing = [n for n in ("config.json", "model.safetensors", "tokenizer.model")
                    if os.path.exists(os.path.join(out, n))]
        if existing:
            raise ConversionError(f"{out} already holds {', '.join(existing)} (use --force)")

    sd = load_state_dict(pth, args.allow_pickle)
    if "tok_embeddings.weight" not in sd:
        raise ConversionError("missing tensor tok_embeddings.weight")
    emb = sd["tok_embeddings.weight"]
    if emb.dim() != 2:
        raise ConversionError(f"tok_embeddings.weight has shape {list(emb.shape)}, expected 2-D")
    vocab = cfg.get("vocab_size")
    if vocab is None or (isinstance(vocab, int) and vocab <= 0):
        cfg["vocab_size"] = int(emb.shape[0])
    elif vocab != emb.shape[0]:
        raise ConversionError(f"params.json vocab_size={vocab} but tok_embeddings.weight has "
                              f"{emb.shape[0]} rows")
    check_config_values(cfg)

    expected = expected_tensors(cfg)
    dropped_tensors = []
    for name in list(sd):
        if name.endswith(".num_batches_tracked") or name.endswith("freqs_cis"):
            dropped_tensors.append(name)
            del sd[name]
    for tied in ("output.tied_module.weight", "output.weight"):
        if tied in sd and cfg.get("weight_tying"):
            t = sd.pop(tied)
            if t.shape != emb.shape or not torch.equal(t.to(emb.dtype), emb):
                raise ConversionError(f"weight_tying is on but {tied} differs from "
                                      f"tok_embeddings.weight")
            dropped_tensors.append(f"{tied} (tied to tok_embeddings.weight)")
    missing = [n for n in expected if n not in sd]
    if missing:
        raise ConversionError("missing tensor" + ("s" if len(missing) > 1 else "") + ": " +
                              ", ".join(missing))
    unexpected = [n for n in sd if n not in expected]
    if unexpected:
        raise ConversionError("unexpected tensor" + ("s" if len(unexpected) > 1 else "") +
                              " (not part of a model with this config): " + ", ".join(unexpected))
    for name, shape in expected.items():
        if tuple(sd[name].shape) != tuple(shape):
            raise ConversionError(f"tensor {name} has shape {list(sd[name].shape)}, the config "
                                  f"needs {list(shape)}")

    # Output dtypes.
    plan = OrderedDict()
    for name in expected:
        t = sd[name]
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ConversionError(f"tensor {name} has unexpected dtype {t.dtype} "
                                  f"(expected a floating type: bf16, fp16, fp32 or fp64)")
        if args.dtype == "fp32":
            plan[name] = "F32"
        elif args.dtype == "bf16":
            plan[name] = "BF16"
        else:
            plan[name] = "BF16" if t.dtype == torch.bfloat16 else "F32"

    os.makedirs(out, exist_ok=True)
    # config.json is written last: it is what makes the directory a model. A re-conversion
    # (--force) removes the old one first, so that one interrupted part-way leaves files without
    # a config (refused at load, naming config.json) rather than new weights or a new tokenizer
    # under the old config.
    config_path = os.path.join(out, "config.json")
    if os.path.exists(config_path):
        os.unlink(config_path)
        fsync_dir(out)
    nbytes = write_safetensors(os.path.join(out, "model.safetensors"), sd, plan)
    if sp_file:
        tmp = os.path.join(out, "tokenizer.model.tmp")
        shutil.copyfile(sp_file, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out, "tokenizer.model"))
    write_text_atomic(config_path, json.dumps(cfg, indent=2) + "\n")
    fsync_dir(out)  # the renames, durable before the summary says the model is there

    n_params = sum(int(sd[n].numel()) for n in expected)
    m0 = sum(int(sd[n].numel()) for n in expected if n.endswith(".attention.memory"))
    summary = {
        "source": pth, "params": params_path, "out": out, "tensors": len(expected),
        "parameters": n_params, "parameters_without_m0": n_params - m0,
        "bytes_written": nbytes,
        "dtypes": {d: sum(1 for v in plan.values() if v == d) for d in sorted(set(plan.values()))},
        "vocab_size": cfg["vocab_size"], "tokenizer": cfg["tokenizer"]["name"],
        "dropped_tensors": dropped_tensors, "dropped_config_keys": dropped_keys,
    }
    return summary


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_safetensors(path: str, sd: Dict[str, "torch.Tensor"], plan: Dict[str, str]) -> int:
    if sys.byteorder != "little":
        raise ConversionError("this converter writes safetensors on little-endian hosts only")
    header = OrderedDict()
    offset = 0
    for name, dt in plan.items():
        n = int(sd[name].numel()) * (2 if dt == "BF16" else 4)
        header[name] = {"dtype": dt, "shape": list(sd[name].shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name, dt in plan.items():
                t = sd[name].detach().contiguous()
                if dt == "BF16":
                    data = t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
                else:
                    data = t.to(torch.float32).numpy().tobytes()
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return 8 + len(text) + offset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Convert a reference SDM checkpoint (consolidated.pth + params.json) into an "
                    "sdmserve model directory (config.json + model.safetensors).")
    ap.add_argument("src", help="consolidated.pth, its directory, or the checkpoint step directory")
    ap.add_argument("out", help="output model directory")
    ap.add_argument("--dtype", choices=("keep", "fp32", "bf16"), default="keep",
                    help="keep: bf16 stays bf16, everything else fp32 (default)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing model directory")
    ap.add_argument("--tokenizer", choices=("bytes", "sp"),
                    help="override params.json data.tokenizer.name")
    ap.add_argument("--tokenizer-model", help="SentencePiece model file (overrides "
                                              "params.json data.tokenizer.path)")
    ap.add_argument("--allow-pickle", action="store_true",
                    help="load the .pth with full pickle (only for trusted files)")
    args = ap.parse_args(argv)
    try:
        s = convert(args)
    except ConversionError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    print(f"converted {s['source']}")
    print(f"  config:      {s['params']} -> {os.path.join(s['out'], 'config.json')} "
          f"(vocab_size {s['vocab_size']}, tokenizer {s['tokenizer']})")
    print(f"  tensors:     {s['tensors']} ({', '.join(f'{k}: {v}' for k, v in s['dtypes'].items())})")
    print(f"  parameters:  {s['parameters']:,} ({s['parameters_without_m0']:,} without M0)")
    print(f"  written:     {s['bytes_written']:,} bytes -> "
          f"{os.path.join(s['out'], 'model.safetensors')}")
    for d in s["dropped_tensors"]:
        print(f"  dropped tensor: {d}")
    for d in s["dropped_config_keys"]:
        print(f"  dropped config key: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
