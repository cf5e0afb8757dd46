"""Triton decode attention over Palu latents (one query token per sequence).

Flash-decoding style: the sequence is split across programs, then the splits are merged.
  - Non-RoPE layers (small ranks): `_fused_norope`, one pass per tile (scores q~.h, online
    softmax, accumulation of the attention-weighted *latent* values), then `_combine`.
  - RoPE layers: a scores kernel writes base-2 scores (4 bytes per head per token), keys never
    touch memory: `_scores_qproj` for MHA with contiguous positions (the query folded into B_k,
    q . RoPE_t(B h) as cos/sin-weighted dots with h) or `_scores` (rebuild the head's key tile
    with B_k and rotate it). Then `_fused_norope` with SCORES_IN accumulates the values, then
    `_combine`.
  - Layers too large for registers: `_scores`, `_values` (online softmax and value accumulation
    per group, split and rank chunk), `_combine`.
The caller maps z [B, H, Rv] to the hidden size (fused o_proj, or B_v then o_proj).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .layout import QuantLatent

LOG2E = 1.4426950408889634


# Packed latents are unpacked to exact small integers; scales and zero points are folded in by
# the callers (per token: k = s (B n) - s z (B 1), q.h = s (q.n) - s z (sum q),
# sum_t p h = sum_t (p s) n - sum_t p s z), so unpacking is the only per-element work.
# Part k of packed bytes as fp16 (n - 2^(bits-1)) * 2^(k bits), four bytes per asm block: two
# PRMTs spread the bytes over the half-words, one LOP3 per pair keeps field k and ORs in the fp16
# exponent of 1024 (the FasterTransformer / Marlin trick without a shift: the field stays where it
# is and its weight 2^(k bits) goes into the query or the output scale), one HSUB2 per pair
# removes 1024 + 2^(bits-1) 2^(k bits). The byte-wise unpack of v1-v8 spent ~3 instructions per
# value; this spends 1.25. Why centred: the tensor cores' fp32 accumulation truncates, so its
# error grows with the partial sums' size; with n in [0, 2^bits) every token adds ~2^(bits-1) s p
# to the value accumulators, a sum that the zero-point term then cancels, and at 128K tokens of
# spread attention the remainder lost 0.6-2 % (measured, benchmarks/NOTES.md, v13). Centred fields
# add terms of either sign. (Leaving the 1024 in costs 10-50x more for the same reason.)
# Callers shift the zero point alike: `_unpacked_zero`.
def _unpack_asm(k: int, bits: int) -> str:
    mask = ((1 << bits) - 1) << (k * bits)
    sub = 0x6400 | (1 << (k * bits + bits - 1))   # fp16 1024 + 2^(bits-1) 2^(k bits)
    return ("{ .reg .b32 a<2>, c, d; mov.b32 c, 0x64006400; "
            f"mov.b32 d, {sub << 16 | sub:#010x}; "
            "prmt.b32 a0, $2, 0, 0x4140; prmt.b32 a1, $2, 0, 0x4342; "
            f"lop3.b32 a0, a0, {mask << 16 | mask:#010x}, c, 0xea; "
            f"lop3.b32 a1, a1, {mask << 16 | mask:#010x}, c, 0xea; "
            "sub.f16x2 $0, a0, d; sub.f16x2 $1, a1, d; }")


_ASM_8_0: tl.constexpr = tl.constexpr(_unpack_asm(0, 8))
_ASM_4_0: tl.constexpr = tl.constexpr(_unpack_asm(0, 4))
_ASM_4_1: tl.constexpr = tl.constexpr(_unpack_asm(1, 4))
_ASM_2_0: tl.constexpr = tl.constexpr(_unpack_asm(0, 2))
_ASM_2_1: tl.constexpr = tl.constexpr(_unpack_asm(1, 2))
_ASM_2_2: tl.constexpr = tl.constexpr(_unpack_asm(2, 2))
_ASM_2_3: tl.constexpr = tl.constexpr(_unpack_asm(3, 2))


@triton.jit
def _unpack_part(raw, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Part k of packed latents as fp16 (n - 2^(BITS-1)) * 2^(k BITS), n the stored integer
    (exact); the zero point goes with it (`_unpacked_zero`).

    Callers divide the query part (or the output part) by 2^(k BITS). ASM=False (the Triton
    interpreter, which runs no inline assembly) computes the same numbers with plain integer ops.
    """
    if ASM:
        if BITS == 8:
            code: tl.constexpr = _ASM_8_0
        elif BITS == 4:
            code: tl.constexpr = _ASM_4_0 if k == 0 else _ASM_4_1
        elif k == 0:
            code: tl.constexpr = _ASM_2_0
        elif k == 1:
            code: tl.constexpr = _ASM_2_1
        elif k == 2:
            code: tl.constexpr = _ASM_2_2
        else:
            code: tl.constexpr = _ASM_2_3
        x = tl.inline_asm_elementwise(code, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:
        n = (raw.to(tl.int32) & (((1 << BITS) - 1) << (k * BITS))) | 0x6400
        x = n.to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + (1 << (k * BITS + BITS - 1)))
    return x


@triton.jit
def _unpacked_zero(zp, BITS: tl.constexpr):
    """The zero point of fields unpacked by `_unpack_part` (centred: n - 2^(BITS-1))."""
    return zp - (1 << (BITS - 1))


# Field k of packed bytes as signed 8-bit integers, four bytes per 32-bit word (the operand
# layout of int8 tensor-core dots): a shift and an AND per word. 8-bit latents (0..255) are
# stored shifted by -128 (XOR of the top bit) to fit int8; callers add 128 to the zero point.
_INT8_8_0: tl.constexpr = tl.constexpr("xor.b32 $0, $1, 0x80808080;")
_INT8_4_0: tl.constexpr = tl.constexpr("and.b32 $0, $1, 0x0f0f0f0f;")
_INT8_4_1: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 4; and.b32 $0, a, 0x0f0f0f0f; }")
_INT8_2_0: tl.constexpr = tl.constexpr("and.b32 $0, $1, 0x03030303;")
_INT8_2_1: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 2; and.b32 $0, a, 0x03030303; }")
_INT8_2_2: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 4; and.b32 $0, a, 0x03030303; }")
_INT8_2_3: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 6; and.b32 $0, a, 0x03030303; }")


@triton.jit
def _field_int8(raw, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Field k of packed latents as int8: n for 2/4-bit, n - 128 for 8-bit latents."""
    if ASM:
        if BITS == 8:
            code: tl.constexpr = _INT8_8_0
        elif BITS == 4:
            code: tl.constexpr = _INT8_4_0 if k == 0 else _INT8_4_1
        elif k == 0:
            code: tl.constexpr = _INT8_2_0
        elif k == 1:
            code: tl.constexpr = _INT8_2_1
        elif k == 2:
            code: tl.constexpr = _INT8_2_2
        else:
            code: tl.constexpr = _INT8_2_3
        x = tl.inline_asm_elementwise(code, "=r,r", [raw], dtype=tl.int8, is_pure=True, pack=4)
    elif BITS == 8:
        x = (raw.to(tl.int32) - 128).to(tl.int8)
    else:
        x = ((raw.to(tl.int32) >> (k * BITS)) & ((1 << BITS) - 1)).to(tl.int8)
    return x


@triton.jit
def _query_cols(q_rows, row_ok, k: tl.constexpr, RKP: tl.constexpr, PAD: tl.constexpr):
    """Query columns of packed part k (RKP of them, zero-padded to the power of two PAD), fp32."""
    c = tl.arange(0, PAD)
    ok = row_ok[:, None] & (c < RKP)[None, :]
    return tl.load(q_rows + k * RKP + c[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _query_int8(q_rows, row_ok, k: tl.constexpr, RKP: tl.constexpr, PAD: tl.constexpr, inv_sq):
    """Query columns of part k as two int8 digits (q ~ sq (hi + lo / 256)): an int8 dot per
    digit gives the query 16 bits of precision relative to its row maximum."""
    return _digits(_query_cols(q_rows, row_ok, k, RKP, PAD) * inv_sq[:, None])


@triton.jit
def _digits(x):
    """x (|x| <= 127, per row) as two int8 digits, x ~ hi + lo / 256, and the rows' sums of
    what the digits represent (zero-point terms that then cancel exactly)."""
    hi = tl.floor(x + 0.5)
    lo = tl.minimum(tl.maximum(tl.floor((x - hi) * 256.0 + 0.5), -127.0), 127.0)
    return hi.to(tl.int8), lo.to(tl.int8), tl.sum(hi, 1) + tl.sum(lo, 1) * (1.0 / 256.0)


@triton.jit
def _int8_scores(qh, ql, raw, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, ih, il):
    n = tl.trans(_field_int8(raw, k, BITS, ASM))
    return ih + tl.dot(qh, n), il + tl.dot(ql, n)


@triton.jit
def _token_scale_zero(SCALE, ZERO, offset, offs_t, stride_t, t_ok):
    """Per-token scale and zero point of a tile of quantised latents, float32."""
    sc = tl.load(SCALE + offset + offs_t * stride_t, mask=t_ok, other=0.0).to(tl.float32)
    zp = tl.load(ZERO + offset + offs_t * stride_t, mask=t_ok, other=0.0).to(tl.float32)
    return sc, zp


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one tile of base-2 scores: (new max, rescale factor, p, new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)   # a row with no token yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _chunk_dots(k_ptr, t_ok, cols, b_rows, q_rows, row_ok, b1_all, b2_all, k1, k2, s,
                RP: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, PER_BYTE: tl.constexpr,
                BITS: tl.constexpr, ROPE: tl.constexpr, ONE_CHUNK: tl.constexpr, ASM: tl.constexpr):
    """One chunk of stored latent columns of a key tile: RoPE, the key halves k1, k2 += h B^T;
    otherwise the scores s += q h^T. Packed part k is unpacked as n 2^(k BITS) (`_unpack_part`)
    and its dot scaled by 2^-(k BITS) in float32 (exact), so B_k and q keep their fp16 values."""
    raw = tl.load(k_ptr + cols[None, :], mask=t_ok[:, None], other=0)   # loaded once
    for k in tl.static_range(PER_BYTE):
        h = raw.to(tl.float16) if BITS == 16 else _unpack_part(raw, k, BITS, ASM)   # (BT, BR)
        w = 1.0 / (1 << (k * BITS))   # part weight (k = 0 for fp16 latents)
        rcols = k * RP + cols                                          # rank indices
        if ROPE:
            if ONE_CHUNK:
                b1, b2 = b1_all, b2_all
            else:
                b1 = tl.load(b_rows + rcols[None, :]).to(tl.float16)   # (HALF, BR)
                b2 = tl.load(b_rows + HALF * R + rcols[None, :]).to(tl.float16)
            if k == 0:
                k1 = tl.dot(h, tl.trans(b1), k1)
                k2 = tl.dot(h, tl.trans(b2), k2)
            else:
                k1 += tl.dot(h, tl.trans(b1)) * w
                k2 += tl.dot(h, tl.trans(b2)) * w
        else:
            qf = tl.load(q_rows + rcols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float16)
            if k == 0:
                s = tl.dot(qf, tl.trans(h), s)
            else:
                s += tl.dot(qf, tl.trans(h)) * w
    return k1, k2, s


@triton.jit
def _scores(Q, HK, HKS, HKZ, BK, POS, POS0, INVF, S, LENS,
            T, tokens_per_split, qk_scale,
            s_qb, s_qh, s_kb, s_kg, s_kt, s_sb, s_sg, s_st, s_pb, s_ob, s_oh,
            UNITS_PER_GROUP: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr,
            R: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
            ROPE: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr, NUM_UNITS: tl.constexpr,
            CONTIG: tl.constexpr, DYN_CHUNKS: tl.constexpr, ASM: tl.constexpr):
    pid_u, pid_s = tl.program_id(0), tl.program_id(1)
    b, u = pid_u // NUM_UNITS, pid_u % NUM_UNITS
    g = u // UNITS_PER_GROUP
    PER_BYTE: tl.constexpr = 1 if BITS == 16 else 8 // BITS
    RP: tl.constexpr = R // PER_BYTE                  # stored columns
    ONE_CHUNK: tl.constexpr = (PER_BYTE == 1) and (BLOCK_R == R)
    rows = tl.arange(0, M)
    row_ok = rows < ROWS
    length = tl.load(LENS + b)
    t0 = pid_s * tokens_per_split
    t_end = tl.minimum(t0 + tokens_per_split, length)
    q_rows = Q + b * s_qb + (u * ROWS + rows)[:, None] * s_qh
    offs_h = tl.arange(0, HALF)
    offs_r = tl.arange(0, BLOCK_R)
    if ROPE:
        q1 = tl.load(q_rows + offs_h[None, :], mask=row_ok[:, None], other=0.0).to(tl.float16)
        q2 = tl.load(q_rows + HALF + offs_h[None, :], mask=row_ok[:, None], other=0.0).to(tl.float16)
        inv_freq = tl.load(INVF + offs_h)
        jl = u % UNITS_PER_GROUP                      # this KV head inside its group
        b_rows = BK + g * (UNITS_PER_GROUP * 2 * HALF * R) + (jl * 2 * HALF + offs_h)[:, None] * R
        if CONTIG:
            # Positions p0 + t + i: cos/sin of (p0 + t)θ per tile by angle addition with a
            # per-program table of iθ, so the trig cost is per tile column, not per element.
            ang_i = tl.arange(0, BLOCK_T).to(tl.float32)[:, None] * inv_freq[None, :]
            ci, si = tl.cos(ang_i), tl.sin(ang_i)
            p0 = tl.load(POS0 + b).to(tl.float32)
            # cos/sin of the tile's first position, advanced tile to tile by a rotation of
            # BLOCK_T θ: accurate trig of a large angle (~64K rad) takes the slow range-reduction
            # path, and evaluating it every tile cost more than the tile's arithmetic.
            ca, sa = tl.cos((p0 + t0) * inv_freq), tl.sin((p0 + t0) * inv_freq)
            cb, sb = tl.cos(BLOCK_T * inv_freq), tl.sin(BLOCK_T * inv_freq)
        # Small fp16 ranks fit one chunk: keep this head's B_k halves in registers for all tiles.
        if ONE_CHUNK:
            b1_all = tl.load(b_rows + offs_r[None, :]).to(tl.float16)
            b2_all = tl.load(b_rows + HALF * R + offs_r[None, :]).to(tl.float16)
    if not ROPE:   # placeholders (unused)
        b_rows = q_rows
    if not (ROPE and ONE_CHUNK):
        b1_all = tl.zeros([HALF, BLOCK_R], tl.float16)
        b2_all = b1_all
    # Zero-point term of folded quantisation: B_k 1 (RoPE) or sum(q) (non-RoPE), per row.
    zsum1 = tl.zeros([HALF], tl.float32)
    zsum2 = tl.zeros([HALF], tl.float32)
    qsum = tl.zeros([M], tl.float32)
    if BITS != 16:
        for r0 in tl.static_range(0, R, BLOCK_R):
            if ROPE:
                zsum1 += tl.sum(tl.load(b_rows + r0 + offs_r[None, :]).to(tl.float16).to(tl.float32), 1)
                zsum2 += tl.sum(tl.load(b_rows + HALF * R + r0 + offs_r[None, :]).to(tl.float16).to(tl.float32), 1)
            else:
                qsum += tl.sum(tl.load(q_rows + r0 + offs_r[None, :], mask=row_ok[:, None],
                                       other=0.0).to(tl.float16).to(tl.float32), 1)
    for t in range(t0, t_end, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        t_ok = offs_t < t_end
        k_ptr = HK + b * s_kb + g * s_kg + offs_t[:, None] * s_kt
        if BITS != 16:
            sc, zp = _token_scale_zero(HKS, HKZ, b * s_sb + g * s_sg, offs_t, s_st, t_ok)
            zp = _unpacked_zero(zp, BITS)
        k1 = tl.zeros([BLOCK_T, HALF], tl.float32)   # RoPE: the key tile's halves
        k2 = tl.zeros([BLOCK_T, HALF], tl.float32)
        s = tl.zeros([M, BLOCK_T], tl.float32)       # otherwise: the scores
        if DYN_CHUNKS:   # a loop, not unrolled: the pipeliner buffers one chunk's loads, not all
            for c0 in range(0, RP, BLOCK_R):
                k1, k2, s = _chunk_dots(k_ptr, t_ok, c0 + offs_r, b_rows, q_rows, row_ok, b1_all, b2_all,
                                        k1, k2, s, RP, R, HALF, PER_BYTE, BITS, ROPE, ONE_CHUNK, ASM)
        else:
            for c0 in tl.static_range(0, RP, BLOCK_R):
                k1, k2, s = _chunk_dots(k_ptr, t_ok, c0 + offs_r, b_rows, q_rows, row_ok, b1_all, b2_all,
                                        k1, k2, s, RP, R, HALF, PER_BYTE, BITS, ROPE, ONE_CHUNK, ASM)
        if BITS != 16:   # fold the per-token scale and zero point back in
            if ROPE:
                k1 = k1 * sc[:, None] - (sc * zp)[:, None] * zsum1[None, :]
                k2 = k2 * sc[:, None] - (sc * zp)[:, None] * zsum2[None, :]
            else:
                s = s * sc[None, :] - qsum[:, None] * (sc * zp)[None, :]
        if ROPE:
            if CONTIG:
                cos = ci * ca[None, :] - si * sa[None, :]
                sin = si * ca[None, :] + ci * sa[None, :]
                ca, sa = ca * cb - sa * sb, sa * cb + ca * sb
            else:
                pos = tl.load(POS + b * s_pb + offs_t, mask=t_ok, other=0).to(tl.float32)
                ang = pos[:, None] * inv_freq[None, :]
                cos, sin = tl.cos(ang), tl.sin(ang)
            if ROWS == 1:   # one query per KV head (MHA): a row reduction, no padded dot
                q1v = tl.sum(q1.to(tl.float32), 0)       # rows other than 0 are zero
                q2v = tl.sum(q2.to(tl.float32), 0)
                sv = tl.sum((k1 * cos - k2 * sin) * q1v[None, :] + (k2 * cos + k1 * sin) * q2v[None, :], 1)
                s = tl.where(rows[:, None] == 0, sv[None, :], 0.0)
            else:
                r1 = (k1 * cos - k2 * sin).to(tl.float16)
                r2 = (k2 * cos + k1 * sin).to(tl.float16)
                s = tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))
        s = s * qk_scale
        out = S + b * s_ob + (u * ROWS + rows)[:, None] * s_oh + offs_t[None, :]
        tl.store(out, s, mask=row_ok[:, None] & t_ok[None, :])


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
    inv_freq = tl.load(INVF + offs_h)
    ang_i = tl.arange(0, BLOCK_T).to(tl.float32)[:, None] * inv_freq[None, :]
    ci, si = tl.cos(ang_i), tl.sin(ang_i)
    p0 = tl.load(POS0 + b).to(tl.float32)
    ca, sa = tl.cos((p0 + t0) * inv_freq), tl.sin((p0 + t0) * inv_freq)   # see _scores
    cb, sb = tl.cos(BLOCK_T * inv_freq), tl.sin(BLOCK_T * inv_freq)
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


@triton.jit
def _values(S, HV, HVS, HVZ, ACC, MS, LS, LENS,
            tokens_per_split, n_splits,
            s_sb, s_sh, s_vb, s_vg, s_vt, s_qb, s_qg, s_qt,
            ROWS: tl.constexpr, M: tl.constexpr, RV: tl.constexpr, BLOCK_RV: tl.constexpr,
            BITS: tl.constexpr, BLOCK_T: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr):
    """Two-pass values: softmax of the scores kernel's output and p h_v for one (sequence, group,
    split, block of stored columns). Every packed part of the loaded bytes is unpacked here
    (`_unpack_part`: n 2^(k BITS), divided out at the end), so the bytes are read once."""
    pid_g, pid_s, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, g = pid_g // G, pid_g % G
    PER_BYTE: tl.constexpr = 1 if BITS == 16 else 8 // BITS
    RVP: tl.constexpr = RV // PER_BYTE
    rows = tl.arange(0, M)
    row_ok = rows < ROWS
    cols = pid_c * BLOCK_RV + tl.arange(0, BLOCK_RV)
    length = tl.load(LENS + b)
    t0 = pid_s * tokens_per_split
    t_end = tl.minimum(t0 + tokens_per_split, length)
    m_i = tl.full([M], -float("inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc0 = tl.zeros([M, BLOCK_RV], tl.float32)   # one accumulator per packed part
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    corr = tl.zeros([M], tl.float32)            # sum_t p_t s_t z_t (folded zero points)
    for t in range(t0, t_end, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        t_ok = offs_t < t_end
        s = tl.load(S + b * s_sb + (g * ROWS + rows)[:, None] * s_sh + offs_t[None, :],
                    mask=row_ok[:, None] & t_ok[None, :], other=-float("inf"))
        m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
        raw = tl.load(HV + b * s_vb + g * s_vg + offs_t[:, None] * s_vt + cols[None, :],
                      mask=t_ok[:, None], other=0)
        if BITS != 16:
            sc, zp = _token_scale_zero(HVS, HVZ, b * s_qb + g * s_qg, offs_t, s_qt, t_ok)
            zp = _unpacked_zero(zp, BITS)
            # the zero-point term must use the same fp16-rounded weights as the dot: otherwise
            # their rounding (2^-12 relative) times the token's zero point lands in every column
            # alike, a common-mode error that an output projection can amplify
            p = (p * sc[None, :]).to(tl.float16).to(tl.float32)
            corr = corr * alpha + tl.sum(p * zp[None, :], 1)
        p16 = p.to(tl.float16)
        if BITS == 16:
            acc0 = tl.dot(p16, raw.to(tl.float16), acc0 * alpha[:, None])
        else:
            acc0 = tl.dot(p16, _unpack_part(raw, 0, BITS, ASM), acc0 * alpha[:, None])
        if PER_BYTE > 1:
            acc1 = tl.dot(p16, _unpack_part(raw, 1, BITS, ASM), acc1 * alpha[:, None])
        if PER_BYTE > 2:
            acc2 = tl.dot(p16, _unpack_part(raw, 2, BITS, ASM), acc2 * alpha[:, None])
            acc3 = tl.dot(p16, _unpack_part(raw, 3, BITS, ASM), acc3 * alpha[:, None])
        m_i = m_new
    base = ((b * G + g) * n_splits + pid_s) * M
    out = ACC + (base + rows)[:, None] * RV + cols[None, :]
    tl.store(out, acc0 - corr[:, None], mask=row_ok[:, None])
    if PER_BYTE > 1:
        tl.store(out + RVP, acc1 * (1.0 / (1 << BITS)) - corr[:, None], mask=row_ok[:, None])
    if PER_BYTE > 2:
        tl.store(out + 2 * RVP, acc2 * (1.0 / (1 << 2 * BITS)) - corr[:, None], mask=row_ok[:, None])
        tl.store(out + 3 * RVP, acc3 * (1.0 / (1 << 3 * BITS)) - corr[:, None], mask=row_ok[:, None])
    if pid_c == 0:
        tl.store(MS + base + rows, m_i, mask=row_ok)
        tl.store(LS + base + rows, l_i, mask=row_ok)


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


@triton.jit
def _combine(ACC, MS, LS, Z, n_splits, s_zb, s_zh,
             ROWS: tl.constexpr, M: tl.constexpr, RV: tl.constexpr, BLOCK_C: tl.constexpr,
             G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the splits of one query head and one block of value columns. Splits are read
    BLOCK_S at a time (a serial loop over ~100 splits was latency-bound: up to 75 us)."""
    pid, pid_c = tl.program_id(0), tl.program_id(1)
    b, h = pid // (G * ROWS), pid % (G * ROWS)
    g, row = h // ROWS, h % ROWS
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < RV
    first = (b * G + g) * n_splits
    m_max = tl.full([BLOCK_S], -float("inf"), tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        m_max = tl.maximum(m_max, tl.load(MS + (first + sp) * M + row, mask=sp < n_splits,
                                          other=-float("inf")))
    m_all = tl.max(m_max, 0)
    m_safe = tl.where(m_all == -float("inf"), 0.0, m_all)
    num = tl.zeros([BLOCK_C], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        sp_ok = sp < n_splits
        idx = (first + sp) * M + row
        w = tl.exp2(tl.load(MS + idx, mask=sp_ok, other=-float("inf")) - m_safe)
        den += w * tl.load(LS + idx, mask=sp_ok, other=0.0)
        part = tl.load(ACC + idx[:, None] * RV + cols[None, :], mask=sp_ok[:, None] & col_ok[None, :],
                       other=0.0)
        num += tl.sum(w[:, None] * part, 0)
    tl.store(Z + b * s_zb + h * s_zh + cols, num / tl.sum(den, 0), mask=col_ok)


def _launch_combine(acc, ms, ls, z, splits, rows, M, rv, G):
    B, H = z.shape[0], z.shape[1]
    block_c = min(64, triton.next_power_of_2(rv))
    block_s = min(32, triton.next_power_of_2(splits))
    _combine[(B * H, triton.cdiv(rv, block_c))](acc, ms, ls, z, splits, z.stride(0), z.stride(1),
                                                ROWS=rows, M=M, RV=rv, BLOCK_C=block_c, G=G,
                                                BLOCK_S=block_s)


def _use_asm(dev) -> bool:
    """Inline PTX on a CUDA device; the Triton interpreter (CPU tests) runs none."""
    return dev.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _bits_and_parts(x, name):
    data = x.data if isinstance(x, QuantLatent) else x
    if not isinstance(x, QuantLatent) and x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{name} latents must be fp16/bf16 or QuantLatent, got {x.dtype}")
    if data.dim() != 4 or (data.stride(-1) != 1 and data.shape[-1] > 1):
        # the kernels address [batch, group, token] by strides and the rank contiguously
        raise ValueError(f"{name} latents must be [batch, groups, tokens, rank] with unit stride "
                         f"along the rank (palu_kernels/layout.py); got shape {tuple(data.shape)}, "
                         f"strides {data.stride()}")
    if isinstance(x, QuantLatent):
        if x.bits not in (2, 4, 8) or x.rank * x.bits != data.shape[-1] * 8:
            raise ValueError(f"{name} latents: {data.shape[-1]} packed bytes per token do not hold "
                             f"rank {x.rank} at {x.bits} bits")
        if x.scale.shape != data.shape[:3] or x.zero.shape != data.shape[:3]:
            raise ValueError(f"{name} latents: scales {tuple(x.scale.shape)} / zero points "
                             f"{tuple(x.zero.shape)} must be [batch, groups, tokens] = {tuple(data.shape[:3])}")
        return x.bits, x.data, x.scale, x.zero, x.rank
    return 16, x, x, x, x.shape[-1]


def _check_pow2(value, name):
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16 for the kernel "
                         "(use the torch reference path otherwise)")


def _pow2_block(columns: int, cap: int) -> int:
    """Largest power of two <= cap dividing `columns` (tl.arange needs powers of two)."""
    b = 1
    while b * 2 <= cap and columns % (b * 2) == 0:
        b *= 2
    if b < 16:
        raise ValueError(f"{columns} stored columns have no power-of-two block >= 16 "
                         "(tl.dot needs 16); use the torch reference path for this rank")
    return b


def _stored_pad(r: int, bits: int) -> int:
    """Stored columns of rank r, rounded up to a power of two (the one-pass kernel's tiles)."""
    return triton.next_power_of_2(r // (1 if bits == 16 else 8 // bits))


def _values_unfit(rv, vbits, M) -> str | None:
    """Why the one-pass kernel cannot accumulate a layer's values (None if it can)."""
    rv_pad = _stored_pad(rv, vbits) * (1 if vbits == 16 else 8 // vbits)
    if M * rv_pad > 16 * 512:   # the whole value rank lives in registers
        return f"value rank {rv} x {M} rows too large for registers"
    return None


def _fused_unfit(rope, rk, rv, kbits, vbits, M) -> str | None:
    """Why the one-pass kernel cannot serve a layer (None if it can)."""
    if rope:
        return "RoPE keys are rebuilt by the two-pass kernels"
    rk_pad = _stored_pad(rk, kbits) * (1 if kbits == 16 else 8 // kbits)
    if rk_pad > 512:   # whole ranks live in registers
        return f"key rank {rk} too large for registers"
    return _values_unfit(rv, vbits, M)


_SLOTS: dict = {}   # (device, kernel specialisation) -> resident programs per GPU


def programs_per_sm(regs: int, warps: int, shared: int, sm_regs: int = 65536,
                    sm_shared: int = 233472, sm_threads: int = 2048) -> int:
    """Blocks of a kernel one SM holds at once, as the occupancy calculator counts them:
    registers are allocated per warp in units of 256, each block reserves 1 KB of shared memory
    besides its own, at most 32 blocks (defaults: an H100/H200 SM)."""
    regs_per_warp = triton.cdiv(max(regs, 1) * 32, 256) * 256
    by_regs = sm_regs // (regs_per_warp * warps)
    by_smem = sm_shared // (shared + 1024) if shared else 32
    return max(1, min(by_regs, by_smem, sm_threads // (32 * warps), 32))


def _resident_programs(compiled, dev) -> int:
    """How many programs of a compiled kernel the GPU holds at once."""
    if getattr(compiled, "n_regs", None) is None:
        compiled._init_handles()   # loads the binary; triton sets n_regs then (not at compile)
    p = torch.cuda.get_device_properties(dev)
    return p.multi_processor_count * programs_per_sm(
        compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
        p.regs_per_multiprocessor, p.shared_memory_per_multiprocessor, p.max_threads_per_multi_processor)


_DYNAMIC: dict = {}   # (device, `_scores` specialisation) -> chunk loop not unrolled


def _dynamic_chunks(grid, args, meta, dev) -> bool:
    """Whether `_scores` must loop over its rank chunks instead of unrolling them: unrolled,
    the pipeliner buffers every chunk's loads, which for large ranks (J-LRD: rank 2048 needs
    656 KB with RoPE) exceeds an SM's shared memory. Decided by compiling the unrolled variant
    once per specialisation; the interpreter (no shared memory) unrolls."""
    if not _use_asm(dev):
        return False
    key = (dev, tuple(meta.items()))
    if key not in _DYNAMIC:
        compiled = _scores.warmup(*args, grid=grid, DYN_CHUNKS=False, **meta)
        limit = getattr(torch.cuda.get_device_properties(dev), "shared_memory_per_block_optin", 232448)
        _DYNAMIC[key] = compiled.metadata.shared > limit
    return _DYNAMIC[key]


_SMS: dict = {}   # device -> streaming multiprocessors


def _sm_count(dev) -> int:
    """Streaming multiprocessors of the device (4 stands in for the CPU interpreter). Cached:
    get_device_properties cost ~15 us of host time per call, three calls per decode step."""
    if dev.type != "cuda":
        return 4
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def values_splits(T: int, splits: int, rv: int, vbits: int, rows: int, blocks: int, sms: int) -> int:
    """Sequence splits of the two-pass values kernel: at most `splits`, and few enough that the
    float32 partial outputs (query rows x rv per split, written, then read by the combine) stay
    within 1/8 of the value latents' bytes -- unless that would leave the GPU with fewer than two
    programs per SM (`blocks` programs per split). Every query row of a group has its own
    partials, so with all heads in one group (J-LRD: 32 rows at rank 2048) 512 splits wrote
    134 MB of partials for 268 MB of fp16 latents; capping alone starved short contexts
    (llama3 J-LRD int2 at 4K: one split, two programs; benchmarks/NOTES.md, session 6)."""
    per_token = rv * 2 if vbits == 16 else rv * vbits // 8 + 4
    cap = T * per_token // (8 * 4 * rows * rv)
    fill = -(-2 * sms // blocks)
    return max(1, min(splits, max(cap, fill)))


def _even_splits(T: int, splits: int, block_t: int) -> tuple[int, int]:
    """(tokens per split, splits): whole tiles per split, no empty split."""
    per_split = triton.cdiv(triton.cdiv(T, splits), block_t) * block_t
    return per_split, triton.cdiv(T, per_split)


def _run_fused(q, kdata, kscale, kzero, kbits, vdata, vscale, vzero, vbits, lengths, scale,
               B, G, T, H, rk, rv, rows, M, block_t, stages, warps, splits, maxnreg=None,
               int_keys=False, scores=None):
    """One-pass kernel, one wave, then the combine. With `scores` [B, H, T] (a RoPE layer's, from
    a scores kernel) only the value side runs: q and the key arguments are not read."""
    dev = vdata.device
    ks = kscale if kbits != 16 else kdata
    vs = vscale if vbits != 16 else vdata
    sc = q if scores is None else scores

    def launch_args(acc, ms, ls, per_split, splits):
        return (q, kdata, kscale, kzero, vdata, vscale, vzero, sc, acc, ms, ls, lengths, per_split, splits,
                scale * LOG2E, q.stride(0), q.stride(1),
                kdata.stride(0), kdata.stride(1), kdata.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
                vdata.stride(0), vdata.stride(1), vdata.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
                sc.stride(0), sc.stride(1))

    meta = dict(ROWS=rows, M=M, RK=rk, RV=rv, RKPAD=_stored_pad(rk, kbits), RVPAD=_stored_pad(rv, vbits),
                BITS_K=kbits, BITS_V=vbits, BLOCK_T=block_t, G=G,
                ASM=_use_asm(dev), INT_KEYS=int_keys, SCORES_IN=scores is not None,
                num_stages=stages, num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    if splits is None:
        sms = _sm_count(dev)
        splits = max(1, min(triton.cdiv(T, 2 * block_t), triton.cdiv(8 * sms, B * G)))
        if _use_asm(dev):
            # One wave: as many splits as the GPU holds programs at once, so all start together
            # and stream equal shares; more leave a partial last wave (measured, NOTES v10:
            # group 8 int4 at 64K, 264 splits in 2 waves 96 us, 64 splits in one 75 us).
            key = (dev, tuple(meta.items()))   # constexprs and launch options: hashable
            if key not in _SLOTS:   # compile (no launch) to read registers and shared memory
                dummy = torch.empty(1, device=dev, dtype=torch.float32)
                compiled = _fused_norope.warmup(*launch_args(dummy, dummy, dummy, *_even_splits(T, splits, block_t)),
                                                grid=(1,), **meta)
                _SLOTS[key] = _resident_programs(compiled, dev)
            splits = max(1, min(triton.cdiv(T, 2 * block_t), _SLOTS[key] // (B * G)))
    per_split, splits = _even_splits(T, splits, block_t)
    acc = torch.empty(B, G, splits, M, rv, device=dev, dtype=torch.float32)
    ms = torch.empty(B, G, splits, M, device=dev, dtype=torch.float32)
    ls = torch.empty_like(ms)
    _fused_norope[(B * G, splits)](*launch_args(acc, ms, ls, per_split, splits), **meta)
    z = torch.empty(B, H, rv, device=dev, dtype=torch.float32)
    _launch_combine(acc, ms, ls, z, splits, rows, M, rv, G)
    return z


def one_pass_options(kbits: int, vbits: int, rk: int, rv: int, stages: int | None = None,
                     int_keys: bool | None = None, maxnreg: int | None = None) -> tuple[int, bool, int | None]:
    """(pipeline stages, int8 key dots, register cap) of the one-pass kernel; None = measured default.

    From benchmarks/NOTES.md (llama2 shapes, 64K): 3 stages for packed latents (v9); int8 key dots
    pay for 2/4-bit keys of rank >= 256 (g4 int2 75 -> 64 us, g8 int2 67 -> 63) and cost for
    smaller key ranks (K25/V75 g2 int4 127 -> 153 us); they need more registers, so at rank 256
    they are capped at 128 (4 programs per SM instead of 2: 90 -> 80 us; rank 512 spills at
    128: 72 -> 127 us, so no cap there)."""
    if stages is None:
        stages = 2 if kbits == vbits == 16 else 3
    int_ok = kbits != 16 and _stored_pad(rk, kbits) >= 32   # int8 dots: k in steps of 32
    if int_keys and not int_ok:
        raise ValueError(f"fused_int_keys needs packed keys with >= 32 stored columns "
                         f"(key rank {rk}, {kbits}-bit)")
    int_keys = (kbits in (2, 4) and rk >= 256) if int_keys is None else bool(int_keys)
    if maxnreg is None and int_keys and max(rk, rv) <= 256:
        maxnreg = 128
    return stages, int_keys, maxnreg


def one_pass_tiles(kbits: int, vbits: int, rk: int, rv: int, programs: int, sms: int,
                   block_t: int | None = None, warps: int | None = None) -> tuple[int, int]:
    """(token tile, warps) of the one-pass kernel; None = measured default (rk = 0: keys not read,
    the values half of a RoPE layer). `programs`: sequences x groups x cdiv(tokens, 256), the
    programs that 128-token tiles (two per split at least) can give the GPU's `sms` SMs.

    benchmarks/NOTES.md, session 7: 2/4-bit latents of rank <= 128 run best on 2 warps with
    128-token tiles (64K: llama2 g1 int2 333 -> 146 us, int4 133 -> 124, K25/V75 g1 int4 154 ->
    146, g2 int2 87 -> 75; llama3 g1 int2 82 -> 40; the RoPE g1 int2 values half 375 -> 316) as
    long as that leaves two programs per SM (at 4K, llama3 g2 int4 8 -> 14 us with 64 programs);
    larger ranks (K25/V75 g2 int4, value rank 192: 126 -> 226 us) and fp16 latents keep 64 / 4."""
    packed = {kbits, vbits} - {16}
    small = packed and packed <= {2, 4} and max(rk, rv) <= 128 and programs >= 2 * sms
    d = (128, 2) if small else (64, 4)
    return (block_t or d[0], warps or d[1])


def qproj_options(kbits: int, rk: int, block_t: int | None = None, stages: int | None = None,
                  warps: int | None = None, int_keys: bool = False) -> tuple[int, int, int]:
    """(token tile, pipeline stages, warps) of the folded-query RoPE scores kernel; None = measured.

    benchmarks/NOTES.md, session 5 (llama2, 64K): fp16 latents 64 / 3 / 8 (two warpgroups, the
    folded query in shared memory, wgmma); packed latents are unpacked in registers and run best
    on one warpgroup: 64 / 3 / 4 for key ranks >= 128 (G-LRD-4 int4 833 -> 629 us, int2 821 ->
    512), and 32-token tiles on 2 warps for rank 64 (M-LRD int4 630 -> 377 us). Session 6, int8
    key dots (`int_keys`): 64 / 3 / 4 for rank >= 128 as well, 32 / 3 / 4 for rank 64 (M-LRD int4
    406 us on 2 warps, 353 on 4)."""
    if kbits == 16:
        d = (64, 3, 8)
    elif rk >= 128:
        d = (64, 3, 4)
    else:
        d = (32, 3, 4 if int_keys else 2)
    return (block_t or d[0], stages or d[1], warps or d[2])


def _qproj_int_fits(kbits: int, rkp: int) -> bool:
    """Packed keys whose stored columns (rkp) the int8-dot folded-query kernel can take."""
    return kbits != 16 and rkp >= 32 and rkp & (rkp - 1) == 0


def qproj_int_default(kbits: int, rkp: int, tokens_per_split: int) -> bool:
    """Whether the folded-query kernel takes packed keys through int8 dots when not told.

    Measured (benchmarks/NOTES.md, sessions 6-7, llama2): faster for 4-bit keys (64K: G-LRD-4 644 ->
    584 us, G-LRD-2 413 -> 361, K25/V75 g4 435 -> 391, M-LRD 377 -> 353 on 4 warps), slower for
    2-bit (G-LRD-4 517 -> 550); 8-bit not measured, so it keeps the measured fp16 unpack. At key
    rank 256 (128 stored columns) only with >= 1408 tokens per program: the int8 path folds the
    query twice per program, and over fewer tokens that costs more than its dots save (G-LRD-4
    int4, batch 1, 33 splits from 16K on: 4K 95 -> 133 us, 32K 404 -> 435, 40K 432 -> 449, 48K 525 -> 510,
    128K 1127 -> 934; batch 8 at 16K, 5 splits of 3.3K tokens: 1179 -> 1008); ranks <= 128 win
    at every length."""
    return (kbits == 4 and _qproj_int_fits(kbits, rkp)
            and (rkp < 128 or tokens_per_split >= 1408))


def palu_decode(q, hk, hv, *, scale: float, n_rep: int, group_size: int, bk=None,
                positions=None, position_offset=None, inv_freq=None, lengths=None,
                splits: int | None = None,
                block_t: int = 32, block_r: int | None = None, block_rv: int = 64,
                stages: tuple[int, int] = (2, 3), warps: tuple[int, int] = (4, 4),
                fused: bool | None = None, fused_block_t: int | None = None, fused_stages: int | None = None,
                fused_warps: int | None = None, fused_maxnreg: int | None = None,
                fused_int_keys: bool | None = None, qproj: bool | None = None,
                qproj_block_t: int | None = None, qproj_stages: int | None = None,
                qproj_warps: int | None = None, qproj_int: bool | None = None) -> torch.Tensor:
    """One decode step of attention over latents; returns z [B, H, Rv] (float32).

    Same contract as `palu_kernels.reference.latent_decode_reference`. RoPE mode when `bk`
    [G, group_size*D, Rk] is given (q [B, H, D] already rotated, positions [B, T],
    inv_freq [D/2]); otherwise q is the fused query [B, H, Rk]. Positions are either arbitrary
    (`positions` [B, T]) or contiguous from `position_offset` [B] (the usual cache; faster RoPE).
    Non-RoPE layers with small ranks take the one-pass `_fused_norope` kernel (`fused=None`:
    whenever it can; False: always the three-launch path; True: required, else an error).
    RoPE layers write scores with `_scores` or `_scores_qproj` (`qproj=None`: folded query for
    MHA with contiguous positions and key rank <= 256) and, unless `fused=False` or the value
    rank is too large, accumulate values with the one-pass kernel reading those scores
    (`qproj_*=None`: the measured tiles of `qproj_options`; `block_t`, `block_r`, `stages` and
    `warps` are those of `_scores` and `_values`, tuned in benchmarks/NOTES.md; `qproj_int`: packed
    keys through int8 tensor-core dots in the folded-query kernel, None: where measured faster,
    `qproj_int_default`);
    `fused_block_t` / `fused_warps=None`: the measured tiles of `one_pass_tiles`;
    `fused_stages=None` picks 2 for fp16 and 3 for packed latents, `fused_maxnreg` caps its
    registers per thread (0: no cap), `fused_int_keys` sends packed keys through int8
    tensor-core dots (None: where measured faster, with a 128-register cap at rank 256).
    With `splits=None` the one-pass kernel runs one wave: as many sequence splits as the GPU
    holds programs at once. `lengths` [B] (default: all T) must lie in [1, T]; only a CPU tensor
    is checked. bf16 latents and queries are taken to fp16 on-chip (exact for
    6e-5 <= |x| < 65504, fp16's normal range; latents of real models lie well inside it).
    """
    kbits, kdata, kscale, kzero, rk = _bits_and_parts(hk, "key")
    vbits, vdata, vscale, vzero, rv = _bits_and_parts(hv, "value")
    B, G, T, _ = kdata.shape
    if q.dim() != 3 or q.shape[0] != B:
        raise ValueError(f"query must be [batch={B}, heads, dim]; got shape {tuple(q.shape)}")
    if vdata.shape[:3] != kdata.shape[:3]:
        raise ValueError(f"key latents {tuple(kdata.shape)} and value latents {tuple(vdata.shape)} "
                         "differ in batch, groups or tokens")
    q = q if q.stride(-1) == 1 else q.contiguous()   # a few KB: copying beats a strided path
    H = q.shape[1]
    if H != G * group_size * n_rep:
        raise ValueError(f"{H} query heads != {G} groups x {group_size} KV heads x {n_rep}")
    rope = bk is not None
    if rope:
        D = q.shape[-1]
        _check_pow2(D // 2, "head_dim/2")
        if bk.shape != (G, group_size * D, rk):
            raise ValueError(f"bk shape {tuple(bk.shape)} != {(G, group_size * D, rk)}")
        units_per_group, rows = group_size, n_rep
        bk = bk.to(torch.float16).contiguous()
    else:
        if q.shape[-1] != rk:
            raise ValueError(f"fused query dim {q.shape[-1]} != key rank {rk}")
        units_per_group, rows = 1, group_size * n_rep
    for r, bits, name in ((rk, kbits, "key rank"), (rv, vbits, "value rank")):
        per = 1 if bits == 16 else 8 // bits
        if (r // per) % 16:
            raise ValueError(f"{name} {r} must give a multiple of 16 stored columns ({bits}-bit)")
    dev = kdata.device
    if lengths is not None:
        if lengths.shape != (B,):
            raise ValueError(f"lengths shape {tuple(lengths.shape)} != (batch,) = {(B,)}")
        # values are checked only where that is free (a CUDA tensor would need a host sync per
        # step, and no sync can run inside a captured CUDA graph); past T the kernels read garbage
        if lengths.device.type == "cpu" and (lengths.min() < 1 or lengths.max() > T):
            raise ValueError(f"lengths {lengths.tolist()} must lie in [1, {T}] (the cached tokens)")
    lengths = (torch.full((B,), T, dtype=torch.int32, device=dev) if lengths is None
               else lengths.to(device=dev, dtype=torch.int32).contiguous())
    mv = max(16, triton.next_power_of_2(group_size * n_rep))
    why_not = _fused_unfit(rope, rk, rv, kbits, vbits, mv)
    if fused and why_not:
        raise ValueError(f"the one-pass kernel cannot serve this layer: {why_not}")
    if fused is not False and not why_not:
        fused_stages, int_keys, fused_maxnreg = one_pass_options(
            kbits, vbits, rk, rv, fused_stages, fused_int_keys, fused_maxnreg)
        fused_block_t, fused_warps = one_pass_tiles(kbits, vbits, rk, rv, B * G * triton.cdiv(T, 256),
                                                    _sm_count(dev), fused_block_t, fused_warps)
        return _run_fused(q, kdata, kscale, kzero, kbits, vdata, vscale, vzero, vbits, lengths,
                          scale, B, G, T, H, rk, rv, group_size * n_rep, mv,
                          fused_block_t, fused_stages, fused_warps, splits, fused_maxnreg, int_keys)
    contig = positions is None
    if contig:
        pos0 = (torch.zeros(B, dtype=torch.int32, device=dev) if position_offset is None
                else position_offset.to(torch.int32).contiguous())
        positions = pos0[:, None]
    else:
        if positions.shape != (B, T):
            raise ValueError(f"positions shape {tuple(positions.shape)} != (batch, tokens) = {(B, T)}")
        positions, pos0 = positions.to(torch.int32).contiguous(), lengths
    if contig and pos0.shape != (B,):
        raise ValueError(f"position_offset shape {tuple(pos0.shape)} != (batch,) = {(B,)}")
    if inv_freq is None:
        if rope:
            raise ValueError("RoPE mode (bk given) needs inv_freq [head_dim / 2]")
        inv_freq = torch.ones(1, device=dev)
    elif rope and inv_freq.shape != (q.shape[-1] // 2,):
        raise ValueError(f"inv_freq shape {tuple(inv_freq.shape)} != (head_dim / 2,) = {(q.shape[-1] // 2,)}")
    inv_freq = inv_freq.float().contiguous()
    units = G * units_per_group
    rkp = rk // (1 if kbits == 16 else 8 // kbits)
    if qproj is None:   # folded-query scores: MHA, contiguous positions, a small rank
        qproj = rope and rows == 1 and contig and rk <= 256 and rkp & (rkp - 1) == 0
    int_told = qproj_int is not None
    if not int_told:   # provisional (the whole sequence as one split); final once splits are known
        qproj_int = bool(qproj) and qproj_int_default(kbits, rkp, T)
    if qproj_int and not _qproj_int_fits(kbits, rkp):
        raise ValueError(f"qproj_int needs packed keys with a power-of-two number >= 32 of stored "
                         f"columns (key rank {rk}, {kbits}-bit)")
    if qproj_int and not qproj:
        raise ValueError("qproj_int needs the folded-query kernel (RoPE, one query per KV head, "
                         "contiguous positions, key rank <= 256)")
    if qproj:
        if not (rope and rows == 1 and contig):
            raise ValueError("qproj=True needs RoPE, one query per KV head and contiguous positions")
        qproj_block_t, qproj_stages, qproj_warps = qproj_options(kbits, rk, qproj_block_t,
                                                                 qproj_stages, qproj_warps, qproj_int)
        block_t = max(block_t, qproj_block_t)   # splits hold whole tiles of both kernels
    splits_arg = splits
    if splits is None:   # enough programs for ~4 waves of the SMs, at least one tile each
        sms = _sm_count(dev)
        splits = max(1, min(triton.cdiv(T, 4 * block_t), triton.cdiv(8 * sms, B * units)))
    per_split, splits = _even_splits(T, splits, block_t)
    if qproj and not int_told:
        # only the rank-256 choice depends on the split's length, and its tiles are the same
        # either way (qproj_options), so the splits above stand
        qproj_int = qproj_int_default(kbits, rkp, per_split)
    M = max(16, triton.next_power_of_2(rows))
    S = torch.empty(B, H, T, device=dev, dtype=torch.float32)
    ks = kscale if kbits != 16 else kdata
    if block_r is None:   # fp16 RoPE keys: B_k of rank <= 256 stays in registers (NOTES, session 5)
        block_r = 256 if rope and kbits == 16 else 128
    br = _pow2_block(rk // (1 if kbits == 16 else 8 // kbits), block_r)
    if qproj:
        _scores_qproj[(B * units, splits)](
            q, kdata, kscale, kzero, bk, pos0, inv_freq, S, lengths, per_split, scale * LOG2E,
            q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
            ks.stride(0), ks.stride(1), ks.stride(2), S.stride(0), S.stride(1),
            UNITS_PER_GROUP=units_per_group, R=rk, HALF=q.shape[-1] // 2, BITS=kbits,
            BLOCK_T=qproj_block_t, NUM_UNITS=units, ASM=_use_asm(dev), INT_H=bool(qproj_int),
            num_stages=qproj_stages, num_warps=qproj_warps)
    else:
        grid = (B * units, splits)
        args = (q, kdata, kscale, kzero, bk if rope else q, positions, pos0, inv_freq, S, lengths,
                T, per_split, scale * LOG2E,
                q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
                ks.stride(0), ks.stride(1), ks.stride(2), positions.stride(0), S.stride(0), S.stride(1))
        meta = dict(UNITS_PER_GROUP=units_per_group, ROWS=rows, M=M, R=rk, BLOCK_R=br,
                    HALF=(q.shape[-1] // 2 if rope else 16), ROPE=rope, BITS=kbits,
                    BLOCK_T=block_t, NUM_UNITS=units, CONTIG=contig, ASM=_use_asm(dev),
                    num_stages=stages[0], num_warps=warps[0])
        _scores[grid](*args, DYN_CHUNKS=_dynamic_chunks(grid, args, meta, dev), **meta)
    if fused is not False and not _values_unfit(rv, vbits, mv):
        # the values half through the one-pass kernel (one wave, v9 unpacking, whole ranks)
        fused_block_t, fused_warps = one_pass_tiles(16, vbits, 0, rv, B * G * triton.cdiv(T, 256),
                                                    _sm_count(dev), fused_block_t, fused_warps)
        return _run_fused(q, q, q, q, 16, vdata, vscale, vzero, vbits, lengths, scale, B, G, T, H,
                          16, rv, group_size * n_rep, mv, fused_block_t,
                          fused_stages or (2 if vbits == 16 else 3), fused_warps, splits_arg,
                          fused_maxnreg, scores=S)
    rvp = rv // (1 if vbits == 16 else 8 // vbits)
    brv = _pow2_block(rvp, block_rv)
    chunks = rvp // brv   # blocks of stored columns; each program unpacks all their parts
    if splits_arg is None:   # the values kernel's own splits: its partials stay small
        sms = _sm_count(dev)
        per_split, splits = _even_splits(
            T, values_splits(T, splits, rv, vbits, group_size * n_rep, B * G * chunks, sms), block_t)
    acc = torch.empty(B, G, splits, mv, rv, device=dev, dtype=torch.float32)
    ms = torch.empty(B, G, splits, mv, device=dev, dtype=torch.float32)
    ls = torch.empty_like(ms)
    vs = vscale if vbits != 16 else vdata
    _values[(B * G, splits, chunks)](
        S, vdata, vscale, vzero, acc, ms, ls, lengths, per_split, splits,
        S.stride(0), S.stride(1), vdata.stride(0), vdata.stride(1), vdata.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        ROWS=group_size * n_rep, M=mv, RV=rv, BLOCK_RV=brv, BITS=vbits, BLOCK_T=block_t, G=G,
        ASM=_use_asm(dev), num_stages=stages[1], num_warps=warps[1])
    z = torch.empty(B, H, rv, device=dev, dtype=torch.float32)
    _launch_combine(acc, ms, ls, z, splits, group_size * n_rep, mv, rv, G)
    return z
