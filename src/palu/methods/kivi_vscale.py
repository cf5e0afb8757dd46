"""KIVI with calibrated per-channel value scales: a fitted method (its state: one fp16 scale per
layer, KV head and channel, fitted on calibration values by `palu.calib.value_scales`).

KIVI codes each token's values in groups of `group` channels with one min-max range a group, so
one large channel widens its group's range and coarsens every other channel's codes there.
Dividing value channel c by s_c = max|v_c|^alpha (normalised to a geometric mean of 1 per KV
head) before quantising and multiplying it back after evens the channels of a group, as
SmoothQuant migrates activation outliers. Keys stay as KIVI has them: they are coded per channel
(groups of tokens), where a per-channel scale cancels out of the min-max codes.

    scales = fit_value_scales(capture_activations(model, windows, fisher=False), alpha=0.5)
    method = KIVIVScale(bits=2, state=scales); method.install(model)

The scales are stored once per layer (`layer_metadata_nbytes`: counted in the cache's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..cache.quant_cache import Codec
from ..calib.state_folder import load_state, save_state
from ..quant.codecs import UniformCodec
from .base import MethodError
from .fitted_state import FittedState
from .kivi import KIVI

FORMAT = 1
FIT_WITH = "python -m palu.pipeline.cli.fit fitted=kivi_vscale"


def state_tag(alpha: float) -> str:
    return f"vscale-a{alpha:g}"


def check_alpha(alpha) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise MethodError(f"kivi_vscale alpha={alpha!r} is not in [0, 1] (0: no scaling, 1: every "
                          "channel's calibrated maximum to one size)")


@dataclass
class ValueScales:
    """The fitted state: `scales` (layers, H, d), fp16 values, geometric mean 1 per (layer, head)."""
    alpha: float
    scales: torch.Tensor
    info: dict = field(default_factory=dict)   # calibration windows, tokens, the model they came from

    @property
    def tag(self) -> str:
        return state_tag(self.alpha)

    def save(self, path: str | Path) -> None:
        save_state(path, {"scales": self.scales},
                   {"format": FORMAT, "method": "kivi_vscale", "tag": self.tag, "alpha": self.alpha,
                    "info": self.info})

    @classmethod
    def load(cls, path: str | Path) -> "ValueScales":
        manifest, t = load_state(path, "kivi_vscale", FORMAT, "KIVI value-scale state", FIT_WITH)
        state = cls(manifest["alpha"], t["scales"], manifest.get("info", {}))
        if state.scales.ndim != 3 or not torch.isfinite(state.scales).all() or (state.scales <= 0).any():
            raise ValueError(f"KIVI value-scale state {path}: scales must be finite and positive, "
                             f"(layers, kv heads, head_dim); got {tuple(state.scales.shape)}")
        return state


class ScaledCodec(Codec):
    """Another codec over x / s, decoded times s (`scales[layer]` (H, d), per channel)."""

    def __init__(self, inner: Codec, scales: torch.Tensor):
        self.inner, self.scales = inner, scales
        self.block, self.dense = inner.block, getattr(inner, "dense", False)

    def _s(self, layer, like):
        return self.scales[layer].to(like.device, torch.float64 if like.dtype == torch.float64 else torch.float32)[None, :, None, :]

    def encode(self, x, layer):
        s = self._s(layer, x)
        return self.inner.encode((x.to(s.dtype) / s).to(x.dtype), layer)

    def decode(self, enc, layer, dtype):
        x = self.inner.decode(enc, layer, torch.float64 if dtype == torch.float64 else torch.float32)
        return (x * self._s(layer, x)).to(dtype)

    def layer_metadata_nbytes(self, layer):
        return self.inner.layer_metadata_nbytes(layer) + 2 * self.scales[layer].numel()   # fp16 scales

    def nbytes_for(self, tokens, B, H, d):
        return self.inner.nbytes_for(tokens, B, H, d)


@dataclass
class KIVIVScale(FittedState, KIVI):
    name = "kivi_vscale"
    state_class, state_what = ValueScales, "KIVI value-scale state"
    state: Any = None          # a fitted ValueScales, or the folder one was saved to

    def check(self) -> None:
        if self.state is None:
            raise MethodError(f"method=kivi_vscale needs method.state=<a fitted value-scale folder> ({FIT_WITH}) "
                              "or a ValueScales")
        super().check()

    @property
    def tag(self) -> str:
        return f"{super().tag}-{self.loaded.tag}"

    def install(self, model) -> None:
        self.check_state_model(model)
        super().install(model)

    def codecs(self, geom, model):
        keys, values = super().codecs(geom, model)
        s = self.loaded.scales
        if tuple(s.shape) != (geom.num_layers, geom.num_kv_heads, geom.head_dim):
            raise ValueError(f"the value scales were fitted for (layers, kv heads, head_dim) {tuple(s.shape)}, "
                             f"the model has {(geom.num_layers, geom.num_kv_heads, geom.head_dim)}")
        return keys, ScaledCodec(values, s)

    def summary(self) -> dict:
        return {**super().summary(), "alpha": self.loaded.alpha}

    def record(self) -> dict:
        return {**super().record(), "state": str(self.state) if not isinstance(self.state, ValueScales) else None,
                "alpha": self.loaded.alpha, "info": self.loaded.info}
