"""StreamingLLM (Xiao et al., ICLR 2024): the first `sink` tokens (attention sinks) and the most
recent `window` tokens, evicted as decoding goes (not only at the prefill, as kvpress's
StreamingLLMPress does). A query at position p sees tokens j < sink and p - window < j <= p, so a
one-pass window means what decoding means and perplexity through it is defined. Keys keep the
positions they were rotated at (kvpress does the same; the paper's re-indexing within the cache
is not done)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.subset_cache import SubsetPolicy
from .base import check_int
from .token_subset import TokenSubset


class StreamingPolicy(SubsetPolicy):
    def __init__(self, sink: int, window: int):
        self.sink, self.window = sink, window

    def visible(self, q_pos, k_pos):
        q, k = q_pos[..., None], k_pos[..., None, :]
        return (k <= q) & ((k < self.sink) | (q - k < self.window))

    def keep_padded(self, layer, queries, keys, positions, seen, scale=None):
        pos, seen = positions, seen.view(-1, 1, 1)
        return (pos >= 0) & ((pos < self.sink) | (pos > seen - self.window))

    @property
    def slot_cap(self) -> int:
        return self.sink + self.window - 1   # what the next query may see, but itself

    def slot_victim(self, votes, positions, held):
        # the oldest token past the sinks (the one that leaves the window)
        return positions.masked_fill(~held | (positions < self.sink), torch.iinfo(positions.dtype).max).argmin(-1)

    def padded_width(self, slots, seen):
        # a row that has seen n tokens holds its first `sink` and its last `window - 1`
        return min(slots, max(seen), self.sink + self.window - 1)

    def keep(self, layer, queries, keys, positions, seen, prefill, scale=None):
        # what the next query (position `seen`) may see
        held = (positions[0, 0] < self.sink) | (positions[0, 0] > seen - self.window)
        if bool(held.all()):
            return None
        idx = held.nonzero().squeeze(-1)
        return idx.expand(*positions.shape[:2], -1).contiguous()


@dataclass
class StreamingLLM(TokenSubset):
    name = "streaming_llm"
    sink: int = 4
    window: int = 1024

    def check(self) -> None:
        check_int(self.sink, "sink", 0)
        check_int(self.window, "window", 1)

    @property
    def tag(self) -> str:
        return f"streaming_llm-s{self.sink}-w{self.window}"

    @property
    def policy(self) -> StreamingPolicy:
        return StreamingPolicy(self.sink, self.window)

    def summary(self) -> dict:
        return {"kv_bits": 16, "family": "eviction", "sink": self.sink, "window": self.window}
