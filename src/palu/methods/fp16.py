"""The baseline: the unmodified model with transformers' ordinary K/V cache at the model's dtype."""
from __future__ import annotations

from dataclasses import dataclass

from .base import CacheMethod


@dataclass
class FullCache(CacheMethod):
    """Full-precision keys and values ("FP16" in the paper's tables; the model's dtype here)."""
    name = "fp16"
    padded_batches = True   # a dynamic cache: per token, per row
    changes_model = False    # nothing installed: the model's own attention

    @property
    def tag(self) -> str:
        return "fp16"

    def make_cache(self, model):
        from transformers import DynamicCache
        return DynamicCache()

    def cache_nbytes(self, cache) -> dict:
        from ..cache.latent_cache import dense_cache_nbytes
        data = dense_cache_nbytes(cache)
        return {"data": data, "metadata": 0, "total": data, "packed": False}
