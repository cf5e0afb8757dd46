"""The packed latent format (library): the latent cache, the quantisers and the GPU kernels all read it.

Latents of one layer: ``[batch, groups, tokens, rank]`` (any strides for batch / group / token,
unit stride along rank). The latent cache's concatenated layout ``[batch, 1, tokens, groups*rank]``
is the same memory seen through `as_groups` without a copy.

Quantised latents (``bits`` in {2, 4, 8}): asymmetric min-max per token and group, packed along
the rank so that byte ``c`` holds elements ``c + k * rank / per_byte`` for ``k < per_byte``
(``per_byte = 8 // bits``) in bits ``k*bits .. k*bits + bits - 1``. A kernel therefore dequantises
``per_byte`` contiguous slices of the rank without any interleaving.

3-bit latents (torch path only; the decode kernels take 2 / 4 / 8): eight elements
``c + k * rank / 8`` (k < 8) form the 24-bit word ``Σ_k q_k << 3k``, stored as three byte planes
side by side: byte ``c`` (bits 0-7), ``c + rank / 8`` (bits 8-15), ``c + 2 rank / 8`` (bits
16-23) — 3 bytes per 8 values, ``3 * rank / 8`` bytes per token and group.

At every width, scales and zero points are fp16 tensors ``[batch, groups, tokens]``; a latent is ``(n - zero) * scale``, the zero point an
integer in [-1024, 1024 + levels] (outside [0, levels] only for tokens whose latents share a sign).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

UNQUANTISED = 16           # the one encoding of "latents in the model's dtype", everywhere
SUPPORTED_BITS = (2, 3, 4, 8)
KERNEL_BITS = (2, 4, 8)   # what the Triton decode / quantise kernels read and write


def pack_unit(bits: int) -> int:
    """Elements packed together: the rank must be a multiple of it."""
    return 8 if bits == 3 else 8 // bits


def packed_width(rank: int, bits: int) -> int:
    """Bytes per token and group of `rank` latents at `bits` (a rank that is not a multiple of
    `pack_unit` is padded with zero codes up to one: the torch path only)."""
    unit = pack_unit(bits)
    return -(-rank // unit) * unit * bits // 8
MIN_SCALE = 2.0 ** -14   # smallest normal fp16: a constant row must not get a zero scale
ZERO_LIMIT = 1024.0      # |zero point| bound: integers up to 2048 are exact in fp16


def as_groups(latents: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, T, G*R] (the latent cache) -> a [B, G, T, R] view, no copy."""
    B, one, T, GR = latents.shape
    if one != 1 or GR % groups:
        raise ValueError(f"latents of shape {tuple(latents.shape)} cannot be split into {groups} groups")
    return latents.view(B, T, groups, GR // groups).permute(0, 2, 1, 3)


@dataclass
class QuantLatent:
    data: torch.Tensor    # uint8 [B, G, T, packed_width(R, bits)]
    scale: torch.Tensor   # fp16 [B, G, T]
    zero: torch.Tensor    # fp16 [B, G, T]
    bits: int
    rank: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))


def quantize_latent(h: torch.Tensor, bits: int) -> QuantLatent:
    """Per-token, per-group asymmetric min-max quantisation of [B, G, T, R] latents, packed."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not one of {SUPPORTED_BITS}")
    R = h.shape[-1]
    levels = 2 ** bits - 1
    hf = h.float()
    lo, hi = hf.amin(-1), hf.amax(-1)
    # Rounding is half-up (floor(x + 0.5)) and the scale at least fp16's smallest normal number,
    # so that kernels/quantize.py reproduces this bit for bit. A token whose latents all share
    # one sign gets a zero point outside [0, levels] (clamping it there saturated every value);
    # the scale is kept >= |lo| / ZERO_LIMIT so the zero point stays an integer fp16 holds exactly.
    # Divisions by a same-device tensor: torch on a GPU turns a division by a Python number into
    # a multiplication by its reciprocal (1 ulp off now and then), on a CPU it divides.
    scale = torch.maximum((hi - lo) / torch.full_like(hi, levels), lo.abs() / ZERO_LIMIT)
    scale = scale.clamp_min(MIN_SCALE).half()
    zero = torch.floor(-lo / scale.float() + 0.5).half()
    q = torch.floor(hf / scale.float()[..., None] + zero.float()[..., None] + 0.5).clamp(0, levels).to(torch.uint8)
    return QuantLatent(pack_codes(q, bits), scale.contiguous(), zero.contiguous(), bits, R)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (..., n) uint8 in [0, 2^bits) packed along the last axis in the layout
    above: (..., packed_width(n, bits)) uint8 (n padded with zero codes to a multiple of
    `pack_unit(bits)`; `unpack_codes(..., n)` drops them)."""
    n = q.shape[-1]
    pad = -n % pack_unit(bits)
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
        n += pad
    parts = q.split(n // pack_unit(bits), dim=-1)
    if bits == 3:
        word = torch.zeros(parts[0].shape, dtype=torch.int32, device=q.device)
        for k, part in enumerate(parts):
            word |= part.to(torch.int32) << (3 * k)
        packed = torch.cat([((word >> s) & 255).to(torch.uint8) for s in (0, 8, 16)], -1)
    else:
        packed = torch.zeros_like(parts[0])
        for k, part in enumerate(parts):
            packed |= part << (k * bits)
    return packed.contiguous()


def unpack_codes(data: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """`pack_codes` undone: (..., packed_width(n, bits)) uint8 -> (..., n) integer codes (int32);
    n None: every packed code (padding included)."""
    if bits == 3:
        b0, b1, b2 = (p.to(torch.int32) for p in data.split(data.shape[-1] // 3, dim=-1))
        word = b0 | (b1 << 8) | (b2 << 16)
        parts = [(word >> (3 * k)) & 7 for k in range(8)]
    else:
        per_byte, mask = 8 // bits, 2 ** bits - 1
        parts = [((data >> (k * bits)) & mask).to(torch.int32) for k in range(per_byte)]
    codes = torch.cat(parts, -1)
    return codes if n is None else codes[..., :n]


def dequantize_latent(q: QuantLatent, dtype=torch.float16) -> torch.Tensor:
    ints = unpack_codes(q.data, q.bits, q.rank).float()
    return ((ints - q.zero.float()[..., None]) * q.scale.float()[..., None]).to(dtype)
