"""Folded-query RoPE scores: the query folded into B_k, so q . RoPE_t(B_k h) becomes cos/sin-
weighted dots with the latents h (contiguous positions; fp16 or int8 tensor-core dots)."""
from __future__ import annotations

import triton
import triton.language as tl

from .unpack import _digits, _field_int8, _token_scale_zero, _unpack_part, _unpacked_zero


@triton.jit
def _fold_query(b_rows, q1, q2, rcols, HALF: tl.constexpr, R: tl.constexpr, k: tl.constexpr,
                BITS: tl.constexpr):
    """Rows f of a = q1_f B1_f + q2_f B2_f and c = q2_f B1_f - q1_f B2_f (rank columns rcols of
    packed part k, divided by the part's weight 2^(k BITS), see `_unpack_part`), and the row sums
    of the undivided fp16 rows (zero-point terms)."""
    a, c = _fold_f32(b_rows, q1, q2, rcols, HALF, R)
    a = a.to(tl.float16).to(tl.float32)
    c = c.to(tl.float16).to(tl.float32)
    w = 1.0 / (1 << (k * BITS)) if BITS != 16 else 1.0
    return (a * w).to(tl.float16), (c * w).to(tl.float16), tl.sum(a, 1), tl.sum(c, 1)


@triton.jit
def _fold_f32(b_rows, q1, q2, rcols, HALF: tl.constexpr, R: tl.constexpr):
    """Rows f of a = q1_f B1_f + q2_f B2_f and c = q2_f B1_f - q1_f B2_f, float32."""
    b1 = tl.load(b_rows + rcols[None, :]).to(tl.float16).to(tl.float32)
    b2 = tl.load(b_rows + HALF * R + rcols[None, :]).to(tl.float16).to(tl.float32)
    return q1[:, None] * b1 + q2[:, None] * b2, q2[:, None] * b1 - q1[:, None] * b2


@triton.jit
def _fold_digits(b_rows, q1, q2, rcols, HALF: tl.constexpr, R: tl.constexpr, inv_a, inv_c):
    """The folded query's columns rcols as int8 digits (`_digits`, rows scaled by inv_a / inv_c)."""
    a, c = _fold_f32(b_rows, q1, q2, rcols, HALF, R)
    ah, al, za = _digits(a * inv_a[:, None])
    ch, cl, zc = _digits(c * inv_c[:, None])
    return ah, al, ch, cl, za, zc


@triton.jit
def _int8_fold_dots(n, ah, ch, ia, ic):
    return (tl.dot(n, tl.trans(ah), ia, out_dtype=tl.int32),
            tl.dot(n, tl.trans(ch), ic, out_dtype=tl.int32))


@triton.jit
def _tile_angles(INVF, POS0, b, t0, offs_h, BLOCK_T: tl.constexpr):
    """The angles a tile's cos/sin recurrence starts from: ci, si [BLOCK_T, HALF] of the offsets
    inside a tile, ca, sa [HALF] of sequence b's first position t0 (advanced tile by tile, see
    _scores), cb, sb [HALF] of one tile's step."""
    inv_freq = tl.load(INVF + offs_h)
    ang_i = tl.arange(0, BLOCK_T).to(tl.float32)[:, None] * inv_freq[None, :]
    p0 = tl.load(POS0 + b).to(tl.float32)
    return (tl.cos(ang_i), tl.sin(ang_i), tl.cos((p0 + t0) * inv_freq), tl.sin((p0 + t0) * inv_freq),
            tl.cos(BLOCK_T * inv_freq), tl.sin(BLOCK_T * inv_freq))


@triton.jit
def _scores_qproj(Q, HK, HKS, HKZ, BK, POS0, INVF, S, LENS, tokens_per_split, qk_scale,
                  s_qb, s_qh, s_kb, s_kg, s_kt, s_sb, s_sg, s_st, s_ob, s_oh,
                  UNITS_PER_GROUP: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
                  BITS: tl.constexpr, BLOCK_T: tl.constexpr, NUM_UNITS: tl.constexpr, ASM: tl.constexpr,
                  INT_H: tl.constexpr):
    """RoPE scores with one query per KV head (MHA), contiguous positions, key rank <= 256.

    q . RoPE_t(B h) = sum_f cos(t th_f) (a_f . h) + sin(t th_f) (c_f . h) with
    a_f = q1_f B1_f + q2_f B2_f and c_f = q2_f B1_f - q1_f B2_f. The query is folded into B once
    per program, so a tile is two [BT, r] x [r, D/2] dots and a cos/sin-weighted row sum: keys
    are never formed and never rotated (the reference path rebuilds and rotates every key).
    INT_H (packed latents): int8 tensor-core dots of the stored fields (`_field_int8`) with the
    folded query as two int8 digits per row (16 bits of precision relative to the row maximum),
    instead of unpacking to fp16; both digits accumulate in one int32 (hi 256 + lo: < 2^31 for
    rank <= 256).
    """
    pid_u, pid_s = tl.program_id(0), tl.program_id(1)
    b, u = pid_u // NUM_UNITS, pid_u % NUM_UNITS
    g, jl = u // UNITS_PER_GROUP, u % UNITS_PER_GROUP
    PER: tl.constexpr = 1 if BITS == 16 else 8 // BITS
    RP: tl.constexpr = R // PER
    cols, offs_h = tl.arange(0, RP), tl.arange(0, HALF)
    length = tl.load(LENS + b)
    t0 = pid_s * tokens_per_split
    t_end = tl.minimum(t0 + tokens_per_split, length)
    q1 = tl.load(Q + b * s_qb + u * s_qh + offs_h).to(tl.float16).to(tl.float32)
    q2 = tl.load(Q + b * s_qb + u * s_qh + HALF + offs_h).to(tl.float16).to(tl.float32)
    b_rows = BK + g * (UNITS_PER_GROUP * 2 * HALF * R) + (jl * 2 * HALF + offs_h)[:, None] * R
    if INT_H:
        amax = tl.zeros([HALF], tl.float32)
        cmax = tl.zeros([HALF], tl.float32)
        for k in tl.static_range(PER):   # row maxima over all parts first: one scale per row
            a, c = _fold_f32(b_rows, q1, q2, k * RP + cols, HALF, R)
            amax = tl.maximum(amax, tl.max(tl.abs(a), 1))
            cmax = tl.maximum(cmax, tl.max(tl.abs(c), 1))
        inv_a = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
        inv_c = tl.where(cmax > 0, 127.0 / tl.maximum(cmax, 1e-30), 0.0)
        ah0, al0, ch0, cl0, za, zc = _fold_digits(b_rows, q1, q2, cols, HALF, R, inv_a, inv_c)
        ah1, al1, ch1, cl1 = ah0, al0, ch0, cl0
        ah2, al2, ch2, cl2, ah3, al3, ch3, cl3 = ah0, al0, ch0, cl0, ah0, al0, ch0, cl0
        if PER > 1:
            ah1, al1, ch1, cl1, za1, zc1 = _fold_digits(b_rows, q1, q2, RP + cols, HALF, R, inv_a, inv_c)
            za, zc = za + za1, zc + zc1
        if PER > 2:
            ah2, al2, ch2, cl2, za2, zc2 = _fold_digits(b_rows, q1, q2, 2 * RP + cols, HALF, R, inv_a, inv_c)
            ah3, al3, ch3, cl3, za3, zc3 = _fold_digits(b_rows, q1, q2, 3 * RP + cols, HALF, R, inv_a, inv_c)
            za, zc = za + za2 + za3, zc + zc2 + zc3
        # one unit of the int32 accumulators (hi 256 + lo) is worth wa / wc; za, zc in those units
        # are the sums of the query the int8 dots see, so the zero points cancel exactly
        wa, wc = amax * (1.0 / (127.0 * 256.0)), cmax * (1.0 / (127.0 * 256.0))
        za, zc = za * 256.0, zc * 256.0
    else:
        a0, c0, za, zc = _fold_query(b_rows, q1, q2, cols, HALF, R, 0, BITS)
        a1, c1, a2, c2, a3, c3 = a0, c0, a0, c0, a0, c0
        if PER > 1:
            a1, c1, za1, zc1 = _fold_query(b_rows, q1, q2, RP + cols, HALF, R, 1, BITS)
            za, zc = za + za1, zc + zc1
        if PER > 2:
            a2, c2, za2, zc2 = _fold_query(b_rows, q1, q2, 2 * RP + cols, HALF, R, 2, BITS)
            a3, c3, za3, zc3 = _fold_query(b_rows, q1, q2, 3 * RP + cols, HALF, R, 3, BITS)
            za, zc = za + za2 + za3, zc + zc2 + zc3
    ci, si, ca, sa, cb, sb = _tile_angles(INVF, POS0, b, t0, offs_h, BLOCK_T)
    for t in range(t0, t_end, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        t_ok = offs_t < t_end
        raw = tl.load(HK + b * s_kb + g * s_kg + offs_t[:, None] * s_kt + cols[None, :],
                      mask=t_ok[:, None], other=0)
        if INT_H:   # high digits of all parts, x 256, then the low digits
            n0 = _field_int8(raw, 0, BITS, ASM)
            n1, n2, n3 = n0, n0, n0
            ia = tl.zeros([BLOCK_T, HALF], tl.int32)
            ic = tl.zeros([BLOCK_T, HALF], tl.int32)
            ia, ic = _int8_fold_dots(n0, ah0, ch0, ia, ic)
            if PER > 1:
                n1 = _field_int8(raw, 1, BITS, ASM)
                ia, ic = _int8_fold_dots(n1, ah1, ch1, ia, ic)
            if PER > 2:
                n2 = _field_int8(raw, 2, BITS, ASM)
                n3 = _field_int8(raw, 3, BITS, ASM)
                ia, ic = _int8_fold_dots(n2, ah2, ch2, ia, ic)
                ia, ic = _int8_fold_dots(n3, ah3, ch3, ia, ic)
            ia, ic = _int8_fold_dots(n0, al0, cl0, ia * 256, ic * 256)
            if PER > 1:
                ia, ic = _int8_fold_dots(n1, al1, cl1, ia, ic)
            if PER > 2:
                ia, ic = _int8_fold_dots(n2, al2, cl2, ia, ic)
                ia, ic = _int8_fold_dots(n3, al3, cl3, ia, ic)
            # score = s_t sum_f cos_f wa_f (ia - z_t ZA_f) + sin_f wc_f (ic - z_t ZC_f): the digit
            # units wa, wc ride on the tile's cos/sin (per-column factors of the recurrence), the
            # per-token scale multiplies the row sum, so an element costs two conversions and four FMAs
            sc, zp = _token_scale_zero(HKS, HKZ, b * s_sb + g * s_sg, offs_t, s_st, t_ok)
            if BITS == 8:
                zp = zp - 128.0      # the fields are n - 128
            cw = ci * (ca * wa)[None, :] - si * (sa * wa)[None, :]
            sw = si * (ca * wc)[None, :] + ci * (sa * wc)[None, :]
            ca, sa = ca * cb - sa * sb, sa * cb + ca * sb   # the next tile's first position
            sv = tl.sum(cw * (ia.to(tl.float32) - zp[:, None] * za[None, :])
                        + sw * (ic.to(tl.float32) - zp[:, None] * zc[None, :]), 1) * sc
        else:
            if BITS == 16:
                h = raw.to(tl.float16)
            else:   # part k as n 2^(k BITS): its weight is divided out of a_k, c_k
                h = _unpack_part(raw, 0, BITS, ASM)
            ua = tl.dot(h, tl.trans(a0))
            uc = tl.dot(h, tl.trans(c0))
            if PER > 1:
                h = _unpack_part(raw, 1, BITS, ASM)
                ua += tl.dot(h, tl.trans(a1))
                uc += tl.dot(h, tl.trans(c1))
            if PER > 2:
                h = _unpack_part(raw, 2, BITS, ASM)
                ua += tl.dot(h, tl.trans(a2))
                uc += tl.dot(h, tl.trans(c2))
                h = _unpack_part(raw, 3, BITS, ASM)
                ua += tl.dot(h, tl.trans(a3))
                uc += tl.dot(h, tl.trans(c3))
            if BITS != 16:
                sc, zp = _token_scale_zero(HKS, HKZ, b * s_sb + g * s_sg, offs_t, s_st, t_ok)
                zp = _unpacked_zero(zp, BITS)
                ua = ua * sc[:, None] - (sc * zp)[:, None] * za[None, :]
                uc = uc * sc[:, None] - (sc * zp)[:, None] * zc[None, :]
            cos = ci * ca[None, :] - si * sa[None, :]
            sin = si * ca[None, :] + ci * sa[None, :]
            ca, sa = ca * cb - sa * sb, sa * cb + ca * sb
            sv = tl.sum(cos * ua + sin * uc, 1)
        tl.store(S + b * s_ob + u * s_oh + offs_t, sv * qk_scale, mask=t_ok)
