"""Gram matrices of the K/V projections' input, per layer, accumulated in float64.

K and V read the same normalised hidden states, so one Gram per layer serves both.
"""
from __future__ import annotations

import torch

from ..models.adapters import adapter_for
from ..progress import steps


def _one_logit(model) -> dict:
    """`logits_to_keep=1` where the model's forward takes it (a fifth of a small model's FLOPs)."""
    import inspect
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def collect_grams(model, windows: torch.Tensor, progress: bool = True) -> dict:
    """Return {"gram": (layers, in, in) float64, "tokens": n} over calibration `windows`."""
    adapter = adapter_for(model.config)
    layers = adapter.layers(model)
    hidden = model.config.hidden_size
    device = next(model.parameters()).device
    # accumulated where the model runs (float64), returned on the CPU
    grams = torch.zeros(len(layers), hidden, hidden, dtype=torch.float64, device=device)
    hooks = []

    def make_hook(i):
        def hook(_module, args):
            x = args[0].reshape(-1, hidden).double()   # (tokens, in)
            grams[i].addmm_(x.T, x)
        return hook

    for i, layer in enumerate(layers):
        _, k_proj, _, _ = adapter.projections(adapter.attention(layer))
        hooks.append(k_proj.register_forward_pre_hook(make_hook(i)))
    # the hooks have what they need before the LM head: its logits for one position only
    one_logit = _one_logit(model)
    try:
        for window in steps(windows, "calibration (Gram)", "windows", progress):
            model(input_ids=window[None].to(device), use_cache=False, **one_logit)
    finally:
        for h in hooks:
            h.remove()
    return {"gram": grams.cpu(), "tokens": int(windows.numel())}
