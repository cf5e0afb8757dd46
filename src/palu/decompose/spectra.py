"""Error profiles of every factorised block: the squared singular values of W_g S (whitened:
S S^T = the layer's calibration Gram), descending. Truncating the block to rank r leaves an
output error of exactly sum(sigma_i^2 for i > r) = ||(W_g - B A) X||_F^2 on the calibration
inputs (Eckart-Young in the whitened space), which is what `error_aware` allocation spends
latent dims against."""
from __future__ import annotations

import torch

from ..models.adapters import adapter_for, geometry_of
from .ranks import Slot, slots
from .svd import whitening


@torch.no_grad()
def whitened_spectra(model, grams: torch.Tensor, group_size: int) -> dict[Slot, torch.Tensor]:
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    rows = group_size * geom.head_dim
    out = {}
    for l, layer in enumerate(adapter.layers(model)):
        _, k, v, _ = adapter.projections(adapter.attention(layer))
        S = whitening(grams[l]).S
        for kind, proj in (("k", k), ("v", v)):
            W = proj.weight.double().cpu()
            for g in range(geom.num_kv_heads // group_size):
                sigma = torch.linalg.svdvals(W[g * rows:(g + 1) * rows] @ S)
                out[Slot(l, kind, g)] = sigma.pow(2)
    missing = [s for s in slots(geom, group_size) if s not in out]
    if missing:
        raise RuntimeError(f"no spectrum for blocks {missing[:3]}")
    return out
