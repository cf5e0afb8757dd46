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
from ..models.adapters import FamilyAdapter, Geometry, layer_window
from .full_heads import FullHeads


class SubsetKVAttention(FullHeads):
    keeps_subset = True   # how a method finds its layers without importing this class

    def __init__(self, attn: nn.Module, adapter: FamilyAdapter, geom: Geometry, method):
        super().__init__(attn, adapter, geom)
        self.method = method
        if layer_window(attn.config, attn.layer_idx) is not None:
            raise ValueError(f"{method.name}: layer {attn.layer_idx} attends through a sliding window; "
                             "token eviction on sliding-window layers is not supported")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, position_ids=None, **kwargs):
        B, T, _ = hidden_states.shape
        x = hidden_states
        q, k, v = self.project(x, position_embeddings)
        cache = self.own_cache(past_key_values, SubsetKVCache)
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
        out = F.scaled_dot_product_attention(q, keys_q, values_q, attn_mask=mask, scale=self.softmax_scale())
        keep = policy.keep(self.layer_idx, q, keys, positions, seen + T, prefill=old_k is None and T > 1,
                           scale=self.softmax_scale())
        if keep is not None:
            idx = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
            keys, values = keys.gather(2, idx), values.gather(2, idx)
            positions = positions.gather(2, keep)
        cache.store(self.layer_idx, keys, values, positions, seen + T)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None


def _check_unpadded(attention_mask, name: str,
                    why: str = "counts tokens (a sink, a window, a budget): a padded batch would "
                               "count a row's pad tokens too") -> None:
    """A padded batch is refused: a column no query may see is a pad token."""
    if attention_mask is None:
        return
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1
    seen_by_some = visible.any(-2) if visible.dim() == 4 else visible
    if not bool(seen_by_some.all()):
        raise ValueError(f"{name} {why}; run prompts one at a time")
