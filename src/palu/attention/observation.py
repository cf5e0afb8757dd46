"""SnapKV's vote (methods/snapkv.py, and its compositions): how much attention the prompt's last
`window` queries give each older token, per query head. Here so that attention modules (Palu's)
and policies share it without importing the methods package."""
from __future__ import annotations

import torch


def window_votes(queries, keys, window: int, scale: float | None = None) -> torch.Tensor:
    """(B, h, S - window): each query head's attention from the prompt's last `window` queries
    (B, h, T, d) to every key (B, h_kv, S, d) older than the window, summed over the window."""
    S, d = keys.shape[2], keys.shape[-1]
    k = keys.repeat_interleave(queries.shape[1] // keys.shape[1], 1)
    scores = (queries[:, :, -window:] @ k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
    causal = torch.arange(S, device=keys.device)[None] <= torch.arange(S - window, S, device=keys.device)[:, None]
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)[..., :S - window].sum(2)
