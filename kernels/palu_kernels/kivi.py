"""KIVI decode attention (Liu et al., ICML 2024) as a peer of the Palu kernels: one query token
over a KIVI cache, keys quantised per channel in groups of `GK` tokens, values per token in groups
of `GV` channels (asymmetric min-max, k = s n + z), the newest `R` tokens exact in fp16.

Layout (`kivi_pack`): fields packed along the channels by `palu.quant.packed.pack_codes`, as the Palu
latents are (byte j of a token holds channel k D/per + j in field k, per = 8 / bits), so
`unpack._unpack_part` serves both;
key scales / zeros [B, KVH, T / GK, D], value scales / zeros [B, KVH, T, D / GV], fp16.

One program per (sequence, KV head, split of the quantised tokens) plus one per (sequence, KV
head) for the exact window; online softmax within a program, `combine._combine` across them.
Each key group is dequantised in registers with its per-channel scale (one HFMA2 per pair of
fp16 values) and contracted with the query by one dot per packed part; each value channel group
likewise with its per-token scale, one dot per group.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .combine import _softmax_step, launch_combine
from palu.quant.packed import pack_codes, unpack_codes
from .palu_decode import _use_asm
from .unpack import _unpack_part

LOG2E = 1.4426950408889634


@triton.jit
def _kivi_split(Q, KQ, KS, KZ, VQ, VS, VZ, KR, VR, ACC, MS, LS,
                T, R, n_splits, tokens_per_split, qk_scale,
                s_qb, s_qh, s_kb, s_kh, s_kt, s_ksb, s_ksh, s_ksg,
                s_vb, s_vh, s_vt, s_vsb, s_vsh, s_vst, s_rb, s_rh, s_rt, s_wb, s_wh, s_wt,
                KVH: tl.constexpr, N_REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                BITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, BLOCK_R: tl.constexpr,
                ASM: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    b, g = pid // KVH, pid % KVH
    PER: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PER                       # stored bytes per token
    NB: tl.constexpr = DB // GV                       # value channel groups per part
    rows = tl.arange(0, M)
    row_ok = rows < N_REP
    jd = tl.arange(0, DB)
    jv = tl.arange(0, GV)
    q_rows = Q + b * s_qb + (g * N_REP + rows) * s_qh
    out = ((b * KVH + g) * (n_splits + 1) + split) * M + rows
    m_i = tl.full([M], -float("inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if split == n_splits:   # the exact window of the newest R tokens
        cd = tl.arange(0, D)
        q = tl.load(q_rows[:, None] + cd[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        tr = tl.arange(0, BLOCK_R)
        t_ok = tr < R
        k = tl.load(KR + b * s_rb + g * s_rh + tr[:, None] * s_rt + cd[None, :], mask=t_ok[:, None],
                    other=0.0)
        s = tl.dot((q * qk_scale).to(tl.float16), tl.trans(k.to(tl.float16)))
        s = tl.where(t_ok[None, :], s, -float("inf"))
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(VR + b * s_wb + g * s_wh + tr[:, None] * s_wt + cd[None, :], mask=t_ok[:, None],
                    other=0.0)
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16))
        tl.store(ACC + out[:, None] * D + cd[None, :], acc, mask=row_ok[:, None])
    else:
        t_begin = split * tokens_per_split
        t_end = tl.minimum(t_begin + tokens_per_split, T)
        # the query parts, scaled once (fp16 dot operands)
        q0 = (tl.load(q_rows[:, None] + jd[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
              * qk_scale).to(tl.float16)
        q1 = (tl.load(q_rows[:, None] + DB + jd[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
              * qk_scale).to(tl.float16)
        q2 = q0
        q3 = q1
        if PER == 4:
            q2 = (tl.load(q_rows[:, None] + 2 * DB + jd[None, :], mask=row_ok[:, None],
                          other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            q3 = (tl.load(q_rows[:, None] + 3 * DB + jd[None, :], mask=row_ok[:, None],
                          other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
        acc0 = tl.zeros([M, GV], tl.float32)
        acc1 = tl.zeros([M, GV], tl.float32)
        acc2 = tl.zeros([M, GV], tl.float32)
        acc3 = tl.zeros([M, GV], tl.float32)
        kbase = KQ + b * s_kb + g * s_kh
        ksbase = b * s_ksb + g * s_ksh
        vbase = VQ + b * s_vb + g * s_vh
        vsbase = b * s_vsb + g * s_vsh
        center: tl.constexpr = 1 << (BITS - 1)
        for t0 in range(t_begin, t_end, GK):          # one key group per tile
            tt = t0 + tl.arange(0, GK)
            raw = tl.load(kbase + tt[:, None] * s_kt + jd[None, :])
            kso = ksbase + (t0 // GK) * s_ksg
            s = tl.zeros([M, GK], tl.float32)
            for k in tl.static_range(PER):
                # k = s n + z = s (n - c) + (z + s c); the unpack gives (n - c) 2^(k bits):
                # dequantised in fp16 with the group's per-channel scale (one HFMA2 per pair)
                ks = tl.load(KS + kso + k * DB + jd).to(tl.float32)
                kz = tl.load(KZ + kso + k * DB + jd).to(tl.float32)
                kt = (_unpack_part(raw, k, BITS, ASM) * (ks * (1.0 / (1 << (k * BITS)))).to(tl.float16)[None, :]
                      + (kz + ks * center).to(tl.float16)[None, :])
                if k == 0:
                    s += tl.dot(q0, tl.trans(kt))
                elif k == 1:
                    s += tl.dot(q1, tl.trans(kt))
                elif k == 2:
                    s += tl.dot(q2, tl.trans(kt))
                else:
                    s += tl.dot(q3, tl.trans(kt))
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i)
            pf = p.to(tl.float16)
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
            for jb in tl.static_range(NB):
                rawv = tl.load(vbase + tt[:, None] * s_vt + jb * GV + jv[None, :])
                for k in tl.static_range(PER):
                    cg = k * NB + jb    # channels cg GV .. cg GV + GV - 1
                    sv = tl.load(VS + vsbase + tt * s_vst + cg).to(tl.float32)
                    zv = tl.load(VZ + vsbase + tt * s_vst + cg).to(tl.float32)
                    # per-token scale of this channel group, dequantised in fp16
                    vt = (_unpack_part(rawv, k, BITS, ASM) * (sv * (1.0 / (1 << (k * BITS)))).to(tl.float16)[:, None]
                          + (zv + sv * center).to(tl.float16)[:, None])
                    term = tl.dot(pf, vt)
                    if cg == 0:
                        acc0 += term
                    elif cg == 1:
                        acc1 += term
                    elif cg == 2:
                        acc2 += term
                    else:
                        acc3 += term
        dst = ACC + out[:, None] * D + jv[None, :]
        tl.store(dst, acc0, mask=row_ok[:, None])
        tl.store(dst + GV, acc1, mask=row_ok[:, None])
        if D // GV > 2:
            tl.store(dst + 2 * GV, acc2, mask=row_ok[:, None])
            tl.store(dst + 3 * GV, acc3, mask=row_ok[:, None])
    tl.store(MS + out, m_i, mask=row_ok)
    tl.store(LS + out, l_i, mask=row_ok)


def _minmax(x: torch.Tensor, dim: int, bits: int):
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    n = ((x - lo) / s).round().clamp(0, (1 << bits) - 1)
    return n, s, lo


def kivi_pack(k: torch.Tensor, v: torch.Tensor, bits: int, group_k: int = 32, group_v: int = 32,
              residual: int = 128) -> dict:
    """A KIVI cache of fp16 K/V [B, KVH, T, D]: the oldest tokens, a multiple of `group_k`,
    quantised (at most `residual` + group_k - 1 newest kept exact, as `palu.methods.kivi`)."""
    if bits not in (2, 4):
        raise ValueError(f"KIVI kernel bits={bits} is not 2 or 4")
    B, H, T, D = k.shape
    if D % group_v or D % (8 // bits):
        raise ValueError(f"head_dim {D} is not a multiple of group_v={group_v} / 8 / bits")
    tq = max(0, (T - residual) // group_k * group_k)
    kq = k[:, :, :tq].float().unflatten(2, (tq // group_k, group_k))      # [B, H, groups, GK, D]
    nk, sk, zk = _minmax(kq, 3, bits)
    vq = v[:, :, :tq].float().unflatten(-1, (D // group_v, group_v))       # [B, H, tq, D/GV, GV]
    nv, sv, zv = _minmax(vq, 4, bits)
    return {"bits": bits, "group_k": group_k, "group_v": group_v,
            "k_data": pack_codes(nk.flatten(2, 3).to(torch.uint8), bits), "k_scale": sk[:, :, :, 0].half().contiguous(),
            "k_zero": zk[:, :, :, 0].half().contiguous(),
            "v_data": pack_codes(nv.flatten(3).to(torch.uint8), bits), "v_scale": sv[..., 0].half().contiguous(),
            "v_zero": zv[..., 0].half().contiguous(),
            "k_res": k[:, :, tq:].contiguous(), "v_res": v[:, :, tq:].contiguous()}


def kivi_dequantize(cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's K, V [B, KVH, T, D] as float32 (what the attention must read)."""
    bits, gk, gv = cache["bits"], cache["group_k"], cache["group_v"]
    nk = unpack_codes(cache["k_data"], bits).float()                            # [B, H, tq, D]
    B, H, tq, D = nk.shape
    k = (nk.unflatten(2, (tq // gk, gk)) * cache["k_scale"][:, :, :, None].float()
         + cache["k_zero"][:, :, :, None].float()).flatten(2, 3)
    nv = unpack_codes(cache["v_data"], bits).float().unflatten(-1, (D // gv, gv))
    v = (nv * cache["v_scale"][..., None].float() + cache["v_zero"][..., None].float()).flatten(3)
    return (torch.cat([k, cache["k_res"].float()], 2), torch.cat([v, cache["v_res"].float()], 2))


def kivi_decode_reference(q: torch.Tensor, cache: dict, scale: float) -> torch.Tensor:
    """One decode step over the dequantised cache, float32: q [B, H, D] -> [B, H, D]."""
    k, v = kivi_dequantize(cache)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    p = (torch.einsum("bhd,bhtd->bht", q.float(), k) * scale).softmax(-1)
    return torch.einsum("bht,bhtd->bhd", p, v)


def kivi_nbytes(cache: dict) -> int:
    """Bytes the cache holds (what one decode step must read), metadata included."""
    return sum(t.numel() * t.element_size() for key, t in cache.items() if isinstance(t, torch.Tensor))


def kivi_decode(q: torch.Tensor, cache: dict, scale: float | None = None, splits: int | None = None,
                num_warps: int | None = None, num_stages: int = 2) -> torch.Tensor:
    """Attention output [B, H, D] (q's dtype) of one query token per sequence over a KIVI cache.
    Defaults measured on the H200 (benchmarks/NOTES.md, KIVI peer kernel): 1 warp for 4-bit,
    2 for 2-bit, two pipeline stages, ~16 programs per SM."""
    bits, gk, gv = cache["bits"], cache["group_k"], cache["group_v"]
    kd, kr = cache["k_data"], cache["k_res"]
    B, KVH, T, DB = kd.shape
    D = kr.shape[-1]
    H = q.shape[1]
    R = kr.shape[2]
    if q.shape != (B, H, D) or H % KVH:
        raise ValueError(f"query shape {tuple(q.shape)} does not fit the cache (B={B}, KV heads "
                         f"{KVH}, head_dim {D})")
    if (R > 256 or T % gk or gk < 16 or (gk & (gk - 1)) or DB * (8 // bits) != D or gv < 16
            or D // gv not in (2, 4) or (D // (8 // bits)) % gv):
        raise ValueError(f"KIVI cache not supported by the kernel: {T} quantised tokens, key group "
                         f"{gk} (a power of two >= 16 dividing them), value group {gv} (>= 16, "
                         f"2 or 4 per head of {D}, whole groups per packed part), {R} exact "
                         "tokens (<= 256)")
    scale = 1 / math.sqrt(D) if scale is None else scale
    num_warps = (1 if bits == 4 else 2) if num_warps is None else num_warps
    n_rep = H // KVH
    M = max(16, triton.next_power_of_2(n_rep))
    if splits is None:   # about 16 programs per SM, whole key groups per split
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, min(triton.cdiv(T, gk), triton.cdiv(16 * sms, B * KVH))) if T else 0
    tps = triton.cdiv(triton.cdiv(T, max(splits, 1)), gk) * gk if T else gk
    splits = triton.cdiv(T, tps) if T else 0
    parts = splits + 1
    acc = torch.empty(B, KVH, parts, M, D, device=q.device, dtype=torch.float32)
    ms = torch.empty(B, KVH, parts, M, device=q.device, dtype=torch.float32)
    ls = torch.empty_like(ms)
    vr = cache["v_res"]
    ks, vs = cache["k_scale"], cache["v_scale"]
    q = q.contiguous()
    _kivi_split[(B * KVH, parts)](
        q, kd, ks, cache["k_zero"], cache["v_data"], vs, cache["v_zero"], kr, vr, acc, ms, ls,
        T, R, splits, tps, scale * LOG2E,
        q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kd.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        cache["v_data"].stride(0), cache["v_data"].stride(1), cache["v_data"].stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2), kr.stride(0), kr.stride(1), kr.stride(2),
        vr.stride(0), vr.stride(1), vr.stride(2),
        KVH=KVH, N_REP=n_rep, M=M, D=D, BITS=bits, GK=gk, GV=gv,
        BLOCK_R=max(16, triton.next_power_of_2(R)), ASM=_use_asm(q.device),
        num_warps=num_warps, num_stages=num_stages)
    z = torch.empty(B, H, D, device=q.device, dtype=torch.float32)
    launch_combine(acc, ms, ls, z, parts, n_rep, M, D, KVH)
    return z.to(q.dtype)
