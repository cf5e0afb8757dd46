"""The scoring and top-k halves of a latent-selection decode step as two Triton kernels (issue 39
item 3), in place of `latent_select`'s fold + `sketch_scores` + `torch.topk` (59 + 58 µs at 64K
on the H200, session 24: torch's radix select launches several kernels per call, and the fold
and the score matmul are separate launches with fp32 copies between them).

`_sketch_scores`: one program per (sequence, KV head, tile of tokens) folds the KV head's query
heads into the sketch channels of its key factor (`q_lat = Σ_i B_k[:, :s]ᵀ q_i`, rounded to the
latents' dtype as `latent_select.sketch_scores` rounds it) and scores the tile's sketch rows,
writing fp16 scores: the same numbers as the torch path up to the order of a 16-term fp32 sum.
It also adds the tile's 256-bin histogram of the scores' high bytes (below) into a per-row
histogram (atomics, non-empty bins only): the radix select's first pass, done while the scores
are in registers.

The radix select (`radix_topk`) finds the k-th largest score of the tokens older than the window
on the scores' 16-bit order keys, its high byte from that histogram, its low byte from 256-bin
histograms of the keys in the chosen high bin, then writes the indices of every score above that
key and as many equal to it as k needs (lowest positions first), then the window: three launches
over (row, chunk of tokens) programs (`_low_hist`, `_offsets` per row, `_emit`), the row's 128 KB
of scores at 64K read twice from L2. Exact: the chosen set's scores are the k largest (ties at the
threshold broken by position; `torch.topk` breaks them arbitrarily, so the sets may differ only
among equal scores). A first version ran the passes as a loop in one program per row: 116 µs at
64K (32 rows), twice torch.topk's 58 µs (benchmarks/NOTES.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(s):
    """fp16 -> int32 in [0, 65536), ordered as the floats are (-0 just below +0)."""
    bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)


@triton.jit
def _sketch_scores(Q, BK, SK, S, HIST, T, older, s_sk_bg, s_sk_t, G,
                   REP: tl.constexpr, D: tl.constexpr, R: tl.constexpr, SKETCH: tl.constexpr,
                   BLOCK_T: tl.constexpr, WITH_HIST: tl.constexpr):
    bg, tb = tl.program_id(0), tl.program_id(1)
    g = bg % G
    d = tl.arange(0, D)
    c = tl.arange(0, SKETCH)
    b = tl.load(BK + g * D * R + d[:, None] * R + c[None, :]).to(tl.float32)       # [D, s]
    q_lat = tl.zeros([SKETCH], tl.float32)
    for i in range(REP):                                                              # the KV head's query heads
        q = tl.load(Q + (bg * REP + i) * D + d).to(tl.float32)
        q_lat += tl.sum(q[:, None] * b, 0)
    q_lat = q_lat.to(tl.float16).to(tl.float32)       # as sketch_scores: q_lat in the latents' dtype
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    sk = tl.load(SK + bg * s_sk_bg + t[:, None] * s_sk_t + c[None, :], mask=ok[:, None], other=0.0)
    sc = tl.sum(sk.to(tl.float32) * q_lat[None, :], 1)
    sc = sc.to(tl.float16)
    tl.store(S + bg * T + t, sc, mask=ok)
    if WITH_HIST:   # the radix select's first pass: the high bytes of the older tokens' keys
        old = t < older
        hist = tl.histogram(tl.where(old, _order_key(sc) >> 8, 0), 256)
        hist -= tl.where(tl.arange(0, 256) == 0, tl.sum((~old).to(tl.int32), 0), 0)
        bins = tl.arange(0, 256)
        tl.atomic_add(HIST + bg * 256 + bins, hist, mask=hist > 0)


@triton.jit
def _pick_bin(hist, need):
    """The bin holding the `need`-th largest element, and how many lie in bins above it."""
    total = tl.sum(hist, 0)
    above = total - tl.cumsum(hist, 0)          # elements in higher bins
    hit = (above < need) & (above + hist >= need)
    bins = tl.arange(0, 256)
    return tl.sum(tl.where(hit, bins, 0), 0), tl.sum(tl.where(hit, above, 0), 0)


@triton.jit
def _high_hist(S, HIST, T, older, BLOCK: tl.constexpr):
    """The first pass alone (for scores that did not come from `_sketch_scores`)."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = c * BLOCK + tl.arange(0, BLOCK)
    ok = t < older
    key = _order_key(tl.load(S + row * T + t, mask=ok, other=0.0))
    hist = tl.histogram(tl.where(ok, key >> 8, 0), 256)
    hist -= tl.where(tl.arange(0, 256) == 0, tl.sum((~ok).to(tl.int32), 0), 0)
    tl.atomic_add(HIST + row * 256 + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit
def _low_hist(S, HIST, LOW, ABOVE, T, older, k, C, BLOCK: tl.constexpr, ATOMIC: tl.constexpr):
    """Per chunk of a row: the 256-bin histogram of the low bytes of the keys in the chosen high
    bin, and how many keys lie in higher bins. ATOMIC: counted by one atomic add per key in the
    bin into a zeroed LOW (few keys: the bin of the k-th largest of a row holds ~k of them), else
    by `tl.histogram` over every key of the chunk, stored."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = c * BLOCK + tl.arange(0, BLOCK)
    ok = t < older
    sc = tl.load(S + row * T + t, mask=ok, other=0.0)     # issued before the bin pick needs the histogram
    hi, _ = _pick_bin(tl.load(HIST + row * 256 + tl.arange(0, 256)), k)
    key = _order_key(sc)
    inside = ok & ((key >> 8) == hi)
    if ATOMIC:
        tl.atomic_add(LOW + (row * C + c) * 256 + (key & 0xFF), 1, mask=inside)
    else:
        hist = tl.histogram(tl.where(inside, key & 0xFF, 0), 256)
        hist -= tl.where(tl.arange(0, 256) == 0, tl.sum((~inside).to(tl.int32), 0), 0)
        tl.store(LOW + (row * C + c) * 256 + tl.arange(0, 256), hist)
    tl.store(ABOVE + row * C + c, tl.sum((ok & ((key >> 8) > hi)).to(tl.int32), 0))


@triton.jit
def _offsets(HIST, LOW, ABOVE, OFF, THR, k, C, CP: tl.constexpr):
    """Per row: the threshold key, how many keys exceed it, how many equal keys k still needs,
    and each chunk's first output slot for the keys above it and for the equal ones."""
    row = tl.program_id(0)
    hist = tl.load(HIST + row * 256 + tl.arange(0, 256))
    hi, above_hi = _pick_bin(hist, k)
    cc = tl.arange(0, CP)
    bins = tl.arange(0, 256)
    low = tl.load(LOW + (row * C + cc[:, None]) * 256 + bins[None, :], mask=cc[:, None] < C, other=0)
    lo, above_lo = _pick_bin(tl.sum(low, 0), k - above_hi)
    gt = tl.load(ABOVE + row * C + cc, mask=cc < C, other=0) + tl.sum(tl.where(bins[None, :] > lo, low, 0), 1)
    eq = tl.sum(tl.where(bins[None, :] == lo, low, 0), 1)
    tl.store(OFF + (row * C + cc) * 2, tl.cumsum(gt, 0) - gt, mask=cc < C)
    tl.store(OFF + (row * C + cc) * 2 + 1, tl.cumsum(eq, 0) - eq, mask=cc < C)
    n_gt = above_hi + above_lo
    tl.store(THR + row * 3, hi * 256 + lo)
    tl.store(THR + row * 3 + 1, n_gt)
    tl.store(THR + row * 3 + 2, k - n_gt)


@triton.jit
def _emit(S, OFF, THR, IDX, T, older, k, window, C, BLOCK: tl.constexpr, WBLOCK: tl.constexpr):
    """Per chunk: the positions of its keys above the threshold, and of the equal keys the row
    still needs (lowest positions first); the first chunk also writes the window."""
    row, c = tl.program_id(0), tl.program_id(1)
    thresh, n_gt, ties = tl.load(THR + row * 3), tl.load(THR + row * 3 + 1), tl.load(THR + row * 3 + 2)
    gt_off, eq_off = tl.load(OFF + (row * C + c) * 2), tl.load(OFF + (row * C + c) * 2 + 1)
    t = c * BLOCK + tl.arange(0, BLOCK)
    ok = t < older
    key = _order_key(tl.load(S + row * T + t, mask=ok, other=0.0))
    gt = ok & (key > thresh)
    eq = ok & (key == thresh)
    out = IDX + row * (k + window)
    if BLOCK <= 32768:   # one scan for both ranks: the count above the threshold in the low 16
        # bits, the equal count above them (at most BLOCK each, so neither carries into the other)
        both = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
        rank_gt, rank_eq = both & 0xFFFF, both >> 16
    else:
        rank_gt, rank_eq = tl.cumsum(gt.to(tl.int32), 0), tl.cumsum(eq.to(tl.int32), 0)
    tl.store(out + gt_off + rank_gt - 1, t.to(tl.int64), mask=gt)
    rank_eq = eq_off + rank_eq - 1
    tl.store(out + n_gt + rank_eq, t.to(tl.int64), mask=eq & (rank_eq < ties))
    if c == 0:
        for w0 in range(0, window, WBLOCK):
            w = w0 + tl.arange(0, WBLOCK)
            tl.store(out + k + w, (older + w).to(tl.int64), mask=w < window)


def sketch_scores_fused(q: torch.Tensor, bk: torch.Tensor, sketch: torch.Tensor, n_rep: int,
                        block_t: int = 1024, window: int | None = None):
    """q [B, H, D] (before RoPE), bk [G, D, R], sketch [B, G, T, s] (its last dimension
    contiguous; the first s channels of the key latents, stored or read in place) -> fp16 scores
    [B, G, T]: `sketch_scores(fold_query(q, bk, n_rep), sketch)` in one launch. With `window`
    (an int): (scores, hist), hist [B, G, 256] the histogram of the high bytes of the order keys
    of the tokens older than the window, the first pass `radix_topk(..., hist=hist)` then skips."""
    B, G, T, s = sketch.shape
    D, R = bk.shape[1], bk.shape[2]
    if sketch.dtype != torch.float16:   # scores are fp16 (the order keys are 16 bits)
        raise ValueError(f"sketch_scores_fused scores fp16 latents, not {sketch.dtype}")
    if sketch.stride(-1) != 1 or sketch.stride(0) != G * sketch.stride(1):
        raise ValueError("sketch_scores_fused reads [B, G, T, s] sketches laid out sequence, head, "
                         "token, channel (the last dimension contiguous)")
    for name, v in (("head_dim", D), ("sketch channels", s)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"sketch_scores_fused: {name} {v} must be a power of two >= 16")
    scores = torch.empty(B, G, T, device=q.device, dtype=torch.float16)
    hist = torch.zeros(B, G, 256, device=q.device, dtype=torch.int32) if window is not None else scores
    _sketch_scores[(B * G, triton.cdiv(T, block_t))](
        q.reshape(B * G * n_rep, D).contiguous(), bk.contiguous(), sketch, scores, hist, T,
        T - (window or 0), sketch.stride(1), sketch.stride(2), G, REP=n_rep, D=D, R=R, SKETCH=s,
        BLOCK_T=block_t, WITH_HIST=window is not None)
    return scores if window is None else (scores, hist)


def radix_topk(scores: torch.Tensor, tokens: int, window: int, hist: torch.Tensor | None = None,
               max_chunks: int = 64, min_block: int = 1024, atomic: bool = False,
               offsets_warps: int = 4, _parts: list | None = None) -> torch.Tensor:
    """scores [B, G, T] fp16 -> indices [B, G, tokens + window] (int64): the `tokens` highest
    scores among the tokens older than the window (ties broken by position), then the window
    (`latent_select.select_tokens`'s contract). `hist`: the first pass's histogram as
    `sketch_scores_fused(..., window=window)` returns it (for this window). Each row is cut into
    at most `max_chunks` chunks of a power-of-two number (>= `min_block`) of tokens, one program
    each: the passes run in parallel over the row, not in a loop of one program per row.
    `atomic`: the low-byte histograms by atomics (`_low_hist`). `offsets_warps`: the warps of the
    per-row `_offsets` program (it holds the row's C x 256 low-byte counts). `_parts` (benchmarks): a list the
    three launches are appended to as callables, to time them alone."""
    if scores.dtype != torch.float16:
        raise ValueError(f"radix_topk orders fp16 scores, not {scores.dtype}")
    B, G, T = scores.shape
    older = T - window
    if window < 0 or tokens < 1 or tokens > older:
        raise ValueError(f"tokens={tokens}, window={window}: need 1 <= tokens <= T - window = {older}")
    if hist is not None and (hist.shape != (B, G, 256) or hist.dtype != torch.int32):
        raise ValueError(f"hist must be [B, G, 256] int32 counts, not {tuple(hist.shape)} {hist.dtype}")
    rows, dev = B * G, scores.device
    scores = scores.contiguous()
    block = max(min_block, triton.next_power_of_2(triton.cdiv(older, max_chunks)))
    C = triton.cdiv(older, block)
    if hist is None:
        hist = torch.zeros(B, G, 256, device=dev, dtype=torch.int32)
        _high_hist[(rows, C)](scores, hist, T, older, BLOCK=block)
    low = (torch.zeros if atomic else torch.empty)(rows, C, 256, device=dev, dtype=torch.int32)
    above = torch.empty(rows, C, device=dev, dtype=torch.int32)
    off = torch.empty(rows, C, 2, device=dev, dtype=torch.int32)
    thr = torch.empty(rows, 3, device=dev, dtype=torch.int32)
    idx = torch.empty(B, G, tokens + window, device=dev, dtype=torch.int64)
    hist = hist.contiguous()
    launches = [
        lambda: _low_hist[(rows, C)](scores, hist, low, above, T, older, tokens, C, BLOCK=block, ATOMIC=atomic),
        lambda: _offsets[(rows,)](hist, low, above, off, thr, tokens, C, CP=triton.next_power_of_2(C),
                                      num_warps=offsets_warps),
        lambda: _emit[(rows, C)](scores, off, thr, idx, T, older, tokens, window, C, BLOCK=block, WBLOCK=256)]
    for launch in launches:
        launch()
    if _parts is not None:
        _parts.extend(launches)
    return idx
