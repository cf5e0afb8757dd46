"""One decode step of latent-space selection (issue 36 item 2, issue 39 item 3) in torch ops, for
M-LRD latents (one key / value latent per KV head): the GPU decode path the latency benchmark
times, and the reference a fused kernel would be checked against.

Per KV head: fold its query heads into the key factor, `q_lat = Σ_i B_kᵀ q_i` (RoPE ignored
for scoring, as `palu.attention.latent_selection` does), score every older token on the first
`sketch` latent channels, keep the best `tokens` plus the newest `window`, rebuild only those
keys (`h_k B_kᵀ`, RoPE at their positions) and attend exactly; the output stays in latent-value
space (B_v is fused into o_proj), as `latent_decode_reference`'s.

`topk="chunked"` takes the top `tokens` of each `chunk`-token slice first and then the top
`tokens` of those candidates: the same set (a token of the global top-k is in its slice's
top-k), but a (heads x slices) first pass fills the GPU where one row per head does not.
`topk="radix"` scores and selects with the two Triton kernels of `select_topk` (fp16 latents: the
fold and the sketch scores in one launch, a radix select of the k-th largest fp16 score in another).
"""
from __future__ import annotations

import torch

from .reference import rope_keys


def fold_query(q: torch.Tensor, bk: torch.Tensor, n_rep: int) -> torch.Tensor:
    """q [B, H, D] (before RoPE), bk [KVH, D, R] -> the summed folded query [B, KVH, R] (fp32)."""
    B, H, D = q.shape
    per_head = torch.einsum("bhd,hdr->bhr", q.float(), bk.float().repeat_interleave(n_rep, 0))
    return per_head.view(B, H // n_rep, n_rep, -1).sum(2)


def select_tokens(scores: torch.Tensor, tokens: int, window: int, topk: str = "plain",
                  chunk: int = 8192) -> torch.Tensor:
    """scores [B, KVH, T] -> token indices [B, KVH, tokens + window] (older chosen, then recent)."""
    B, G, T = scores.shape
    older = T - window
    if tokens > older:
        raise ValueError(f"tokens={tokens} exceeds the {older} tokens older than the window")
    s = scores[..., :older]
    if topk == "chunked" and older % chunk == 0 and older // chunk > 1 and tokens <= chunk:
        vals, idx = s.reshape(B, G, older // chunk, chunk).topk(tokens, -1, sorted=False)
        idx = idx + torch.arange(0, older, chunk, device=s.device)[:, None]
        pick = vals.reshape(B, G, -1).topk(tokens, -1, sorted=False).indices
        top = idx.reshape(B, G, -1).gather(-1, pick)
    elif topk == "radix":
        from .select_topk import radix_topk
        return radix_topk(scores, tokens, window)
    elif topk in ("plain", "chunked"):
        top = s.topk(tokens, -1, sorted=False).indices
    else:
        raise ValueError(f"topk={topk!r} is not 'plain', 'chunked' or 'radix'")
    recent = torch.arange(older, T, device=s.device).expand(B, G, window)
    return torch.cat([top, recent], -1)


def sketch_scores(q_lat: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """q_lat [B, KVH, R] fp32, sketch [B, KVH, T, s] (the first s latent channels) -> [B, KVH, T]."""
    s = sketch.shape[-1]
    return (sketch @ q_lat[..., :s, None].to(sketch.dtype)).squeeze(-1)


def attend_selected(q_rot: torch.Tensor, hk: torch.Tensor, hv: torch.Tensor, bk: torch.Tensor,
                    idx: torch.Tensor, inv_freq: torch.Tensor, scale: float, n_rep: int) -> torch.Tensor:
    """Exact attention over the chosen tokens: q_rot [B, H, D] (rotated at the query's position),
    idx [B, KVH, n] -> z [B, H, Rv] (fp32)."""
    B, G, n = idx.shape
    hk_sel = hk.gather(2, idx[..., None].expand(-1, -1, -1, hk.shape[-1]))
    hv_sel = hv.gather(2, idx[..., None].expand(-1, -1, -1, hv.shape[-1]))
    k = hk_sel @ bk.transpose(-1, -2).to(hk_sel.dtype)                              # [B, G, n, D]
    ang = idx.float()[..., None] * inv_freq.float()                                    # [B, G, n, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    k1, k2 = k.float().chunk(2, -1)
    k = k.float() * cos + torch.cat([-k2, k1], -1) * sin
    qg = q_rot.float().view(B, G, n_rep, -1)
    p = (torch.einsum("bgid,bgnd->bgin", qg, k) * scale).softmax(-1)
    return torch.einsum("bgin,bgnr->bgir", p, hv_sel.float()).reshape(B, G * n_rep, -1)


def rope_table(length: int, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, D] at positions 0..length-1 (a cache's, built once, not per step)."""
    ang = torch.arange(length, device=inv_freq.device).float()[:, None] * inv_freq.float()
    return torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)


def attend_selected_sdpa(q_rot, hk, hv, bk, idx, table, scale: float, n_rep: int) -> torch.Tensor:
    """`attend_selected` in the latents' dtype with fewer kernels: the chosen rows gathered,
    keys rebuilt by one batched matmul, RoPE from the cache's cos / sin table at their
    positions, then torch SDPA (values of the latent rank). -> z [B, H, Rv]."""
    B, G, n = idx.shape
    hk_sel = hk.gather(2, idx[..., None].expand(-1, -1, -1, hk.shape[-1]))
    hv_sel = hv.gather(2, idx[..., None].expand(-1, -1, -1, hv.shape[-1]))
    k = hk_sel @ bk.transpose(-1, -2).to(hk_sel.dtype)                              # [B, G, n, D]
    cos, sin = table[0][idx], table[1][idx]                                           # [B, G, n, D]
    k1, k2 = k.chunk(2, -1)
    k = k * cos + torch.cat([-k2, k1], -1) * sin
    z = torch.nn.functional.scaled_dot_product_attention(
        q_rot.to(k.dtype)[:, :, None], k, hv_sel, scale=scale, enable_gqa=n_rep > 1)
    return z[:, :, 0].float()


def selection_decode(q, q_rot, hk, hv, bk, inv_freq, *, tokens: int, window: int, sketch: int,
                     scale: float, n_rep: int, topk: str = "plain", sketch_latents=None, table=None,
                     fused: bool = False, splits: int | None = None, attend_options: dict | None = None):
    """One step: q / q_rot [B, H, D] (before / after RoPE), hk [B, KVH, T, Rk], hv [B, KVH, T, Rv],
    bk [KVH, D, Rk]. `sketch_latents` is a separately stored [B, KVH, T, sketch] copy (contiguous);
    None reads the first `sketch` channels of `hk` in place. `table` (`rope_table`): attend through
    `attend_selected_sdpa` instead of the float32 `attend_selected`; `fused`: through the Triton
    kernel `select_attend.select_attend` (`splits` programs per KV head; None: ~3 waves of programs;
    `attend_options`: its block_n / num_warps / early_v)."""
    sk = sketch_latents if sketch_latents is not None else hk[..., :sketch]
    if topk == "radix":     # fold + sketch scores + the radix select's first pass in one Triton launch
        from .select_topk import radix_topk, sketch_scores_fused
        if tokens > hk.shape[2] - window:
            raise ValueError(f"tokens={tokens} exceeds the {hk.shape[2] - window} tokens older than the window")
        scores, hist = sketch_scores_fused(q, bk, sk, n_rep, window=window)
        idx = radix_topk(scores, tokens, window, hist=hist)
    else:
        idx = select_tokens(sketch_scores(fold_query(q, bk, n_rep), sk), tokens, window, topk)
    if fused:               # one Triton kernel (palu_kernels/select_attend.py)
        from .select_attend import select_attend
        return select_attend(q_rot, hk, hv, bk, idx, inv_freq, scale, n_rep, splits=splits,
                             **(attend_options or {}))
    if table is not None:   # the cache's cos / sin table: the fewer-kernel path
        return attend_selected_sdpa(q_rot, hk, hv, bk, idx, table, scale, n_rep)
    return attend_selected(q_rot, hk, hv, bk, idx, inv_freq, scale, n_rep)


def rotate_query(q: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] rotated at `position` (the decode step's), fp32."""
    pos = torch.full((q.shape[0], 1), position, device=q.device)
    return rope_keys(q[:, :, None], pos, inv_freq)[:, :, 0]
