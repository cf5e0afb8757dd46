"""A padded batch's kept tokens in preallocated slots, for decode steps replayed as CUDA graphs
(`eval/static_subset.greedy_static_subset`): the eviction methods that choose once, after the
prefill (SnapKV, PyramidKV), then only append, and the selection methods that keep every token
and choose what each step reads (Quest: `policy.select_rows` over the buffer, on the device).

After the eager prefill each layer of the `SubsetKVCache` holds (B, H, n, d) keys and values,
rows that keep fewer tokens than the fullest led by filler slots (position FILLER). Here each
layer's n slots are copied into a buffer with room for every new token, and a (B, 1, 1, n + new)
mask marks the slots a row may read (its kept tokens; the fillers are the same slots in every KV
head of a row, since a layer's budget is per row, not per head). A step writes every row's token
at slot n + step and opens that column: one shape, no host read, the same for every row.
Rows that end can leave the batch (`select_rows`, when `static_decode.shrinks`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.grouped_decode import grouped_decode


class SubsetSlots:
    def __init__(self, cache, new_tokens: int, policy=None):
        self.keys, self.values, self.masks, self.widths, self.counts = [], [], [], [], []
        for i, lay in enumerate(cache.layers):
            if lay.keys is None:
                raise ValueError(f"layer {i} holds no tokens: prefill the batch through the cache first")
            B, H, n, d = lay.keys.shape
            real = lay.positions >= 0               # (B, H, n); a pad or filler is at FILLER (-1)
            if not torch.equal(real, real[:, :1].expand_as(real)):
                raise RuntimeError(f"layer {i}: a row's KV heads hold tokens in different slots")
            mask = real.new_zeros(B, 1, 1, n + new_tokens)
            mask[:, 0, 0, :n] = real[:, 0]
            for held, out in ((lay.keys, self.keys), (lay.values, self.values)):
                buf = held.new_zeros(B, H, n + new_tokens, d)
                buf[:, :, :n] = held
                out.append(buf)
            # the layer keeps views of its slots, not a second copy of the kept tokens
            lay.keys, lay.values = self.keys[-1][:, :, :n], self.values[-1][:, :, :n]
            self.masks.append(mask)
            self.widths.append(n)
            self.counts.append(real[:, 0].sum(-1))                            # (B,) tokens kept
        device = cache.layers[0].keys.device
        self.step = torch.zeros(1, dtype=torch.long, device=device)   # advanced on the device
        # a selecting policy (Quest) reads a subset each step: each row's tokens are the slots
        # [pad, width + step] (nothing evicted, so the prefill's left pads lead every layer)
        self.policy = policy if policy is not None and getattr(policy, "select_rows", None) else None
        if self.policy is not None:
            pads = cache.layers[0].pads
            self.pads = (torch.zeros(len(self.counts[0]), dtype=torch.long, device=device) if pads is None
                         else pads.to(device=device, dtype=torch.long))
            # the pages' key bounds, kept as tokens arrive (a policy that has them: Quest), so a step
            # scores pages without realigning and rescanning every key (~5 passes over the keys a
            # layer and step before; the bounds are exact, so the same pages are chosen)
            self.bounds = None
            if getattr(self.policy, "page_bounds", None) is not None:
                self.bounds = [self.policy.page_bounds(self.policy.aligned(k, self.pads), w - self.pads)
                               for k, w in zip(self.keys, self.widths)]
        self.new_tokens = new_tokens
        self.layers = cache.layers

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (a device index, in order): the rows that ended leave."""
        for name in ("keys", "values", "masks", "counts"):
            setattr(self, name, [t[rows] for t in getattr(self, name)])
        for lay, keys, values, n in zip(self.layers, self.keys, self.values, self.widths):
            lay.keys, lay.values = keys[:, :, :n], values[:, :, :n]   # views again: the old slots are freed
        if self.policy is not None:
            self.pads = self.pads[rows]
            if self.bounds is not None:
                self.bounds = [(lo[rows], hi[rows]) for lo, hi in self.bounds]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Every row's new token (B, H, 1, d) at the layer's next slot, its column opened: the
        layer's keys, values and mask to attend with."""
        slot = self.step + self.widths[layer]
        self.keys[layer].index_copy_(2, slot, keys)
        self.values[layer].index_copy_(2, slot, values)
        self.masks[layer].index_fill_(3, slot, True)
        return self.keys[layer], self.values[layer], self.masks[layer]

    def attend(self, layer: int, queries, keys, values, scale: float, positions=None) -> torch.Tensor:
        """One decode step of the layer: the new token written, the queries (B, nh, 1, d) attending
        to every slot the row holds (query heads grouped by KV head): (B, nh, 1, d)."""
        new = keys
        keys, values, mask = self.write(layer, keys, values)
        if self.policy is None:
            return grouped_decode(queries, keys, values, mask, scale)
        held = self.step + (self.widths[layer] + 1) - self.pads                      # (B,) tokens a row holds
        bounds = None
        if self.bounds is not None:
            bounds = self.bounds[layer]
            self.policy.add_to_bounds(*bounds, new, held)
        mask = mask & self.policy.select_rows(queries, keys, self.pads, held, bounds)[:, :, None]   # (B, H, 1, W)
        B, nh, _, d = queries.shape
        grouped = queries.reshape(B, keys.shape[1], nh // keys.shape[1], d)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(B, nh, 1, d)

    def advance(self) -> None:
        self.step.add_(1)

    def row_tokens(self, new: dict[int, int]) -> dict[int, list[int]]:
        """Row b's tokens per layer (b in `new`: a place in the batch) once it has decoded `new[b]`
        tokens into the cache."""
        kept = torch.stack(self.counts).tolist()                                   # (layers, B)
        return {b: [layer[b] + extra for layer in kept] for b, extra in new.items()}
