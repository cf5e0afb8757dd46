"""Two-pass values: online softmax over given scores and accumulation of the attention-weighted
latent values, per group, sequence split and rank chunk (layers too large for one pass)."""
from __future__ import annotations

import triton
import triton.language as tl

from .combine import _softmax_step
from .unpack import _token_scale_zero, _unpack_part, _unpacked_zero


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
