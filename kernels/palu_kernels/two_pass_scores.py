"""Two-pass RoPE scores: each key tile rebuilt on-chip from its latents (B_k h), rotated, dotted
with the query; base-2 scores out, keys never written to memory."""
from __future__ import annotations

import triton
import triton.language as tl

from .unpack import _token_scale_zero, _unpack_part, _unpacked_zero


@triton.jit
def _chunk_dots(k_ptr, t_ok, cols, b_rows, q_rows, row_ok, b1_all, b2_all, k1, k2, s,
                RP: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, PER_BYTE: tl.constexpr,
                BITS: tl.constexpr, ROPE: tl.constexpr, ONE_CHUNK: tl.constexpr, ASM: tl.constexpr,
                MASK_R: tl.constexpr):
    """One chunk of stored latent columns of a key tile: RoPE, the key halves k1, k2 += h B^T;
    otherwise the scores s += q h^T. Packed part k is unpacked as n 2^(k BITS) (`_unpack_part`)
    and its dot scaled by 2^-(k BITS) in float32 (exact), so B_k and q keep their fp16 values.
    MASK_R: the chunk runs past the stored columns (a padded block, `ScoresPlan.block_r`): the
    columns beyond them load as zeros in B_k and q, so they add nothing."""
    c_ok = cols < RP
    if MASK_R:
        raw = tl.load(k_ptr + cols[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0)
    else:
        raw = tl.load(k_ptr + cols[None, :], mask=t_ok[:, None], other=0)   # loaded once
    for k in tl.static_range(PER_BYTE):
        h = raw.to(tl.float16) if BITS == 16 else _unpack_part(raw, k, BITS, ASM)   # (BT, BR)
        w = 1.0 / (1 << (k * BITS))   # part weight (k = 0 for fp16 latents)
        rcols = k * RP + cols                                          # rank indices
        if ROPE:
            if ONE_CHUNK:
                b1, b2 = b1_all, b2_all
            else:
                if MASK_R:
                    b1 = tl.load(b_rows + rcols[None, :], mask=c_ok[None, :], other=0.0).to(tl.float16)
                    b2 = tl.load(b_rows + HALF * R + rcols[None, :], mask=c_ok[None, :],
                                 other=0.0).to(tl.float16)
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
            qf = tl.load(q_rows + rcols[None, :], mask=row_ok[:, None] & c_ok[None, :],
                         other=0.0).to(tl.float16)
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
    MASK_R: tl.constexpr = (RP % BLOCK_R) != 0        # a padded rank block (`ScoresPlan.block_r`)
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
            r_ok = (r0 + offs_r) < R      # all true unless the block is padded
            if ROPE:
                zsum1 += tl.sum(tl.load(b_rows + r0 + offs_r[None, :], mask=r_ok[None, :],
                                        other=0.0).to(tl.float16).to(tl.float32), 1)
                zsum2 += tl.sum(tl.load(b_rows + HALF * R + r0 + offs_r[None, :], mask=r_ok[None, :],
                                        other=0.0).to(tl.float16).to(tl.float32), 1)
            else:
                qsum += tl.sum(tl.load(q_rows + r0 + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :],
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
                                        k1, k2, s, RP, R, HALF, PER_BYTE, BITS, ROPE, ONE_CHUNK, ASM, MASK_R)
        else:
            for c0 in tl.static_range(0, RP, BLOCK_R):
                k1, k2, s = _chunk_dots(k_ptr, t_ok, c0 + offs_r, b_rows, q_rows, row_ok, b1_all, b2_all,
                                        k1, k2, s, RP, R, HALF, PER_BYTE, BITS, ROPE, ONE_CHUNK, ASM, MASK_R)
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
