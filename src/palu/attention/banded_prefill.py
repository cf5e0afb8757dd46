"""A quantised cache's one-pass prefill without a dense mask (issue 49: KIVI's prefill attention
cost 4.4x FP16's a column on the H100, over ~2x the columns: session 44's `batch_scores`).

Decode-equivalence (`cache/quant_cache.py`) makes query t see token j coded once t >=
quantised_at(j), exact before; quantised_at(j) - j is at most `reach` = max block - 1 + window
(sinks are never coded). So attention splits, exactly, into

- the far part, tokens j <= t - reach: every one in its coded form (a sink's coded form is its
  exact one), so plain causal attention of queries [reach, T) over the first T - reach tokens,
  one flash call with its log-sum-exp;
- the band, tokens t - reach < j <= t: at most `reach` columns a query, each key and value in the
  form the schedule gives it at t, computed per chunk of queries with explicit scores;

merged by their log-sum-exps. The work is causal attention plus a band of reach + chunk columns a
query, against ~2T masked columns before; the result is the masked view's to rounding (float64
tests: `tests/unit/test_banded_prefill.py`). PALU_BANDED_PREFILL=0 keeps the masked view.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

CHUNK = 64           # queries a band chunk
BAND_BYTES = 1 << 30  # scores held at once by the band (float32), split over the batch above it


def enabled() -> bool:
    value = os.environ.get("PALU_BANDED_PREFILL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PALU_BANDED_PREFILL={value!r}: expected 1 (banded prefill) or 0 (the masked view)")
    return value == "1"


@dataclass
class QuantKVBand:
    """A prefill step's tokens in both forms (B, Hkv, T, d): `exact`, and `coded` (a token's coded
    form where the step codes it, its exact form elsewhere), with each token's first query that
    sees it coded (`key_at`, `value_at`: (T,) on the device) and the schedule's `reach`."""
    exact_k: torch.Tensor
    exact_v: torch.Tensor
    coded_k: torch.Tensor
    coded_v: torch.Tensor
    key_at: torch.Tensor
    value_at: torch.Tensor
    reach: int


@dataclass
class RowBands:
    """A left-padded batch's first step, its rows kept apart (`QuantKVLayer.rows`): each row's band
    over its real tokens, which start `skips[b]` tokens into the step."""
    skips: list[int]
    bands: list[QuantKVBand]


def attend_rows(q: torch.Tensor, rows: RowBands, scale: float) -> torch.Tensor:
    """Each row's real queries over its own band; a pad query's output is zero (never read)."""
    out = q.new_zeros(q.shape[:-1] + (rows.bands[0].exact_v.shape[-1],))
    for b, (skip, band) in enumerate(zip(rows.skips, rows.bands)):
        out[b:b + 1, :, skip:] = attend(q[b:b + 1, :, skip:], band, scale)
    return out


def applies(T: int, reach: int) -> bool:
    """Whether the split pays: a band narrower than half the prompt."""
    return T > 1 and 2 * reach < T


def attend(q: torch.Tensor, band: QuantKVBand, scale: float, kernel=None) -> torch.Tensor:
    """Attention of the prefill's queries q (B, Hq, T, d) over `band`, each query seeing each token
    in the form the cache held it at that query's decode step; (B, Hq, T, dv). `kernel`: the
    band's (None: `band_kernel`'s choice; False: the torch band)."""
    T, D = q.shape[2], band.reach
    rep = q.shape[1] // band.exact_k.shape[1]
    widen = (lambda t: t.repeat_interleave(rep, 1)) if rep > 1 else (lambda t: t)
    if D == 0:   # every token coded from its own step on: causal attention over the coded forms
        out, _ = causal_with_lse(q, widen(band.coded_k), widen(band.coded_v), scale)
        return out
    near, near_lse = _band(q, band, scale, kernel)
    far, far_lse = causal_with_lse(q[:, :, D:], widen(band.coded_k[:, :, :T - D]),
                                   widen(band.coded_v[:, :, :T - D]), scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    far_lse, near_lse = far_lse.to(work), near_lse.to(work)
    total = torch.logaddexp(far_lse, near_lse[:, :, D:])
    mixed = (far.to(work) * torch.exp(far_lse - total)[..., None]
             + near[:, :, D:].to(work) * torch.exp(near_lse[:, :, D:] - total)[..., None])
    return torch.cat([near[:, :, :D], mixed.to(near.dtype)], 2)


def causal_with_lse(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (query i sees keys <= i; equal head counts) and each query's log-sum-exp
    of its scaled scores (float32 on a GPU, the inputs' dtype on the CPU), through the fused
    kernels that return it; explicit scores where none applies."""
    T = q.shape[2]
    try:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, True, scale=scale)[:2]
            return out, lse
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
            return out, lse
        if q.device.type == "cuda":
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, True, scale=scale)[:2]
            return out, lse[..., :T]
    except (RuntimeError, NotImplementedError):
        pass   # a kernel that refuses these shapes or dtype: the explicit scores below
    return causal_math(q, k, v, scale)


def causal_math(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of `causal_with_lse`: explicit float32 (float64 if given) scores."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    T = q.shape[2]
    s = (q.to(work) @ k.to(work).transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ v.to(work)
    return out.to(q.dtype), lse


def band_kernel(q: torch.Tensor):
    """`palu_kernels.quant_band` for q on a GPU in a dtype it takes, else None (the torch band)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    try:
        from palu_kernels.quant_band import quant_band
    except ImportError:
        return None
    return quant_band


def _band(q, band: QuantKVBand, scale: float, kernel=None):
    """Each query's attention over its band (tokens t - reach < j <= t, in their forms at t) and
    its log-sum-exp: through the kernel where one applies (`kernel`: a test's choice)."""
    kernel = band_kernel(q) if kernel is None else kernel
    if kernel:
        return kernel(q, band.exact_k, band.coded_k, band.exact_v, band.coded_v, band.key_at,
                      band.value_at, band.reach, scale)
    return band_torch(q, band, scale)


def band_torch(q, band: QuantKVBand, scale: float):
    """The band in torch (the kernel's reference, and the CPU's path): queries in chunks of
    CHUNK, each chunk against its CHUNK + reach - 1 tokens, scores explicit."""
    B, Hq, T, d = q.shape
    H, D = band.exact_k.shape[1], band.reach
    rep, C = Hq // H, min(CHUNK, T)
    n = math.ceil(T / C)
    W = C + D - 1
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    # which (query, column) pairs are in the band, and in which forms, one chunk's geometry a row
    t = (torch.arange(n, device=dev)[:, None] * C + torch.arange(C, device=dev)[None])[..., None]   # (n, C, 1)
    j = t - (t % C) - (D - 1) + torch.arange(W, device=dev)[None, None]                             # (n, C, W)
    inside = (j >= 0) & (j <= t) & (j > t - D) & (t < T)
    jc = j.clamp(0, T - 1)
    key_coded = inside & (t >= band.key_at[jc])
    value_coded = inside & (t >= band.value_at[jc])
    # the chunks' windows of tokens: (B, H, n, W, d) views of the forms padded by D - 1 before
    windows = [_windows(x, D, C, n) for x in (band.exact_k, band.coded_k, band.exact_v, band.coded_v)]
    qs = (torch.nn.functional.pad(q, (0, 0, 0, n * C - T)).view(B, H, rep, n, C, d).transpose(2, 3)
          .reshape(B, H, n, rep * C, d))
    per_row = Hq * n * C * W * torch.finfo(work).bits // 8 * 3
    step = max(1, BAND_BYTES // max(per_row, 1))
    outs, lses = [], []
    for b0 in range(0, B, step):
        rows = slice(b0, b0 + step)
        ek, ck, ev, cv = (w[rows] for w in windows)
        qb = qs[rows]
        b = qb.shape[0]
        shape = (b, H, n, rep, C, W)
        se = (qb @ ek.transpose(-1, -2)).to(work).view(shape)
        sc = (qb @ ck.transpose(-1, -2)).to(work).view(shape)
        s = torch.where(key_coded[:, None], sc, se) * scale
        del se, sc
        s = s.masked_fill(~inside[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)                                  # (b, H, n, rep, C)
        p = torch.exp(s - lse[..., None])
        del s
        vc = value_coded[:, None].to(p.dtype)
        flat = (b, H, n, rep * C, W)
        out = (((p * vc).view(flat).to(cv.dtype) @ cv).to(work)
               + ((p * (1 - vc)).view(flat).to(ev.dtype) @ ev).to(work))
        del p
        outs.append(out.view(b, H, n, rep, C, -1))
        lses.append(lse)
    out = torch.cat(outs).transpose(2, 3).reshape(B, Hq, n * C, -1)[:, :, :T]
    lse = torch.cat(lses).transpose(2, 3).reshape(B, Hq, n * C)[:, :, :T]
    return out.to(q.dtype), lse


def _windows(x: torch.Tensor, D: int, C: int, n: int) -> torch.Tensor:
    """(B, H, T, d) -> (B, H, n, C + D - 1, d): chunk i's tokens [i C - (D - 1), (i + 1) C), zeros
    before the first token and after the last."""
    T = x.shape[2]
    padded = torch.nn.functional.pad(x, (0, 0, D - 1, n * C - T))
    return padded.unfold(2, C + D - 1, C).transpose(-1, -2)
