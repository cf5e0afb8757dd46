"""The key / value balance of `error_aware` ranks, probed on held-out calibration text.

error_aware's loss model is quadratic: a block's output error costs its output Fisher times the
discarded whitened energy. That holds for small errors. A key error, though, passes through the
softmax, so once most of a key spectrum is cut the first-order Fisher underestimates what it
costs and might starve the keys (kept 0.3 on SmolLM2 gave them 28% of the dims and lost to every
Fisher variant; measured since: the probe keeps key weight 1 there, so it was not the keys, see the
README). One scalar corrects the balance where it is off: the keys' weights are
multiplied by `key_weight` before the greedy allocation, and `probe_key_weight` picks it from
KEY_WEIGHTS by the real LM loss of the truncated model (each block replaced by its best rank-r
whitened reconstruction, which is the Palu model without quantisation) on probe windows that the
Gram did not see (the first Fisher windows). With key_weight 1 it is the plain quadratic model.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..models.adapters import adapter_for, geometry_of
from .ranks import Slot, allocate, ranks_table

KEY_WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0)
PROBE_WINDOWS = 1        # Fisher windows the probe scores (one 2048-token window by default)


@contextlib.contextmanager
def truncated(model, svds: dict, allocation: dict):
    """The model with every K/V block at its allocated rank (dense weights), restored after."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    rows = allocation["group_size"] * geom.head_dim
    ranks = ranks_table(allocation)
    saved = []
    try:
        for l, layer in enumerate(adapter.layers(model)):
            _, k, v, _ = adapter.projections(adapter.attention(layer))
            for kind, proj in (("k", k), ("v", v)):
                saved.append((proj, proj.weight.data.clone()))
                W = proj.weight.data.double().cpu().clone()
                for g in range(geom.num_kv_heads // allocation["group_size"]):
                    U, sigma, V = svds[Slot(l, kind, g)]
                    r = ranks[(l, kind, g)]
                    W[g * rows:(g + 1) * rows] = (U[:, :r] * sigma[:r]) @ V[:r]
                proj.weight.data.copy_(W.to(proj.weight.dtype))
        yield model
    finally:
        for proj, weight in saved:
            proj.weight.data.copy_(weight)


@torch.no_grad()
def probe_loss(model, windows: torch.Tensor) -> float:
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for window in windows:
        batch = window[None].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss.item()
        total += loss * (batch.shape[1] - 1)
        count += batch.shape[1] - 1
    if not math.isfinite(total):
        raise FloatingPointError("non-finite probe loss while choosing error_aware's key weight")
    return total / count


def probe_key_weight(model, svds: dict, fisher: torch.Tensor, kept_ratio: float, group_size: int,
                     multiple: int, windows: torch.Tensor, weights=KEY_WEIGHTS) -> tuple[float, list[dict]]:
    """The key weight of KEY_WEIGHTS whose allocation gives the lowest probe loss (ties: the
    smaller weight), and every candidate's loss and key share."""
    geom = geometry_of(model.config)
    spectra = {s: sigma.pow(2) for s, (_, sigma, _) in svds.items()}
    rows = []
    for w in weights:
        allocation = allocate(geom, kept_ratio, group_size, "error_aware", multiple, fisher, spectra,
                              key_weight=w)
        with truncated(model, svds, allocation):
            loss = probe_loss(model, windows)
        keys = sum(r["rank"] for r in allocation["ranks"] if r["kind"] == "k")
        rows.append({"key_weight": w, "loss": loss, "ppl": math.exp(loss),
                     "key_share": keys / allocation["latent_size"]})
    best = min(rows, key=lambda r: (r["loss"], r["key_weight"]))
    return best["key_weight"], rows
