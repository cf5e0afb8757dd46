"""Fused elementwise steps of a decoder layer (one launch each instead of ~9 and 2).

A decode step of a 7B model in torch runs ~30 tiny elementwise kernels per layer around its
GEMVs (RMSNorm alone is cast, square, mean, add, rsqrt, multiply, cast, multiply); at batch 1
each costs ~1.5-3 us of GPU time whatever its size: ~1 ms per token (the decode profile in
benchmarks/NOTES.md). Used by the benchmark decoder (`palu_bench.bench_decoder`) for the dense and the
Palu model alike, so speed-ups over the dense model are not flattered by them.

Numerics follow the torch expressions they replace: the residual sum is rounded to the model's
dtype before it is normalised, the norm is taken in float32 and rounded before the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(X, D, W, XO, HO, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * N + cols, mask=ok, other=0.0)
    if HAS_D:
        x = (x.to(tl.float32) + tl.load(D + row * N + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(XO + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    # rounded to the dtype, then times the weight in float32 (exact) and rounded again: the
    # dtype's own product, without 16-bit arithmetic (which the interpreter gets wrong for bf16)
    h = ((xf * inv).to(x.dtype).to(tl.float32) * w).to(x.dtype)
    tl.store(HO + row * N + cols, h, mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * w) for rows of x [..., N]; delta None: (x, rms_norm(x) * w)."""
    N = x.shape[-1]
    if w.shape != (N,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta "
                         f"{None if delta is None else tuple(delta.shape)}, weight {tuple(w.shape)}")
    x = x.contiguous()
    rows = x.numel() // N
    xo = torch.empty_like(x) if delta is not None else x
    ho = torch.empty_like(x)
    d = delta.contiguous() if delta is not None else x
    _add_rms_norm[(rows,)](x, d, w, xo, ho, eps, N=N, BLOCK=triton.next_power_of_2(N),
                           HAS_D=delta is not None, num_warps=8 if N >= 2048 else 4)
    return xo, ho


@triton.jit
def _silu_mul(GU, OUT, N: tl.constexpr, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(GU + row * 2 * N + cols, mask=ok, other=0.0)
    u = tl.load(GU + row * 2 * N + N + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)          # F.silu rounds to the input dtype
    tl.store(OUT + row * N + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2N] = [gate | up] (the fused gate/up projection)."""
    two_n = gate_up.shape[-1]
    if two_n % 2:
        raise ValueError(f"silu_mul: last dimension {two_n} is not [gate | up]")
    gate_up = gate_up.contiguous()
    N, rows = two_n // 2, gate_up.numel() // two_n
    out = torch.empty(*gate_up.shape[:-1], N, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul[(rows, triton.cdiv(N, block))](gate_up, out, N=N, BLOCK=block, num_warps=4)
    return out
