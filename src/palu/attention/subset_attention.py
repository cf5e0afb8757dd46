"""Attention through a token-subset cache (the eviction methods, `palu/methods/streaming_llm.py`,
`snapkv.py`): the model's own q/k/v projections, q/k norms and RoPE (keys stored after RoPE, at
their true positions), then the queries attend to the kept tokens plus this step's, as the
method's policy allows (`SubsetPolicy.visible`), and the policy picks what the cache keeps.

A padded batch is refused (the policies count tokens: a row's pad tokens would count too);
without a cache a fresh one serves the step, so the model never runs without the method.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.subset_cache import SubsetKVCache
from ..models.adapters import FamilyAdapter, Geometry, apply_qk_norm, layer_window
from .rope import apply_rope


class SubsetKVAttention(nn.Module):
    keeps_subset = True   # how a method finds its layers without importing this class

    def __init__(self, attn: nn.Module, adapter: FamilyAdapter, geom: Geometry, method):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = adapter.projections(attn)
        self.q_norm, self.k_norm = adapter.norms(attn)
        self.qk_norm = adapter.qk_norm
        self.layer_idx, self.geom, self.method = attn.layer_idx, geom, method
        self.scaling = attn.scaling
        self.query_scaled = adapter.query_scaled_in_proj
        if layer_window(attn.config, attn.layer_idx) is not None:
            raise ValueError(f"{method.name}: layer {attn.layer_idx} attends through a sliding window; "
                             "token eviction on sliding-window layers is not supported")

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
        if self.geom.rope:
            cos, sin = position_embeddings
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = self._cache(past_key_values)
        _check_unpadded(attention_mask, self.method.name)
        old_k, old_v, old_pos, seen = cache.held(self.layer_idx)
        H = self.geom.num_kv_heads
        new_pos = torch.arange(seen, seen + T, device=x.device, dtype=torch.int32)
        new_pos_h = new_pos.expand(B, H, T)
        keys = k if old_k is None else torch.cat([old_k, k], 2)
        values = v if old_v is None else torch.cat([old_v, v], 2)
        positions = new_pos_h if old_pos is None else torch.cat([old_pos, new_pos_h], 2)
        policy = cache.policy            # built once per cache by the method
        mask = policy.visible(new_pos, positions)                   # (B, H, T, S)
        if T == 1 and old_k is not None:
            chosen = policy.select(q, keys, positions)              # (B, H, S) or None
            if chosen is not None:
                mask = mask & chosen[:, :, None, :]
        mask = mask.repeat_interleave(self.geom.n_rep, dim=1)       # per query head
        keys_q = keys.repeat_interleave(self.geom.n_rep, 1)
        values_q = values.repeat_interleave(self.geom.n_rep, 1)
        out = F.scaled_dot_product_attention(q, keys_q, values_q, attn_mask=mask,
                                             scale=1.0 if self.query_scaled else self.scaling)
        keep = policy.keep(self.layer_idx, q, keys, positions, seen + T, prefill=old_k is None and T > 1,
                           scale=1.0 if self.query_scaled else self.scaling)
        if keep is not None:
            idx = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
            keys, values = keys.gather(2, idx), values.gather(2, idx)
            positions = positions.gather(2, keep)
        cache.store(self.layer_idx, keys, values, positions, seen + T)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None

    def _cache(self, cache) -> SubsetKVCache:
        if cache is None:
            return self.method.make_cache_for(self.geom.num_layers)
        if not isinstance(cache, SubsetKVCache) or cache.owner != self.method.tag:
            raise TypeError(f"{self.method.tag} attention cannot use a {type(cache).__name__}: it "
                            f"reads keys and values only from its own cache; pass "
                            f"past_key_values=method.make_cache(model)")
        return cache


def _check_unpadded(attention_mask, name: str) -> None:
    """A padded batch is refused: a column no query may see is a pad token."""
    if attention_mask is None:
        return
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1
    seen_by_some = visible.any(-2) if visible.dim() == 4 else visible
    if not bool(seen_by_some.all()):
        raise ValueError(f"{name} counts tokens (a sink, a window, a budget): a padded batch would "
                         "count a row's pad tokens too; run prompts one at a time")
