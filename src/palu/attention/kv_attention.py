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
from ..models.adapters import FamilyAdapter, Geometry, layer_window
from . import banded_prefill
from .full_heads import FullHeads
from .rope import apply_rope


class QuantKVAttention(FullHeads):
    quantises_kv = True   # how a method finds its layers without importing this class

    def __init__(self, attn: nn.Module, adapter: FamilyAdapter, geom: Geometry, method,
                 rotary: nn.Module | None = None):
        super().__init__(attn, adapter, geom)
        self.method = method
        self.sliding_window = layer_window(attn.config, attn.layer_idx)   # this layer's, if it slides
        self._rotary = (rotary,)   # shared with the model, not a submodule of ours

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, position_ids=None, **kwargs):
        B, T, _ = hidden_states.shape
        x = hidden_states
        pre_rope = self.method.pre_rope
        q, k, v = self.project(x, position_embeddings, rotate_keys=not pre_rope)
        cache = self.own_cache(past_key_values, QuantKVCache)
        if cache.slots is not None:   # decode steps in preallocated slots, replayed as CUDA graphs
            if T != 1:
                raise ValueError(f"{self.method.tag}: a cache in preallocated slots takes one token a row a step")
            out = cache.slots.attend(self.layer_idx, q, k, v, self.softmax_scale())
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None
        past = cache.get_seq_length(self.layer_idx)
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)[None]
        view = cache.step(self.layer_idx, k, v, position_ids, attention_mask, self.sliding_window,
                          banded=not pre_rope)
        if isinstance(view, (banded_prefill.QuantKVBand, banded_prefill.RowBands)):
            # a prefill: causal + a band, no dense mask (a left-padded batch: row by row)
            attend = banded_prefill.attend if isinstance(view, banded_prefill.QuantKVBand) else banded_prefill.attend_rows
            out = attend(q, view, self.softmax_scale())
            self._after_prefill(cache, q, k, v, past, T)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None
        keys = view.keys
        if self.geom.rope and pre_rope:
            kcos, ksin = self._rotary[0](x, view.key_positions.long())
            keys = apply_rope(keys, kcos, ksin)
        values, gqa = view.values, self.geom.n_rep > 1
        if gqa and view.mask is not None and T > 1:
            # SDPA's grouped-query kernels take no mask on CUDA, so its math path would hold
            # batch x query heads x T x S scores (KIVI's 8K prefill ran out of memory at batch 32
            # on the H200); with the heads expanded the memory-efficient kernel takes the mask
            keys, values = (t.repeat_interleave(self.geom.n_rep, 1) for t in (keys, values))
            gqa = False
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=view.mask, scale=self.softmax_scale(),
                                             enable_gqa=gqa)
        self._after_prefill(cache, q, k, v, past, T)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None

    def _after_prefill(self, cache, q, k, v, past: int, T: int) -> None:
        eviction = getattr(self.method, "eviction", None)     # a composition with SnapKV
        if eviction is not None and past == 0 and T > 1:
            self._evict(eviction, cache.layers[self.layer_idx], q, k, v, T)

    def _evict(self, eviction, layer, q, k, v, T: int) -> None:
        """After the prefill, hold only the tokens `eviction` keeps. A left-padded batch's rows
        are apart (`QuantKVLayer.rows`): each row chooses among its own real tokens, with its own
        queries, and its row layer holds what that prompt alone would. A right-padded one (the
        slots' prefill) chooses the same per row and leaves the holding to the slots."""
        scale = self.softmax_scale()
        if layer.stash is not None:
            # a right-padded prefill: row b's tokens and queries are its first n_b; every row's
            # choice at once (one scoring and one top-k for the batch where the scorer has a
            # batched rule: SnapKV's 64 rows x 30 layers of small calls made KIVI + SnapKV's
            # prefill 1.53 s against Atom's 0.95 s at 64 x 4K, session 49), kept for the slots,
            # which gather its exact tokens (`QuantSlots._row_forms`)
            layer.kept_rows = eviction.keep_right_padded(self.layer_idx, q, k, layer.stash_lengths, scale)
            return
        parts = ([(layer, slice(None), 0)] if layer.rows is None
                 else [(row, slice(b, b + 1), pad) for b, (row, pad) in enumerate(zip(layer.rows, layer.pads))])
        for store, rows, pad in parts:
            qb, kb, vb = q[rows, :, pad:], k[rows, :, pad:], v[rows, :, pad:]
            keep = eviction.keep(self.layer_idx, qb, kb, None, T - pad, prefill=True, scale=scale)
            if keep is not None:
                pick = lambda t: t.gather(2, keep[..., None].expand(-1, -1, -1, t.shape[-1]))  # noqa: E731
                store.evict(pick(kb), pick(vb), T - pad)
