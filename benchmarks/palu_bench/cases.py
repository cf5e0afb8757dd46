"""Random inputs of one decode-attention configuration for the latency benchmarks, with their byte
and FLOP counts: Palu latents (optionally packed) and factors, or a dense K/V cache."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim, theta, device):
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))


def latent_bytes(B, G, T, r, bits):
    if bits == 16:
        return B * G * T * r * 2
    return B * G * T * (r * bits // 8 + 4)  # packed data + fp16 scale + fp16 zero point


def palu_case(shape, B, T, s, kept_k, kept_v, bits, rope, device="cuda", seed=0):
    """Random latents / factors for one configuration, plus its byte and FLOP counts."""
    from palu.quant.packed import quantize_latent
    H, KVH, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    G, n_rep = KVH // s, H // KVH
    rk, rv = int(kept_k * s * D), int(kept_v * s * D)
    g = torch.Generator(device=device).manual_seed(seed)
    hk = torch.randn(B, G, T, rk, device=device, dtype=torch.float16, generator=g)
    hv = torch.randn(B, G, T, rv, device=device, dtype=torch.float16, generator=g)
    q = torch.randn(B, H, D if rope else rk, device=device, dtype=torch.float16, generator=g)
    bk = (torch.randn(G, s * D, rk, device=device, dtype=torch.float16, generator=g)
          / math.sqrt(rk)) if rope else None
    if bits != 16:
        hk, hv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=1 / math.sqrt(D), n_rep=n_rep, group_size=s, bk=bk,
              position_offset=torch.zeros(B, device=device, dtype=torch.int32),
              inv_freq=rope_inv_freq(D, shape["rope_theta"], device))
    from palu_kernels.palu_decode import _fused_unfit
    one_pass = _fused_unfit(rope, rk, rv, bits, bits, max(16, s * n_rep)) is None
    nbytes = (latent_bytes(B, G, T, rk, bits) + latent_bytes(B, G, T, rv, bits)
              + (0 if one_pass else 2 * B * H * T * 4)        # scores written and read back
              + (bk.numel() * 2 if rope else 0))
    flops = 2 * B * T * H * rv + (2 * B * T * (KVH * D * rk + H * D) if rope else 2 * B * T * H * rk)
    return q, hk, hv, kw, {"rank_k": rk, "rank_v": rv, "groups": G, "bytes": nbytes, "flops": flops}


def dense_case(shape, B, T, device="cuda", seed=0):
    H, KVH, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, 1, D, device=device, dtype=torch.float16, generator=g)
    k = torch.randn(B, KVH, T, D, device=device, dtype=torch.float16, generator=g)
    v = torch.randn(B, KVH, T, D, device=device, dtype=torch.float16, generator=g)
    return q, k, v, {"bytes": 2 * B * KVH * T * D * 2, "flops": 4 * B * H * T * D}
