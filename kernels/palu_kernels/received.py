"""The attention each key receives from a step's queries, summed over them and over the query
heads of its KV head: H2O's heavy-hitter score (`palu.methods.h2o`), without the scores.

Why a kernel: in torch a prefill's sums need the whole (queries x keys) softmax per query head,
written and read again by every elementwise pass (mask, softmax, sum): at SmolLM2's shapes,
64 prompts x 4K tokens x 9 query heads, that is ~19 GB of fp16 scores a layer, ~10 passes over
them, 7.5 s for the 30 layers of one prefill on an H100 (session 46). Here pass 1 gives each
query its log-sum-exp over the keys it may see (an online softmax, as flash attention does),
and pass 2, one program per block of keys of one KV head, streams the queries that may see them
and adds exp(score - lse) in registers. Nothing of size queries x keys is stored.

Visibility is by position: query t (position q_pos[b, t]; < 0: a pad, sees nothing and gives
nothing) sees key j of KV head h when 0 <= k_pos[b, h, j] <= q_pos[b, t]. Slots are in position
order within a row (a prefill of a left-padded batch; a cache whose earlier slots hold earlier
tokens), so a query block skips the key blocks after its last slot.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)


def attention_received(q, k, q_pos, k_pos, scale: float, block_m: int = 64, block_n: int = 64):
    """q (B, Hq, T, D); k (B, H, S, D) (H divides Hq; the step's T queries are the last T slots);
    q_pos (B, T) and k_pos (B, H, S) integer positions (< 0: not a token). Returns (B, H, S)
    float32: for each key, the softmax weight every visible query gives it, summed over the
    queries and the KV head's query heads."""
    B, Hq, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    if Hq % H or S < T:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: heads must divide, S >= T")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous in their last dimension")
    q_pos = q_pos.to(torch.int32).contiguous()
    k_pos = k_pos.to(torch.int32).contiguous()
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32
    args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    _lse[(triton.cdiv(T, block_m), B * Hq)](q, k, q_pos, k_pos, lse, *args, Hq, Hq // H, H, T, S,
                                           scale * LOG2E, D=D, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee)
    out = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    _received[(triton.cdiv(S, block_n), B * H)](q, k, q_pos, k_pos, lse, out, *args, Hq, Hq // H, H, T, S,
                                               scale * LOG2E, D=D, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee)
    return out


@triton.jit
def _scores(q, k, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _lse(Q, K, QP, KP, LSE, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, Hq, rep, H, T, S, scale2,
         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Each query's log-sum-exp (base 2, of scale2-scaled scores) over the keys it sees; +inf
    for a query that sees none (so pass 2 adds exp2(-inf) = 0 for it)."""
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, hq = (bh // Hq).to(tl.int64), bh % Hq   # int64 offsets: B x Hq x T x D passes 2^31 at long contexts
    h = hq // rep
    t = chunk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + hq * s_qh + t[:, None] * s_qt + offs_d[None, :], mask=t[:, None] < T, other=0.0)
    qp = tl.load(QP + b * T + t, mask=t < T, other=-1)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    hi = tl.minimum(S - T + chunk * BLOCK_M + BLOCK_M, S)   # past the block's last slot: never seen
    for n0 in range(0, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        kp = tl.load(KP + (b * H + h) * S + j, mask=j < S, other=-1)
        k = tl.load(K + b * s_kb + h * s_kh + j[:, None] * s_kt + offs_d[None, :], mask=j[:, None] < S, other=0.0)
        seen = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None]) & (qp[:, None] >= 0)
        s = tl.where(seen, _scores(q, k, IEEE) * scale2, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(LSE + bh * T + t, lse, mask=t < T)


@triton.jit
def _received(Q, K, QP, KP, LSE, OUT, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, Hq, rep, H, T, S, scale2,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    n0 = chunk * BLOCK_N
    j = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kp = tl.load(KP + bh * S + j, mask=j < S, other=-1)
    k = tl.load(K + b * s_kb + h * s_kh + j[:, None] * s_kt + offs_d[None, :], mask=j[:, None] < S, other=0.0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    first = tl.maximum(n0 - (S - T), 0) // BLOCK_M * BLOCK_M   # queries before the block's first slot see none of it
    for r in range(0, rep):
        hq = h * rep + r
        for m0 in range(first, T, BLOCK_M):
            t = m0 + tl.arange(0, BLOCK_M)
            q = tl.load(Q + b * s_qb + hq * s_qh + t[:, None] * s_qt + offs_d[None, :], mask=t[:, None] < T,
                        other=0.0)
            qp = tl.load(QP + b * T + t, mask=t < T, other=-1)
            lse = tl.load(LSE + (b * Hq + hq) * T + t, mask=t < T, other=float("inf"))
            seen = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None]) & (qp[:, None] >= 0)
            p = tl.exp2(_scores(q, k, IEEE) * scale2 - lse[:, None])
            acc += tl.sum(tl.where(seen, p, 0.0), 0)
    tl.store(OUT + bh * S + j, acc, mask=j < S)
