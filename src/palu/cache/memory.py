"""Measured KV-cache memory of a real prefill through a method's cache."""
from __future__ import annotations

import torch


@torch.no_grad()
def prefill_nbytes(model, method, input_ids: torch.Tensor) -> dict:
    """Bytes `method`'s cache really holds after prefilling `input_ids` into a fresh one
    (`method.cache_nbytes`: data, metadata such as scales and positions, total)."""
    cache = method.make_cache(model)
    model(input_ids, past_key_values=cache, use_cache=True)
    return method.cache_nbytes(cache)


def fp16_equivalent(nbytes: dict, element_size: int) -> float:
    """The same cache with its unpacked data in fp16 (packed data and metadata as stored)."""
    data = nbytes["data"] if nbytes.get("packed") else nbytes["data"] * 2 / element_size
    return data + nbytes["metadata"]
