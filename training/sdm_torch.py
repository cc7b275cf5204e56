"""Trainable float32 PyTorch version of the SDM hybrid (docs/model-spec.md), for training.

Same config fields and tensor names as training/sdm_reference_model.py (the float64 oracle the
tests use), so a state dict of `SdmLM` is a model directory's `model.safetensors` as is. It
differs from the oracle only in how it computes, to train on a CPU in minutes:

  * sliding-window attention runs block-locally: queries in blocks of `window` positions see
    their own block and the one before, masked to the window (exact, and T/window times fewer
    scores than a [T, T] mask);
  * the SDM recurrence keeps each head's memory dense ([s^2, hd], small at this size) and runs
    the delta rule of §5.4 with the write and read sets scattered into dense vectors: a slot
    outside the write set has weight 0 and decay 1, so it is unchanged, exactly as the sparse
    update leaves it. The top-K selection over all s^2 pair sums equals the two-stage
    product-key selection (proved in sdm_reference_model.address_brute_force).

Supported subset (what training/train.py uses): `swa` and `sdm` layers (and `attn`), no
`attn_gate`, no `query_batchnorm`, `key_weighted_decay` false, shared_residual, Softmax
activations, no weight tying.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

import sdm_reference_model as ref


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(T: int, hd: int, theta: float, device=None, dtype=torch.float32):
    # fp32 frequency then angle, as docs/model-spec.md §4.2 states.
    i = torch.arange(hd // 2, dtype=dtype, device=device)
    inv_freq = 1.0 / (theta ** (2.0 * i / hd))
    ang = torch.arange(T, dtype=dtype, device=device)[:, None] * inv_freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin):
    """x: [B, T, heads, hd]; rotates adjacent pairs (2m, 2m+1)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, g: "ref.AttnGeom", theta: float):
        super().__init__()
        self.g, self.theta = g, theta
        self.wq = nn.Linear(dim, g.n_heads * g.head_dim, bias=False)
        self.wk = nn.Linear(dim, g.n_kv_heads * g.head_dim, bias=False)
        self.wv = nn.Linear(dim, g.n_kv_heads * g.head_dim, bias=False)
        self.wo = nn.Linear(g.n_heads * g.head_dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        g = self.g
        cos, sin = rope_tables(T, g.head_dim, self.theta, x.device, x.dtype)
        q = apply_rope(self.wq(x).view(B, T, g.n_heads, g.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, g.n_kv_heads, g.head_dim), cos, sin)
        v = self.wv(x).view(B, T, g.n_kv_heads, g.head_dim)
        rep = g.n_heads // g.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, h, T, hd]
        scale = 1.0 / math.sqrt(g.head_dim)
        w = g.window
        if w is None or w >= T:
            pos = torch.arange(T, device=x.device)
            delta = pos[:, None] - pos[None, :]
            allowed = delta >= 0
            if w is not None:
                allowed &= delta < w
            s = (q @ k.transpose(-1, -2)) * scale
            o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
        else:
            o = self._block_local(q, k, v, w, scale)
        return self.wo(o.transpose(1, 2).reshape(B, T, g.n_heads * g.head_dim))

    @staticmethod
    def _block_local(q, k, v, w, scale):
        B, h, T, hd = q.shape
        n = (T + w - 1) // w
        pad = n * w - T
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        # keys of block j: positions (j-1)w .. (j+1)w - 1 (a zero block before the first)
        kp = F.pad(k, (0, 0, w, 0)).unfold(2, 2 * w, w).transpose(-1, -2)  # [B,h,n,2w,hd]
        vp = F.pad(v, (0, 0, w, 0)).unfold(2, 2 * w, w).transpose(-1, -2)
        qb = q.view(B, h, n, w, hd)
        s = (qb @ kp.transpose(-1, -2)) * scale  # [B,h,n,w,2w]
        qi = torch.arange(w, device=q.device)[:, None] + w  # query offset within the 2w keys
        kj = torch.arange(2 * w, device=q.device)[None, :]
        allowed = (qi - kj >= 0) & (qi - kj < w)
        first = torch.zeros(n, 1, 1, dtype=torch.bool, device=q.device)
        first[0] = True  # block 0: the padded keys before position 0 do not exist
        allowed = allowed[None] & ~(first & (kj < w)[None])
        s = s.masked_fill(~allowed[None, None], float("-inf"))
        o = torch.softmax(s, -1) @ vp
        return o.reshape(B, h, n * w, hd)[:, :, :T]


class SdmMemory(nn.Module):
    """One SDM layer; parameter names are the reference's (docs/model-format.md)."""

    def __init__(self, dim: int, cfg: "ref.RefConfig"):
        super().__init__()
        g = cfg.sdm
        self.H, self.s, self.hd = g.heads, g.side, g.head_width
        a = cfg.sdm_arg
        self.W, self.R = int(a("num_writes", 1)), int(a("num_reads", 1))
        self.write_scale = float(a("write_act_scale", 1.0))
        self.read_scale = float(a("read_act_scale", 1.0))
        self.ln_eps = float(a("norm_eps", 1e-6))
        assert a("write_act", "Softmax") == "Softmax" and a("read_act", "Softmax") == "Softmax"
        assert not a("key_weighted_decay", False) and not a("query_batchnorm", False)
        assert a("update_rule", "shared_residual") == "shared_residual"
        self.normalize = bool(a("normalize_readings", False))
        self.gated = bool(a("output_gate", False))
        self.learned_m0 = bool(a("backprop_on_memory", True))
        H, s, hd = self.H, self.s, self.hd
        key = H * 2 * s
        self.Wq_read = nn.Linear(dim, key)
        self.Wk_write = nn.Linear(dim, key)
        self.Wv_write = nn.Linear(dim, dim)
        self.a_proj = nn.Linear(dim, H)
        self.b_proj = nn.Linear(dim, H)
        self.Wo = nn.Linear(dim, dim)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H))
        if self.gated:
            self.Wog = nn.Linear(dim, dim)
        if self.learned_m0:
            self.memory = nn.Parameter(torch.zeros(H * s * s, hd))
        if self.normalize:
            self.readings_norm = nn.LayerNorm(hd, eps=self.ln_eps)
        # Time steps per chunk of the parallel form (1: step by step); a speed knob only, exact
        # at any value (tests/training/test_sdm_chunked.py), though the last bits of training
        # depend on it. training/train.py sets it (--sdm-chunk).
        self.chunk = 32

    @staticmethod
    def _chunked(S, kw, qr, logd, alpha, beta, v, C):
        """The same recurrence, C time steps at a time (a WY-style chunked form).

        With D_t the diagonal decay (alpha_t on the write set, 1 elsewhere) and k_t supported on
        the write set, one step is M_t = D_t M_{t-1} + k_t u_t^T with
        u_t = beta_t (v_t - alpha_t M_{t-1}^T k_t). Within a chunk that starts from S, with
        G_t = D_1...D_t: M_t = G_t S + sum_{j<=t} (G_t / G_j) k_j u_j^T, so the u_t solve the
        unit lower-triangular system u_t + sum_{j<t} A_tj u_j = beta_t v_t
        - alpha_t beta_t S^T G_{t-1} k_t with A_tj = alpha_t beta_t k_j^T (G_{t-1} / G_j) k_t,
        and the reads are y_t = S^T G_t q_t + sum_{j<=t} u_j k_j^T (G_t / G_j) q_t.
        Shapes: S [B,H,S2,hd]; kw, qr, logd [B,T,H,S2]; alpha, beta [B,T,H]; v [B,T,H,hd]."""
        B, T, H, S2 = kw.shape
        perm = lambda z: z.permute(0, 2, 1, *range(3, z.dim()))  # noqa: E731  [B,H,T,...]
        kw, qr, logd, alpha, beta, v = (perm(z) for z in (kw, qr, logd, alpha, beta, v))
        outs = []
        for c0 in range(0, T, C):
            c1 = min(T, c0 + C)
            n = c1 - c0
            k, q, ld = kw[:, :, c0:c1], qr[:, :, c0:c1], logd[:, :, c0:c1]
            a, b, vv = alpha[:, :, c0:c1], beta[:, :, c0:c1], v[:, :, c0:c1]
            L = torch.cumsum(ld, dim=2)  # log G_t
            Lp = L - ld  # log G_{t-1}
            strict = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
            incl = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(0)
            neg = float("-inf")
            E1 = torch.exp((Lp[:, :, :, None, :] - L[:, :, None, :, :])
                           .masked_fill(~strict[:, :, None], neg))  # [B,H,t,j,S2]
            A = (k[:, :, :, None, :] * E1 * k[:, :, None, :, :]).sum(-1) * (a * b)[..., None]
            rhs = b[..., None] * vv - (a * b)[..., None] * ((torch.exp(Lp) * k) @ S)
            eye = torch.eye(n, dtype=k.dtype, device=k.device)
            U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
            E2 = torch.exp((L[:, :, :, None, :] - L[:, :, None, :, :])
                           .masked_fill(~incl[:, :, None], neg))
            Bm = (q[:, :, :, None, :] * E2 * k[:, :, None, :, :]).sum(-1)  # [B,H,t,j]
            outs.append((torch.exp(L) * q) @ S + Bm @ U)
            Lend = L[:, :, -1:, :]
            S = torch.exp(Lend).transpose(-1, -2) * S + \
                (torch.exp(Lend - L) * k).transpose(-1, -2) @ U
        y = torch.cat(outs, dim=2)  # [B,H,T,hd]
        return y.permute(0, 2, 1, 3), S

    def _dense_weights(self, scores, K, scale):
        """scores [B, T, H*2s] -> (dense activation weights [B, T, H, s^2], write mask)."""
        B, T, _ = scores.shape
        s = self.s
        sc = scores.view(B, T, self.H, 2 * s)
        sums = (sc[..., :s, None] + sc[..., None, s:]).flatten(-2)  # slot = a*s + b
        K = min(K, s * s)
        vals, idx = torch.topk(sums, K, dim=-1)
        act = torch.softmax(scale * vals, dim=-1)
        dense = torch.zeros_like(sums).scatter(-1, idx, act)
        mask = torch.zeros_like(sums).scatter(-1, idx, 1.0)
        return dense, mask

    def forward(self, x, state: Optional[torch.Tensor] = None, return_state: bool = False):
        if torch.is_autocast_cpu_enabled():
            # Under bf16 autocast (train.py --precision bf16) the memory layer still runs in
            # float32: the delta rule accumulates into the same slots over thousands of steps,
            # and the chunked form's triangular solve would lose it in bf16's 8 bits.
            with torch.autocast("cpu", enabled=False):
                return self.forward(x.float(), state, return_state)
        B, T, d = x.shape
        H, s, hd = self.H, self.s, self.hd
        S2 = s * s
        gate = -torch.exp(self.A_log) * F.softplus(self.a_proj(x) + self.dt_bias)  # [B,T,H]
        alpha = torch.exp(gate)
        beta = torch.sigmoid(self.b_proj(x))
        v = self.Wv_write(x).view(B, T, H, hd)
        kw, wmask = self._dense_weights(self.Wk_write(x), self.W, self.write_scale)
        qr, _ = self._dense_weights(self.Wq_read(x), self.R, self.read_scale)
        decay = 1.0 + wmask * (alpha[..., None] - 1.0)  # [B,T,H,S2]: 1 outside the write set
        if state is not None:
            M = state
        elif self.learned_m0:
            M = self.memory.view(1, H, S2, hd).expand(B, H, S2, hd)
        else:
            M = x.new_zeros(B, H, S2, hd)
        if self.chunk > 1:
            logd = wmask * gate[..., None]  # log of the decay: 0 outside the write set
            y, M = self._chunked(M, kw, qr, logd, alpha, beta, v, self.chunk)
        else:
            bv = beta[..., None] * v  # [B,T,H,hd]
            reads = []
            for t in range(T):
                M = decay[:, t, :, :, None] * M
                k = kw[:, t]  # [B,H,S2]
                vhat = torch.einsum("bhs,bhsd->bhd", k, M)
                M = M + k[..., None] * (bv[:, t] - beta[:, t, :, None] * vhat)[:, :, None, :]
                reads.append(torch.einsum("bhs,bhsd->bhd", qr[:, t], M))
            y = torch.stack(reads, dim=1)  # [B,T,H,hd]
        if self.normalize:
            y = self.readings_norm(y)
        y = y.reshape(B, T, d)
        if self.gated:
            y = torch.sigmoid(self.Wog(x)) * y
        out = self.Wo(y)
        return (out, M) if return_state else out


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, i: int, cfg: "ref.RefConfig"):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if self.kind == "sdm":
            self.attention = SdmMemory(cfg.dim, cfg)
        else:
            self.attention = Attention(cfg.dim, cfg.attn[i], cfg.rope_theta)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class SdmLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        cfg = ref.RefConfig.from_dict(config)
        assert not cfg.weight_tying and not cfg.attn_gate
        self.config_dict = dict(config)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(i, cfg) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def init_weights(self, seed: int, beta_bias: float = 0.0) -> None:
        """Truncated-normal init with std dim^-0.5 (hidden^-0.5 for w2; output projections scaled
        by 1/sqrt(2 n_layers)); SDM decay rates A log-uniform in [A_init_range], which we default
        to slow decay so the memory can hold a fact over a long stretch from the start.
        `beta_bias` starts the SDM write strength beta = sigmoid(b_proj(x)) near sigmoid(beta_bias):
        a negative value makes ordinary text overwrite a slot slowly until the model learns which
        bytes are worth writing, so a fact survives long enough for recall to be learnable."""
        gen = torch.Generator().manual_seed(seed)
        d = self.cfg.dim
        depth = math.sqrt(2 * self.cfg.n_layers)

        def tn(p, std):
            with torch.no_grad():
                t = torch.randn(p.shape, generator=gen).clamp_(-3, 3) * std
                p.copy_(t)

        tn(self.tok_embeddings.weight, 1.0)
        tn(self.output.weight, d ** -0.5)
        for layer in self.layers:
            at = layer.attention
            if isinstance(at, Attention):
                for m in (at.wq, at.wk, at.wv):
                    tn(m.weight, d ** -0.5)
                tn(at.wo.weight, d ** -0.5 / depth)
            else:
                for m in (at.Wq_read, at.Wk_write, at.Wv_write, at.a_proj, at.b_proj):
                    tn(m.weight, d ** -0.5)
                    nn.init.zeros_(m.bias)
                nn.init.constant_(at.b_proj.bias, beta_bias)
                tn(at.Wo.weight, d ** -0.5 / depth)
                nn.init.zeros_(at.Wo.bias)
                if at.gated:
                    tn(at.Wog.weight, d ** -0.5)
                    nn.init.zeros_(at.Wog.bias)
                lo, hi = self.cfg.sdm_arg("A_init_range", [0.01, 1.0])
                lo = max(float(lo), 1e-4)
                u = torch.rand(at.H, generator=gen)
                with torch.no_grad():
                    at.A_log.copy_(math.log(lo) + u * (math.log(float(hi)) - math.log(lo)))
                    at.dt_bias.zero_()
                if at.learned_m0:
                    tn(at.memory, 0.02)
            ff = layer.feed_forward
            tn(ff.w1.weight, d ** -0.5)
            tn(ff.w3.weight, d ** -0.5)
            tn(ff.w2.weight, self.cfg.ffn_hidden ** -0.5 / depth)

    def reference_state_dict(self) -> Dict[str, torch.Tensor]:
        """The state dict under the reference's names (exactly expected_tensor_shapes)."""
        sd = {k: v.detach() for k, v in self.state_dict().items()}
        want = ref.expected_tensor_shapes(self.cfg)
        assert set(sd) == set(want), (sorted(set(sd) ^ set(want)))
        return {k: sd[k] for k in want}

    def count_params(self, include_m0: bool = True) -> int:
        n = 0
        for name, p in self.named_parameters():
            if not include_m0 and name.endswith("attention.memory"):
                continue
            n += p.numel()
        return n
