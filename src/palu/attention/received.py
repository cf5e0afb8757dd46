"""The attention each cached key receives from a step's queries, summed over the queries and the
query heads of its KV head (H2O's score, `palu/methods/h2o.py`), for a batch whose rows may be
padded: visibility by position (query t of row b sees key j of KV head h when
0 <= k_pos[b, h, j] <= q_pos[b, t]; a negative position is a pad or a filler).

On a GPU a Triton kernel computes it without storing the scores (`palu_kernels.received`);
elsewhere, and where the kernel does not apply, torch does, a chunk of queries at a time.
"""
from __future__ import annotations

import torch

# the torch path's scores per chunk of queries, at most (at a prefill of 64 rows x 4K tokens and
# 9 query heads: 115 queries a chunk, 35 chunks a layer)
SCORES_AT_ONCE = 2 ** 28


def received(q, k, q_pos, k_pos, scale: float, kernel=None) -> torch.Tensor:
    """q (B, Hq, T, D), k (B, H, S, D), the step's queries being the last T slots; q_pos (B, T),
    k_pos (B, H, S). Returns (B, H, S) float32 at least (float64 for float64 inputs).
    `kernel`: a test's choice of kernel (default: `palu_kernels.received` where it applies)."""
    kernel = received_kernel(q) if kernel is None else kernel
    if kernel is not None:
        return kernel(q, k, q_pos, k_pos, scale)
    return received_torch(q, k, q_pos, k_pos, scale)


def received_kernel(q: torch.Tensor):
    """The kernel for q on a GPU in a dtype and head width it takes, else None."""
    D = q.shape[-1]
    if (q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or D < 16 or D & (D - 1)):
        return None
    try:
        from palu_kernels.received import attention_received
    except ImportError:
        return None
    return attention_received


def received_torch(q, k, q_pos, k_pos, scale: float) -> torch.Tensor:
    B, Hq, T, d = q.shape
    H, S = k.shape[1], k.shape[2]
    rep = Hq // H
    kr = k.repeat_interleave(rep, 1)
    kp = k_pos.repeat_interleave(rep, 1)[:, :, None]                      # (B, Hq, 1, S)
    out = torch.zeros(B, H, S, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    chunk = max(1, SCORES_AT_ONCE // max(1, B * Hq * S))
    for t0 in range(0, T, chunk):
        qp = q_pos[:, None, t0:t0 + chunk, None]                          # (B, 1, c, 1)
        seen = (kp >= 0) & (kp <= qp)
        logits = (q[:, :, t0:t0 + chunk] @ kr.transpose(-1, -2)) * scale
        weights = logits.masked_fill(~seen, float("-inf")).softmax(-1).masked_fill(qp < 0, 0.0)
        out += weights.sum(2, dtype=out.dtype).view(B, H, rep, S).sum(2)
    return out
