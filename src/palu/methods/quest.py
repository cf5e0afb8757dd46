"""Quest (Tang et al., ICML 2024): query-aware selection. Every token is kept; keys are grouped in
pages of `page` tokens with the per-channel minimum and maximum of each page's keys as metadata.
A decode step scores each page by the upper bound of its query-key products
(sum over channels of max(q_c min_c, q_c max_c), summed over the KV head's query heads), reads
the best pages up to `budget` tokens (the newest page always) and attends exactly over them.
Bytes stored: every token plus the page bounds; bytes read per step: the chosen pages plus every
page's bounds. The prefill attends fully (Quest selects at decode), so one-pass scores are refused."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache.subset_cache import SubsetPolicy
from .base import MethodError, check_int
from .token_subset import TokenSubset


class QuestPolicy(SubsetPolicy):
    keeps_after_prefill = False   # keeps every token; selects what a step reads

    def __init__(self, page: int, budget: int):
        self.page, self.budget = page, budget

    def select(self, queries, keys, positions):
        B, H, S, d = keys.shape
        if S <= self.budget:
            return None
        return self._chosen(queries, keys, torch.full((B,), S, device=keys.device))

    def select_padded(self, queries, keys, pads):
        """Every row at once: each row's tokens shifted to slot 0 (so its pages start at its first
        token, as alone), its pages scored over its own tokens, then shifted back; a row within the
        budget reads all its tokens."""
        return self.select_rows(queries, keys, pads, keys.shape[2] - pads.to(torch.long))

    def select_rows(self, queries, keys, pads, held, bounds=None):
        """`select_padded` where row b's tokens are the slots [pads[b], pads[b] + held[b]) of a
        buffer that may be wider (preallocated slots, `cache/subset_slots.py`): (B, H, S) bool.
        `bounds`: the row-aligned pages' (lo, hi) the slots keep up to date (`page_bounds`,
        `add_to_bounds`), so a step does not realign and rescan every key."""
        B, H, S, d = keys.shape
        t = torch.arange(S, device=keys.device)
        if bounds is None:
            bounds = self.page_bounds(self.aligned(keys, pads), held)
        chosen = self.chosen_pages(queries, *bounds, held, S) | (held <= self.budget)[:, None, None]
        chosen &= (t < held[:, None])[:, None]                                # (B, H, S) over t
        back = (t - pads.to(torch.long)[:, None])                              # slot -> row-aligned t
        return chosen.gather(2, back.clamp_min(0)[:, None].expand(B, H, S)) & (back >= 0)[:, None]

    @staticmethod
    def aligned(keys, pads):
        """Each row's slots shifted left by its pads: row-aligned token t at index t."""
        B, H, S, d = keys.shape
        own = (pads.to(torch.long)[:, None] + torch.arange(S, device=keys.device)).clamp_max(S - 1)
        return keys.gather(2, own[:, None, :, None].expand(B, H, S, d))

    def page_bounds(self, keys, held):
        """(lo, hi), each (B, H, pages, d): the per-channel minimum and maximum of each page's keys,
        row b's tokens at [0, held[b]); a page with none of them holds +inf / -inf."""
        B, H, S, d = keys.shape
        pages = math.ceil(S / self.page)
        padded = torch.nn.functional.pad(keys, (0, 0, 0, pages * self.page - S))
        blocks = padded.view(B, H, pages, self.page, d)
        valid = (torch.arange(pages * self.page, device=keys.device)[None] < held[:, None])
        valid = valid.view(B, 1, pages, self.page, 1)
        return blocks.masked_fill(~valid, float("inf")).amin(3), blocks.masked_fill(~valid, float("-inf")).amax(3)

    def add_to_bounds(self, lo, hi, key, held):
        """Row b's newest key (B, H, 1, d), its row-aligned token held[b] - 1, into its page's
        bounds in place (exact: a minimum and a maximum do not depend on the order)."""
        B, H, _, d = lo.shape
        page = ((held.to(torch.long) - 1) // self.page).view(B, 1, 1, 1).expand(B, H, 1, d)
        # one page per (row, head): gather, compare, write back (no atomics, any dtype, capturable)
        lo.scatter_(2, page, torch.minimum(lo.gather(2, page), key.to(lo.dtype)))
        hi.scatter_(2, page, torch.maximum(hi.gather(2, page), key.to(hi.dtype)))

    def _chosen(self, queries, keys, held):
        """(B, H, S) bool: the pages each row reads, its tokens at slots [0, held[b])."""
        return self.chosen_pages(queries, *self.page_bounds(keys, held), held, keys.shape[2])

    def chosen_pages(self, queries, lo, hi, held, S):
        """(B, H, S) bool over row-aligned tokens: the pages the step's query scores best by its
        upper bound from the pages' (lo, hi), the newest page always, none past a row's tokens."""
        B, H, pages, d = lo.shape
        n_rep = queries.shape[1] // H
        q = queries[:, :, -1].view(B, H, n_rep, d)                           # this step's query
        bound = torch.maximum(q[:, :, :, None] * lo[:, :, None], q[:, :, :, None] * hi[:, :, None])
        score = bound.sum(-1).sum(2)                                          # (B, H, P)
        count = -(-held // self.page)                                         # (B,) each row's pages
        page = torch.arange(pages, device=lo.device)
        score = score.masked_fill(page >= count[:, None, None], float("-inf"))
        score = score.masked_fill(page == (count - 1)[:, None, None], float("inf"))   # the newest page
        chosen_pages = score.topk(min(pages, self.budget // self.page), dim=-1).indices
        chosen = torch.zeros(B, H, pages, dtype=torch.bool, device=lo.device)
        chosen.scatter_(-1, chosen_pages, True)
        return (chosen & (page < count[:, None, None])).repeat_interleave(self.page, -1)[..., :S]


@dataclass
class Quest(TokenSubset):
    name = "quest"
    one_pass = False
    page: int = 16           # tokens per page
    budget: int = 512        # tokens read per decode step (a multiple of page)

    def check(self) -> None:
        check_int(self.page, "page")
        check_int(self.budget, "budget")
        if self.budget % self.page or self.budget < 2 * self.page:
            raise MethodError(f"method.budget={self.budget} must be a multiple of method.page={self.page}, "
                              "at least two pages")

    @property
    def tag(self) -> str:
        return f"quest-p{self.page}-n{self.budget}"

    @property
    def policy(self) -> QuestPolicy:
        return QuestPolicy(self.page, self.budget)

    def cache_nbytes(self, cache) -> dict:
        n = cache.nbytes()
        S = cache.kept_tokens()
        # one token's keys and values over all layers (2 H d elements each) = one page's bounds
        # (a min and a max per key channel)
        per_token = n["data"] // S if S else 0
        bounds = math.ceil(S / self.page) * per_token
        return {"data": n["data"], "metadata": n["metadata"] + bounds, "total": n["total"] + bounds,
                "read_per_step": min(S, self.budget) * per_token + bounds, "packed": False}

    def summary(self) -> dict:
        return {"kv_bits": 16, "family": "selection", "budget": self.budget, "page": self.page}
