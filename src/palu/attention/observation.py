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


# scores held at once by `window_votes_right_padded` (its rows split above it)
VOTE_BYTES = 1 << 28


def window_votes_right_padded(queries, keys, window: int, lengths: list[int],
                              scale: float | None = None) -> torch.Tensor:
    """`window_votes` for every row of a right-padded batch at once, row b being its first
    lengths[b] queries (B, h, T, d) and keys (B, h_kv, S, d): (B, h, S), row b's entries
    [0, lengths[b] - window) its votes alone, zero elsewhere (rows shorter than the window: all
    zero). The query heads are grouped by KV head, so the keys are not repeated."""
    B, h, _, d = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    rep, dev = h // H, keys.device
    n = torch.tensor(lengths, device=dev)
    start = (n - window).clamp(min=0)                                   # row b's first window query
    at = (start[:, None] + torch.arange(window, device=dev)).clamp(max=queries.shape[2] - 1)   # (B, w)
    j = torch.arange(S, device=dev)
    scale = scale if scale is not None else d ** -0.5
    per_row = h * window * S * queries.element_size() * 3
    step = max(1, VOTE_BYTES // max(per_row, 1))
    out = []
    for b0 in range(0, B, step):
        rows = slice(b0, b0 + step)
        b = at[rows].shape[0]
        q = queries[rows].gather(2, at[rows][:, None, :, None].expand(b, h, window, d))
        scores = (q.view(b, H, rep * window, d) @ keys[rows].transpose(-1, -2)) * scale   # (b, H, rep w, S)
        causal = j[None, None] <= at[rows][:, :, None]                                   # (b, w, S)
        scores = scores.view(b, H, rep, window, S).masked_fill(~causal[:, None, None], float("-inf"))
        votes = scores.softmax(-1).sum(3).view(b, h, S)
        out.append(votes.masked_fill(j[None, None] >= (n[rows] - window)[:, None, None], 0))
    return torch.cat(out)
