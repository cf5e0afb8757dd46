"""What the attentions that keep full keys and values share (kv_attention.py, subset_attention.py):
the model's q/k/v projections of the hidden states, through the family's q/k norm, the query
scaling (OPT) and RoPE, as the model's own attention computes them."""
from __future__ import annotations

import torch
from torch import nn

from ..models.adapters import FamilyAdapter, Geometry, apply_qk_norm
from .rope import apply_rope


class FullHeads(nn.Module):
    """Base of an attention module that replaces the model's: its projections and norms."""

    def __init__(self, attn: nn.Module, adapter: FamilyAdapter, geom: Geometry):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = adapter.projections(attn)
        self.q_norm, self.k_norm = adapter.norms(attn)   # before RoPE and before the cache
        self.qk_norm = adapter.qk_norm
        self.layer_idx, self.geom = attn.layer_idx, geom
        self.scaling = attn.scaling
        self.query_scaled = adapter.query_scaled_in_proj

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, n, self.geom.head_dim).transpose(1, 2)

    def project(self, x, position_embeddings, rotate_keys: bool = True):
        """q (B, nh, T, d), k and v (B, H, T, d); keys left unrotated with rotate_keys=False
        (KVQuant quantises pre-RoPE keys)."""
        q = apply_qk_norm(self._heads(self.q_proj(x), self.geom.num_heads), self.q_norm, self.qk_norm)
        k = apply_qk_norm(self._heads(self.k_proj(x), self.geom.num_kv_heads), self.k_norm, self.qk_norm)
        v = self._heads(self.v_proj(x), self.geom.num_kv_heads)
        if self.query_scaled:
            q = q * self.scaling
        if self.geom.rope:
            cos, sin = position_embeddings
            q = apply_rope(q, cos, sin)
            if rotate_keys:
                k = apply_rope(k, cos, sin)
        return q, k, v

    def softmax_scale(self) -> float:
        return 1.0 if self.query_scaled else self.scaling

    def own_cache(self, cache, kind: type):
        """The method's own cache for this step: a fresh one without a cache (the model never
        runs without the method), a TypeError for any other Cache (another method's included)."""
        if cache is None:
            if not self.method.one_pass:   # a fresh cache every step would evict or select nothing
                raise ValueError(f"{self.method.tag} evicts or selects tokens through its cache: a "
                                 "forward without it (use_cache=False, or no past_key_values) would be "
                                 "the full model's; pass past_key_values=method.make_cache(model)")
            return self.method.make_cache_for(self.geom.num_layers)
        if not isinstance(cache, kind) or cache.owner != self.method.tag:
            raise TypeError(f"{self.method.tag} attention cannot use a {type(cache).__name__}: it "
                            f"reads keys and values only from its own cache; pass "
                            f"past_key_values=method.make_cache(model)")
        return cache
