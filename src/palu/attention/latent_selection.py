"""Latent-space token selection for Palu (ours; issue 36): a decode step scores every cached
token with the query folded into the group's key factor and the token's latent,
`Σ_heads (B_k,headᵀ q_head)[:sketch] · h_j[:sketch]`, keeps the best `tokens` per group plus the
newest `window`, and attends exactly (keys rebuilt, RoPE at their positions) over those only.

With RoPE the score uses the query *before* its rotation and the latent before the key's: the
relative rotation between them is ignored (an approximation, measured by `recalls`: the exact
attention mass the chosen tokens carry). Without RoPE the folded query is exact, so with every
latent channel (`sketch` None) the score is the true logit. A family with a k-norm is refused:
the norm acts on the rebuilt key, so a latent dot product no longer ranks tokens by their logit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LatentSelection:
    tokens: int                  # tokens chosen per group beyond the window
    window: int                  # newest tokens always read
    sketch: int | None = None    # leading latent channels the score reads (None: all)
    recalls: list | None = field(default=None)   # set to [] to record the attention mass captured
    oracle: list = field(default_factory=list)   # beside it: the mass of the best set of that size

    def query_latents(self, attn, g: int, q_pre: torch.Tensor) -> torch.Tensor:
        """Group g's queries folded into its key factor: (B, heads_g, 1, r_g)."""
        Bk = getattr(attn, f"B_k{g}")
        heads = attn._query_heads(g)
        return torch.stack([q_pre[:, i] @ Bk[attn._local_kv(i, g)].to(q_pre.dtype) for i in heads], 1)

    def choose(self, q_lat: torch.Tensor, hk_g: torch.Tensor,
               visible: torch.Tensor | None = None) -> torch.Tensor | None:
        """Indices (B, n) of the tokens read, in order; None when every token would be.
        `visible` (B, S) bool: a left-padded batch's real tokens; a pad is never preferred to a
        real token (a row with fewer real tokens than the budget gets pads, which its mask hides)."""
        B, S, r = hk_g.shape
        if S <= self.tokens + self.window:
            return None
        s = r if self.sketch is None else min(self.sketch, r)
        scores = (q_lat[..., :s] @ hk_g[:, None, :, :s].transpose(-1, -2)).sum(1)[:, 0]   # (B, S)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        older = S - self.window
        top = scores[:, :older].topk(self.tokens, dim=-1).indices
        recent = torch.arange(older, S, device=hk_g.device).expand(B, -1)
        return torch.cat([top.sort(-1).values, recent], -1)

    def record(self, probs: torch.Tensor, idx: torch.Tensor) -> None:
        """`probs` (B, h, 1, S): the exact attention over every token; the mass of the chosen."""
        if self.recalls is not None:
            p = probs[:, :, 0]
            mass = p.gather(-1, idx[:, None].expand(-1, p.shape[1], -1)).sum(-1)
            self.recalls.extend(mass.flatten().tolist())
            self.oracle.extend(p.topk(idx.shape[-1], dim=-1).values.sum(-1).flatten().tolist())
