"""A padded batch's kept tokens in preallocated slots, for decode steps replayed as CUDA graphs
(`eval/static_subset.greedy_static_subset`): the eviction methods that choose once, after the
prefill (SnapKV, PyramidKV), then only append.

After the eager prefill each layer of the `SubsetKVCache` holds (B, H, n, d) keys and values,
rows that keep fewer tokens than the fullest led by filler slots (position FILLER). Here each
layer's n slots are copied into a buffer with room for every new token, and a (B, 1, 1, n + new)
mask marks the slots a row may read (its kept tokens; the fillers are the same slots in every KV
head of a row, since a layer's budget is per row, not per head). A step writes every row's token
at slot n + step and opens that column: one shape, no host read, the same for every row.
Rows that end keep decoding (their later tokens are dropped by the caller)."""
from __future__ import annotations

import torch

from ..attention.grouped_decode import grouped_decode


class SubsetSlots:
    def __init__(self, cache, new_tokens: int):
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
            self.masks.append(mask)
            self.widths.append(n)
            self.counts.append(real[:, 0].sum(-1))                            # (B,) tokens kept
        device = cache.layers[0].keys.device
        self.step = torch.zeros(1, dtype=torch.long, device=device)   # advanced on the device
        self.new_tokens = new_tokens
        self.position_nbytes = cache.layers[0].positions.element_size()

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
        return grouped_decode(queries, *self.write(layer, keys, values), scale)

    def advance(self) -> None:
        self.step.add_(1)

    def row_nbytes(self, new: list[int]) -> list[dict]:
        """Each row's bytes as the method's cache counts them when the row holds its kept prompt
        tokens and `new[b]` decoded ones: keys and values in the model's dtype, an int32 position
        per KV head as metadata (`SubsetKVCache.nbytes` of the row alone)."""
        kept = torch.stack(self.counts).sum(0).tolist()          # one host read: tokens over layers
        per_data = self.keys[0].shape[1] * self.keys[0].shape[3] * self.keys[0].element_size() * 2
        per_meta = self.keys[0].shape[1] * self.position_nbytes
        layers = len(self.keys)
        out = []
        for b, extra in enumerate(new):
            tokens = kept[b] + layers * extra
            data, meta = tokens * per_data, tokens * per_meta
            out.append({"data": data, "metadata": meta, "total": data + meta})
        return out

