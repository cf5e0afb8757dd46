"""Perplexity over non-overlapping windows (the GPTQ / Palu protocol)."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 1, progress: bool = True) -> dict:
    """exp(mean next-token NLL) over all windows; each window is scored independently.

    Returns ppl, total nll, scored token count and wall time, so results can be re-aggregated.
    """
    device = next(model.parameters()).device
    nll, count, start = 0.0, 0, time.perf_counter()
    batches = windows.split(batch_size)
    for batch in tqdm(batches, desc="perplexity", unit="win", disable=not progress, leave=False):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(),
                               reduction="sum")
        nll += loss.item()
        count += batch[:, 1:].numel()
    mean = nll / count
    return {"ppl": math.exp(mean), "nll": nll, "scored_tokens": count, "windows": len(windows),
            "seconds": time.perf_counter() - start}
