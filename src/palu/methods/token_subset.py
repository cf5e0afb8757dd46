"""What the token-eviction methods share (streaming_llm.py, snapkv.py): install the subset
attention in every layer, one `SubsetKVCache` per sequence, bytes as stored (kept keys and values
in the model's dtype; their int32 positions per KV head as metadata). Bytes read per decode step
equal the bytes stored: an evicted token is never read again."""
from __future__ import annotations

from dataclasses import dataclass

from ..cache.subset_cache import SubsetKVCache, SubsetPolicy
from ..models.adapters import adapter_for, geometry_of
from .base import CacheMethod


@dataclass
class TokenSubset(CacheMethod):
    """Base of the eviction methods; a subclass sets `name`, its fields and `policy`."""
    padded_batches = True   # each row's policy decides over its own tokens (subset_attention._by_row)

    @property
    def policy(self) -> SubsetPolicy:
        raise NotImplementedError

    def install(self, model) -> None:
        from ..attention.subset_attention import SubsetKVAttention
        adapter, geom = adapter_for(model.config), geometry_of(model.config)
        self._layers = geom.num_layers
        for layer in adapter.layers(model):
            attn = adapter.attention(layer)
            if any(getattr(attn, mark, False) for mark in ("keeps_subset", "quantises_kv", "stores_latents")):
                raise ValueError(f"the model's attention is already replaced ({type(attn).__name__}); "
                                 f"install {self.name} on a fresh model")
            layer.self_attn = SubsetKVAttention(attn, adapter, geom, self)

    def make_cache_for(self, num_layers: int) -> SubsetKVCache:
        return SubsetKVCache(self.policy, num_layers, owner=self.tag)

    def make_cache(self, model):
        return self.make_cache_for(model.config.num_hidden_layers)

    def cache_nbytes(self, cache) -> dict:
        n = cache.nbytes()
        return {**n, "read_per_step": n["total"], "packed": False}
