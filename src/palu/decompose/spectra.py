"""Error profiles of every factorised block: the squared singular values of W_g S (whitened:
S S^T = the layer's calibration Gram), descending. Truncating the block to rank r leaves an
output error of exactly sum(sigma_i^2 for i > r) = ||(W_g - B A) X||_F^2 on the calibration
inputs (Eckart-Young in the whitened space), which is what `error_aware` allocation spends
latent dims against."""
from __future__ import annotations

import torch

from ..models.adapters import adapter_for, geometry_of
from .ranks import Slot, slots
from .svd import canonical_svd, whitening


@torch.no_grad()
def whitened_svds(model, grams: torch.Tensor, group_size: int) -> dict[Slot, tuple]:
    """Per block (U, sigma, V) with W_g = U diag(sigma) V exactly and U diag(sigma[:r]) V[:r] its
    best rank-r factorisation for the calibration inputs (V = Vh S^-1, the whitened SVD)."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    rows = group_size * geom.head_dim
    device = next(model.parameters()).device      # float64 where the model runs; kept on the CPU
    out = {}
    for l, layer in enumerate(adapter.layers(model)):
        _, k, v, _ = adapter.projections(adapter.attention(layer))
        white = whitening(grams[l].to(device))
        for kind, proj in (("k", k), ("v", v)):
            W = proj.weight.double()
            for g in range(geom.num_kv_heads // group_size):
                U, sigma, Vh = canonical_svd(W[g * rows:(g + 1) * rows] @ white.S)
                out[Slot(l, kind, g)] = (U.cpu(), sigma.cpu(), (Vh @ white.S_inv).cpu())
    missing = [s for s in slots(geom, group_size) if s not in out]
    if missing:
        raise RuntimeError(f"no spectrum for blocks {missing[:3]}")
    return out


def spectra_of(svds: dict) -> dict[Slot, torch.Tensor]:
    return {slot: sigma.pow(2) for slot, (_, sigma, _) in svds.items()}


@torch.no_grad()
def whitened_spectra(model, grams: torch.Tensor, group_size: int) -> dict[Slot, torch.Tensor]:
    """{Slot: sigma^2 descending} of every block (`whitened_svds`)."""
    return spectra_of(whitened_svds(model, grams, group_size))
