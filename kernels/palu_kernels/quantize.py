"""Quantise-and-store of new latent tokens into a preallocated packed cache, one launch.

`palu.quant.packed.quantize_latent` in torch is ~20 small kernels per tensor; called for keys and
values in every layer of every decode step it cost ~80 µs per layer (measured in the end-to-end
benchmark, benchmarks/NOTES.md). This kernel does the same per-token min-max quantisation and
packing for one (sequence, group, token) per program and writes data, scale and zero point in
place. Bit-identical to `quantize_latent` (tested through the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from palu.quant.packed import MIN_SCALE, ZERO_LIMIT, QuantLatent


@triton.jit
def _div(a, b):
    """IEEE round-to-nearest division, as torch divides: Triton's `/` on fp32 compiles to the
    approximate div.full.f32 (2 ulp), which moved a value across a rounding boundary now and then
    (found by a 70K-token GPU test; 5-token tests never hit one)."""
    return tl.math.div_rn(a, b)


@triton.jit
def _quantize_store(H, DATA, SCALE, ZERO, start,
                    s_hb, s_hg, s_ht, s_db, s_dg, s_dt, s_sb, s_sg, s_st,
                    R: tl.constexpr, RP_P2: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                    MIN_S: tl.constexpr, ZLIM: tl.constexpr, START_IN_MEMORY: tl.constexpr,
                    START_PER_ROW: tl.constexpr):
    t, pid = tl.program_id(0), tl.program_id(1)   # tokens on axis 0: up to 2^31 - 1 (axis 1: 65535)
    b, g = pid // G, pid % G
    if START_PER_ROW:     # each row's own slot (a ragged batch's step: every row at its length)
        start = tl.load(start + b).to(tl.int32)
    elif START_IN_MEMORY:   # a device tensor: a captured CUDA graph replays with each step's slot
        start = tl.load(start).to(tl.int32)
    PER: tl.constexpr = 8 // BITS
    RP: tl.constexpr = R // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, RP_P2)
    ok = cols < RP
    src = H + b * s_hb + g * s_hg + t * s_ht
    lo = tl.full([RP_P2], float("inf"), tl.float32)
    hi = tl.full([RP_P2], -float("inf"), tl.float32)
    for k in tl.static_range(PER):
        x = tl.load(src + k * RP + cols, mask=ok, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.where(ok, x, float("inf")))
        hi = tl.maximum(hi, tl.where(ok, x, -float("inf")))
    lo_all, hi_all = tl.min(lo, 0), tl.max(hi, 0)
    zeros = lo_all * 0.0
    scale = tl.maximum(_div(hi_all - lo_all, zeros + LEVELS), _div(tl.abs(lo_all), zeros + ZLIM))
    scale = tl.maximum(scale, MIN_S).to(tl.float16)
    sf = scale.to(tl.float32)
    zero = tl.floor(_div(-lo_all, sf) + 0.5).to(tl.float16)     # see quantize_latent
    zf = zero.to(tl.float32)
    sfv = tl.zeros([RP_P2], tl.float32) + sf
    packed = tl.zeros([RP_P2], tl.int32)
    for k in tl.static_range(PER):
        x = tl.load(src + k * RP + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.floor(_div(x, sfv) + zf + 0.5), 0.0), LEVELS).to(tl.int32)
        packed = packed | (q << (k * BITS))
    row = b * s_db + g * s_dg + (start + t) * s_dt
    tl.store(DATA + row + cols, packed.to(tl.uint8), mask=ok)
    tl.store(SCALE + b * s_sb + g * s_sg + (start + t) * s_st, scale)
    tl.store(ZERO + b * s_sb + g * s_sg + (start + t) * s_st, zero)


MAX_GRID_Y = 65535


def quantize_grid(B: int, G: int, n: int) -> tuple[int, int]:
    """Tokens on the grid's first axis: a prefill of n >= 64K tokens on the second axis (at most
    65535 programs) failed with CUDA's "invalid argument" (found by the transformers benchmark)."""
    return (n, B * G)


def quantize_into(h: torch.Tensor, dst: QuantLatent, start: int | torch.Tensor,
                  per_row: bool = False) -> None:
    """Quantise latents h [B, G, n, R] and write them to tokens start .. start+n-1 of dst.

    `start`: a Python int, or a one-element integer tensor on dst's device, read by the kernel
    (no host sync; a CUDA graph captured with it writes wherever the tensor points at replay);
    `per_row`: `start` is a (B,) integer tensor, row b's tokens written from start[b] (a ragged
    batch's step, one launch where scattering torch's codes row by row took ~25 kernels).
    Only an int start is checked against the cache's length."""
    B, G, n, R = h.shape
    in_memory = isinstance(start, torch.Tensor)
    if per_row:
        if not in_memory or tuple(start.shape) != (B,) or start.dtype.is_floating_point \
                or start.device != dst.data.device:
            raise ValueError(f"per_row: start must be {B} integers (one a row) on {dst.data.device}; got "
                             f"{getattr(start, 'dtype', type(start).__name__)} "
                             f"{tuple(getattr(start, 'shape', ()))}")
        start = start.contiguous()   # the kernel reads start[b] at offset b
    elif in_memory:
        if start.numel() != 1 or start.dtype.is_floating_point or start.device != dst.data.device:
            raise ValueError(f"start tensor must be one integer on {dst.data.device}; got "
                             f"{start.dtype} {tuple(start.shape)} on {start.device}")
    elif start < 0 or start + n > dst.data.shape[2]:
        raise ValueError(f"tokens {start}..{start + n - 1} do not fit a cache of {dst.data.shape[2]}")
    if R != dst.rank or dst.data.shape[:2] != (B, G):
        raise ValueError(f"latents {tuple(h.shape)} do not match the cache "
                         f"({tuple(dst.data.shape[:2])} x rank {dst.rank})")
    if B * G > MAX_GRID_Y:
        raise ValueError(f"batch x groups = {B} x {G} = {B * G} exceeds the {MAX_GRID_Y} programs a "
                         "CUDA grid's second axis takes")
    rp = R // (8 // dst.bits)
    _quantize_store[quantize_grid(B, G, n)](
        h, dst.data, dst.scale, dst.zero, start, h.stride(0), h.stride(1), h.stride(2),
        dst.data.stride(0), dst.data.stride(1), dst.data.stride(2),
        dst.scale.stride(0), dst.scale.stride(1), dst.scale.stride(2),
        R=R, RP_P2=triton.next_power_of_2(rp), BITS=dst.bits, G=G, MIN_S=MIN_SCALE,
        ZLIM=ZERO_LIMIT, START_IN_MEMORY=in_memory, START_PER_ROW=per_row, num_warps=1)
