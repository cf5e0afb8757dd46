"""The eviction contract (issue 49, kvpress's shape): a method writes only its scorer; this base
does the budget, the newest tokens always kept, the top-k, the kept order, and the sharing of one
kept set by several heads. Every storage calls the same `keep` / `scores`: the plain subset cache
(`subset_cache.py`, one set per KV head), the quantised cache (`quant_cache.py`, after the
prefill) and the latent cache (`latent_cache.py`, one set per layer: its groups' latents share one
token axis, so the heads' scores are averaged first, `choose`). So a scorer composes with any
storage (`palu/methods/palu_evict.py`).

A scorer returns, for a step's queries (B, nh, T, d) and the keys held (B, H, S, d), one score per
KV head for each of the S - `protected` older tokens (higher: kept). Stateful scorers (H2O's
accumulated attention) follow the kept tokens through `kept`.
"""
from __future__ import annotations

import torch

from .subset_cache import SubsetPolicy


class ScoredEviction(SubsetPolicy):
    # newest tokens always kept (SnapKV's observation window, H2O's recent window)
    protected = 0
    # whether `scores` must see every step although nothing is evicted (H2O accumulates)
    accumulates = False

    def budget(self, layer: int, tokens: int) -> int:
        """Tokens layer `layer` holds after a step that leaves it `tokens`."""
        raise NotImplementedError

    def scores(self, layer: int, queries: torch.Tensor, keys: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """(B, H, S - protected): how much each older token deserves to stay, per KV head."""
        raise NotImplementedError

    def kept(self, layer: int, keep: torch.Tensor | None) -> None:
        """The indices (B, X, n) just kept (None: all), for a scorer with state per token."""

    def evicts(self, layer: int, tokens: int) -> bool:
        """Whether a step leaving `tokens` tokens evicts any (host integers only: no device wait)."""
        return max(self.protected, self.budget(layer, tokens)) < tokens

    def choose(self, layer: int, scores: torch.Tensor, S: int) -> torch.Tensor | None:
        """Indices (B, X, n) of the tokens to hold, in order, from scores (B, X, S - protected):
        X KV heads, or 1 for a set shared by heads (their scores averaged by the caller)."""
        n = max(self.protected, self.budget(layer, S))
        if n >= S:
            return None
        w = self.protected
        top = scores.topk(n - w, dim=-1).indices.sort(-1).values
        recent = torch.arange(S - w, S, device=scores.device).expand(*scores.shape[:2], w)
        return torch.cat([top, recent], -1)

    def keep_shared(self, layer: int, parts, scale: float | None = None) -> torch.Tensor | None:
        """`keep` for a storage whose heads share one kept set (the latent cache: a layer's groups
        share one token axis): `parts` [(queries, keys)] (Palu's groups, or all heads at once),
        every KV head's scores averaged. (B, 1, n) indices, or None to keep all. Stateless scorers
        only (a stateful one's state follows per-head sets)."""
        if self.accumulates:
            raise TypeError(f"{type(self).__name__} keeps state per KV head's tokens; a storage "
                            "whose heads share one kept set cannot hold it")
        S = parts[0][1].shape[2]
        if not self.evicts(layer, S):
            return None
        scores = torch.cat([self.scores(layer, q, k, scale) for q, k in parts], 1)
        return self.choose(layer, scores.mean(1, keepdim=True), S)

    def keep(self, layer, queries, keys, positions, seen, prefill, scale=None):
        if not (prefill or self.keeps_after_prefill):
            return None
        S = keys.shape[2]
        if not self.evicts(layer, S):
            if self.accumulates:
                self.scores(layer, queries, keys, scale)
                self.kept(layer, None)
            return None
        keep = self.choose(layer, self.scores(layer, queries, keys, scale), S)
        self.kept(layer, keep)
        return keep
