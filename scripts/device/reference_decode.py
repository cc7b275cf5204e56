#!/usr/bin/env python3
# Times the reference implementation's own decode step (facebookresearch/sparse-delta-memory:
# Lingua's LMTransformer with SparseDeltaMemory layers, whose decode runs on Triton kernels) at
# the shapes of our `sdm_flagship` preset, so that the device check can print "ours vs
# reference" next to `sdm-bench decode --pair flagship --contexts 1024 --batches 1,8,64`.
#
# What is timed: one decode step = the reference model's forward on one new token per sequence
# (batch B, eager, bf16, random weights), with its sliding-window layers on its sdpa path over a
# KV cache (window applied by a boolean mask, as its generator's generate_next_token does) and
# its SDM layers on their T = 1 path (Triton fused_product_key_rest + fused_decode_step over a
# per-sequence SDMLayerState), plus building that step's masks and a greedy argmax over the
# logits. Medians of per-step CUDA-event times after warm-up steps; each sequence has first
# been brought to --context tokens. Separately, one SDM mixer (SparseDeltaMemory.forward, T = 1)
# alone. Prefill uses the reference's own inference path, in chunks of <= 64 tokens (its
# token-by-token T <= 64 path; its T > 64 prefill compiles CUDA extensions with load_inline,
# minutes on a fresh machine: --prefill full), for --prefill_batch sequences whose states are
# then copied to all B (decode cost does not depend on the values in the state).
#
# The reference's code is NOT part of this repository (its license is non-commercial): it is
# extracted into the gitignored .refcode/ by scripts/fetch-reference.sh, carried to the GPU
# machine, and imported from there at run time only. Modules the reference imports but the
# decode path does not use (xformers; einops where absent) are replaced by small stand-ins of
# ours, listed in the output. `--device cpu --tiny` runs the plumbing on a CPU (our `tiny`
# preset; Triton kernels replaced by plain-PyTorch stand-ins, so its times mean nothing).
#
#   python3 scripts/device/reference_decode.py --ref .refcode/sparse-delta-memory \
#       --json $OUT/reference_decode.json
import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
import types

T0 = time.monotonic()
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def log(msg):
    print(f"[reference {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def elapsed():
    return time.monotonic() - T0


# ---- our configs (engine/model_config.cc), as the reference's LMTransformerArgs ----------------
def _three_to_one(n_layers):
    return ([i for i in range(n_layers) if i % 4 != 3], [i for i in range(n_layers) if i % 4 == 3])


def ffn_hidden(dim, multiple_of=256, mult=None):  # engine FfnHiddenDim == reference FeedForward
    h = int(2 * (4 * dim) / 3)
    if mult is not None:
        h = int(mult * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def _sdm_args(**geometry):
    """Our SdmArgs defaults (engine/model_config.h) with a preset's geometry on top."""
    args = dict(output_gate=True, normalize_readings=True, backprop_on_memory=True,
                read_act="Softmax", write_act="Softmax", read_act_scale=1.0, write_act_scale=1.0,
                norm_eps=1e-6, query_batchnorm=False, key_weighted_decay=False, dt_bias_init=0.0,
                A_init_range=(0.0, 16.0), snapshot_quant="none")
    args.update(geometry)
    return args


def flagship_config():
    """`sdm_flagship` = Scale(2048, 24, 16, 8, sdm=true, sdm_heads=2, gate=false)."""
    swa, sdm = _three_to_one(24)
    return dict(
        preset="sdm_flagship", dim=2048, n_layers=24, n_heads=16, n_kv_heads=8,
        rope_theta=100000.0, norm_eps=1e-5, multiple_of=256, ffn_dim_multiplier=None,
        vocab_size=258, weight_tying=False, attn_gate=False, attn_at=[], swa_at=swa, sdm_at=sdm,
        swa_window=1024, swa_n_heads=16, swa_n_kv_heads=16, swa_head_dim=None,
        sdm=_sdm_args(num_heads=2, slots_per_head=65536, num_writes=128, num_reads=128,
                      memory_block_size=256))


def tiny_config():
    """Our `tiny` preset (3 SWA layers with GQA 4/2 and window 8, 1 SDM layer of 2 x 8^2 slots)."""
    return dict(
        preset="tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, rope_theta=10000.0,
        norm_eps=1e-5, multiple_of=256, ffn_dim_multiplier=None, vocab_size=258,
        weight_tying=False, attn_gate=False, attn_at=[], swa_at=[0, 1, 2], sdm_at=[3],
        swa_window=8, swa_n_heads=None, swa_n_kv_heads=None, swa_head_dim=None,
        sdm=_sdm_args(num_heads=2, slots_per_head=64, num_writes=8, num_reads=8,
                      memory_block_size=16))


def derived(cfg):
    d = cfg["dim"]
    swa_h = cfg["swa_n_heads"] or cfg["n_heads"]
    swa_kv = cfg["swa_n_kv_heads"] or (swa_h if cfg["swa_n_heads"] else (cfg["n_kv_heads"] or swa_h))
    s = cfg["sdm"]
    side = int(round(math.sqrt(s["slots_per_head"])))
    return dict(swa_heads=swa_h, swa_kv_heads=swa_kv, swa_head_dim=cfg["swa_head_dim"] or d // swa_h,
                ffn_hidden=ffn_hidden(d, cfg["multiple_of"], cfg["ffn_dim_multiplier"]),
                sdm_side=side, sdm_head_width=d // s["num_heads"],
                sdm_state_bytes_per_seq_layer=s["num_heads"] * s["slots_per_head"] * (d // s["num_heads"]))


def config_mapping(cfg, max_seqlen):
    """(our field, value, reference argument) rows, printed and written to the JSON."""
    dv = derived(cfg)
    s = cfg["sdm"]
    rows = [
        ("dim", cfg["dim"], "LMTransformerArgs.dim"),
        ("n_layers", cfg["n_layers"], "n_layers"),
        ("swa_at", cfg["swa_at"], "swa_at"), ("sdm_at", cfg["sdm_at"], "sdm_at"),
        ("attn_at", cfg["attn_at"], "attn_at"),
        ("n_heads / n_kv_heads (full attention only; unused without attn layers)",
         f"{cfg['n_heads']} / {cfg['n_kv_heads']}", "n_heads / n_kv_heads"),
        ("swa heads / kv heads / head_dim", f"{dv['swa_heads']} / {dv['swa_kv_heads']} / {dv['swa_head_dim']}",
         "swa_n_heads / swa_n_kv_heads / (dim // swa_n_heads)"),
        ("swa_window", cfg["swa_window"], "swa_window"),
        ("rope_theta", cfg["rope_theta"], "rope_theta"),
        ("norm_eps", cfg["norm_eps"], "norm_eps"),
        ("ffn hidden (multiple_of, ffn_dim_multiplier)",
         f"{dv['ffn_hidden']} ({cfg['multiple_of']}, {cfg['ffn_dim_multiplier']})",
         "FeedForward(hidden_dim=4*dim)"),
        ("vocab_size", cfg["vocab_size"], "vocab_size"),
        ("weight_tying", cfg["weight_tying"], "weight_tying"),
        ("attn_gate", cfg["attn_gate"], "attn_gate"),
        ("sdm.num_heads (H)", s["num_heads"], "sdm_args.num_heads"),
        ("sdm.slots_per_head (s^2)", f"{s['slots_per_head']} (s = {dv['sdm_side']})", "sdm_args.slots_per_head"),
        ("sdm head width hd = dim / H", dv["sdm_head_width"], "SparseDeltaMemory.head_dim"),
        ("sdm.num_writes W / num_reads R", f"{s['num_writes']} / {s['num_reads']}", "sdm_args.num_writes / num_reads"),
        ("sdm.output_gate / normalize_readings", f"{s['output_gate']} / {s['normalize_readings']}",
         "sdm_args.output_gate / normalize_readings"),
        ("sdm.backprop_on_memory (learned M0)", s["backprop_on_memory"], "sdm_args.backprop_on_memory"),
        ("sdm.read_act / write_act", f"{s['read_act']} / {s['write_act']}", "sdm_args.read_act / write_act"),
        ("sdm.norm_eps", s["norm_eps"], "sdm_args.norm_eps"),
        ("sdm.memory_block_size (prefill chunk; speed only)", s["memory_block_size"], "sdm_args.memory_block_size"),
        ("max_seqlen (ours: training only; the reference's RoPE table must cover every position)",
         max_seqlen, "max_seqlen"),
    ]
    return [dict(ours=a, value=b, reference=c) for a, b, c in rows]


# ---- stand-ins for modules the reference imports but its decode path does not need ------------
STUBS = []


def _new_module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


class _Anything:
    """Permissive placeholder: any attribute, call or index gives another placeholder."""

    def __init__(self, name="stub"):
        self._name = name

    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Anything(f"{self._name}.{k}")

    def __call__(self, *a, **k):
        return _Anything(f"{self._name}()")

    def __getitem__(self, k):
        return _Anything(f"{self._name}[]")


def einops_rearrange(x, pattern, **sizes):
    """einops.rearrange for plain reshape/transpose patterns (named axes, (groups), literal 1)."""

    def parse(side):
        groups, cur = [], None
        for tok in side.replace("(", " ( ").replace(")", " ) ").split():
            if tok == "(":
                cur = []
            elif tok == ")":
                groups.append(cur)
                cur = None
            elif cur is not None:
                cur.append(tok)
            else:
                groups.append([tok])
        return groups

    left, right = (parse(s) for s in pattern.split("->"))
    if len(left) != x.dim():
        raise ValueError(f"rearrange: pattern {pattern!r} does not fit shape {tuple(x.shape)}")
    known = dict(sizes)
    for grp, n in zip(left, x.shape):
        names = [a for a in grp if a != "1"]
        unknown = [a for a in names if a not in known]
        prod = 1
        for a in names:
            if a in known:
                prod *= known[a]
        if len(unknown) > 1:
            raise ValueError(f"rearrange: cannot infer {unknown} in {pattern!r}")
        if unknown:
            if prod == 0 or n % prod:
                raise ValueError(f"rearrange: {n} not divisible by {prod} in {pattern!r}")
            known[unknown[0]] = n // prod
        elif prod != n:
            raise ValueError(f"rearrange: axis of {n} != {prod} in {pattern!r}")
    lnames = [a for g in left for a in g if a != "1"]
    rnames = [a for g in right for a in g if a != "1"]
    if sorted(lnames) != sorted(rnames) or len(set(lnames)) != len(lnames):
        raise ValueError(f"rearrange: axes differ in {pattern!r}")
    y = x.reshape([known[a] for a in lnames]).permute([lnames.index(a) for a in rnames])
    out = []
    for g in right:
        p = 1
        for a in g:
            if a != "1":
                p *= known[a]
        out.append(p)
    return y.reshape(out)


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    import torch
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def install_stubs(device):
    import importlib
    import torch
    import torch.nn.functional as F

    def have(mod, *names):
        try:
            m = importlib.import_module(mod)
            return all(hasattr(m, n) for n in names)
        except Exception:
            return False

    if not have("xformers.ops", "fmha", "AttentionBias"):
        class AttentionBias:  # only named in type hints and the unused fmha branch
            pass
        x = _new_module("xformers")
        _new_module("xformers.ops", fmha=_Anything("xformers.ops.fmha"), AttentionBias=AttentionBias)
        x.__path__ = []
        STUBS.append("xformers (unused by the sdpa decode path)")
    if not have("einops", "rearrange"):
        _new_module("einops", rearrange=einops_rearrange)
        STUBS.append("einops.rearrange (ours: reshape/permute, same semantics)")
    if not have("torch.distributed._tensor", "Replicate", "Shard"):
        try:
            from torch.distributed.tensor import Replicate, Shard
        except Exception:
            Replicate = Shard = type("Placement", (), {})
        _new_module("torch.distributed._tensor", Replicate=Replicate, Shard=Shard)
        STUBS.append("torch.distributed._tensor (tensor parallelism only)")
    tp_names = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                "parallelize_module")
    if not have("torch.distributed.tensor.parallel", *tp_names):
        if "torch.distributed.tensor" not in sys.modules and not have("torch.distributed.tensor"):
            _new_module("torch.distributed.tensor").__path__ = []
        _new_module("torch.distributed.tensor.parallel", **{n: _Anything(n) for n in tp_names})
        STUBS.append("torch.distributed.tensor.parallel (tensor parallelism only)")
    fa_names = ("BlockMask", "flex_attention", "_mask_mod_signature", "create_block_mask")
    if not have("torch.nn.attention.flex_attention", *fa_names):
        if not have("torch.nn.attention"):
            _new_module("torch.nn.attention", sdpa_kernel=_Anything("sdpa_kernel"),
                        SDPBackend=_Anything("SDPBackend")).__path__ = []

        def _no_flex(*a, **k):
            raise RuntimeError("flex_attention is not available in this torch (stub)")
        _new_module("torch.nn.attention.flex_attention", BlockMask=type("BlockMask", (), {}),
                    flex_attention=_no_flex, create_block_mask=_no_flex, _mask_mod_signature=object)
        STUBS.append("torch.nn.attention.flex_attention (prefill-packing path, unused)")
    if not hasattr(torch, "compile"):
        torch.compile = lambda fn=None, **k: fn if fn is not None else (lambda f: f)
        STUBS.append("torch.compile (identity; old torch)")
    if not hasattr(F, "scaled_dot_product_attention"):
        F.scaled_dot_product_attention = _sdpa_math
        STUBS.append("F.scaled_dot_product_attention (ours, math; old torch)")
    if not have("triton.language"):
        if device == "cuda":
            raise RuntimeError("triton is not importable: the reference's SDM kernels need it")

        def jit(fn=None, **k):
            def wrap(f):
                return _Anything(f"triton kernel {f.__name__} (stub: never called in CPU mode)")
            return wrap(fn) if fn is not None else wrap
        t = _new_module("triton", jit=jit, Config=_Anything("triton.Config"),
                        autotune=lambda *a, **k: (lambda f: f), heuristics=lambda *a, **k: (lambda f: f),
                        next_power_of_2=lambda n: 1 << max(0, (int(n) - 1).bit_length()),
                        cdiv=lambda a, b: (a + b - 1) // b, __version__="stub")
        t.__path__ = []
        tl = _new_module("triton.language")
        tl.__getattr__ = lambda name: _Anything(f"tl.{name}")
        STUBS.append("triton (CPU mode only; its kernels are replaced below)")


def import_reference(ref, device):
    ref = os.path.abspath(ref)
    if not os.path.isdir(os.path.join(ref, "lingua", "sparse_delta_memory")):
        raise SystemExit(f"reference code not found under {ref} (run scripts/fetch-reference.sh "
                         f"and carry .refcode)")
    sys.path.insert(0, ref)
    install_stubs(device)
    import importlib
    try:
        importlib.import_module("lingua.probe")
    except Exception as e:  # activation probing only; RMSNorm calls log_stats, a no-op when off
        sys.modules.pop("lingua.probe", None)
        _new_module("lingua.probe", log_stats=lambda x, name: x)
        STUBS.append(f"lingua.probe (log_stats no-op; import failed: {type(e).__name__}: {e})")
    from apps.main.transformer import LMTransformer, LMTransformerArgs
    from lingua.sparse_delta_memory import SparseDeltaMemory, SparseDeltaMemoryArgs
    from lingua.sparse_delta_memory.cache import SDMLayerState
    from lingua.transformer import Attention
    import lingua.sparse_delta_memory.layer as layer_mod
    return types.SimpleNamespace(LMTransformer=LMTransformer, LMTransformerArgs=LMTransformerArgs,
                                 SDM=SparseDeltaMemory, SDMArgs=SparseDeltaMemoryArgs,
                                 SDMLayerState=SDMLayerState, Attention=Attention, layer_mod=layer_mod)


def use_torch_standins(R, why):
    """CPU mode (or, on CUDA, a fallback after its Triton decode path failed): plain-PyTorch
    stand-ins (ours) for the reference's three Triton calls on the decode and chunked-prefill
    paths; the T = 1 write/read then runs the reference's own PyTorch loop (_step_write_read)."""
    import torch
    import importlib

    def product_key_rest(top_val1, idx1, top_val2, idx2, half_key, k_sub):
        n = top_val1.shape[0]
        scores = (top_val1.unsqueeze(-1) + top_val2.unsqueeze(-2)).reshape(n, -1)
        val, inner = torch.topk(scores, k=k_sub, dim=-1)
        i1 = torch.gather(idx1.long(), -1, torch.div(inner, k_sub, rounding_mode="floor"))
        i2 = torch.gather(idx2.long(), -1, inner % k_sub)
        idx, perm = torch.sort(i1 * half_key + i2, dim=-1, stable=True)
        return val.float().gather(-1, perm), idx

    def decode_step(memory, k_idx, k_val, v, beta, g, q_idx, q_val, **kw):
        return R.SDM._step_write_read(None, memory, k_idx.long(), k_val.to(memory.dtype), v, beta, g,
                                      q_idx.long(), q_val.to(memory.dtype))

    def argsort(keys):
        return torch.sort(keys, dim=-1, stable=True)

    R.layer_mod.fused_product_key_rest = product_key_rest
    R.layer_mod.fused_decode_step = decode_step
    importlib.import_module("lingua.sparse_delta_memory.triton_argsort").triton_argsort = argsort
    STUBS.append(f"{why}: fused_product_key_rest, triton_argsort -> ours (PyTorch); fused_decode_step -> "
                 "the reference's _step_write_read (PyTorch)")


def step_masks(pos, ar, window):
    """pos: [T] positions of this forward's queries; ar: arange(L) -> per-type [T, L] boolean
    masks over the KV cache (True = attend), as the reference's generate_next_token builds."""
    delta = pos.unsqueeze(1) - ar.unsqueeze(0)
    causal = delta >= 0
    return {"attn": causal, "swa": causal & (delta < window)}


class KVCache:
    """Ours: the reference generator's KVCache interface and layout ([B, L, kv_heads, head_dim],
    written at tok_idx with index_copy_, the whole buffer returned), with offset 0."""

    def __init__(self, k, v):
        self.k_cache, self.v_cache = k, v

    def update(self, k_val, v_val, tok_idx):
        self.k_cache.index_copy_(1, tok_idx, k_val)
        self.v_cache.index_copy_(1, tok_idx, v_val)
        return self.k_cache, self.v_cache


# ---- the run ------------------------------------------------------------------------------------
RESULT = {}
JSON_PATH = None


def write_json():
    if not JSON_PATH:
        return
    RESULT["elapsed_s"] = round(elapsed(), 2)
    RESULT["stubs"] = STUBS
    os.makedirs(os.path.dirname(os.path.abspath(JSON_PATH)), exist_ok=True)
    tmp = JSON_PATH + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    os.replace(tmp, JSON_PATH)


def on_term(signum, frame):
    log(f"signal {signum}: writing what was measured and stopping")
    RESULT["terminated"] = f"signal {signum}"
    write_json()
    os._exit(124)


def is_oom(e):
    import torch
    oom = getattr(torch.cuda, "OutOfMemoryError", None) or getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower()


def main():
    global JSON_PATH
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ref", default=os.path.join(ROOT, ".refcode", "sparse-delta-memory"))
    p.add_argument("--json", default="")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time_limit_s", type=float, default=150.0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="our `tiny` preset instead of sdm_flagship")
    p.add_argument("--dtype", default="", choices=["", "bf16", "fp32"],
                   help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--prefill", default="chunked", choices=["chunked", "full", "none"],
                   help="chunked: the reference's T<=64 inference path, --prefill_chunk tokens per "
                        "forward; full: one forward over the context (its T>64 path, which "
                        "compiles CUDA extensions with load_inline); none: no prefill (state "
                        "= learned M0, random KV), decode cost is the same")
    p.add_argument("--prefill_chunk", type=int, default=64)
    p.add_argument("--prefill_batch", type=int, default=1,
                   help="sequences prefilled; their states are copied to all B")
    p.add_argument("--no_sdm_alone", action="store_true", help="skip timing one SDM mixer alone")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    JSON_PATH = args.json or None
    signal.signal(signal.SIGTERM, on_term)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]

    import torch
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    torch.manual_seed(args.seed)
    cfg = tiny_config() if args.tiny else flagship_config()
    dv = derived(cfg)
    L = args.context + args.warmup + args.steps + 1  # KV cache length = RoPE table length
    commit_file = os.path.join(os.path.dirname(os.path.abspath(args.ref)), "COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown"

    what = ("one decode step of the reference LMTransformer (apps/main/transformer.py, eager, "
            f"{str(dtype).replace('torch.', '')}, random weights): model.forward on one new token for "
            "each of B sequences ([B,1] batch layout), SWA layers on its sdpa path with a KV cache of "
            f"{L} positions and the window as a boolean mask (its generator's generate_next_token), "
            "SDM layers on their T=1 Triton path (fused_product_key_rest + fused_decode_step) over a "
            "per-sequence SDMLayerState, + the step's mask build and a greedy argmax; median of "
            "per-step CUDA-event times. The reference's own generator decodes SDM models one prompt "
            "at a time; the batched [B,1] call is its model's own batching.")
    RESULT.update(
        what=what,
        reference=dict(repo="facebookresearch/sparse-delta-memory", commit=commit,
                       path=os.path.abspath(args.ref)),
        device=(torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"),
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      cuda=getattr(torch.version, "cuda", None)),
        args=vars(args), preset=cfg["preset"], context=args.context, kv_cache_len=L,
        config_mapping=config_mapping(cfg, L), rows=[])
    log(f"device {RESULT['device']}, torch {torch.__version__}, reference {commit[:12]} at {args.ref}")

    R = import_reference(args.ref, args.device)
    try:
        import triton
        RESULT["versions"]["triton"] = getattr(triton, "__version__", "?")
    except Exception:
        RESULT["versions"]["triton"] = None
    decode_path = ("Triton T=1 path (fused_product_key_rest + fused_decode_step)" if cuda else
                   "CPU stand-ins (times mean nothing)")
    RESULT["decode_path"] = decode_path
    if not cuda:
        use_torch_standins(R, "CPU mode")
    for s in STUBS:
        log(f"stand-in: {s}")
    log(f"preset {cfg['preset']} -> reference LMTransformerArgs:")
    for row in RESULT["config_mapping"]:
        print(f"    {row['ours']:<58} = {str(row['value']):<28} -> {row['reference']}", flush=True)
    write_json()

    # ---- model: the reference's classes, our shapes, random weights (its init_weights) ----
    s = cfg["sdm"]
    sdm_args = R.SDMArgs(**{k: v for k, v in s.items()})
    margs = R.LMTransformerArgs(
        dim=cfg["dim"], n_layers=cfg["n_layers"], n_heads=cfg["n_heads"], n_kv_heads=cfg["n_kv_heads"],
        rope_theta=cfg["rope_theta"], norm_eps=cfg["norm_eps"], multiple_of=cfg["multiple_of"],
        ffn_dim_multiplier=cfg["ffn_dim_multiplier"], vocab_size=cfg["vocab_size"],
        weight_tying=cfg["weight_tying"], attn_gate=cfg["attn_gate"], attn_at=cfg["attn_at"],
        swa_at=cfg["swa_at"], sdm_at=cfg["sdm_at"], swa_window=cfg["swa_window"],
        swa_n_heads=cfg["swa_n_heads"], swa_n_kv_heads=cfg["swa_n_kv_heads"],
        swa_head_dim=cfg["swa_head_dim"], max_seqlen=L, sdm_args=sdm_args)
    t = time.monotonic()
    if cuda:
        with torch.device(dev):
            model = R.LMTransformer(margs)
            model.init_weights()
    else:
        model = R.LMTransformer(margs)
        model.init_weights()
    for prm in model.parameters():  # as the reference's loader: parameters to the model dtype
        prm.data = prm.data.to(dtype=dtype)
    model.eval()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    n_params = sum(p.numel() for p in model.parameters())
    n_mem = sum(m.memory.numel() for m in model.modules() if isinstance(m, R.SDM) and m.memory is not None)
    types_ = model.layer_types
    ffn_real = model.layers[0].feed_forward.hidden_dim
    attn_mods = [m for m in model.modules() if isinstance(m, R.Attention)]
    sdm_mods = [m for m in model.modules() if isinstance(m, R.SDM)]
    a0 = attn_mods[0]
    checks = dict(layer_types=types_, ffn_hidden=ffn_real, swa_heads=a0.n_heads,
                  swa_kv_heads=a0.n_kv_heads, swa_head_dim=a0.head_dim,
                  sdm_head_dim=sdm_mods[0].head_dim, sdm_slots_per_head=sdm_mods[0].slots_per_head,
                  params=n_params, sdm_memory_params=n_mem)
    RESULT["model"] = checks
    log(f"model built in {time.monotonic() - t:.1f}s: {n_params / 1e9:.3f}B parameters "
        f"({n_mem / 1e9:.3f}B of them SDM initial memory), layers "
        f"{''.join(dict(swa='w', sdm='M', attn='A')[x] for x in types_)} "
        f"(w = swa, M = sdm, A = attn: {types_.count('swa')} swa + {types_.count('sdm')} sdm)")
    mism = []
    if ffn_real != dv["ffn_hidden"]:
        mism.append(f"ffn hidden {ffn_real} != ours {dv['ffn_hidden']}")
    if (a0.n_heads, a0.n_kv_heads, a0.head_dim) != (dv["swa_heads"], dv["swa_kv_heads"], dv["swa_head_dim"]):
        mism.append(f"swa geometry {(a0.n_heads, a0.n_kv_heads, a0.head_dim)} != ours")
    if sdm_mods[0].head_dim != dv["sdm_head_width"]:
        mism.append(f"sdm head width {sdm_mods[0].head_dim} != ours {dv['sdm_head_width']}")
    if types_.count("sdm") != len(cfg["sdm_at"]):
        mism.append("layer types differ")
    RESULT["shape_mismatches"] = mism
    log("shapes match ours" if not mism else f"SHAPE MISMATCH: {mism}")
    write_json()

    H_kv, hd_a = a0.n_kv_heads, a0.head_dim
    window = cfg["swa_window"]
    ar = torch.arange(L, device=dev)

    def masks(pos):
        return step_masks(pos, ar, window)

    def install(kv, sdm_states):
        for m, (k, v) in zip(attn_mods, kv):
            m.kv_cache = KVCache(k, v)
        for m, st in zip(sdm_mods, sdm_states):
            m._gen_cache = st

    def uninstall():
        for m in attn_mods:
            if hasattr(m, "kv_cache"):
                del m.kv_cache
        for m in sdm_mods:
            if hasattr(m, "_gen_cache"):
                del m._gen_cache

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # ---- prefill prefill_batch sequences with the reference's own inference path ----
    B0 = max(1, min(args.prefill_batch, max(batches) if batches else 1))
    pre = dict(mode=args.prefill, sequences=B0, chunk=None, seconds=None)
    RESULT["prefill"] = pre
    base_kv = [(torch.zeros(B0, L, H_kv, hd_a, dtype=dtype, device=dev),
                torch.zeros(B0, L, H_kv, hd_a, dtype=dtype, device=dev)) for _ in attn_mods]
    base_sdm = [m.create_kv_cache(bsz=B0, seq_len=0, dtype=dtype, device=dev) for m in sdm_mods]
    t = time.monotonic()
    mode = args.prefill
    with torch.inference_mode():
        if mode != "none":
            chunk = args.context if mode == "full" else max(1, args.prefill_chunk)
            pre["chunk"] = chunk
            toks = torch.randint(0, cfg["vocab_size"], (B0, args.context), device=dev)
            install(base_kv, base_sdm)
            try:
                for c0 in range(0, args.context, chunk):
                    c1 = min(args.context, c0 + chunk)
                    pos = torch.arange(c0, c1, device=dev)
                    logits = model(toks[:, c0:c1], tok_idx=pos, mask=masks(pos), attn_impl="sdpa")
                    if c0 == 0 or c1 == args.context or (c0 // chunk) % 4 == 3:
                        sync()
                        log(f"prefill {c1}/{args.context} tokens x {B0} sequence(s) "
                            f"({mode}, {chunk} per forward), {time.monotonic() - t:.1f}s")
                    if elapsed() > args.time_limit_s * 0.5:
                        raise TimeoutError(f"prefill passed half the time limit at {c1} tokens")
                sync()
                pre["logits_finite"] = bool(torch.isfinite(logits.float()).all())
                base_sdm = [m._gen_cache for m in sdm_mods]
                assert all(st.cache_len == args.context for st in base_sdm), \
                    [st.cache_len for st in base_sdm]
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"prefill FAILED ({msg}); falling back to no prefill (decode cost is the same)")
                if not isinstance(e, TimeoutError):
                    traceback.print_exc()
                pre["error"] = msg
                mode = "none"
                uninstall()
                base_sdm = [m.create_kv_cache(bsz=B0, seq_len=0, dtype=dtype, device=dev) for m in sdm_mods]
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            uninstall()
        if mode == "none":
            for k, v in base_kv:
                k.normal_()
                v.normal_()
            for st in base_sdm:
                st._cache_len = args.context
        pre["mode_used"] = mode
    sync()
    pre["seconds"] = round(time.monotonic() - t, 2)
    log(f"prefill done: {mode}, {pre['seconds']}s")
    write_json()

    # ---- decode, per batch size ----
    state_per_seq = (len(sdm_mods) * dv["sdm_state_bytes_per_seq_layer"] +
                     len(attn_mods) * 2 * L * H_kv * hd_a) * torch.finfo(dtype).bits // 8
    prev = None  # (B, median_ms)
    oom_at = None
    rows = RESULT["rows"]
    queue = list(batches)
    while queue:
        B = queue.pop(0)
        row = dict(batch=B, status="skipped", decode_path=decode_path)
        rows.append(row)
        left = args.time_limit_s - elapsed()
        need = 20.0 if prev is None else 8.0 + (args.warmup + args.steps) * prev[1] / 1000 * max(1.0, B / prev[0]) * 1.5
        if not cuda:
            need = 1.0 if prev is None else (args.warmup + args.steps) * prev[1] / 1000 * max(1.0, B / prev[0])
        row["state_gib"] = round(B * state_per_seq / 2**30, 2)
        if oom_at is not None and B >= oom_at:
            row["reason"] = f"batch {oom_at} already ran out of memory"
            log(f"batch {B}: skipped ({row['reason']})")
            continue
        if left < need:
            row["reason"] = f"time limit: {left:.0f}s left of {args.time_limit_s:.0f}s, ~{need:.0f}s needed"
            log(f"batch {B}: skipped ({row['reason']})")
            write_json()
            continue
        if cuda:
            free, total = torch.cuda.mem_get_info(dev)
            if B * state_per_seq > free - 2 * 2**30:
                row["reason"] = (f"out of memory (decode state {B * state_per_seq / 2**30:.1f} GiB, "
                                 f"{free / 2**30:.1f} GiB free)")
                oom_at = B
                log(f"batch {B}: skipped ({row['reason']})")
                write_json()
                continue
            torch.cuda.reset_peak_memory_stats(dev)
        log(f"batch {B}: copying the prefilled state to {B} sequences ({row['state_gib']} GiB)")
        try:
            with torch.inference_mode():
                src = torch.arange(B, device=dev) % B0
                kv = [(k.index_select(0, src), v.index_select(0, src)) for k, v in base_kv]
                states = []
                for st in base_sdm:
                    m0 = st.memory.view(B0, -1, st.memory.shape[-1])
                    mem = torch.empty(B * m0.shape[1], m0.shape[2], dtype=m0.dtype, device=dev)
                    mv = mem.view(B, m0.shape[1], m0.shape[2])
                    for b in range(B):
                        mv[b].copy_(m0[b % B0])
                    states.append(R.SDMLayerState(memory=mem, seq_len=args.context))
                install(kv, states)
                n = args.warmup + args.steps
                toks = torch.randint(0, cfg["vocab_size"], (n, B, 1), device=dev)
                pos = torch.full((1,), args.context, dtype=torch.long, device=dev)
                times, partial = [], False
                sync()
                t_b = time.monotonic()
                for i in range(n):
                    if cuda:
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                    else:
                        c0 = time.perf_counter()
                    logits = model(toks[i], tok_idx=pos, mask=masks(pos), attn_impl="sdpa")
                    nxt = logits[:, -1].argmax(dim=-1)  # greedy sample (fed tokens are random)
                    pos += 1
                    if cuda:
                        e1.record()
                        if i >= args.warmup:
                            times.append((e0, e1))
                    else:
                        if i >= args.warmup:
                            times.append(time.perf_counter() - c0)
                    if i == args.warmup - 1 or (args.warmup == 0 and i == 0):
                        sync()
                        row["warmup_s"] = round(time.monotonic() - t_b, 2)
                        row["logits_finite"] = bool(torch.isfinite(logits.float()).all())
                        log(f"batch {B}: {args.warmup} warm-up step(s) in {row['warmup_s']}s "
                            f"(includes Triton compiles)")
                    if elapsed() > args.time_limit_s - 3:
                        partial = True
                        break
                sync()
                ms = [a.elapsed_time(b) for a, b in times] if cuda else [x * 1000 for x in times]
                del nxt
                if partial and len(ms) < 3:
                    raise TimeoutError(f"time limit reached after {len(ms)} timed steps")
                if not ms:
                    raise RuntimeError("no timed steps (--steps 0?)")
                ms.sort()
                med = statistics.median(ms)
                row.update(status="partial" if partial else "ok", steps=len(ms), median_ms=round(med, 4),
                           mean_ms=round(sum(ms) / len(ms), 4), min_ms=round(ms[0], 4),
                           p90_ms=round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 4),
                           tok_s=round(B * 1000.0 / med, 1))
                if partial:
                    row["reason"] = "time limit reached during the timed steps"
                log(f"batch {B}: median {med:.3f} ms/step ({row['tok_s']} tok/s) over {len(ms)} steps"
                    f"{' (partial)' if partial else ''}")
                prev = (B, med)
                # one SDM mixer alone: SparseDeltaMemory.forward, T = 1, with its state
                if not args.no_sdm_alone and elapsed() < args.time_limit_s - 8:
                    sdm0, st0 = sdm_mods[0], states[0]
                    x = torch.randn(B, 1, cfg["dim"], device=dev, dtype=dtype)
                    ts = []
                    for i in range(args.warmup + args.steps):
                        if cuda:
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record()
                        else:
                            c0 = time.perf_counter()
                        out, st0 = sdm0(x, freqs_cis=None, mask=None, cache=st0)
                        if cuda:
                            e1.record()
                        if i >= args.warmup:
                            ts.append((e0, e1) if cuda else time.perf_counter() - c0)
                        if elapsed() > args.time_limit_s - 3:
                            break
                    sync()
                    ms2 = sorted([a.elapsed_time(b) for a, b in ts] if cuda else [x_ * 1000 for x_ in ts])
                    if ms2:
                        row["sdm_mixer_median_ms"] = round(statistics.median(ms2), 4)
                        row["sdm_mixer_steps"] = len(ms2)
                        log(f"batch {B}: one SDM mixer alone (SparseDeltaMemory.forward, T=1): median "
                            f"{row['sdm_mixer_median_ms']:.3f} ms over {len(ms2)} calls "
                            f"(x{len(sdm_mods)} layers = {len(sdm_mods) * row['sdm_mixer_median_ms']:.3f} ms)")
                if cuda:
                    row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if is_oom(e):
                row.update(status="skipped", reason=f"out of memory: {msg[:300]}")
                oom_at = B
            elif isinstance(e, TimeoutError):
                row.update(status="skipped", reason=msg)
            else:
                row.update(status="error", reason=msg[:500])
                traceback.print_exc()
                if cuda and "Triton" in decode_path:
                    # The reference's Triton decode failed here (e.g. a Triton version it was not
                    # written for): time its PyTorch token loop instead, said in every row after.
                    decode_path = ("FALLBACK after a Triton error: the reference's PyTorch "
                                   "_step_write_read for SDM (+ our PyTorch product-key completion)")
                    RESULT["decode_path"] = decode_path
                    RESULT["triton_error"] = msg[:500]
                    use_torch_standins(R, "CUDA fallback after Triton error")
                    queue.insert(0, B)
            log(f"batch {B}: {row['status']} ({row['reason']})")
        finally:
            uninstall()
            kv = states = logits = out = x = mem = mv = st0 = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        write_json()

    # ---- table last ----
    print(flush=True)
    print(f"== reference decode ({cfg['preset']}, context {args.context}, {RESULT['device']}, "
          f"reference {commit[:12]}, prefill {mode}) ==", flush=True)
    print(f"{'batch':>6} {'median ms/step':>15} {'tok/s':>10} {'sdm mixer ms':>13}  status", flush=True)
    for r in rows:
        med = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        tok = f"{r['tok_s']:.1f}" if "tok_s" in r else "-"
        sdm = f"{r['sdm_mixer_median_ms']:.3f}" if "sdm_mixer_median_ms" in r else "-"
        st = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        print(f"{r['batch']:>6} {med:>15} {tok:>10} {sdm:>13}  {st}", flush=True)
    print(f"timed: {what}", flush=True)
    print(f"SDM decode path: {decode_path}", flush=True)
    if not cuda:
        print("NOTE: CPU plumbing mode: Triton kernels replaced by PyTorch stand-ins; times mean nothing",
              flush=True)
    write_json()
    if JSON_PATH:
        log(f"wrote {JSON_PATH}")
    return 0 if any(r["status"] in ("ok", "partial") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
