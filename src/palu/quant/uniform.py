"""Asymmetric min-max integer quantisation in groups, packed (`palu.quant.packed.pack_codes`).

x (B, H, n, d) is grouped either along the channels of each token (`axis="channel"`: Atom, KIVI's
values; `group` channels share a scale) or along the tokens of each channel (`axis="token"`:
KIVI's keys; `group` consecutive tokens share a scale per channel). A value is stored as its
code q in [0, 2^bits) with x̂ = q * scale + min; scale and min are fp16 (what is stored is what is
used: codes are computed from the fp16-rounded scale and min, so |x - x̂| <= scale / 2 up to fp16
rounding of the min).
"""
from __future__ import annotations

import torch

# MIN_SCALE: a constant group gets fp16's smallest normal scale, never zero (as the latents do)
from palu.quant.packed import MIN_SCALE, pack_codes, unpack_codes


def check_group(group: int, size: int, what: str) -> int:
    if not isinstance(group, int) or group <= 0 or size % group:
        raise ValueError(f"group size {group!r} does not divide {what} ({size})")
    return group


def _grouped(x: torch.Tensor, group: int, axis: str) -> tuple[torch.Tensor, int]:
    """A view whose reduction dim holds one group's members, and that dim's index."""
    B, H, n, d = x.shape
    if axis == "channel":
        return x.reshape(B, H, n, d // group, group), -1
    return x.reshape(B, H, n // group, group, d), 3


def _codes(x: torch.Tensor, bits: int, group: int, axis: str):
    """(codes q as grouped uint8, fp16 scale, fp16 min, the group dim) of x, unpacked."""
    levels = 2 ** bits - 1
    g, dim = _grouped(x.float(), group, axis)
    lo, hi = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    mn = lo.half()
    scale = ((hi - mn.float()) / levels).clamp_min(MIN_SCALE).half()
    q = torch.floor((g - mn.float()) / scale.float() + 0.5).clamp(0, levels).to(torch.uint8)
    return q, scale, mn, dim


def quantize(x: torch.Tensor, bits: int, group: int, axis: str = "channel") -> dict:
    """x (B, H, n, d) -> {"codes": (B, H, n, d * bits / 8) uint8, "scale", "min"} where scale and
    min are fp16 (B, H, n, d / group) for channel groups, (B, H, n / group, d) for token groups."""
    q, scale, mn, dim = _codes(x, bits, group, axis)
    codes = pack_codes(q.reshape(x.shape), bits)
    return {"codes": codes, "scale": scale.squeeze(dim), "min": mn.squeeze(dim)}


def fake_quantize(x: torch.Tensor, bits: int, group: int, axis: str = "channel") -> torch.Tensor:
    """dequantize(quantize(x)) bit for bit, without packing the codes and unpacking them again
    (lossless for codes in [0, 2^bits)): the same scale, minimum and codes, the same float32
    products, cast to x's dtype. A decode step that codes a block as it falls due needs only
    this (`cache/quant_slots.py`), and the pack / unpack were ~12 of its ~35 kernels a call."""
    q, scale, mn, _ = _codes(x, bits, group, axis)
    return (q.float() * scale.float() + mn.float()).reshape(x.shape).to(x.dtype)


def dequantize(enc: dict, bits: int, group: int, axis: str, dtype) -> torch.Tensor:
    shape = enc["min"].shape
    d = shape[-1] * group if axis == "channel" else shape[-1]
    q = unpack_codes(enc["codes"], bits, d).float()
    g, dim = _grouped(q, group, axis)
    x = g * enc["scale"].float().unsqueeze(dim) + enc["min"].float().unsqueeze(dim)
    return x.reshape(q.shape).to(dtype)
