"""SnapKV (Li et al., 2024): after the prefill, each KV head keeps the prompt tokens that the
prompt's last `window` queries (the observation window) attend to most — their attention summed
over the window and the head's query heads, average-pooled over `kernel` neighbouring tokens —
plus the observation window itself; decoding then attends to what was kept and to every new token.
`compression_ratio` is kvpress's: the fraction of the prompt's tokens removed. Tokens are chosen
per KV head (positions kept per head). One-pass scores are refused (`one_pass`): the eviction
happens after the prefill's own attention."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.observation import window_votes, window_votes_right_padded
from ..cache.eviction import ScoredEviction
from .base import MethodError, check_int
from .token_subset import TokenSubset


class SnapKVPolicy(ScoredEviction):
    """SnapKV's scorer (`cache/eviction.py` does the budget, the window and the top-k)."""
    keeps_after_prefill = False   # chosen once, after the prefill

    def __init__(self, ratio: float, window: int, kernel: int):
        self.ratio, self.window, self.kernel = ratio, window, kernel
        self.protected = window   # the observation window stays

    def budget(self, layer: int, prompt: int) -> int:
        """Prompt tokens layer `layer` keeps (the same in every layer; PyramidKV overrides)."""
        return prompt - int(round(prompt * self.ratio))

    def scores(self, layer, queries, keys, scale=None):
        """The window's attention to each older token, averaged over a KV head's query heads and
        pooled over `kernel` neighbours: (B, H, S - window)."""
        B, H, S, _ = keys.shape
        votes = window_votes(queries, keys, self.window, scale)                 # (B, nh, S - w)
        votes = votes.view(B, H, -1, S - self.window).mean(2)
        return F.avg_pool1d(votes, self.kernel, stride=1, padding=self.kernel // 2)

    def scores_right_padded(self, layer, queries, keys, lengths, scale=None):
        """`scores` of every row of a right-padded batch at once: (B, H, S), row b's first
        lengths[b] - window entries its scores alone (its votes are zero beyond them, which is the
        pooling's zero padding there)."""
        B, H, S, _ = keys.shape
        votes = window_votes_right_padded(queries, keys, self.window, lengths, scale)   # (B, nh, S)
        votes = votes.view(B, H, -1, S).mean(2)
        return F.avg_pool1d(votes, self.kernel, stride=1, padding=self.kernel // 2)


def check_snapkv(ratio, window, kernel, names=("compression_ratio", "window", "kernel")) -> None:
    """SnapKV's settings (also its compositions', under their own field names)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise MethodError(f"method.{names[0]}={ratio!r} must be in [0, 1) (the fraction of the prompt removed)")
    check_int(window, names[1])
    check_int(kernel, names[2])
    if kernel % 2 == 0:
        raise MethodError(f"method.{names[2]}={kernel!r} must be odd (pooling centred on each token)")


@dataclass
class SnapKV(TokenSubset):
    name = "snapkv"
    one_pass = False
    compression_ratio: float = 0.5   # fraction of the prompt's tokens removed (kvpress)
    window: int = 32                 # observation window (the prompt's last queries)
    kernel: int = 5                  # pooling over neighbouring tokens (odd)

    def check(self) -> None:
        check_snapkv(self.compression_ratio, self.window, self.kernel)

    @property
    def tag(self) -> str:
        return f"snapkv-r{self.compression_ratio:g}-w{self.window}-k{self.kernel}"

    @property
    def policy(self) -> SnapKVPolicy:
        return SnapKVPolicy(float(self.compression_ratio), self.window, self.kernel)

    def summary(self) -> dict:
        return {"kv_bits": 16, "family": "eviction", "compression_ratio": self.compression_ratio}
