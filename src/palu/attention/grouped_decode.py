"""One query token attending to a dense cache with its query heads grouped by KV head: each key
and value is read once a step instead of copied per query head (`repeat_interleave`, as
transformers does whenever a mask is given). On a GPU through `palu_kernels.dense_decode` (split
over the sequence; SDPA's masked kernel parallelises over rows and heads only), elsewhere
through SDPA. Used by the decode steps replayed as CUDA graphs (`eval/static_decode.py`: the
plain model's `StaticCache`, and the eviction methods' preallocated slots)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def dense_decode_kernel(query: torch.Tensor):
    """`palu_kernels.dense_decode` on a GPU, or None (PALU_DENSE_DECODE=0, or Triton or the
    kernels package missing: SDPA's masked kernel then)."""
    if query.device.type != "cuda" or os.environ.get("PALU_DENSE_DECODE", "1") == "0":
        return None
    try:
        from palu_kernels.dense_decode import dense_decode
    except ImportError:
        return None
    return dense_decode


def grouped_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """query (B, nh, 1, D), key / value (B, H, L, D), mask (B, 1, 1, L) bool (True: may attend):
    the attention output (B, nh, 1, D)."""
    B, nh, _, D = query.shape
    grouped = query.reshape(B, key.shape[1], nh // key.shape[1], D)
    kernel = dense_decode_kernel(query)
    if kernel is not None:
        out = kernel(grouped, key, value, mask, scale)
    else:
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
    return out.reshape(B, nh, 1, D)
