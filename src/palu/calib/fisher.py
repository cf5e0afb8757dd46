"""Fisher information of the K and V projection weights: squared gradients of the LM loss.

Stored per layer, per K/V and per KV head (the sum of the Fisher entries in that head's rows),
so any group size can be reduced from it later.
"""
from __future__ import annotations

import torch

from ..models.adapters import adapter_for, geometry_of
from ..progress import steps


def collect_fisher(model, windows: torch.Tensor, progress: bool = True) -> dict:
    """Return {"fisher": (layers, 2, kv_heads) float64, "windows": n}. Only K/V weights get grads."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    layers = adapter.layers(model)
    weights = []
    for layer in layers:
        _, k, v, _ = adapter.projections(adapter.attention(layer))
        weights.append((k.weight, v.weight))
    saved = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for kw, vw in weights:
        kw.requires_grad_(True)
        vw.requires_grad_(True)
    squares = [[torch.zeros_like(kw, dtype=torch.float64), torch.zeros_like(vw, dtype=torch.float64)]
               for kw, vw in weights]
    device = next(model.parameters()).device
    try:
        for window in steps(windows, "Fisher", "windows", progress):
            batch = window[None].to(device)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            model.zero_grad(set_to_none=True)
            loss.backward()
            for acc, pair in zip(squares, weights):
                for j in range(2):
                    acc[j] += pair[j].grad.double() ** 2     # on the weights' device
    finally:
        model.zero_grad(set_to_none=True)
        for p, flag in saved.items():
            p.requires_grad_(flag)
    fisher = torch.zeros(len(layers), 2, geom.num_kv_heads, dtype=torch.float64)
    for i, acc in enumerate(squares):
        for j in range(2):  # rows of head h: h*head_dim .. (h+1)*head_dim
            fisher[i, j] = acc[j].view(geom.num_kv_heads, geom.head_dim, -1).sum(dim=(1, 2)).cpu()
    return {"fisher": fisher, "windows": int(len(windows))}
