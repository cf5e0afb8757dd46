"""Swap a model's attention modules for Palu attention (explicitly; importing palu patches nothing)."""
from __future__ import annotations

from ..models.adapters import adapter_for, check_rope, geometry_of, rotary_for
from .palu_attention import PaluAttention


def install_palu(model, factors: list, group_size: int, fuse: bool = True):
    """Replace every layer's attention with PaluAttention built from `factors` (one per layer)."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    check_rope(model.config, "Palu attention")
    layers = adapter.layers(model)
    if len(factors) != len(layers):
        raise ValueError(f"{len(factors)} factor sets for a model with {len(layers)} layers")
    for i, (layer, lf) in enumerate(zip(layers, factors)):
        attn = adapter.attention(layer)
        if isinstance(attn, PaluAttention):
            raise ValueError("the model already has Palu attention installed")
        layer.self_attn = PaluAttention(attn, adapter, geom, lf, group_size, rotary=rotary_for(model, i),
                                        fuse=fuse)
    model.config.palu = {"group_size": group_size, "fuse": fuse}
    return model


BACKENDS = ("auto", "triton", "torch")


def set_backend(model, backend: str) -> None:
    """Decode path of every PaluAttention in `model` (see attention/kernel_backend.py)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    for m in model.modules():
        if isinstance(m, PaluAttention):
            m.backend = backend
