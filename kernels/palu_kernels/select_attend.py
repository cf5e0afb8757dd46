"""The attend part of a latent-selection decode step as one Triton kernel (issue 39 item 3):
`latent_select.attend_selected` (its CPU-tested reference) without the gathers and copies that
bound the torch composition (126 µs at 64K, k = 1056, of which ~100 µs gathers, `cat`s and
elementwise ops: `results/checks/h200-select-attend-profile.txt`).

One program per (sequence, KV head, split of the chosen tokens): per tile of BLOCK_N chosen tokens
it loads their key and value latent rows by index, rebuilds the two halves of each key with the
head's factor (two [N, R] x [R, D/2] dots), rotates them at the token's position (cos / sin from
the position and inv_freq, in registers), scores the KV head's query heads (padded to 16 rows for
the tensor cores) and updates an online softmax whose value accumulator stays in latent space.
The splits' partials are merged by `combine._combine` (one launch; the torch merge it replaced was
seven). M-LRD latents (one per KV head), fp16.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .combine import _softmax_step, launch_combine


@triton.jit
def _select_attend(Q, HK, HV, BK, IDX, INV, ACC, MS, LS, n_tok, per_split, qk_scale,
                   s_hk_bg, s_hk_t, s_hv_bg, s_hv_t, G,
                   ROWS: tl.constexpr, M: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                   R: tl.constexpr, RV: tl.constexpr, BLOCK_N: tl.constexpr, EARLY_V: tl.constexpr):
    bg, sp = tl.program_id(0), tl.program_id(1)
    g = bg % G
    half = HALF
    rows = tl.arange(0, M)
    dh = tl.arange(0, HALF)
    rr = tl.arange(0, R)
    rv = tl.arange(0, RV)
    # the KV head's query heads (rotated at the query's position), split into the two halves
    q_ok = rows[:, None] < ROWS
    q1 = tl.load(Q + (bg * ROWS + rows[:, None]) * D + dh[None, :], mask=q_ok, other=0.0)
    q2 = tl.load(Q + (bg * ROWS + rows[:, None]) * D + half + dh[None, :], mask=q_ok, other=0.0)
    # the head's key factor B_k [D, R], as [R, D/2] halves for key rows h @ B_kᵀ
    b1 = tl.load(BK + g * D * R + dh[None, :] * R + rr[:, None])
    b2 = tl.load(BK + g * D * R + (half + dh[None, :]) * R + rr[:, None])
    inv = tl.load(INV + dh)
    m_i = tl.full([M], -float("inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, RV], tl.float32)
    start = sp * per_split
    stop = tl.minimum(start + per_split, n_tok)
    for t0 in range(start, stop, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        ok = offs < stop
        tok = tl.load(IDX + bg * n_tok + offs, mask=ok, other=0)
        hk = tl.load(HK + bg * s_hk_bg + tok[:, None] * s_hk_t + rr[None, :], mask=ok[:, None], other=0.0)
        if EARLY_V:   # both row gathers in flight before the products (they depend only on the indices)
            hv = tl.load(HV + bg * s_hv_bg + tok[:, None] * s_hv_t + rv[None, :], mask=ok[:, None], other=0.0)
        k1 = tl.dot(hk, b1)                                              # [N, D/2] fp32
        k2 = tl.dot(hk, b2)
        ang = tok.to(tl.float32)[:, None] * inv[None, :]
        c, s = tl.cos(ang), tl.sin(ang)
        r1 = (k1 * c - k2 * s).to(tl.float16)
        r2 = (k2 * c + k1 * s).to(tl.float16)
        sc = (tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))) * qk_scale   # [M, N], base 2
        sc = tl.where(ok[None, :], sc, -float("inf"))
        m_i, alpha, p, l_i = _softmax_step(sc, m_i, l_i)
        if not EARLY_V:
            hv = tl.load(HV + bg * s_hv_bg + tok[:, None] * s_hv_t + rv[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), hv)
    out = (bg * tl.num_programs(1) + sp) * M
    tl.store(ACC + (out + rows[:, None]) * RV + rv[None, :], acc)
    tl.store(MS + out + rows, m_i)
    tl.store(LS + out + rows, l_i)


def select_attend(q_rot: torch.Tensor, hk: torch.Tensor, hv: torch.Tensor, bk: torch.Tensor,
                  idx: torch.Tensor, inv_freq: torch.Tensor, scale: float, n_rep: int,
                  splits: int | None = None, block_n: int = 32, num_warps: int = 4,
                  early_v: bool = False, torch_merge: bool = False) -> torch.Tensor:
    """z [B, H, Rv] (fp32): `attend_selected`'s result. q_rot [B, H, D], hk [B, G, T, R],
    hv [B, G, T, Rv] (fp16, token rows contiguous), bk [G, D, R], idx [B, G, n] (int).
    Defaults from `palu_bench.select_sweep` on the H200 (results/checks/h200-select-attend-sweep.json):
    tiles of 32 tokens, 4 warps, ~3 waves of programs (22.4 µs at llama2-7b 64K, k = 1056, against
    38.7 µs for one wave of 64-token tiles); `early_v` measured no faster (kept for the sweep)."""
    B, G, n = idx.shape
    D, R, RV = q_rot.shape[-1], hk.shape[-1], hv.shape[-1]
    if (hk.stride(-1) != 1 or hv.stride(-1) != 1 or hk.stride(0) != G * hk.stride(1)
            or hv.stride(0) != G * hv.stride(1)):
        raise ValueError("select_attend reads latent rows of [B, G, T, R] latents laid out "
                         "sequence, head, token, channel (the last dimension contiguous)")
    for name, v in (("head_dim / 2", D // 2), ("key rank", R), ("value rank", RV)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"select_attend: {name} {v} must be a power of two >= 16")
    M = max(16, triton.next_power_of_2(n_rep))
    if splits is None:   # about three waves of programs: the H200 sweep's fastest at 64K, 32 and 8 KV heads
        props = torch.cuda.get_device_properties(q_rot.device) if q_rot.is_cuda else None
        sms = props.multi_processor_count if props else 4
        splits = max(1, min(triton.cdiv(n, block_n), triton.cdiv(3 * sms, B * G)))
    per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    splits = triton.cdiv(n, per_split)
    dev = q_rot.device
    acc = torch.empty(B * G, splits, M, RV, device=dev, dtype=torch.float32)
    ms = torch.empty(B * G, splits, M, device=dev, dtype=torch.float32)
    ls = torch.empty_like(ms)
    q = q_rot.to(torch.float16).reshape(B * G, n_rep, D).contiguous()
    _select_attend[(B * G, splits)](
        q, hk, hv, bk.to(torch.float16).contiguous(), idx.reshape(B * G, n).contiguous(),
        inv_freq.float().contiguous(), acc, ms, ls, n, per_split, scale * math.log2(math.e),
        hk.stride(1), hk.stride(2), hv.stride(1), hv.stride(2), G,
        ROWS=n_rep, M=M, D=D, HALF=D // 2, R=R, RV=RV, BLOCK_N=block_n, EARLY_V=early_v,
        num_warps=num_warps)
    if not torch_merge:
        z = torch.empty(B, G * n_rep, RV, device=dev, dtype=torch.float32)
        launch_combine(acc, ms, ls, z, splits, n_rep, M, RV, G)
        return z
    m_all = ms.amax(1, keepdim=True)   # the merge as torch ops (the sweep's comparison)
    w = torch.exp2(ms - m_all)
    z = (acc * w[..., None]).sum(1) / (ls * w).sum(1)[..., None]          # [B*G, M, RV]
    return z[:, :n_rep].reshape(B, G * n_rep, RV)
