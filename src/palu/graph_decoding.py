"""Greedy decoding with every one-token step replayed as a CUDA graph.

`model.generate(past_key_values=LatentCache(model))` runs each step eagerly: at 7B shapes the
Python of 32 Palu layers (five Triton launches and ~40 torch ops each) costs more than the GPU
work. Here the model's step over a `GraphLatentCache` is captured once per *bucket* of context
lengths and replayed:

    cache = palu.GraphLatentCache(model, max_tokens=8192, bits=4)
    out = palu.GraphDecoder(model, cache).generate(input_ids, max_new_tokens=256)

A graph's kernels read a fixed number of cache slots (the bucket: the context rounded up, at
most 1/8 more, `bucket_tokens`) and mask the rest by the cache's device-side lengths, so one
graph serves every step of its bucket; a generation captures eight graphs per doubling of the
context (each costs two eager steps and a capture, ~0.2 s at 7B shapes on an H200, plus the
kernels' compilation the first time a length specialisation appears). Greedy only; no padding
(every row of a batch has the same length).
"""
from __future__ import annotations

from typing import Callable

import torch

from .cache.graph_cache import GraphLatentCache


def bucket_tokens(n: int, max_tokens: int, min_tokens: int = 256, per_doubling: int = 8) -> int:
    """Cache slots a step with `n` cached tokens reads: n rounded up to a multiple of
    2^floor(log2 n) / per_doubling (at most 1/per_doubling more), at least `min_tokens`, at most
    `max_tokens`."""
    if not 1 <= n <= max_tokens:
        raise ValueError(f"{n} tokens do not fit a cache of max_tokens={max_tokens}")
    quantum = max(1, (1 << (n.bit_length() - 1)) // per_doubling)
    return min(max_tokens, max(min_tokens, -(-n // quantum) * quantum))


class CapturedStep:
    """`fn` (no arguments, reads and writes only static tensors) captured as one CUDA graph,
    after warm-up calls on a side stream (kernel compilation, cuBLAS workspaces) that must be
    repeatable: they run the same step the graph will."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None, warmup: int = 2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class GraphDecoder:
    """One-token decode steps of `model` (Palu attention installed) over `cache`, replayed."""

    def __init__(self, model, cache: GraphLatentCache, min_bucket: int = 256):
        if not isinstance(cache, GraphLatentCache):
            raise TypeError(f"GraphDecoder needs a GraphLatentCache, not {type(cache).__name__}")
        device = cache.lengths.device
        self._check_device(device)
        self.model, self.cache, self.min_bucket = model, cache, min_bucket
        B = cache.batch
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)
        # a prepared 4D mask is passed through by transformers as is; with a GraphLatentCache the
        # Palu layers mask one-token steps by the cache's lengths and ignore it
        self.mask = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=device)
        self.pool = None
        self.graphs: dict[int, CapturedStep] = {}

    @staticmethod
    def _check_device(device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}")

    def _capture(self, fn) -> Callable[[], torch.Tensor]:
        if self.pool is None:   # one memory pool for all buckets: their graphs never run at once
            self.pool = torch.cuda.graph_pool_handle()
        return CapturedStep(fn, self.pool)

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        return self.model(input_ids=self.ids, position_ids=self.positions, attention_mask=self.mask,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def _graph(self, tokens: int) -> CapturedStep:
        bucket = bucket_tokens(tokens, self.cache.max_tokens, self.min_bucket)
        if bucket not in self.graphs:
            self.cache.view_tokens = bucket
            try:
                self.graphs[bucket] = self._capture(self._forward)
            finally:
                self.cache.view_tokens = None
        return self.graphs[bucket]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Logits (B, vocab) of `tokens` (B,) at `position` (= tokens cached before it). The
        returned tensor is the graph's output buffer: the next step overwrites it."""
        if position != self.cache.seen:
            raise ValueError(f"position {position} != the {self.cache.seen} tokens cached")
        self.ids.copy_(tokens.view(-1, 1))
        self.positions.fill_(position)
        graph = self._graph(position + 1)   # capturing runs the step too (repeatably)
        logits = graph()
        self.cache.seen = position + 1
        return logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy continuation of `input_ids` (B, T) into an empty cache: (B, T + new tokens).
        With `eos_token_id`, stops once every row has produced it (one host sync per step); a
        row that finished earlier goes on generating (cut it at its first eos)."""
        B, T = input_ids.shape
        if self.cache.seen:
            raise ValueError(f"the cache already holds {self.cache.seen} tokens; generate starts "
                             "from an empty cache (GraphLatentCache(...) anew, or reset())")
        if max_new_tokens < 1 or T + max_new_tokens > self.cache.max_tokens + 1:
            raise ValueError(f"{T} prompt + max_new_tokens={max_new_tokens} tokens need a cache of "
                             f"at least {T + max_new_tokens - 1} (max_tokens={self.cache.max_tokens})")
        logits = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]       # the prefill, eager
        out = [input_ids, logits.argmax(-1, keepdim=True)]
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        for position in range(T, T + max_new_tokens - 1):
            if eos_token_id is not None:
                done |= out[-1][:, 0] == eos_token_id
                if bool(done.all()):
                    break
            out.append(self.step(out[-1][:, 0], position).argmax(-1, keepdim=True))
        return torch.cat(out, 1)
