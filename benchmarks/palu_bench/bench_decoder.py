"""A Llama-shaped decoder for end-to-end decode benchmarks, one token per step.

Dense: static fp16 KV cache + torch SDPA. Palu: `StaticLatentCache` (fp16 or packed 2/4/8-bit
latents) + the Triton latent kernels, with per-group factors A (latents = A x) and B (keys are
rebuilt on-chip as B h, then rotated; values are rebuilt *after* attention from the latent
output, z_i B_v,i, then o_proj). Everything a step does is static, so a step is captured as
one CUDA graph and replayed, as a serving stack runs decode.

Decode time depends on the shapes, not on the weight values, so benchmarks use random weights;
`palu_from_dense` builds an exact (full-rank) or truncated factorisation of a dense decoder, which
the tests use to check that both paths compute the same model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .static_cache import StaticLatentCache


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-5
    rope: bool = True        # False: an OPT-like model of the same shape (no rotary embedding)

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"decoder shape: {name}={getattr(self, name)} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")

    @property
    def n_rep(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class PaluSpec:
    group_size: int      # KV heads per latent group
    rank_k: int          # latent rank per group
    rank_v: int
    bits: int = 16       # latent storage: 16 (fp16) or 2 / 4 / 8 (packed, per-token scales)

    @classmethod
    def from_kept(cls, shape: DecoderShape, group_size: int, kept_k: float, kept_v: float, bits: int = 16):
        if shape.kv_heads % group_size:
            raise ValueError(f"group_size={group_size} does not divide kv_heads={shape.kv_heads}")
        full = group_size * shape.head_dim
        for name, kept in (("kept_k", kept_k), ("kept_v", kept_v)):
            if not 0 < kept <= 1:
                raise ValueError(f"{name}={kept} must be in (0, 1]")
        return cls(group_size, round(kept_k * full), round(kept_v * full), bits)


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    """x [B, h, D] at one position (half-split convention, as Llama in transformers)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class StaticKVCache:
    """Dense fp16 keys/values [B, KV heads, max_tokens, head_dim] per layer, preallocated."""

    def __init__(self, shape: DecoderShape, batch: int, max_tokens: int, device, dtype):
        size = (batch, shape.kv_heads, max_tokens, shape.head_dim)
        self.keys = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.layers)]
        self.max_tokens = max_tokens

    def fill_random(self, seed: int = 0) -> None:
        gen = torch.Generator(device=self.keys[0].device).manual_seed(seed)
        for t in self.keys + self.values:
            t.normal_(generator=gen)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class Decoder:
    """Random-weight Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU); dense or Palu attention."""

    def __init__(self, shape: DecoderShape, palu: PaluSpec | None = None, device="cpu",
                 dtype=torch.float16, seed: int = 0, kernel_params: dict | None = None, init=True,
                 weight_std: float = 0.02, fused_ops: bool | None = None):
        self.shape, self.palu, self.device, self.dtype = shape, palu, torch.device(device), dtype
        self.kernel_params = kernel_params or {}
        # residual add + RMSNorm and SiLU * up as one Triton launch each (palu_kernels/fused_ops.py);
        # None: on a GPU. Dense and Palu models alike.
        self.fused_ops = self.device.type == "cuda" if fused_ops is None else fused_ops
        if palu is not None:
            if shape.kv_heads % palu.group_size:
                raise ValueError(f"group_size={palu.group_size} does not divide kv_heads={shape.kv_heads}")
            self.groups = shape.kv_heads // palu.group_size
        half = torch.arange(0, shape.head_dim, 2, device=self.device, dtype=torch.float32)
        self.inv_freq = 1.0 / shape.rope_theta ** (half / shape.head_dim)
        self.layers: list[dict] = []
        if init:
            self._random_weights(seed, weight_std)

    # ---- weights ------------------------------------------------------------------------------
    def _random_weights(self, seed, weight_std):
        s, gen = self.shape, torch.Generator(device=self.device).manual_seed(seed)

        def rand(*size, std=weight_std):
            return (torch.randn(*size, device=self.device, generator=gen) * std).to(self.dtype)

        D, H, KV = s.head_dim, s.heads, s.kv_heads
        self.embed = rand(s.vocab, s.hidden, std=1.0)
        self.norm, self.lm_head = torch.ones(s.hidden, device=self.device, dtype=self.dtype), rand(s.vocab, s.hidden)
        for _ in range(s.layers):
            layer = {"ln1": self.norm.clone(), "ln2": self.norm.clone(), "wq": rand(H * D, s.hidden),
                     "wo": rand(s.hidden, H * D), "w_gate_up": rand(2 * s.intermediate, s.hidden),
                     "w_down": rand(s.hidden, s.intermediate)}
            if self.palu is None:
                layer["wkv"] = rand(2 * KV * D, s.hidden)
            else:
                p, G = self.palu, self.groups
                layer["a_kv"] = rand(G * (p.rank_k + p.rank_v), s.hidden)
                if s.rope:
                    layer["bk"] = rand(G, p.group_size * D, p.rank_k, std=1 / math.sqrt(p.rank_k))
                else:   # B_k rows of each query head's KV head, as (D, r_k): q~ = B_kᵀ q
                    layer["bkq"] = rand(H, D, p.rank_k, std=1 / math.sqrt(D))
                layer["bv"] = rand(H, p.rank_v, D, std=1 / math.sqrt(p.rank_v))
            self.layers.append(layer)

    @classmethod
    def palu_from_dense(cls, dense: "Decoder", palu: PaluSpec) -> "Decoder":
        """Per-group truncated SVD of the dense W_k / W_v (exact at full rank), float64."""
        s = dense.shape
        out = cls(s, palu, dense.device, dense.dtype, kernel_params=dense.kernel_params, init=False,
                  fused_ops=dense.fused_ops)
        out.embed, out.norm, out.lm_head = dense.embed, dense.norm, dense.lm_head
        n = palu.group_size * s.head_dim                                   # rows of one group

        def factor(w, r):   # per group g: W_g ≈ B_g A_g, singular values split evenly
            A, B = [], []
            for g in range(out.groups):
                U, S, Vh = torch.linalg.svd(w[g * n:(g + 1) * n], full_matrices=False)
                root = S[:r].sqrt()
                A.append(root[:, None] * Vh[:r])                            # (r, hidden)
                B.append(U[:, :r] * root)                                   # (s*D, r)
            return A, B

        for layer in dense.layers:
            wk, wv = layer["wkv"].double().split(s.kv_heads * s.head_dim)
            (ak, bk), (av, bv) = factor(wk, palu.rank_k), factor(wv, palu.rank_v)
            a_kv = torch.cat(ak + av)            # the layout `_attend` splits: all keys, then values
            new = {k: v for k, v in layer.items() if k != "wkv"}
            new.update(a_kv=a_kv.to(dense.dtype), bv=cls._per_head(bv, s, palu, True, dense.dtype))
            if s.rope:
                new["bk"] = torch.stack(bk).to(dense.dtype)
            else:
                new["bkq"] = cls._per_head(bk, s, palu, False, dense.dtype)
            out.layers.append(new)
        return out

    @staticmethod
    def _per_head(B, s: DecoderShape, palu: PaluSpec, transpose: bool, dtype):
        """Per query head i, the rows of its KV head (i // n_rep) in its group's B: (H, D, r)."""
        D, out = s.head_dim, []
        for i in range(s.heads):
            kv = i // s.n_rep
            rows = B[kv // palu.group_size][(kv % palu.group_size) * D:(kv % palu.group_size + 1) * D]
            out.append(rows.T if transpose else rows)
        return torch.stack(out).to(dtype)

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm, self.lm_head] + [t for lay in self.layers for t in lay.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- cache and one decode step ------------------------------------------------------------
    def new_cache(self, batch: int, max_tokens: int):
        if self.palu is None:
            return StaticKVCache(self.shape, batch, max_tokens, self.device, self.dtype)
        p = self.palu
        return StaticLatentCache(self.shape.layers, batch, self.groups, max_tokens, p.rank_k, p.rank_v,
                                 p.bits, self.device, self.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: int, cache) -> torch.Tensor:
        """Logits [B, vocab] for `tokens` [B] at position `pos`; the cache holds tokens < pos."""
        if not 0 <= pos < cache.max_tokens:
            raise ValueError(f"position {pos} outside the cache (max_tokens={cache.max_tokens})")
        s = self.shape
        ang = pos * self.inv_freq
        cos, sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)
        x, delta = self.embed[tokens], None
        for i, layer in enumerate(self.layers):
            x, h = self._add_norm(x, delta, layer["ln1"])
            attn = self._attend(i, layer, h, pos, cos, sin, cache)
            x, h = self._add_norm(x, F.linear(attn, layer["wo"]), layer["ln2"])
            delta = F.linear(self._swiglu(F.linear(h, layer["w_gate_up"])), layer["w_down"])
        x, h = self._add_norm(x, delta, self.norm)
        return F.linear(h, self.lm_head)

    def _add_norm(self, x, delta, w):
        """(x + delta, RMSNorm(x + delta) w); delta None: (x, RMSNorm(x) w)."""
        if self.fused_ops:
            from palu_kernels.fused_ops import add_rms_norm
            return add_rms_norm(x, delta, w, self.shape.eps)
        x = x if delta is None else x + delta
        return x, rms_norm(x, w, self.shape.eps)

    def _swiglu(self, gate_up):
        if self.fused_ops:
            from palu_kernels.fused_ops import silu_mul
            return silu_mul(gate_up)
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up

    def _attend(self, i, layer, h, pos, cos, sin, cache):
        s, B = self.shape, h.shape[0]
        D = s.head_dim
        q = F.linear(h, layer["wq"]).view(B, s.heads, D)
        if s.rope:
            q = rope(q, cos, sin)
        if self.palu is None:
            k, v = F.linear(h, layer["wkv"]).view(B, 2, s.kv_heads, D).unbind(1)
            cache.keys[i][:, :, pos] = rope(k, cos, sin) if s.rope else k
            cache.values[i][:, :, pos] = v
            out = F.scaled_dot_product_attention(q[:, :, None], cache.keys[i][:, :, :pos + 1],
                                                 cache.values[i][:, :, :pos + 1],
                                                 enable_gqa=s.n_rep > 1)
            return out.reshape(B, s.heads * D)
        from palu_kernels.palu_decode import palu_decode
        p, G = self.palu, self.groups
        hk, hv = F.linear(h, layer["a_kv"]).split([G * p.rank_k, G * p.rank_v], -1)
        cache.write(i, hk.view(B, G, 1, p.rank_k), hv.view(B, G, 1, p.rank_v), pos)
        keys, values = cache.read(i, pos + 1)
        kw = dict(scale=1 / math.sqrt(D), n_rep=s.n_rep, group_size=p.group_size, **self.kernel_params)
        if s.rope:
            z = palu_decode(q, keys, values, bk=layer["bk"], position_offset=self._zero_offsets(B),
                            inv_freq=self.inv_freq, **kw)                # (B, H, r_v) float32
        else:   # keys never rebuilt: scores are (B_kᵀ q)·h
            qt = torch.bmm(q.transpose(0, 1), layer["bkq"]).transpose(0, 1)   # (B, H, r_k)
            z = palu_decode(qt.contiguous(), keys, values, **kw)
        heads = torch.bmm(z.to(self.dtype).transpose(0, 1), layer["bv"])  # (H, B, D)
        return heads.transpose(0, 1).reshape(B, s.heads * D)

    def _zero_offsets(self, batch):
        cached = getattr(self, "_offsets", None)
        if cached is None or cached.shape[0] != batch:
            self._offsets = torch.zeros(batch, dtype=torch.int32, device=self.device)
        return self._offsets


def step_flops(shape: DecoderShape, palu: PaluSpec | None, context: int, batch: int = 1) -> int:
    """FLOPs of one decode step with `context` cached tokens (multiply-adds count 2)."""
    s, T = shape, context + 1
    H, KV, D, hid = s.heads, s.kv_heads, s.head_dim, s.hidden
    linear = H * D * hid + hid * H * D + 3 * hid * s.intermediate           # q, o, MLP
    if palu is None:
        linear += 2 * KV * D * hid
        attention = 4 * H * T * D                                           # q·k and p·v
    else:
        G = KV // palu.group_size
        linear += G * (palu.rank_k + palu.rank_v) * hid + H * palu.rank_v * D  # A_kv, B_v after attention
        values = 2 * H * T * palu.rank_v
        if s.rope:   # keys rebuilt on-chip (per KV head), then q·k
            attention = 2 * KV * T * D * palu.rank_k + 2 * H * T * D + values
        else:        # q~ = B_kᵀ q once, then q~·h
            linear += H * D * palu.rank_k
            attention = 2 * H * T * palu.rank_k + values
    return batch * (s.layers * (2 * linear + attention) + 2 * s.vocab * hid)
