"""Online softmax: one tile's update, and the merge of the sequence splits' partial outputs."""
from __future__ import annotations

import triton
import triton.language as tl


def launch_combine(acc, ms, ls, z, splits, rows, M, rv, G):
    """Merge per-split partials acc [B*G*splits, M, rv], ms / ls [B*G*splits, M] into z [B, H, rv]."""
    B, H = z.shape[0], z.shape[1]
    block_c = min(64, triton.next_power_of_2(rv))
    block_s = min(32, triton.next_power_of_2(splits))
    _combine[(B * H, triton.cdiv(rv, block_c))](acc, ms, ls, z, splits, z.stride(0), z.stride(1),
                                                ROWS=rows, M=M, RV=rv, BLOCK_C=block_c, G=G,
                                                BLOCK_S=block_s)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one tile of base-2 scores: (new max, rescale factor, p, new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)   # a row with no token yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


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
