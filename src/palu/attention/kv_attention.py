"""Attention through a quantised KV cache (the KV-quantisation baselines, `palu/methods/`).

Replaces a layer's attention: q, k, v projections as the model's own, then every key and value
goes through the method's `QuantKVCache` (`cache/quant_cache.py`) and the queries attend to what
it holds, with the mask it returns (so a one-pass window is decode-equivalent). Keys are stored
after RoPE, or before it for a method that quantises pre-RoPE keys (KVQuant): those are rotated
at their stored positions when read.

Without a cache (`use_cache=False`) a fresh one serves the step, so the model never runs
unquantised by accident; any other transformers Cache is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.quant_cache import QuantKVCache
from ..models.adapters import FamilyAdapter, Geometry, apply_qk_norm, layer_window
from .rope import apply_rope


class QuantKVAttention(nn.Module):
    quantises_kv = True   # how a method finds its layers without importing this class

    def __init__(self, attn: nn.Module, adapter: FamilyAdapter, geom: Geometry, method,
                 rotary: nn.Module | None = None):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = adapter.projections(attn)
        self.q_norm, self.k_norm = adapter.norms(attn)   # before RoPE and before the cache
        self.qk_norm = adapter.qk_norm
        self.layer_idx, self.geom, self.method = attn.layer_idx, geom, method
        self.sliding_window = layer_window(attn.config, attn.layer_idx)   # this layer's, if it slides
        self.scaling = attn.scaling
        self.query_scaled = adapter.query_scaled_in_proj
        self._rotary = (rotary,)   # shared with the model, not a submodule of ours

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, n, self.geom.head_dim).transpose(1, 2)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, position_ids=None, **kwargs):
        B, T, _ = hidden_states.shape
        x = hidden_states
        q = apply_qk_norm(self._heads(self.q_proj(x), self.geom.num_heads), self.q_norm, self.qk_norm)
        k = apply_qk_norm(self._heads(self.k_proj(x), self.geom.num_kv_heads), self.k_norm, self.qk_norm)
        v = self._heads(self.v_proj(x), self.geom.num_kv_heads)
        if self.query_scaled:
            q = q * self.scaling
        pre_rope = self.method.pre_rope
        if self.geom.rope:
            cos, sin = position_embeddings
            q = apply_rope(q, cos, sin)
            if not pre_rope:
                k = apply_rope(k, cos, sin)
        cache = self._cache(past_key_values)
        past = cache.get_seq_length(self.layer_idx)
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)[None]
        view = cache.step(self.layer_idx, k, v, position_ids, attention_mask, self.sliding_window)
        keys = view.keys
        if self.geom.rope and pre_rope:
            kcos, ksin = self._rotary[0](x, view.key_positions.long())
            keys = apply_rope(keys, kcos, ksin)
        out = F.scaled_dot_product_attention(
            q, keys, view.values, attn_mask=view.mask, scale=1.0 if self.query_scaled else self.scaling,
            enable_gqa=self.geom.n_rep > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None

    def _cache(self, cache) -> QuantKVCache:
        if cache is None:
            return self.method.make_cache_for(self.geom.num_layers)
        if not isinstance(cache, QuantKVCache) or cache.owner != self.method.tag:
            raise TypeError(f"{self.method.tag} attention cannot use a {type(cache).__name__}: it "
                            f"reads keys and values only from its own quantised cache; pass "
                            f"past_key_values=method.make_cache(model)")
        return cache
