"""Pure-torch reference for one decode step of attention over Palu latents (float32 math)."""
from __future__ import annotations

import torch

from palu.quant.packed import QuantLatent, dequantize_latent


def rope_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """k [B, h, T, D], positions [B, T] -> RoPE(k) in the half-split convention, float32."""
    ang = positions.float()[..., None] * inv_freq.float()               # (B, T, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    k1, k2 = k.float().chunk(2, -1)
    return k.float() * cos + torch.cat([-k2, k1], -1) * sin


def latent_decode_reference(q, hk, hv, *, scale: float, n_rep: int, group_size: int,
                            bk=None, positions=None, position_offset=None, inv_freq=None,
                            lengths=None) -> torch.Tensor:
    """Attention output in latent-value space, z [B, H, Rv] (float32).

    RoPE mode (bk given): q [B, H, D] already rotated; keys = RoPE(h_k B_kᵀ). Non-RoPE mode:
    q [B, H, Rk] is the fused query B_kᵀ q. hk / hv are [B, G, T, R] or QuantLatent.
    `lengths` [B] masks the tail of each sequence (batch with different lengths).
    """
    hk = dequantize_latent(hk, torch.float32) if isinstance(hk, QuantLatent) else hk.float()
    hv = dequantize_latent(hv, torch.float32) if isinstance(hv, QuantLatent) else hv.float()
    B, G, T, _ = hk.shape
    H = q.shape[1]
    if bk is not None and positions is None:
        off = position_offset if position_offset is not None else torch.zeros(B, device=hk.device)
        positions = off.long()[:, None] + torch.arange(T, device=hk.device)[None]
    heads_per_group = H // G
    scores = []
    for g in range(G):
        qg = q[:, g * heads_per_group:(g + 1) * heads_per_group].float()         # (B, hg, *)
        if bk is not None:
            D = q.shape[-1]
            k = (hk[:, g] @ bk[g].float().T).view(B, T, group_size, D).transpose(1, 2)  # (B, s, T, D)
            k = rope_keys(k, positions, inv_freq).repeat_interleave(n_rep, 1)   # (B, hg, T, D)
            scores.append(torch.einsum("bhd,bhtd->bht", qg, k))
        else:
            scores.append(torch.einsum("bhr,btr->bht", qg, hk[:, g]))
    s = torch.cat(scores, 1) * scale                                             # (B, H, T)
    if lengths is not None:
        s = s.masked_fill(torch.arange(T, device=s.device)[None, None] >= lengths[:, None, None], float("-inf"))
    p = s.softmax(-1)
    z = [torch.einsum("bht,btr->bhr", p[:, g * heads_per_group:(g + 1) * heads_per_group], hv[:, g])
         for g in range(G)]
    return torch.cat(z, 1)
