"""H2O (Zhang et al., NeurIPS 2023): heavy hitters plus the recent window. Every kept token
accumulates the attention it receives (summed over the steps' queries and the KV head's query
heads); once a KV head holds more than `budget` tokens, it keeps the newest `window` and the
`budget - window` older tokens with the highest accumulated attention. The accumulated scores
(float32 per kept token and KV head) are state the cache holds: counted as metadata. Decoding
one token at a time is the method, so one-pass scores are refused (`one_pass`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..attention.received import received
from ..cache.eviction import ScoredEviction
from .base import MethodError, check_int
from .token_subset import TokenSubset


class H2OPolicy(ScoredEviction):
    """H2O's scorer: per cache, the accumulated attention of every kept token, per layer (B, H, S)
    (`cache/eviction.py` does the budget, the recent window and the top-k)."""
    accumulates = True

    def __init__(self, budget: int, window: int):
        self.budget_tokens, self.window = budget, window
        self.protected = window
        self.accumulated: dict[int, torch.Tensor] = {}
        self._total: dict[int, torch.Tensor] = {}   # this step's totals, until `kept` says what stays

    def budget(self, layer, tokens):
        return self.budget_tokens

    def scores(self, layer, queries, keys, scale=None):
        B, H, S, d = keys.shape
        T, n_rep = queries.shape[2], queries.shape[1] // H
        k = keys.repeat_interleave(n_rep, 1)
        logits = (queries @ k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
        q_pos = torch.arange(S - T, S, device=keys.device)
        logits = logits.masked_fill(torch.arange(S, device=keys.device)[None] > q_pos[:, None], float("-inf"))
        received = logits.softmax(-1).sum(2).view(B, H, n_rep, S).sum(2).float()     # (B, H, S)
        old = self.accumulated.get(layer)
        total = received if old is None else received + torch.nn.functional.pad(old, (0, T))
        self._total[layer] = total
        return total[..., :S - self.window]

    def kept(self, layer, keep):
        total = self._total.pop(layer)
        self.accumulated[layer] = total if keep is None else total.gather(-1, keep)

    def padded_width(self, slots, seen):
        # a row keeps min(its tokens, budget); the fullest row holds `slots` tokens
        return min(slots, self.budget_tokens)

    def keep_padded(self, layer, queries, keys, positions, seen, scale=None):
        """Every row of a left-padded batch at once (the prefill and each eager decode step):
        each row's queries attend to its own tokens only (position >= 0, causal by position),
        the attention they give is added to the row's sums, and a row holding more than the
        budget keeps its newest `window` tokens and the `budget - window` older ones with the
        largest sums: `keep` for the row alone. The sums come from `attention/received.py` (a
        Triton kernel on a GPU, storing no scores); before, a padded batch scored row by row, a
        (heads, T, T) softmax per row and layer (64 x 30 at a 4K prefill). The state (`_total`
        until `kept`) is (B, H, S), each slot's sum (0 at fillers and pads)."""
        B, H, S, d = keys.shape
        T = queries.shape[2]
        real = positions >= 0                                                # (B, H, S)
        seen = seen.view(B, 1, 1).to(positions.dtype)
        q_pos = seen[:, 0] - T + torch.arange(T, device=keys.device)[None]   # (B, T); < 0: a pad
        # stored as float32, as `scores` stores them
        got = received(queries, keys, q_pos, positions, scale if scale is not None else d ** -0.5).float()
        old = self.accumulated.get(layer)
        self._total[layer] = got if old is None else got + torch.nn.functional.pad(old, (0, S - old.shape[-1]))
        counts = real.sum(-1, keepdim=True)                                  # (B, H, 1)
        if not bool((counts > self.budget_tokens).any()):
            return real
        older = real & (positions <= seen - 1 - self.window)
        top = self._total[layer].masked_fill(~older, float("-inf")).topk(self.budget_tokens - self.window, dim=-1).indices
        held = real & ~older                                                 # the newest `window`
        held = held | torch.zeros_like(real).scatter_(-1, top, True) & older
        # a row within the budget keeps all it holds (its top-k took non-older slots too)
        return torch.where(counts > self.budget_tokens, held, real)

    def map_rows(self, layer, fn):
        if layer in self.accumulated:
            self.accumulated[layer] = fn(self.accumulated[layer])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.accumulated.values())

    # decode steps in slots (cache/evicting_slots.py): the slots keep each token's accumulated
    # attention (this policy's `accumulated`, float32) and hand the sums here as `votes`
    @property
    def slot_cap(self) -> int:
        return self.budget_tokens

    def slot_victim(self, votes, positions, held):
        # the older token (not among the newest `window`) with the least attention accumulated:
        # `choose`'s top-k of budget - window among the older tokens drops it
        newest = positions.masked_fill(~held, -1).amax(-1, keepdim=True)
        older = held & (positions <= newest - self.window)
        return votes.masked_fill(~older, float("inf")).argmin(-1)

    def state_for_bytes(self, held):
        out = copy.copy(self)
        out.accumulated = {layer: t.float() for layer, t in held.items()}
        return out


@dataclass
class H2O(TokenSubset):
    name = "h2o"
    one_pass = False
    budget: int = 512        # tokens kept per KV head
    window: int = 64         # of which the newest (the rest: heavy hitters)

    def check(self) -> None:
        check_int(self.budget, "budget", 2)
        check_int(self.window, "window", 1)
        if self.window >= self.budget:
            raise MethodError(f"method.window={self.window} must be below method.budget={self.budget} "
                              "(the rest of the budget holds the heavy hitters)")

    @property
    def tag(self) -> str:
        return f"h2o-n{self.budget}-w{self.window}"

    @property
    def policy(self) -> H2OPolicy:
        return H2OPolicy(self.budget, self.window)

    def cache_nbytes(self, cache) -> dict:
        n = super().cache_nbytes(cache)
        extra = cache.policy.nbytes()
        return {**n, "metadata": n["metadata"] + extra, "total": n["total"] + extra,
                "read_per_step": n["read_per_step"] + extra}

    def summary(self) -> dict:
        return {"kv_bits": 16, "family": "eviction", "budget": self.budget, "window": self.window}
