"""Fused elementwise steps of a decoder layer (one launch each instead of ~9 and 2).

A decode step of a 7B model in torch runs ~30 tiny elementwise kernels per layer around its
GEMVs (RMSNorm alone is cast, square, mean, add, rsqrt, multiply, cast, multiply); at batch 1
each costs ~1.5-3 us of GPU time whatever its size: ~1 ms per token (the decode profile in
benchmarks/NOTES.md). Used by the benchmark decoder (`palu_bench.bench_decoder`) for the dense and the
Palu model alike, so speed-ups over the dense model are not flattered by them; and, the last three
(`rms_norm_rows`, `silu_times`, `rope`), by the library in a transformers model's own norms, MLPs
and rotary embedding on a GPU (`palu.models.fused_layers`), where a 64 x 4K prefill spent about
half its kernel time in these elementwise passes (the H200 profile, results/checks/h200-step-profile-fp16.json).

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


# ---- a transformers model's own layers (`palu.models.fused_layers`): prefill shapes, many rows ----

@triton.jit
def _rms_norm_rows(X, W, OUT, rows, eps, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    ok = (r < rows) & (cols < N)
    x = tl.load(X + r * N + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    # LlamaRMSNorm: the normalised row rounded to the dtype, then the weight's product rounded
    h = ((xf * inv[:, None]).to(x.dtype).to(tl.float32) * w).to(x.dtype)
    tl.store(OUT + r * N + cols, h, mask=ok)


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward for x [..., N] and a weight of x's dtype, a few rows a program (a
    prefill's 64 x 4K rows of 576: one launch where torch makes seven passes)."""
    N = x.shape[-1]
    if w.shape != (N,) or w.dtype != x.dtype:
        raise ValueError(f"rms_norm_rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(w.shape)} {w.dtype}")
    x = x.contiguous()
    rows = x.numel() // N
    out = torch.empty_like(x)
    block = triton.next_power_of_2(N)
    per = max(1, min(16, 4096 // block))
    _rms_norm_rows[(triton.cdiv(rows, per),)](x, w, out, rows, eps, N=N, BLOCK=block, ROWS=per,
                                             num_warps=8 if block * per >= 8192 else 4)
    return out


@triton.jit
def _silu_times(G, U, OUT, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(G + i, mask=ok, other=0.0)
    u = tl.load(U + i, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)          # F.silu rounds to the input dtype
    tl.store(OUT + i, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of one shape and dtype (a SwiGLU MLP's two projections)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_times: gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    block = 2048
    _silu_times[(triton.cdiv(gate.numel(), block),)](gate, up, out, gate.numel(), BLOCK=block, num_warps=8)
    return out


@triton.jit
def _rope(X, C, S, OUT, T, H, sxb, sxh, sxt, scb, sct, H_BLOCK: tl.constexpr, D: tl.constexpr):
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    h = tl.arange(0, H_BLOCK)[:, None]
    d = tl.arange(0, D)[None, :]
    half: tl.constexpr = D // 2
    partner = (d + half) % D                       # rotate_half: [-x2, x1]
    ok = h < H
    base = b.to(tl.int64) * sxb + t.to(tl.int64) * sxt + h * sxh
    x = tl.load(X + base + d, mask=ok, other=0.0)
    xp = tl.load(X + base + partner, mask=ok, other=0.0).to(tl.float32)
    xp = tl.where(d < half, -xp, xp)
    c = tl.load(C + b.to(tl.int64) * scb + t * sct + d).to(tl.float32)
    s = tl.load(S + b.to(tl.int64) * scb + t * sct + d).to(tl.float32)
    # (x * cos) + (rotate_half(x) * sin), each product rounded to the dtype as torch rounds it
    out = ((x.to(tl.float32) * c).to(x.dtype).to(tl.float32) + (xp * s).to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(OUT + base + d, out, mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` for one of q / k: x (B, H, T, D) in any layout whose
    last dim is dense, cos / sin (B or 1, T, D) of x's dtype; the result has x's layout. Bit for
    bit torch's: every product and the sum are rounded where torch rounds them."""
    B, H, T, D = x.shape
    if (cos.dim() != 3 or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B) or sin.shape != cos.shape
            or cos.dtype != x.dtype or sin.dtype != x.dtype or D % 2 or D & (D - 1)):
        raise ValueError(f"rope: x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}, "
                         f"sin {tuple(sin.shape)} {sin.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)           # x's strides (a transposed view stays one)
    if out.stride() != x.stride():
        x = x.contiguous()
        out = torch.empty_like(x)
    scb = 0 if cos.shape[0] == 1 else cos.stride(0)
    _rope[(B * T,)](x, cos, sin, out, T, H, x.stride(0), x.stride(1), x.stride(2), scb, cos.stride(1),
                    H_BLOCK=triton.next_power_of_2(H), D=D, num_warps=4,
                    enable_fp_fusion=False)   # no FMA across the rounded products (1 ulp apart on an H100)
    return out
