"""Rotary position embedding in the Hugging Face (half-split) convention."""
from __future__ import annotations

import torch

# the fused kernel (`palu_kernels.fused_ops.rope`, bit for bit this module's expression), set by
# `palu.models.fused_layers` while a batch is answered on a GPU; it answers None where it does not
# apply (partial rotary, float32, a CPU), and torch rotates
kernel = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, d); cos/sin (B, T, r) from the model's rotary embedding. r < d (partial
    rotary, Phi-3's `partial_rotary_factor`): the first r dims rotate, the rest pass through."""
    out = None if kernel is None else kernel(x, cos, sin)   # None where the kernel does not apply
    if out is not None:
        return out
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :r], x[..., r:]
    return torch.cat([head * cos + rotate_half(head) * sin, rest], dim=-1)
