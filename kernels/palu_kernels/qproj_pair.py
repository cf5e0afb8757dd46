"""Folded-query RoPE scores for fp16 latents, two heads per program: the heads share each tile's
cos/sin weights (and, inside a G-LRD group, the latent tile itself)."""
from __future__ import annotations

import triton
import triton.language as tl

from .qproj import _fold_query, _tile_angles


@triton.jit
def _head_fold(Q, BK, b, u, s_qb, s_qh, offs_h, cols, UNITS_PER_GROUP: tl.constexpr,
               R: tl.constexpr, HALF: tl.constexpr):
    """Head u's query folded into its rows of B_k: a, c [HALF, R] fp16 (`_fold_query`)."""
    g, jl = u // UNITS_PER_GROUP, u % UNITS_PER_GROUP
    q1 = tl.load(Q + b * s_qb + u * s_qh + offs_h).to(tl.float16).to(tl.float32)
    q2 = tl.load(Q + b * s_qb + u * s_qh + HALF + offs_h).to(tl.float16).to(tl.float32)
    b_rows = BK + g * (UNITS_PER_GROUP * 2 * HALF * R) + (jl * 2 * HALF + offs_h)[:, None] * R
    a, c, _, _ = _fold_query(b_rows, q1, q2, cols, HALF, R, 0, 16)
    return a, c


@triton.jit
def _tile_score(h, a, c, cos, sin):
    return tl.sum(cos * tl.dot(h, tl.trans(a)) + sin * tl.dot(h, tl.trans(c)), 1)


@triton.jit
def _scores_qproj_pair(Q, HK, BK, POS0, INVF, S, LENS, tokens_per_split, qk_scale,
                       s_qb, s_qh, s_kb, s_kg, s_kt, s_ob, s_oh,
                       UNITS_PER_GROUP: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_T: tl.constexpr, NUM_UNITS: tl.constexpr):
    """`_scores_qproj` for fp16 latents with heads u, u + 1 in one program (NUM_UNITS even).

    The cos/sin weights of a tile (four float ops per element of [BT, HALF], the recurrence of
    `_scores_qproj`) are formed once for both heads; the weighting and row sum stay per head.
    With UNITS_PER_GROUP >= 2 (G-LRD) both heads read the same latents: one tile load serves both.
    """
    pid_u, pid_s = tl.program_id(0), tl.program_id(1)
    PAIRS: tl.constexpr = NUM_UNITS // 2
    b, u = pid_u // PAIRS, (pid_u % PAIRS) * 2
    g0, g1 = u // UNITS_PER_GROUP, (u + 1) // UNITS_PER_GROUP
    cols, offs_h = tl.arange(0, R), tl.arange(0, HALF)
    length = tl.load(LENS + b)
    t0 = pid_s * tokens_per_split
    t_end = tl.minimum(t0 + tokens_per_split, length)
    a0, c0 = _head_fold(Q, BK, b, u, s_qb, s_qh, offs_h, cols, UNITS_PER_GROUP, R, HALF)
    a1, c1 = _head_fold(Q, BK, b, u + 1, s_qb, s_qh, offs_h, cols, UNITS_PER_GROUP, R, HALF)
    ci, si, ca, sa, cb, sb = _tile_angles(INVF, POS0, b, t0, offs_h, BLOCK_T)
    for t in range(t0, t_end, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        t_ok = offs_t < t_end
        rows = offs_t[:, None] * s_kt + cols[None, :]
        h0 = tl.load(HK + b * s_kb + g0 * s_kg + rows, mask=t_ok[:, None], other=0).to(tl.float16)
        if UNITS_PER_GROUP == 1:
            h1 = tl.load(HK + b * s_kb + g1 * s_kg + rows, mask=t_ok[:, None], other=0).to(tl.float16)
        else:
            h1 = h0
        cos = ci * ca[None, :] - si * sa[None, :]
        sin = si * ca[None, :] + ci * sa[None, :]
        ca, sa = ca * cb - sa * sb, sa * cb + ca * sb
        tl.store(S + b * s_ob + u * s_oh + offs_t, _tile_score(h0, a0, c0, cos, sin) * qk_scale, mask=t_ok)
        tl.store(S + b * s_ob + (u + 1) * s_oh + offs_t, _tile_score(h1, a1, c1, cos, sin) * qk_scale,
                 mask=t_ok)
