"""One-pass decode: scores q~.h, online softmax and the attention-weighted latent values of a
tile in one kernel (non-RoPE layers; with SCORES_IN the values half of a RoPE layer)."""
from __future__ import annotations

import triton
import triton.language as tl

from .combine import _softmax_step
from .unpack import (_field_int8, _int8_scores, _query_cols, _query_int8, _token_scale_zero,
                     _unpack_part, _unpacked_zero)


@triton.jit
def _query_part(q_rows, row_ok, k: tl.constexpr, RKP: tl.constexpr, PAD: tl.constexpr, BITS: tl.constexpr):
    """Query columns of packed part k, divided by the part's weight 2^(k BITS): exact down to
    |q| = 2^(k BITS - 14); below, fp16 subnormals round q by less than 2^(k BITS - 25)."""
    q = _query_cols(q_rows, row_ok, k, RKP, PAD)
    return (q * (1.0 / (1 << (k * BITS)))).to(tl.float16)


@triton.jit
def _fused_norope(Q, HK, HKS, HKZ, HV, HVS, HVZ, S, ACC, MS, LS, LENS, tokens_per_split, n_splits, qk_scale,
                  s_qb, s_qh, s_kb, s_kg, s_kt, s_ksb, s_ksg, s_kst,
                  s_vb, s_vg, s_vt, s_vsb, s_vsg, s_vst, s_sb, s_sh,
                  ROWS: tl.constexpr, M: tl.constexpr, RK: tl.constexpr, RV: tl.constexpr,
                  RKPAD: tl.constexpr, RVPAD: tl.constexpr,
                  BITS_K: tl.constexpr, BITS_V: tl.constexpr, BLOCK_T: tl.constexpr, G: tl.constexpr,
                  ASM: tl.constexpr, INT_KEYS: tl.constexpr, SCORES_IN: tl.constexpr):
    """Non-RoPE models, one pass: scores, online softmax and value accumulation per tile, so the
    scores never leave the chip. One program per (sequence, group, split); whole ranks in
    registers (the host takes this path only for small ranks).

    Packed part k is read as n 2^(k bits) (`_unpack_part`): the query part k comes pre-divided
    by 2^(k bits) and the value part k's accumulator is divided at the end. Stored widths that
    are not powers of two (e.g. the K25/V75 split's value rank 96 s) are zero-padded to RKPAD /
    RVPAD columns in registers (tl.arange needs powers of two); the pad is never loaded.
    INT_KEYS: packed keys go through int8 tensor-core dots instead (`_field_int8`: a shift and
    an AND per four values instead of fp16 conversion; the query as two int8 digits per row,
    `_query_int8`).
    SCORES_IN: the scores come from S [B, H, T] (base-2, scaled), written by a RoPE scores kernel;
    this kernel is then the values half of a RoPE layer (no key or query is read)."""
    pid_g, pid_s = tl.program_id(0), tl.program_id(1)
    b, g = pid_g // G, pid_g % G
    PK: tl.constexpr = 1 if BITS_K == 16 else 8 // BITS_K
    PV: tl.constexpr = 1 if BITS_V == 16 else 8 // BITS_V
    RKP: tl.constexpr = RK // PK
    RVP: tl.constexpr = RV // PV
    rows = tl.arange(0, M)
    row_ok = rows < ROWS
    ck, cv = tl.arange(0, RKPAD), tl.arange(0, RVPAD)
    ck_ok, cv_ok = (ck < RKP)[None, :], (cv < RVP)[None, :]   # all true unless padded
    length = tl.load(LENS + b)
    t0 = pid_s * tokens_per_split
    t_end = tl.minimum(t0 + tokens_per_split, length)
    q_rows = Q + b * s_qb + (g * ROWS + rows)[:, None] * s_qh
    kb = 16 if BITS_K == 16 else BITS_K
    if SCORES_IN:
        s_rows = S + b * s_sb + (g * ROWS + rows)[:, None] * s_sh
    elif INT_KEYS:
        qmax = tl.max(tl.abs(_query_cols(q_rows, row_ok, 0, RKP, RKPAD)), 1)
        for k in tl.static_range(1, PK):
            qmax = tl.maximum(qmax, tl.max(tl.abs(_query_cols(q_rows, row_ok, k, RKP, RKPAD)), 1))
        sq = qmax * (1.0 / 127.0)
        inv_sq = tl.where(qmax > 0, 127.0 / tl.maximum(qmax, 1e-30), 0.0)
        qh0, ql0, qs = _query_int8(q_rows, row_ok, 0, RKP, RKPAD, inv_sq)
        qh1, ql1, qh2, ql2, qh3, ql3 = qh0, ql0, qh0, ql0, qh0, ql0
        if PK > 1:
            qh1, ql1, qs1 = _query_int8(q_rows, row_ok, 1, RKP, RKPAD, inv_sq)
            qs += qs1
        if PK > 2:
            qh2, ql2, qs2 = _query_int8(q_rows, row_ok, 2, RKP, RKPAD, inv_sq)
            qh3, ql3, qs3 = _query_int8(q_rows, row_ok, 3, RKP, RKPAD, inv_sq)
            qs += qs2 + qs3
        qsum = qs * sq   # sum of the query the int8 dots see, so the zero point cancels exactly
    else:
        q0 = _query_part(q_rows, row_ok, 0, RKP, RKPAD, kb)
        q1 = q0
        q2 = q0
        q3 = q0
        if PK > 1:
            q1 = _query_part(q_rows, row_ok, 1, RKP, RKPAD, kb)
        if PK > 2:
            q2 = _query_part(q_rows, row_ok, 2, RKP, RKPAD, kb)
            q3 = _query_part(q_rows, row_ok, 3, RKP, RKPAD, kb)
        qsum = tl.sum(q0.to(tl.float32), 1)      # sum(q), for the zero point
        if PK > 1:
            qsum += tl.sum(q1.to(tl.float32), 1) * (1 << BITS_K)
        if PK > 2:
            qsum += (tl.sum(q2.to(tl.float32), 1) * (1 << 2 * BITS_K)
                     + tl.sum(q3.to(tl.float32), 1) * (1 << 3 * BITS_K))
    m_i = tl.full([M], -float("inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    wz = tl.zeros([M], tl.float32)      # sum_t p_t s_t z_t (value zero points)
    acc0 = tl.zeros([M, RVPAD], tl.float32)
    acc1 = tl.zeros([M, RVPAD], tl.float32)
    acc2 = tl.zeros([M, RVPAD], tl.float32)
    acc3 = tl.zeros([M, RVPAD], tl.float32)
    for t in range(t0, t_end, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        t_ok = offs_t < t_end
        if not SCORES_IN:
            rk = tl.load(HK + b * s_kb + g * s_kg + offs_t[:, None] * s_kt + ck[None, :],
                         mask=t_ok[:, None] & ck_ok, other=0)
        if SCORES_IN:
            s = tl.load(s_rows + offs_t[None, :], mask=row_ok[:, None] & t_ok[None, :], other=-float("inf"))
        elif BITS_K == 16:
            s = tl.dot(q0, tl.trans(rk.to(tl.float16)))
        elif INT_KEYS:
            ih = tl.zeros([M, BLOCK_T], tl.int32)
            il = tl.zeros([M, BLOCK_T], tl.int32)
            ih, il = _int8_scores(qh0, ql0, rk, 0, BITS_K, ASM, ih, il)
            if PK > 1:
                ih, il = _int8_scores(qh1, ql1, rk, 1, BITS_K, ASM, ih, il)
            if PK > 2:
                ih, il = _int8_scores(qh2, ql2, rk, 2, BITS_K, ASM, ih, il)
                ih, il = _int8_scores(qh3, ql3, rk, 3, BITS_K, ASM, ih, il)
            s = (ih.to(tl.float32) + il.to(tl.float32) * (1.0 / 256.0)) * sq[:, None]
            sc, zp = _token_scale_zero(HKS, HKZ, b * s_ksb + g * s_ksg, offs_t, s_kst, t_ok)
            if BITS_K == 8:
                zp = zp - 128.0      # the fields are n - 128
            s = s * sc[None, :] - qsum[:, None] * (sc * zp)[None, :]
        else:
            s = tl.dot(q0, tl.trans(_unpack_part(rk, 0, BITS_K, ASM)))
            if PK > 1:
                s += tl.dot(q1, tl.trans(_unpack_part(rk, 1, BITS_K, ASM)))
            if PK > 2:
                s += tl.dot(q2, tl.trans(_unpack_part(rk, 2, BITS_K, ASM)))
                s += tl.dot(q3, tl.trans(_unpack_part(rk, 3, BITS_K, ASM)))
            sc, zp = _token_scale_zero(HKS, HKZ, b * s_ksb + g * s_ksg, offs_t, s_kst, t_ok)
            zp = _unpacked_zero(zp, BITS_K)
            s = s * sc[None, :] - qsum[:, None] * (sc * zp)[None, :]
        if not SCORES_IN:
            s = tl.where(t_ok[None, :], s * qk_scale, -float("inf"))
        m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
        rv = tl.load(HV + b * s_vb + g * s_vg + offs_t[:, None] * s_vt + cv[None, :],
                     mask=t_ok[:, None] & cv_ok, other=0)
        if BITS_V == 16:
            acc0 = acc0 * alpha[:, None] + tl.dot(p.to(tl.float16), rv.to(tl.float16))
        else:
            sc, zp = _token_scale_zero(HVS, HVZ, b * s_vsb + g * s_vsg, offs_t, s_vst, t_ok)
            zp = _unpacked_zero(zp, BITS_V)
            p16 = (p * sc[None, :]).to(tl.float16)
            wz = wz * alpha + tl.sum(p16.to(tl.float32) * zp[None, :], 1)
            acc0 = acc0 * alpha[:, None] + tl.dot(p16, _unpack_part(rv, 0, BITS_V, ASM))
            if PV > 1:
                acc1 = acc1 * alpha[:, None] + tl.dot(p16, _unpack_part(rv, 1, BITS_V, ASM))
            if PV > 2:
                acc2 = acc2 * alpha[:, None] + tl.dot(p16, _unpack_part(rv, 2, BITS_V, ASM))
                acc3 = acc3 * alpha[:, None] + tl.dot(p16, _unpack_part(rv, 3, BITS_V, ASM))
        m_i = m_new
    base = ((b * G + g) * n_splits + pid_s) * M
    out = ACC + (base + rows)[:, None] * RV + cv[None, :]
    # part k: acc_k / 2^(k bits) = sum_t p_t s_t n_t; minus the zero points
    vb = 16 if BITS_V == 16 else BITS_V
    ok = row_ok[:, None] & cv_ok
    tl.store(out, acc0 - wz[:, None], mask=ok)
    if PV > 1:
        tl.store(out + RVP, acc1 * (1.0 / (1 << vb)) - wz[:, None], mask=ok)
    if PV > 2:
        tl.store(out + 2 * RVP, acc2 * (1.0 / (1 << 2 * vb)) - wz[:, None], mask=ok)
        tl.store(out + 3 * RVP, acc3 * (1.0 / (1 << 3 * vb)) - wz[:, None], mask=ok)
    tl.store(MS + base + rows, m_i, mask=row_ok)
    tl.store(LS + base + rows, l_i, mask=row_ok)
