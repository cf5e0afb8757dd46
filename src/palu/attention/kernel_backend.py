"""Decode fast path: PaluAttention over the latent cache through the Triton kernels.

`backend="auto"` uses it for one-token decode steps of fp16/bf16 models on CUDA when the kernel
can serve the layer (uniform ranks across groups, no padding mask, no RoPE attention scaling,
RoPE head_dim 32, 64, 128, ...); everything else takes the torch reference path. RoPE scaling types
that only change the frequencies (linear, llama3, dynamic NTK) are served: the kernels read
inv_freq from the model's rotary module at each step; YaRN / LongRoPE also scale the logits
(attention_scaling != 1) and take the torch path. Palu re-rotates every cached key each step,
so under dynamic NTK old keys follow the current frequencies (a dense HF cache keeps the
rotation they were stored with). A family with a k-norm (Qwen3, Gemma-3, OLMo-2) or partial
rotary (some Phi-3) takes the torch path: the kernels rebuild and rotate keys without a norm, over
the whole head. `backend="triton"` forces it whenever it can run at all (any dtype; on CPU
through TRITON_INTERPRET=1: tests).
"""
from __future__ import annotations

import os

import torch


def can_use_kernel(attn, x, mask, bits: int = 16) -> str | None:
    """None if the kernel can run this step, else the reason it cannot (`bits`: the cache's
    packed width, 16 for unquantised latents)."""
    if x.shape[1] != 1:
        return "prefill (more than one query token)"
    if getattr(attn, "k_norm", None) is not None:
        return "k-norm (Qwen3, Gemma-3, OLMo-2: keys are normalised after they are rebuilt; no kernel does that)"
    if attn.geom.rope and 2 * attn._rotary[0].inv_freq.numel() != attn.geom.head_dim:
        return f"partial rotary ({2 * attn._rotary[0].inv_freq.numel()} of {attn.geom.head_dim} dims rotate)"
    from palu.quant.packed import KERNEL_BITS, UNQUANTISED
    if bits != UNQUANTISED and bits not in KERNEL_BITS:
        return f"{bits}-bit latents (the kernels read {KERNEL_BITS})"
    if len(set(attn.ranks_k)) != 1 or len(set(attn.ranks_v)) != 1:
        return "ranks differ between groups"
    per = 1 if bits == UNQUANTISED else 8 // bits
    if attn.ranks_k[0] % per or attn.ranks_v[0] % per:
        return f"ranks ({attn.ranks_k[0]}, {attn.ranks_v[0]}) are padded in the packed layout"
    if (attn.ranks_k[0] // per) % 16 or (attn.ranks_v[0] // per) % 16:
        return f"ranks ({attn.ranks_k[0]}, {attn.ranks_v[0]}) give stored columns not a multiple of 16"
    if attn.backend == "auto" and (x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16)):
        return "auto backend: kernels only for fp16/bf16 on CUDA"
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU)"
    if mask is not None and not (mask.dtype == torch.bool and bool(mask.all())):
        return "padding mask"
    if attn.geom.rope:
        rotary = attn._rotary[0]
        if getattr(rotary, "attention_scaling", 1.0) != 1.0:
            return "rope scaling with attention_scaling (YaRN / LongRoPE scale the logits)"
        half = attn.geom.head_dim // 2
        if attn.geom.head_dim % 2 or half < 16 or half & (half - 1):
            return f"head_dim {attn.geom.head_dim}: the kernels rotate halves of a power of two >= 16"
    return None


def kernel_decode(attn, x, q, hk, hv, *, kpos=None, contiguous: bool | None = None, lengths=None,
                  position_offset=None):
    """One decode step through palu_kernels.palu_decode; returns the layer output (B, 1, hidden).

    `hk`, `hv`: the cached latents in the kernels' layout ([B, G, T, r], or packed QuantLatents).
    RoPE positions: `position_offset` [B] (token t of row b at position_offset[b] + t), or
    `kpos` (B or 1, T) with `contiguous` saying whether every row runs p0, p0 + 1, ...
    (LatentCache tracks it as tokens arrive; None checks here, O(T) and one host sync).
    `lengths` [B]: tokens to read per row (default all T); a device tensor is not read on the host.
    """
    from palu_kernels.palu_decode import palu_decode
    B = x.shape[0]
    hk, hv = _kernel_dtype(hk), _kernel_dtype(hv)
    kw = dict(scale=attn._sdpa_scale(), n_rep=attn.geom.n_rep, group_size=attn.group_size, lengths=lengths)
    if attn.geom.rope:
        if attn.k_bias is not None:
            return None  # a key bias is not folded into the kernel's rebuild
        bk = _stacked_bk(attn)
        if position_offset is not None:
            where = dict(position_offset=position_offset)
        else:
            pos = kpos.expand(B, -1)
            if contiguous is None:
                steps = torch.arange(pos.shape[1], device=pos.device, dtype=pos.dtype)
                contiguous = torch.equal(pos, pos[:, :1] + steps)
            # the usual cache: the kernels' fast RoPE path
            where = dict(position_offset=pos[:, 0]) if contiguous else dict(positions=pos)
        z = palu_decode(_kernel_dtype(q[:, :, 0]), hk, hv, bk=bk, inv_freq=attn._rotary[0].inv_freq,
                        **where, **kw)
    else:
        qf = attn._fused_queries(x)                                        # (B, H, 1, r)
        z = palu_decode(_kernel_dtype(qf[:, :, 0]), hk, hv, **kw)
    z = z.to(x.dtype).reshape(B, -1)            # (B, H * r_v): heads in Wo_fused's column order
    return torch.addmm(attn.o_bias_fused.expand(B, -1), z, attn.Wo_fused.T)[:, None]


def _kernel_dtype(t):
    """fp16 and bf16 go to the kernels as they are (bf16 is converted on-chip); anything else
    (fp32 models in interpreter tests) as fp16. Packed latents are bytes already."""
    if not isinstance(t, torch.Tensor) or t.dtype in (torch.float16, torch.bfloat16):
        return t
    return t.half()


def _stacked_bk(attn) -> torch.Tensor:
    """The groups' B_k as one fp16 tensor [G, s*hd, r], built once per module (and again if the
    module moves or a B_k is written in place): stacking it every step cost a copy of every B_k
    per layer and token."""
    first = attn.B_k0
    key = (first.device, first.dtype) + tuple((b.data_ptr(), b._version) for b in
                                              (getattr(attn, f"B_k{g}") for g in range(attn.n_groups)))
    cached = getattr(attn, "_kernel_bk", None)
    if cached is None or cached[0] != key:
        bk = torch.stack([getattr(attn, f"B_k{g}") for g in range(attn.n_groups)]).half()
        attn._kernel_bk = cached = (key, bk)
    return cached[1]
