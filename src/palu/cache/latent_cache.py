"""A KV cache that stores Palu latents (r numbers per token per group), pre-RoPE.

Plugs into transformers' Cache API, so `model.generate(..., past_key_values=LatentCache(model))`
works. Per layer it keeps `keys` (B, 1, T, R_k) and `values` (B, 1, T, R_v) — the latents of all
groups side by side (groups may have different ranks) — plus the token positions (B, T) that
RoPE needs when keys are rebuilt.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class LatentLayer(DynamicLayer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None
        # Every row holds positions p0, p0 + 1, ... (the usual cache): the decode kernels then
        # take a per-row offset and their fast RoPE path. Tracked as tokens arrive, so a decode
        # step checks its new tokens only, not the whole cache.
        self.contiguous = True

    def update_latent(self, hk, hv, positions):
        """Append latents (B, T, R) and positions (B, T); return everything stored so far."""
        keys, values = self.update(hk.unsqueeze(1), hv.unsqueeze(1))
        positions = positions.to(torch.int32).expand(hk.shape[0], -1)
        if self.contiguous:
            start = positions[:, :1] if self.positions is None else self.positions[:, -1:] + 1
            steps = torch.arange(positions.shape[1], device=positions.device, dtype=positions.dtype)
            self.contiguous = bool((positions == start + steps).all())
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], 1)
        return keys.squeeze(1), values.squeeze(1), self.positions

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.positions is not None and self.keys is not None:
            self.positions = self.positions[:, : self.keys.shape[-2]]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        return {"latents": size(self.keys) + size(self.values), "positions": size(self.positions)}


class LatentCache(Cache):
    """One LatentLayer per decoder layer of `model` (or `num_layers`)."""

    def __init__(self, model=None, num_layers: int | None = None):
        n = num_layers if num_layers is not None else model.config.num_hidden_layers
        super().__init__(layers=[LatentLayer() for _ in range(n)])

    def update_latent(self, hk, hv, positions, layer_idx: int):
        return self.layers[layer_idx].update_latent(hk, hv, positions)

    def nbytes(self) -> dict:
        """Bytes really held: latents and the int32 positions, summed over layers."""
        totals = {"latents": 0, "positions": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                totals[key] += value
        totals["total"] = totals["latents"] + totals["positions"]
        return totals


def dense_cache_nbytes(cache) -> int:
    """Bytes held by an ordinary transformers cache (keys + values of every layer)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
