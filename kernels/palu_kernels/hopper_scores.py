"""RoPE scores over M-LRD latents by a hand-written warp-specialised Hopper kernel (`hopper/rope_scores.cu`:
TMA producer warp, mma.sync consumer warps, cos/sin epilogue overlapped with the next slot's loads).

Serves RoPE layers with one latent of rank 64 per KV head (M-LRD at 50 % of head_dim 128), fp16 latents,
contiguous positions, MHA or GQA with 4 query heads per KV head (each query head folded into B_k, so
no key is formed). Built on first use with `torch.utils.cpp_extension` for sm_90a and cached in torch's
extension folder; where it cannot build or the GPU is not a Hopper, `unfit` says why and `palu_decode`
keeps the Triton scores kernel (`_scores_qproj`, the CPU-tested reference). `fold_query` and
`folded_scores_reference` are plain torch: the layout the kernel reads and the scores it must write,
tested on CPU against keys rebuilt and rotated in float64.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "hopper" / "rope_scores.cu"
RANK, HALF, TILE = 64, 64, 64
# compiled (query heads per KV head, frequencies per consumer warp, ring slots, reduction): PALU_VARIANTS in
# the .cu; reduction 0 adds a head's warps through shared memory, 1 by atomic adds into zeroed scores
VARIANTS = {(1, 32, 4, 0), (1, 16, 2, 0), (1, 16, 4, 0), (1, 16, 6, 0), (4, 16, 4, 0), (4, 32, 4, 0),
            (1, 16, 4, 1), (4, 16, 4, 1)}
PER_WARP, STAGES, REDUCE = 16, 4, 0   # the default variant (benchmarks/NOTES.md, issue 39 h2-h4)
# The fold's rank columns in the order the kernel's mma K positions take them: K position kk of k-step
# ks is physical rank 16 c + 4 ks + 2 (kk >> 3) + (kk & 1), c = (kk & 7) >> 1, so the thread of lane
# column c reads the contiguous physical ranks [16 c, 16 c + 16) of a token (two 16-byte loads).
RANK_ORDER = [16 * ((kk & 7) >> 1) + 4 * ks + 2 * (kk >> 3) + (kk & 1) for ks in range(4) for kk in range(16)]


def fold_query(q: torch.Tensor, bk: torch.Tensor, n_rep: int, per_warp: int = PER_WARP) -> torch.Tensor:
    """The folded query in the kernel's layout, fp16 [B, H, 64 / w, 2 w, 64] (w = per_warp): for query
    head u (KV head u // n_rep) and warp p, rows [0, w) are a_f, rows [w, 2w) c_f for f = w p + row % w,
    rank columns in RANK_ORDER, with
    a_f = q1_f B1_f + q2_f B2_f and c_f = q2_f B1_f - q1_f B2_f (fp16 inputs, float32 sums, one fp16
    rounding: as `_scores_qproj` folds)."""
    B, H, D = q.shape
    qf = q.to(torch.float16).float()
    bkh = bk.to(torch.float16).float()[torch.arange(H, device=q.device) // n_rep]     # [H, D, R]
    q1, q2, b1, b2 = qf[..., :HALF, None], qf[..., HALF:, None], bkh[:, :HALF], bkh[:, HALF:]
    a, c = q1 * b1 + q2 * b2, q2 * b1 - q1 * b2                                         # [B, H, 64, R]
    w = per_warp
    parts = [torch.cat([a[:, :, p * w:(p + 1) * w], c[:, :, p * w:(p + 1) * w]], 2) for p in range(HALF // w)]
    return _kernel_rank_order(torch.stack(parts, 2).to(torch.float16)).contiguous()


def _kernel_rank_order(x: torch.Tensor) -> torch.Tensor:
    """x[..., RANK_ORDER] as a view (no index tensor: safe inside CUDA-graph capture): physical
    rank 16 c + 4 ks + 2 hi + lo goes to position 16 ks + 8 hi + 2 c + lo."""
    return x.unflatten(-1, (4, 4, 2, 2)).permute(*range(x.dim() - 1), -3, -2, -4, -1).flatten(-4)


def folded_scores_reference(fold: torch.Tensor, hk: torch.Tensor, pos0: torch.Tensor,
                            inv_freq: torch.Tensor) -> torch.Tensor:
    """Float64 scores [B, H, T] (unscaled) from a `fold_query` buffer: sum_f cos (a_f . h) + sin (c_f . h)
    at angle (pos0 + t) th_f, the sum the kernel computes."""
    B, H = fold.shape[:2]
    G, T = hk.shape[1], hk.shape[2]
    f, w = fold.double(), fold.shape[3] // 2
    a = torch.cat([f[:, :, p, :w] for p in range(f.shape[2])], 2)                      # [B, H, 64, R]
    c = torch.cat([f[:, :, p, w:] for p in range(f.shape[2])], 2)
    h = hk.double()[:, torch.arange(H, device=hk.device) // (H // G)]  # [B, H, T, R]
    h = _kernel_rank_order(h)
    ang = (pos0.double()[:, None] + torch.arange(T, device=hk.device, dtype=torch.float64)[None])[..., None] \
        * inv_freq.double()                                                            # [B, T, 64]
    ua, uc = torch.einsum("bhfr,bhtr->bhtf", a, h), torch.einsum("bhfr,bhtr->bhtf", c, h)
    return (ang.cos()[:, None] * ua + ang.sin()[:, None] * uc).sum(-1)


@functools.lru_cache(maxsize=None)
def _module():
    """The compiled extension, or the reason it is not there (a string)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability()} is not Hopper (9, 0)"
    try:
        from torch.utils.cpp_extension import load
        return load(name="palu_hopper_rope_scores", sources=[str(SOURCE)],
                    extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo"],
                    verbose=False)
    except Exception as err:   # no nvcc, a toolkit too old for sm_90a, ...: the Triton kernel serves
        return f"build failed: {type(err).__name__}: {str(err)[-500:]}"


def unfit(q, hk, bk, *, n_rep: int, group_size: int, contiguous_positions: bool,
          stages: int = STAGES, per_warp: int = PER_WARP, reduce: int = REDUCE) -> str | None:
    """Why the Hopper kernel cannot serve this step (None: it can)."""
    if bk is None:
        return "not a RoPE layer"
    if not isinstance(hk, torch.Tensor) or hk.dtype != torch.float16:
        return "latents are not fp16"
    if group_size != 1 or hk.shape[-1] != RANK or q.shape[-1] != 2 * HALF:
        return f"needs M-LRD rank {RANK}, head_dim {2 * HALF} (group {group_size}, rank {hk.shape[-1]}, " \
               f"head_dim {q.shape[-1]})"
    if (n_rep, per_warp, stages, reduce) not in VARIANTS:
        return (f"no compiled variant for {n_rep} query heads per KV head, {per_warp} frequencies per warp, "
                f"{stages} stages, reduction {reduce} (compiled: {sorted(VARIANTS)})")
    if not contiguous_positions:
        return "positions are not contiguous"
    if hk.stride(-1) != 1 or hk.stride(2) % 8 or hk.data_ptr() % 16:
        return "latent rows are not 16-byte aligned with unit-stride rank"
    mod = _module()
    return mod if isinstance(mod, str) else None


def rope_scores(q, hk, bk, pos0, inv_freq, lengths, qk_scale: float, n_rep: int, *, group_size: int = 1,
                contiguous_positions: bool = True, stages: int = STAGES, per_warp: int = PER_WARP,
                reduce: int = REDUCE, splits: int | None = None) -> torch.Tensor:
    """Scores [B, H, T] float32 (x qk_scale; written for t < lengths[b]) of one decode step, as
    `_scores_qproj` writes them. `splits=None`: one wave (as many CTAs as the GPU holds at once)."""
    why = unfit(q, hk, bk, n_rep=n_rep, group_size=group_size, contiguous_positions=contiguous_positions,
                stages=stages, per_warp=per_warp, reduce=reduce)
    if why:
        raise ValueError(f"the Hopper RoPE scores kernel cannot serve this step: {why}")
    mod = _module()
    B, G, T, _ = hk.shape
    H = q.shape[1]
    if splits is None:
        sms = torch.cuda.get_device_properties(hk.device).multi_processor_count
        splits = max(1, min(math.ceil(T / TILE), mod.resident_ctas(n_rep, per_warp, stages, reduce) * sms // (B * G)))
    per_split = math.ceil(math.ceil(T / splits) / TILE) * TILE
    splits = math.ceil(T / per_split)
    S = (torch.zeros if reduce else torch.empty)(B, H, T, device=hk.device, dtype=torch.float32)
    mod.rope_scores(hk, fold_query(q, bk, n_rep, per_warp), pos0.to(torch.int32).contiguous(),
                    inv_freq.float().contiguous(), S, lengths.to(torch.int32).contiguous(), n_rep, per_warp,
                    stages, reduce, splits, per_split, float(qk_scale))
    return S
