"""The band of a quantised cache's banded prefill (`palu.attention.banded_prefill`): each query t
attends to the tokens t - reach < j <= t, each key and value in the form the cache holds it at
t's decode step (coded once t >= its `key_at` / `value_at`, exact before), and returns its
output with its log-sum-exp, for the caller to merge with the far part's.

Why a kernel: in torch the band materialises scores of B x heads x T x (chunk + reach) columns in
float32 several times over (two key forms, the mask, the softmax, two value forms); at SmolLM2's
shapes, batch 64 x 4K, that is ~2 GB a pass and ~10 passes a layer. Here one program holds a
chunk of queries of one head and streams its band's keys and values in both forms through an
online softmax, as flash attention does, choosing each score's and each weight's form in
registers.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def quant_band(q, ek, ck, ev, cv, key_at, value_at, reach: int, scale: float,
               block_m: int = 64, block_n: int = 64):
    """q (B, Hq, T, D); ek, ck, ev, cv (B, H, T, D) the exact and coded forms (H divides Hq);
    key_at, value_at (T,) int64: each token's first query that sees its key / value coded.
    Returns the output (B, Hq, T, D) in q's dtype and the log-sum-exp (B, Hq, T) float32."""
    B, Hq, T, D = q.shape
    H = ek.shape[1]
    if reach < 1:
        raise ValueError(f"reach={reach}: a band needs at least the query's own token")
    for name, t in (("q", q), ("ek", ek), ("ck", ck), ("ev", ev), ("cv", cv)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if ek.stride() != ck.stride() or ev.stride() != cv.stride():
        raise ValueError("the exact and coded forms must share their layout")
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, block_m), B * Hq)
    _band[grid](q, ek, ck, ev, cv, key_at, value_at, out, lse,
                q.stride(0), q.stride(1), q.stride(2), ek.stride(0), ek.stride(1), ek.stride(2),
                ev.stride(0), ev.stride(1), ev.stride(2), out.stride(0), out.stride(1), out.stride(2),
                Hq, Hq // H, T, reach, scale * LOG2E, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
                IEEE=q.dtype == torch.float32)
    return out, lse


@triton.jit
def _band(Q, EK, CK, EV, CV, KAT, VAT, OUT, LSE, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt,
          s_vb, s_vh, s_vt, s_ob, s_oh, s_ot, Hq, rep, T, reach, scale2,
          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, hq = bh // Hq, bh % Hq
    h = hq // rep
    m0 = chunk * BLOCK_M
    t = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + hq * s_qh + t[:, None] * s_qt + offs_d[None, :], mask=t[:, None] < T, other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kbase = b * s_kb + h * s_kh
    vbase = b * s_vb + h * s_vh
    lo = tl.maximum(m0 - reach + 1, 0)
    hi = tl.minimum(m0 + BLOCK_M, T)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        real = j < hi
        inside = (real[None, :] & (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - reach)
                  & (t[:, None] < T))
        kat = tl.load(KAT + j, mask=real, other=0)
        vat = tl.load(VAT + j, mask=real, other=0)
        koff = kbase + j[:, None] * s_kt + offs_d[None, :]
        ek = tl.load(EK + koff, mask=real[:, None], other=0.0)
        ck = tl.load(CK + koff, mask=real[:, None], other=0.0)
        if IEEE:
            se = tl.dot(q, tl.trans(ek), input_precision="ieee")
            sc = tl.dot(q, tl.trans(ck), input_precision="ieee")
        else:
            se = tl.dot(q, tl.trans(ek))
            sc = tl.dot(q, tl.trans(ck))
        s = tl.where(t[:, None] >= kat[None, :], sc, se) * scale2
        s = tl.where(inside, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        coded = t[:, None] >= vat[None, :]
        voff = vbase + j[:, None] * s_vt + offs_d[None, :]
        ev = tl.load(EV + voff, mask=real[:, None], other=0.0)
        cv = tl.load(CV + voff, mask=real[:, None], other=0.0)
        pc = tl.where(coded, p, 0.0)
        pe = tl.where(coded, 0.0, p)
        if IEEE:
            pv = (tl.dot(pc, cv.to(tl.float32), input_precision="ieee")
                  + tl.dot(pe, ev.to(tl.float32), input_precision="ieee"))
        else:
            pv = tl.dot(pc.to(cv.dtype), cv) + tl.dot(pe.to(ev.dtype), ev)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_i = tl.where(t < T, l_i, 1.0)   # rows past the prompt: nothing seen, nothing stored
    out = acc / l_i[:, None]
    tl.store(OUT + b * s_ob + hq * s_oh + t[:, None] * s_ot + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=t[:, None] < T)
    tl.store(LSE + bh * T + t, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=t < T)
