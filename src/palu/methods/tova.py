"""TOVA (Oren et al., 2024): a fixed budget of tokens per KV head; whenever a step leaves more,
the tokens the step's last query attends to least (its attention averaged over the head's query
heads) are evicted. The prefill keeps what its last query attends to most. Decoding one token at a
time is the method; a one-pass window is not (its queries would all see every token), so one-pass
scores are refused (`one_pass`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.eviction import ScoredEviction
from .base import check_int
from .token_subset import TokenSubset


class TovaPolicy(ScoredEviction):
    """TOVA's scorer (`cache/eviction.py` does the budget and the top-k)."""

    def __init__(self, budget: int):
        self.budget_tokens = budget

    def budget(self, layer, tokens):
        return self.budget_tokens

    def scores(self, layer, queries, keys, scale=None):
        """The step's last query's attention to each token, averaged over the KV head's query heads."""
        B, H, S, d = keys.shape
        n_rep = queries.shape[1] // H
        last = queries[:, :, -1:]                                            # (B, nh, 1, d)
        k = keys.repeat_interleave(n_rep, 1)
        weights = ((last @ k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)).softmax(-1)
        return weights[:, :, 0].view(B, H, n_rep, S).mean(2)                 # (B, H, S)

    @property
    def slot_cap(self) -> int:
        return self.budget_tokens

    def slot_victim(self, votes, positions, held):
        # the token this step's query attends to least (`keep`'s top-k of budget + 1 drops it)
        return votes.masked_fill(~held, float("inf")).argmin(-1)

    def padded_width(self, slots, seen):
        # a row keeps min(its tokens, budget); the fullest row holds `slots` tokens
        return min(slots, self.budget_tokens)

    def keep_padded(self, layer, queries, keys, positions, seen, scale=None):
        real = positions >= 0                                                # (B, H, S)
        B, H, S, d = keys.shape
        if S <= self.budget_tokens:
            return real
        n_rep = queries.shape[1] // H
        k = keys.repeat_interleave(n_rep, 1)
        logits = (queries[:, :, -1:] @ k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
        logits = logits.masked_fill(~real.repeat_interleave(n_rep, 1)[:, :, None], float("-inf"))
        votes = logits.softmax(-1)[:, :, 0].view(B, H, n_rep, S).mean(2)     # a row's own softmax
        top = votes.masked_fill(~real, -1.0).topk(self.budget_tokens, dim=-1).indices
        # a row with no more tokens than the budget keeps them all (its top-k takes fillers too)
        return torch.zeros_like(real).scatter_(-1, top, True) & real


@dataclass
class Tova(TokenSubset):
    name = "tova"
    one_pass = False
    budget: int = 512        # tokens kept per KV head

    def check(self) -> None:
        check_int(self.budget, "budget")

    @property
    def tag(self) -> str:
        return f"tova-n{self.budget}"

    @property
    def policy(self) -> TovaPolicy:
        return TovaPolicy(self.budget)

    def summary(self) -> dict:
        return {"kv_bits": 16, "family": "eviction", "budget": self.budget}
