"""Attention through a token-subset cache (the eviction methods, `palu/methods/streaming_llm.py`,
`snapkv.py`): the model's own q/k/v projections, q/k norms and RoPE (keys stored after RoPE, at
their true positions), then the queries attend to the kept tokens plus this step's, as the
method's policy allows (`SubsetPolicy.visible`), and the policy picks what the cache keeps.

A left-padded batch is served row by row: each row's positions count its own tokens, no query
sees a pad, and the policy decides over each row's own tokens with its own state (`_by_row`), so
every row holds what its prompt alone would (rows that keep fewer tokens than the longest are led
by masked filler slots). Without a cache a fresh one serves the step, so the model never runs
without the method.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.protocol import left_pads
from ..cache.subset_cache import FILLER, SubsetKVCache, SubsetPolicy, gather_slots, real_slots, slots_of
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
        q, k, v = self.project(x, position_embeddings)   # RoPE at each row's own positions
        cache = self.own_cache(past_key_values, SubsetKVCache)
        if cache.slots is not None:   # decode steps in preallocated slots, replayed as CUDA graphs
            if T != 1:
                raise ValueError(f"{self.method.name}: a cache in preallocated slots takes one token a row a step")
            out = cache.slots.attend(self.layer_idx, q, k, v, self.softmax_scale(), position_ids)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None
        old_k, old_v, old_pos, seen = cache.held(self.layer_idx)
        lay = cache.layers[self.layer_idx]
        if old_k is None:
            lay.pads = left_pads(attention_mask, B, T, self.method.name)
            lay.host_pads = None if lay.pads is None else lay.pads.tolist()   # once, at the prefill
        H, pads = self.geom.num_kv_heads, lay.pads
        slots = torch.arange(seen, seen + T, device=x.device, dtype=torch.int32)
        q_pos = slots.expand(B, 1, T)
        if pads is not None:   # a row's positions count its own tokens; a pad's is FILLER
            q_pos = (q_pos - pads.view(B, 1, 1).to(torch.int32)).clamp_min(FILLER)
        keys = k if old_k is None else torch.cat([old_k, k], 2)
        values = v if old_v is None else torch.cat([old_v, v], 2)
        new_pos = q_pos.expand(B, H, T)
        positions = new_pos if old_pos is None else torch.cat([old_pos, new_pos], 2)
        policy = cache.policy            # built once per cache by the method
        # at the prefill every KV head holds the same positions: one mask for all heads, which
        # SDPA broadcasts (per query head it took 36 GiB at a batch of 32 x 8K on the H200)
        seen_pos = positions[:, :1] if old_pos is None else positions
        mask = policy.visible(q_pos, seen_pos)                      # (B, H or 1, T, S)
        if pads is not None:   # no query sees a pad or a filler; a pad's query sees all (finite)
            mask = (mask & (seen_pos >= 0)[:, :, None]) | (q_pos < 0)[..., None]
        selects = type(policy).select is not SubsetPolicy.select   # Quest reads a subset each step
        if T == 1 and old_k is not None and (pads is None or selects):
            chosen = NotImplemented
            if pads is None:
                chosen = policy.select(q, keys, positions)
            elif lay.whole:   # every row's tokens are its slots [pad, S): all rows at once where it can
                chosen = policy.select_padded(q, keys, pads)
            if chosen is NotImplemented:
                chosen = _by_row(cache, B, lambda p, b, qb, kb, posb, seen_b: p.select(qb, kb, posb),
                                 q, keys, positions, q_pos, seen + T, pads, select=True, layer=lay)
            if chosen is not None:
                mask = mask & chosen[:, :, None, :]
        if mask.shape[1] > 1:
            mask = mask.repeat_interleave(self.geom.n_rep, dim=1)   # per query head
        keys_q = keys.repeat_interleave(self.geom.n_rep, 1)
        values_q = values.repeat_interleave(self.geom.n_rep, 1)
        out = F.scaled_dot_product_attention(q, keys_q, values_q, attn_mask=mask, scale=self.softmax_scale())
        scale, first = self.softmax_scale(), old_k is None
        if pads is None:
            keep = policy.keep(self.layer_idx, q, keys, positions, seen + T, prefill=first and T > 1, scale=scale)
        elif not (first or policy.keeps_after_prefill):
            keep = None
        elif (held := policy.keep_padded(self.layer_idx, q, keys, positions, seen + T - pads,
                                         scale=scale)) is not None:            # every row at once
            width = (None if lay.host_pads is None else
                     policy.padded_width(keys.shape[2], [seen + T - p for p in lay.host_pads]))
            keep = slots_of(held, width)
            if policy.accumulates:   # its sums follow the kept slots, as `keep` does for a row alone
                policy.kept(self.layer_idx, None if keep is None else keep[0])
        else:
            keep = _by_row(cache, B, lambda p, b, qb, kb, posb, seen_b: p.keep(
                self.layer_idx, qb, kb, posb, seen_b, prefill=first and qb.shape[2] > 1, scale=scale),
                q, keys, positions, q_pos, seen + T, pads, layer=lay)
        if keep is not None:
            lay.whole = False    # slots dropped, fillers in: a row's tokens are found on the device
            keep, fillers = keep if pads is not None else (keep, None)
            keys, values = gather_slots(keys, keep), gather_slots(values, keep)
            positions = positions.gather(2, keep)
            if fillers is not None:
                positions = positions.masked_fill(fillers, FILLER)
        cache.store(self.layer_idx, keys, values, positions, seen + T)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None


def _by_row(cache, B, decide, q, keys, positions, q_pos, seen, pads, select: bool = False, layer=None):
    """A policy's decision for a padded batch, row by row over each row's own tokens (its real
    slots and queries, its own seen count and policy state), as the row's prompt alone would
    decide it. keep: (B, H, n) slot indices and their filler flags (`slots_of`); select:
    (B, H, S) bool. None: every row keeps (reads) all. `layer`: the cache layer, whose host copy
    of the pads (and, before any eviction, the rows' slot ranges) spares the device a wait per row."""
    rows, any_change = [], False
    host = None if layer is None else layer.host_pads
    T, S = q.shape[2], positions.shape[2]
    for b in range(B):
        if host is not None and layer.whole:    # row b's tokens: slots [pad, S); its queries: the last
            pad = host[b]                       # T - max(0, pad - first query's slot)
            idx = torch.arange(pad, S, device=positions.device).expand(1, positions.shape[1], -1)
            qb = q[b:b + 1, :, max(0, pad - (seen - T)):]
        else:
            idx = real_slots(positions[b:b + 1])                                   # (1, H, n_b)
            qb = q[b:b + 1, :, (q_pos[b, 0] >= 0)]
            pad = host[b] if host is not None else int(pads[b])
        got = decide(cache.policy_of_row(b, B), b, qb, gather_slots(keys[b:b + 1], idx),
                     positions[b:b + 1].gather(2, idx), seen - pad)
        any_change |= got is not None
        rows.append((idx, got))
    if not any_change:
        return None
    chosen = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
    for b, (idx, got) in enumerate(rows):   # a row's chosen slots (its kept or read tokens)
        if got is None:
            chosen[b].scatter_(-1, idx[0], True)
        elif select:
            chosen[b].scatter_(-1, idx[0], got[0])
        else:
            chosen[b].scatter_(-1, idx[0].gather(-1, got[0]), True)
    return chosen if select else slots_of(chosen)


def _check_unpadded(attention_mask, name: str,
                    why: str = "counts tokens (a sink, a window, a budget): a padded batch would "
                               "count a row's pad tokens too") -> None:
    """A padded batch is refused (the latent caches' eviction and selection): a column no query
    may see is a pad token."""
    if attention_mask is None:
        return
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1
    seen_by_some = visible.any(-2) if visible.dim() == 4 else visible
    if not bool(seen_by_some.all()):
        raise ValueError(f"{name} {why}; run prompts one at a time")
