#!/usr/bin/env python3
"""Independent float64 reference of the SDM hybrid language model (docs/model-spec.md).

This file is the project's oracle for whole-model logits. It is written from the model
specification (docs/model-spec.md), not from the C++ engine, and shares no code with it:
the only things the two have in common are the file formats (config.json, safetensors) and the
tensor names. Everything is computed in float64 with the most direct formulation available:

  * attention over the whole sequence with explicit [T, T] causal / sliding-window masks;
  * SDM token by token: gates, (eval-mode) BatchNorm of the scores, product-key addressing,
    the delta-rule write, the read after the write, readings LayerNorm, output gate, Wo.

Usage as a library:
    model = ReferenceModel.load("model_dir")
    logits = model.logits_all([1, 2, 3])      # numpy float64 [T, vocab]
Usage as a script:
    /usr/bin/python3 sdm_reference_model.py MODEL_DIR --tokens 1,2,3 [--all] [--addressing brute]
prints {"tokens": [...], "logits": [[...], ...]} like `sdm-cli logits`.

Needs numpy and torch (CPU) only; the safetensors file is read with struct/numpy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# safetensors (read and write; no third-party package)
# ----------------------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": (np.float64, 8),
    "F32": (np.float32, 4),
    "F16": (np.float16, 2),
    "BF16": (None, 2),  # decoded by hand: the top 16 bits of an IEEE float32
}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (NaN kept a NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def read_safetensors_header(path: str) -> Tuple[dict, int]:
    """Returns (header dict without __metadata__, byte offset of the data region)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise ValueError(f"{path}: implausible safetensors header length {n}")
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return header, 8 + n


def load_safetensors(path: str) -> Dict[str, Tuple[str, np.ndarray]]:
    """name -> (dtype string, array). BF16 tensors come back widened (exactly) to float32."""
    header, base = read_safetensors_header(path)
    size = os.path.getsize(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            dtype = info["dtype"]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(v) for v in info["data_offsets"])
            if dtype not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
            np_dtype, width = _ST_DTYPES[dtype]
            count = int(np.prod(shape)) if shape else 1
            if end - begin != count * width or base + end > size:
                raise ValueError(f"{path}: tensor '{name}' has inconsistent data_offsets")
            f.seek(base + begin)
            buf = f.read(end - begin)
            if dtype == "BF16":
                arr = bf16_bits_to_f32(np.frombuffer(buf, dtype="<u2")).reshape(shape)
            else:
                arr = np.frombuffer(buf, dtype=np.dtype(np_dtype).newbyteorder("<"))
                arr = arr.astype(np_dtype).reshape(shape)
            out[name] = (dtype, arr)
    return out


def save_safetensors(path: str, tensors: Dict[str, np.ndarray], dtype: str = "F32",
                     dtypes: Optional[Dict[str, str]] = None, metadata: Optional[dict] = None
                     ) -> int:
    """Writes tensors (name -> float array) as F32 or BF16 (per-tensor override in `dtypes`).

    Tensors are laid out contiguously in the given order, without holes. Written to a temporary
    name and renamed, so a reader never sees a half-written file. Returns the file size.
    """
    header = {}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        dt = (dtypes or {}).get(name, dtype)
        a = np.asarray(arr)
        if dt == "F32":
            blob = np.ascontiguousarray(a, dtype="<f4").tobytes()
        elif dt == "BF16":
            blob = f32_to_bf16_bits(a.astype(np.float32)).astype("<u2").tobytes()
        else:
            raise ValueError(f"cannot write dtype {dt}")
        header[name] = {"dtype": dt, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)  # align the data region to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(text) + offset


# ----------------------------------------------------------------------------------------------
# Config (the reference's `model` section + "tokenizer"), resolved independently of the C++ code
# ----------------------------------------------------------------------------------------------


def _layer_set(spec, n_layers: int, name: str) -> List[int]:
    if spec is None:
        return []
    if isinstance(spec, bool):
        raise ValueError(f"{name}: a boolean is not a layer spec")
    if isinstance(spec, str):
        s = spec.strip()
        if not s:
            return []
        if s.lower() == "all":
            return list(range(n_layers))
        idx = [int(p.strip()) for p in s.split(",")]
    elif isinstance(spec, (int, float)):
        idx = [int(spec)]
    else:
        idx = [int(v) for v in spec]
    for i in idx:
        if not 0 <= i < n_layers:
            raise ValueError(f"{name}: layer {i} out of range")
    if len(set(idx)) != len(idx):
        raise ValueError(f"{name}: duplicate layer index")
    return sorted(idx)


@dataclass
class AttnGeom:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: Optional[int]  # None = full causal attention


@dataclass
class SdmGeom:
    heads: int  # H
    side: int  # s
    head_width: int  # hd = dim / H


@dataclass
class RefConfig:
    raw: dict
    dim: int
    n_layers: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    weight_tying: bool
    attn_gate: bool
    ffn_hidden: int
    layer_types: List[str]
    attn: Dict[int, AttnGeom] = field(default_factory=dict)
    sdm: Optional[SdmGeom] = None
    sdm_args: dict = field(default_factory=dict)

    @staticmethod
    def from_dict(c: dict) -> "RefConfig":
        dim = int(c.get("dim", 512))
        n_layers = int(c.get("n_layers", 8))
        sets = {t: _layer_set(c.get(t + "_at"), n_layers, t + "_at") for t in ("attn", "swa", "sdm")}
        types = [None] * n_layers
        for t, idx in sets.items():
            for i in idx:
                if types[i] is not None:
                    raise ValueError(f"layer {i} has two types")
                types[i] = t
        if any(t is None for t in types):
            raise ValueError("attn_at/swa_at/sdm_at do not cover every layer")

        # FFN hidden size: SwiGLU with h = int(2 * 4 * dim / 3), optionally scaled, rounded up.
        multiple_of = int(c.get("multiple_of", 256))
        hidden = int(2 * (4 * dim) / 3)
        if c.get("ffn_dim_multiplier") is not None:
            hidden = int(float(c["ffn_dim_multiplier"]) * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)

        cfg = RefConfig(
            raw=c, dim=dim, n_layers=n_layers, vocab_size=int(c.get("vocab_size", -1)),
            norm_eps=float(c.get("norm_eps", 1e-5)), rope_theta=float(c.get("rope_theta", 10000.0)),
            weight_tying=bool(c.get("weight_tying", False)), attn_gate=bool(c.get("attn_gate", False)),
            ffn_hidden=hidden, layer_types=types)

        n_heads, head_dim, n_kv = c.get("n_heads"), c.get("head_dim"), c.get("n_kv_heads")
        for i, t in enumerate(types):
            if t == "attn":
                hd = head_dim if head_dim is not None else dim // n_heads
                nh = n_heads if n_heads is not None else dim // head_dim
                nkv = n_kv if n_kv is not None else nh
                cfg.attn[i] = AttnGeom(nh, nkv, hd, None)
            elif t == "swa":
                # SWA heads fall back to the full-attention values, except that an explicit
                # swa_n_heads makes swa_n_kv_heads default to itself, and swa_head_dim defaults
                # to dim / (SWA heads).
                if c.get("swa_n_heads") is not None:
                    nh = int(c["swa_n_heads"])
                else:
                    nh = n_heads if n_heads else dim // head_dim
                if c.get("swa_n_kv_heads") is not None:
                    nkv = int(c["swa_n_kv_heads"])
                elif c.get("swa_n_heads") is not None:
                    nkv = nh
                else:
                    nkv = n_kv if n_kv else nh
                hd = int(c["swa_head_dim"]) if c.get("swa_head_dim") is not None else dim // nh
                cfg.attn[i] = AttnGeom(nh, nkv, hd, int(c["swa_window"]))
        if "sdm" in types:
            a = dict(c.get("sdm_args") or {})
            cfg.sdm_args = a
            H = int(a.get("num_heads", 1))
            sph = int(a.get("slots_per_head", 10000))
            s = int(round(math.sqrt(sph)))
            if s * s != sph:
                raise ValueError("slots_per_head must be a perfect square")
            cfg.sdm = SdmGeom(H, s, dim // H)
        return cfg

    def sdm_arg(self, key, default):
        v = self.sdm_args.get(key, default)
        return default if v is None else v


def expected_tensor_shapes(cfg: RefConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor the reference's LMTransformer state dict holds for this config (persistent
    buffers included, BatchNorm's num_batches_tracked and the tied output excluded)."""
    d = cfg.dim
    out = {"tok_embeddings.weight": (cfg.vocab_size, d)}
    for i, t in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = (d,)
        if t == "sdm":
            g = cfg.sdm
            key = g.heads * 2 * g.side
            a = p + "attention."
            for name, rows in (("Wq_read", key), ("Wk_write", key), ("Wv_write", d),
                               ("a_proj", g.heads), ("b_proj", g.heads), ("Wo", d)):
                out[a + name + ".weight"] = (rows, d)
                out[a + name + ".bias"] = (rows,)
            out[a + "A_log"] = (g.heads,)
            out[a + "dt_bias"] = (g.heads,)
            if cfg.sdm_arg("output_gate", False):
                out[a + "Wog.weight"] = (d, d)
                out[a + "Wog.bias"] = (d,)
            if cfg.sdm_arg("backprop_on_memory", True):
                out[a + "memory"] = (g.heads * g.side * g.side, g.head_width)
            if cfg.sdm_arg("normalize_readings", False):
                out[a + "readings_norm.weight"] = (g.head_width,)
                out[a + "readings_norm.bias"] = (g.head_width,)
            if cfg.sdm_arg("query_batchnorm", False):
                for bn in ("query_bn", "key_bn"):
                    for s in ("weight", "bias", "running_mean", "running_var"):
                        out[a + bn + "." + s] = (key,)
        else:
            g = cfg.attn[i]
            a = p + "attention."
            out[a + "wq.weight"] = (g.n_heads * g.head_dim, d)
            out[a + "wk.weight"] = (g.n_kv_heads * g.head_dim, d)
            out[a + "wv.weight"] = (g.n_kv_heads * g.head_dim, d)
            out[a + "wo.weight"] = (d, g.n_heads * g.head_dim)
            if cfg.attn_gate:
                out[a + "w_gate.weight"] = (g.n_heads * g.head_dim, d)
        out[p + "ffn_norm.weight"] = (d,)
        out[p + "feed_forward.w1.weight"] = (cfg.ffn_hidden, d)
        out[p + "feed_forward.w3.weight"] = (cfg.ffn_hidden, d)
        out[p + "feed_forward.w2.weight"] = (d, cfg.ffn_hidden)
    out["norm.weight"] = (d,)
    if not cfg.weight_tying:
        out["output.weight"] = (cfg.vocab_size, d)
    return out


# ----------------------------------------------------------------------------------------------
# Building blocks (float64)
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)  # biased, as nn.LayerNorm
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [T, heads, hd]. Rotates the adjacent pairs (2i, 2i+1) of position p by
    p * theta^(-2i/hd)."""
    T, _, hd = x.shape
    i = torch.arange(hd // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def attention(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, g: AttnGeom, theta: float,
              attn_gate: bool) -> torch.Tensor:
    T = x.shape[0]
    q = (x @ w[p + "wq.weight"].T).view(T, g.n_heads, g.head_dim)
    k = (x @ w[p + "wk.weight"].T).view(T, g.n_kv_heads, g.head_dim)
    v = (x @ w[p + "wv.weight"].T).view(T, g.n_kv_heads, g.head_dim)
    q, k = rope(q, theta), rope(k, theta)
    group = g.n_heads // g.n_kv_heads
    pos = torch.arange(T)
    delta = pos[:, None] - pos[None, :]  # i - j
    allowed = delta >= 0
    if g.window is not None:
        allowed &= delta < g.window
    out = torch.empty(T, g.n_heads, g.head_dim, dtype=torch.float64)
    for h in range(g.n_heads):
        kv = h // group  # query head h shares kv head h // (n_heads / n_kv_heads)
        scores = (q[:, h, :] @ k[:, kv, :].T) / math.sqrt(g.head_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h, :] = torch.softmax(scores, dim=-1) @ v[:, kv, :]
    out = out.reshape(T, g.n_heads * g.head_dim)
    if attn_gate:
        out = torch.sigmoid(x @ w[p + "w_gate.weight"].T) * out
    return out @ w[p + "wo.weight"].T


def feed_forward(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str) -> torch.Tensor:
    a = x @ w[p + "w1.weight"].T
    b = x @ w[p + "w3.weight"].T
    return (torch.nn.functional.silu(a) * b) @ w[p + "w2.weight"].T


# ---- SDM addressing ----


@dataclass
class AddressStats:
    """Smallest gap seen between the K-th and the (K+1)-th largest pair sum. A gap near the
    engine's rounding error means fp32 and float64 may legitimately pick different slots."""
    min_gap: float = math.inf

    def note(self, gap: float) -> None:
        self.min_gap = min(self.min_gap, gap)


def address_product_keys(ua: torch.Tensor, ub: torch.Tensor, K: int
                         ) -> Tuple[List[int], List[float]]:
    """Two-stage product-key selection as the spec states it: the top min(K, s) of each half,
    their pairwise sums, the top min(K, kk^2) of those; slot = a*s + b; sorted by slot.
    Returns (slots, raw scores) before the activation."""
    s = ua.shape[0]
    kk = min(K, s)
    va, ia = torch.topk(ua, kk)
    vb, ib = torch.topk(ub, kk)
    sums = (va[:, None] + vb[None, :]).reshape(-1)
    kf = min(K, kk * kk)
    vals, flat = torch.topk(sums, kf)
    slots = [int(ia[f // kk]) * s + int(ib[f % kk]) for f in flat.tolist()]
    order = sorted(range(kf), key=lambda j: slots[j])
    return [slots[j] for j in order], [float(vals[j]) for j in order]


def address_brute_force(ua: torch.Tensor, ub: torch.Tensor, K: int,
                        stats: Optional[AddressStats] = None) -> Tuple[List[int], List[float]]:
    """Exact top-min(K, s^2) over all s^2 sums ua[a] + ub[b] (ties toward the lower slot index),
    slot = a*s + b, sorted by slot.

    This equals the two-stage product-key selection above: if a pair (a, b) is among the K best
    sums, then `a` is among the K best of half A (otherwise K rows a' with ua[a'] > ua[a] would
    give K sums ua[a'] + ub[b] that beat it), and likewise for b; so restricting each half to its
    top min(K, s) loses no winner, and the second stage is then the same exact top-K."""
    s = ua.shape[0]
    sums = (ua[:, None] + ub[None, :]).reshape(-1).tolist()
    order = sorted(range(s * s), key=lambda slot: (-sums[slot], slot))
    kf = min(K, s * s)
    if stats is not None and kf < s * s:
        stats.note(sums[order[kf - 1]] - sums[order[kf]])
    chosen = sorted(order[:kf])
    return chosen, [sums[j] for j in chosen]


def activation(name: str, x: torch.Tensor, scale: float) -> torch.Tensor:
    """Applied to the chosen scores (in slot order). The scale only enters Softmax, as in the
    reference's ScaledSoftmax; l2_normalize divides by (norm + 1e-12)."""
    if name == "Softmax":
        return torch.softmax(scale * x, dim=-1)
    if name == "l2_normalize":
        return x / (torch.linalg.norm(x) + 1e-12)
    if name == "Identity":
        return x
    if name == "Sigmoid":
        return torch.sigmoid(x)
    if name == "ReLU":
        return torch.relu(x)
    raise ValueError(f"unknown activation {name}")


def delta_write(rows: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor, beta, v: torch.Tensor,
                rule: str = "shared_residual") -> torch.Tensor:
    """New values of the K written rows [K, hd] given their old values `rows`, the write weights
    k [K], the per-slot decay alpha [K], the input gate beta and the value v [hd].

    shared_residual (the reference, default): Mt = alpha*M; vhat = sum_i k_i Mt[i];
        M[i] = Mt[i] + k_i * beta * (v - vhat).
    slot_residual (the paper's printed Eq. 4, opt-in): M[i] = Mt[i] + beta * k_i * (v - Mt[i]).
    """
    mt = alpha[:, None] * rows
    if rule == "shared_residual":
        vhat = (k[:, None] * mt).sum(0)  # one prediction shared by all written slots
        return mt + k[:, None] * beta * (v - vhat)[None, :]
    if rule == "slot_residual":
        return mt + beta * k[:, None] * (v[None, :] - mt)
    raise ValueError(f"unknown update_rule {rule}")


def sdm_layer(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: RefConfig,
              addressing: str, stats: Optional[AddressStats]) -> torch.Tensor:
    """x: [T, dim] (already attention_norm'ed). Runs the recurrence from M0, token by token."""
    T, d = x.shape
    g = cfg.sdm
    H, s, hd = g.heads, g.side, g.head_width
    arg = cfg.sdm_arg
    W, R = int(arg("num_writes", 1)), int(arg("num_reads", 1))
    write_act, read_act = arg("write_act", "Softmax"), arg("read_act", "Softmax")
    write_scale, read_scale = float(arg("write_act_scale", 1.0)), float(arg("read_act_scale", 1.0))
    kwd = bool(arg("key_weighted_decay", False))
    rule = arg("update_rule", "shared_residual")
    if rule not in ("shared_residual", "slot_residual"):
        raise ValueError(f"unknown update_rule {rule}")

    def lin(name, inp):
        return inp @ w[p + name + ".weight"].T + w[p + name + ".bias"]

    # Per-token projections for the whole sequence (each depends only on its own token).
    a = lin("a_proj", x)  # [T, H]
    gate = -torch.exp(w[p + "A_log"]) * torch.nn.functional.softplus(a + w[p + "dt_bias"])
    beta = torch.sigmoid(lin("b_proj", x))  # [T, H]
    v = lin("Wv_write", x).view(T, H, hd)
    u = lin("Wk_write", x)  # [T, H*2s]
    r = lin("Wq_read", x)
    if arg("query_batchnorm", False):
        def bn(name, z):  # eval-mode BatchNorm1d, eps 1e-5
            return ((z - w[p + name + ".running_mean"]) /
                    torch.sqrt(w[p + name + ".running_var"] + 1e-5) * w[p + name + ".weight"]
                    + w[p + name + ".bias"])
        u, r = bn("key_bn", u), bn("query_bn", r)

    if arg("backprop_on_memory", True):
        M = w[p + "memory"].clone().view(H, s * s, hd)
    else:
        M = torch.zeros(H, s * s, hd, dtype=torch.float64)

    def address(scores, K):
        ua, ub = scores[:s], scores[s:2 * s]  # half A, then half B
        if addressing == "brute":
            return address_brute_force(ua, ub, K, stats)
        if stats is not None:
            address_brute_force(ua, ub, K, stats)  # only to record the boundary gap
        return address_product_keys(ua, ub, K)

    readings = torch.empty(T, H, hd, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            cols = slice(h * 2 * s, (h + 1) * 2 * s)
            widx, wraw = address(u[t, cols], W)
            ridx, rraw = address(r[t, cols], R)
            k = activation(write_act, torch.tensor(wraw, dtype=torch.float64), write_scale)
            q = activation(read_act, torch.tensor(rraw, dtype=torch.float64), read_scale)
            # Write: decay the written rows, then the delta rule on the write set only.
            if kwd:
                alpha = torch.exp(gate[t, h] * k)  # per written slot
            else:
                alpha = torch.exp(gate[t, h]).expand(len(widx))
            M[h, widx, :] = delta_write(M[h, widx, :], k, alpha, beta[t, h], v[t, h], rule)
            # Read after the write.
            readings[t, h] = (q[:, None] * M[h, ridx, :]).sum(0)

    if arg("normalize_readings", False):
        readings = layer_norm(readings, w[p + "readings_norm.weight"], w[p + "readings_norm.bias"],
                              float(arg("norm_eps", 1e-6)))
    y = readings.reshape(T, d)
    if arg("output_gate", False):
        y = torch.sigmoid(lin("Wog", x)) * y
    return lin("Wo", y)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class ReferenceModel:
    def __init__(self, config: dict, weights: Dict[str, np.ndarray]):
        self.config = RefConfig.from_dict(config)
        expected = expected_tensor_shapes(self.config)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ValueError("missing tensors: " + ", ".join(missing))
        extra = sorted(set(weights) - set(expected))
        if extra:
            raise ValueError("unexpected tensors: " + ", ".join(extra))
        for name, shape in expected.items():
            if tuple(weights[name].shape) != tuple(shape):
                raise ValueError(f"tensor {name}: shape {list(weights[name].shape)}, "
                                 f"expected {list(shape)}")
        self.w = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in weights.items()}
        self.stats = AddressStats()

    @staticmethod
    def load(model_dir: str) -> "ReferenceModel":
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        tensors = load_safetensors(os.path.join(model_dir, "model.safetensors"))
        return ReferenceModel(config, {k: a for k, (_, a) in tensors.items()})

    def logits_all(self, tokens: Sequence[int], addressing: str = "product") -> np.ndarray:
        """Logits for every position: float64 [T, vocab]."""
        cfg, w = self.config, self.w
        ids = torch.tensor(list(tokens), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("empty token sequence")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError("token id out of range")
        h = w["tok_embeddings.weight"][ids]
        for i, t in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            xn = rms_norm(h, w[p + "attention_norm.weight"], cfg.norm_eps)
            if t == "sdm":
                mix = sdm_layer(xn, w, p + "attention.", cfg, addressing, self.stats)
            else:
                mix = attention(xn, w, p + "attention.", cfg.attn[i], cfg.rope_theta,
                                cfg.attn_gate)
            h = h + mix
            h = h + feed_forward(rms_norm(h, w[p + "ffn_norm.weight"], cfg.norm_eps), w,
                                 p + "feed_forward.")
        out_w = w["tok_embeddings.weight"] if cfg.weight_tying else w["output.weight"]
        return (rms_norm(h, w["norm.weight"], cfg.norm_eps) @ out_w.T).numpy()

    def logits_last(self, tokens: Sequence[int], addressing: str = "product") -> np.ndarray:
        return self.logits_all(tokens, addressing)[-1]


def reference_logits(model_dir: str, tokens: Sequence[int], addressing: str = "product"
                     ) -> np.ndarray:
    """Logits for every position of `tokens` for the model in `model_dir` (float64 [T, V])."""
    return ReferenceModel.load(model_dir).logits_all(tokens, addressing)


def self_test(seed: int = 0) -> List[str]:
    """Checks the oracle against facts that do not depend on it. Returns failure messages."""
    failures = []
    f64 = torch.float64
    # 1. The two-slot example of docs/model-spec.md §5.4 (shared residual) and the paper's Eq. 4.
    rows = torch.tensor([[2.5], [5.0]], dtype=f64)
    k = torch.tensor([0.5, 0.5], dtype=f64)
    alpha = torch.tensor([0.8, 0.8], dtype=f64)
    v = torch.tensor([10.0], dtype=f64)
    got = delta_write(rows, k, alpha, 0.5, v, "shared_residual").flatten().tolist()
    if max(abs(a - b) for a, b in zip(got, [3.75, 5.75])) > 1e-12:
        failures.append(f"two-slot example (shared_residual): {got} != [3.75, 5.75]")
    got = delta_write(rows, k, alpha, 0.5, v, "slot_residual").flatten().tolist()
    if max(abs(a - b) for a, b in zip(got, [4.0, 5.5])) > 1e-12:
        failures.append(f"two-slot example (slot_residual): {got} != [4, 5.5]")

    # 2. Product-key selection == brute force over all s^2 sums, for K below, at and above s.
    gen = torch.Generator().manual_seed(seed)
    for s in (3, 8):
        for K in (1, 2, s - 1, s, s + 3, s * s, s * s + 5):
            for _ in range(20):
                ua = torch.randn(s, generator=gen, dtype=f64)
                ub = torch.randn(s, generator=gen, dtype=f64)
                if address_product_keys(ua, ub, K) != address_brute_force(ua, ub, K):
                    failures.append(f"product keys != brute force (s={s}, K={K})")
                    break

    # 3. With K = s^2 every slot is written with Softmax weights: SDM is then a dense gated
    #    delta rule S <- alpha S + beta k (v - (alpha S)^T k)^T, read q^T S, on a [s^2, hd] state.
    s, hd, T = 3, 4, 6
    M = torch.randn(s * s, hd, generator=gen, dtype=f64)
    S = M.clone()
    for _ in range(T):
        ua, ub, ra, rb = (torch.randn(s, generator=gen, dtype=f64) for _ in range(4))
        v = torch.randn(hd, generator=gen, dtype=f64)
        a, b = 0.5 + 0.5 * float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen))
        widx, wraw = address_product_keys(ua, ub, s * s)
        ridx, rraw = address_product_keys(ra, rb, s * s)
        kk = activation("Softmax", torch.tensor(wraw, dtype=f64), 1.0)
        q = activation("Softmax", torch.tensor(rraw, dtype=f64), 1.0)
        M[widx] = delta_write(M[widx], kk, torch.full((s * s,), a, dtype=f64), b, v)
        y = (q[:, None] * M[ridx]).sum(0)
        kd = torch.softmax((ua[:, None] + ub[None, :]).reshape(-1), 0)  # dense key, slot order
        qd = torch.softmax((ra[:, None] + rb[None, :]).reshape(-1), 0)
        S = a * S
        S = S + b * torch.outer(kd, v - S.T @ kd)
        if (y - S.T @ qd).abs().max() > 1e-12:
            failures.append("K = s^2 SDM != dense gated delta rule")
            break
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--all", action="store_true", help="one row per position")
    ap.add_argument("--addressing", choices=("product", "brute"), default="product")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    logits = reference_logits(args.model_dir, tokens, args.addressing)
    rows = logits if args.all else logits[-1:]
    print(json.dumps({"tokens": tokens,
                      "logits": [[float("%.9g" % v) for v in row] for row in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
