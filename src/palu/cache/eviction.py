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

    def scores_right_padded(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, lengths: list[int],
                            scale: float | None = None):
        """`scores` for every row of a right-padded batch at once (row b: its first lengths[b]
        queries and keys): (B, H, S), row b's first lengths[b] - protected entries what `scores`
        gives the row alone. NotImplemented: no such rule (`keep_right_padded` goes row by row)."""
        return NotImplemented

    def keep_right_padded(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, lengths: list[int],
                          scale: float | None = None):
        """`keep` after the prefill of a right-padded batch, every row choosing among its own first
        lengths[b] tokens with its own last queries: (index, counts), index (B, X, n) each row's kept
        tokens in order (its first counts[b] entries are what `keep` gives the row alone: all
        its tokens where it evicts none; zeros after), or (None, lengths) where no row evicts."""
        if not any(self.evicts(layer, n) for n in lengths):
            return None, list(lengths)
        scores = NotImplemented if self.accumulates else self.scores_right_padded(layer, queries, keys, lengths, scale)
        if scores is NotImplemented:   # row by row, each row's choice padded into one index
            kept = [self.keep(layer, queries[b:b + 1, :, :n], keys[b:b + 1, :, :n], None, n, prefill=True,
                              scale=scale) for b, n in enumerate(lengths)]
            X = next(k.shape[1] for k in kept if k is not None)
            kept = [torch.arange(n, device=keys.device).expand(1, X, n) if k is None else k
                    for k, n in zip(kept, lengths)]
            counts = [k.shape[-1] for k in kept]
            index = keys.new_zeros(len(kept), X, max(counts), dtype=torch.long)
            for b, k in enumerate(kept):
                index[b, :, :counts[b]] = k[0]
            return index, counts
        return self.choose_right_padded(layer, scores, lengths)

    def choose_right_padded(self, layer: int, scores: torch.Tensor, lengths: list[int]):
        """`choose` for every row at once, from `scores_right_padded`'s (B, X, S): row b keeps its
        top max(protected, budget) - protected older tokens, in order, then its newest
        `protected`; a row that evicts none keeps all its tokens. (index, counts) as
        `keep_right_padded` returns them; every count is a host integer."""
        w, dev = self.protected, scores.device
        evicts = [self.evicts(layer, n) for n in lengths]
        counts = [max(w, self.budget(layer, n)) if e else n for e, n in zip(evicts, lengths)]
        tops = [c - w if e else 0 for c, e in zip(counts, evicts)]         # older tokens each row keeps
        top_n = torch.tensor(tops, device=dev)                               # (B,)
        base = torch.tensor([n - w if e else 0 for n, e in zip(lengths, evicts)], device=dev)          # window's first
        older = torch.tensor(lengths, device=dev) - w
        B, X, S = scores.shape
        width, most = max(counts), max(tops)                                 # host integers: no device wait
        p = torch.arange(width, device=dev)
        index = base[:, None, None] + p - top_n[:, None, None]          # the window (all, for a row that evicts none)
        if most:
            j = torch.arange(S, device=dev)
            masked = scores.masked_fill(j >= older[:, None, None], float("-inf"))
            top = masked.topk(most, dim=-1).indices                     # best first; a row's own top_n[b] lead
            top = top.masked_fill(torch.arange(most, device=dev) >= top_n[:, None, None], S).sort(-1).values
            top = torch.nn.functional.pad(top, (0, width - most))
            index = torch.where(p < top_n[:, None, None], top, index)
        index = index.masked_fill(p >= torch.tensor(counts, device=dev)[:, None, None], 0)
        return index.expand(B, X, width), counts

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
