"""Measured KV-cache memory of a real prefill: Palu latent cache vs the ordinary FP16/FP32 cache."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache.latent_cache import LatentCache, dense_cache_nbytes


@torch.no_grad()
def cache_bytes(model, input_ids: torch.Tensor, latent: bool) -> dict:
    """Bytes the cache really holds after prefilling `input_ids`: {"tensors", "positions", "total"}.

    `tensors` are the K/V (or latent) tensors in the model's dtype; `positions` the int32 token
    positions a latent cache keeps for RoPE (0 for the ordinary cache).
    """
    cache = LatentCache(model) if latent else DynamicCache()
    model(input_ids, past_key_values=cache, use_cache=True)
    if latent:
        n = cache.nbytes()
        return {"tensors": n["latents"], "positions": n["positions"], "total": n["total"]}
    dense = dense_cache_nbytes(cache)
    return {"tensors": dense, "positions": 0, "total": dense}


def fp16_equivalent(nbytes: dict, element_size: int) -> float:
    """The same cache with its tensors in fp16 (positions stay int32)."""
    return nbytes["tensors"] * 2 / element_size + nbytes["positions"]
