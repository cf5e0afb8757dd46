"""Fitting KIVI's per-channel value scales (`methods/kivi_vscale.py`) on calibration values:
s_c = max|v_c|^alpha over the captured tokens, per layer and KV head, divided by the heads'
geometric mean so the scales move range between channels and not overall. Values come from the
same capture as KVQuant's (`capture_activations(..., fisher=False)`: no gradients needed)."""
from __future__ import annotations

import torch

from ..methods.kivi_vscale import ValueScales, check_alpha
from .kvquant import KVQuantActivations, capture_activations

FLOOR = 1e-3      # of a head's largest channel maximum: a channel that never fires is not blown up


def fit_value_scales(captured: KVQuantActivations, alpha: float = 0.5) -> ValueScales:
    check_alpha(alpha)
    scales = []
    for layer in range(captured.info["layers"]):
        peak = captured.acts[(layer, "v")].double().abs().amax(0)              # (H, d)
        peak = peak.clamp_min(FLOOR * peak.amax(-1, keepdim=True).clamp_min(1e-30))
        s = peak ** alpha
        s = s / s.log().mean(-1, keepdim=True).exp()                          # geometric mean 1 per head
        scales.append(s.half().float())                                        # stored as fp16: used as stored
    info = {k: v for k, v in captured.info.items() if k != "fisher"}
    return ValueScales(float(alpha), torch.stack(scales), info)


def fit_kivi_vscale(model, windows: torch.Tensor, alpha: float = 0.5, tokens_per_window: int = 256,
                    seed: int = 0, progress: bool = True, info: dict | None = None) -> ValueScales:
    """Capture calibration values of an *unmodified* model on `windows` (n, T) and fit the scales."""
    check_alpha(alpha)
    return fit_value_scales(capture_activations(model, windows, fisher=False, tokens_per_window=tokens_per_window,
                                                seed=seed, progress=progress, info=info), alpha)
