"""Perplexity over non-overlapping windows (the GPTQ / Palu protocol), through a method's cache."""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..progress import steps

BLOCK = 128     # scored tokens per NLL block (the resampling unit of ppl intervals)


def check_windows(model, windows: torch.Tensor) -> None:
    """Token windows the model can score (ValueError naming the bad value otherwise)."""
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows of shape {tuple(windows.shape)}: (n, T) with T >= 2 tokens needed "
                         "(one to predict from, one to score)")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"token id {high if high >= vocab else low} is outside the model's "
                         f"vocabulary of {vocab} ids (windows of another tokenizer?)")


def token_nll(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Each window's next-token NLL (B, T-1), float64, one row at a time: the whole batch's logits
    upcast at once is B x T x vocab floats (9.3 GiB for 8 x 2048 tokens of a 152K vocabulary, which
    ran Qwen2.5's evaluate jobs out of their GPU share); a row's is 1/B of it. Per token the same
    numbers: cross-entropy with reduction="none" scores each position on its own."""
    return torch.stack([F.cross_entropy(row[:-1].float(), ids[1:], reduction="none")
                        for row, ids in zip(logits, batch)]).double()


@torch.no_grad()   # (once on check_windows instead: Gemma-3's evaluate kept the graph, 9.3 GB)
def perplexity(model, windows: torch.Tensor, batch_size: int = 1, progress: bool = True,
               make_cache: Callable[[], object] | None = None,
               cache_nbytes: Callable[[object], dict] | None = None) -> dict:
    """exp(mean next-token NLL) over all windows; each window is scored independently.

    `make_cache`: a fresh cache per window (a method's `make_cache`). The window then runs as one
    prefill into that cache, so every query attends to exactly what the cache stores for the
    tokens before it (Palu: its latents, quantised when the cache quantises them). A one-pass
    evaluation therefore equals feeding the tokens one at a time through the same cache
    (tests/unit/test_method_perplexity.py). None: no cache (`use_cache=False`).
    `batch_size` windows run as one prefill (equal lengths, no padding: each row holds what it
    holds alone). `cache_nbytes`: measures the first batch's filled cache, returned as one
    window's (`cache_nbytes`, `memory.one_row`).
    Returns ppl, total nll, scored token count and wall time, so results can be re-aggregated,
    and the NLL of every block of `BLOCK` scored tokens of every window (`block_nll`,
    `block_tokens`, window by window): the unit that intervals on ppl and paired differences
    between methods resample (`palu.eval.stats.ppl_interval`), since a default run has only a few
    windows.
    """
    check_windows(model, windows)
    device = next(model.parameters()).device
    nll, count, start, measured = 0.0, 0, time.perf_counter(), None
    block_nll: list[float] = []
    block_tokens: list[int] = []
    batches = windows.split(batch_size)
    for batch in steps(batches, "perplexity", "windows", progress):
        batch = batch.to(device)
        if make_cache is None:
            logits = model(input_ids=batch, use_cache=False).logits             # (B, T, V)
        else:
            cache = make_cache()
            logits = model(input_ids=batch, past_key_values=cache, use_cache=True).logits
            if cache_nbytes is not None and measured is None:
                from ..cache.memory import one_row
                measured = one_row(cache_nbytes(cache), batch.shape[0])
            del cache
        tokens = token_nll(logits, batch)
        del logits
        loss = tokens.sum().item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss ({loss}) in a perplexity window: "
                                     "the model or its cache produced NaN/inf")
        nll += loss
        count += batch[:, 1:].numel()
        for row in tokens:
            for part in row.split(BLOCK):
                block_nll.append(part.sum().item())
                block_tokens.append(part.numel())
    mean = nll / count
    out = {"ppl": math.exp(mean), "nll": nll, "scored_tokens": count, "windows": len(windows),
           "seconds": time.perf_counter() - start, "block_nll": block_nll, "block_tokens": block_tokens}
    if measured is not None:
        out["cache_nbytes"] = measured
    return out
