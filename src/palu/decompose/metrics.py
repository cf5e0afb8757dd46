"""Output-side metrics of the `attention` decomposition: each block is fitted for what attention
does with it, not for the K / V projection output itself.

The whitened SVD minimises ||(W - BA) X|| (input side: the calibration Gram). Here the error is
also weighed on the output side by an SPD metric M of the block's rows, ||L (W - BA) X|| with
LᵀL = M, which the SVD of L W S solves exactly (`svd.factorize(..., out_metric=M)`):

- values: the attention output o = sum_h W_o,h P_h V_j(h) is linear in V, so a value error e of KV
  head j reaches the residual stream as W_o,h e for each of its query heads h. We take the heads'
  attention patterns P_h as unrelated (no cross terms), so M_j = sum_h W_o,hᵀ W_o,h;
- keys: a key error e changes the score of query q by qᵀ R e (R: the relative RoPE rotation), so
  M_j = sum_h E[R qᵀ q R] over the calibration queries of j's heads. q = W_q,h x on the same
  inputs as the keys, so E[q qᵀ] = W_q,h G W_q,hᵀ / n comes from the layer's Gram (the query
  bias, where a family has one, is left out). With RoPE we average over the relative rotation:
  the rotate-half pairs (i, i + d/2) turn at different frequencies, so the average keeps, per
  pair, its mean query energy on both dims and drops everything else (M_j diagonal); without
  RoPE M_j is the full query second moment.
Blocks of several KV heads (G-LRD, J-LRD) take the block-diagonal of their heads' metrics.
With M = identity this is the whitened SVD; every metric is damped by 1e-6 of its mean diagonal
so its Cholesky factor exists.
"""
from __future__ import annotations

import torch

DAMPING = 1e-6


def _damped(M: torch.Tensor) -> torch.Tensor:
    M = (M + M.T) / 2
    return M + DAMPING * M.diagonal().mean().clamp_min(1e-30) * torch.eye(len(M), dtype=M.dtype)


def value_metrics(o_weight: torch.Tensor, num_kv_heads: int, head_dim: int, n_rep: int) -> list[torch.Tensor]:
    """(head_dim, head_dim) per KV head: sum over its query heads of W_o,hᵀ W_o,h."""
    Wo = o_weight.double()
    out = []
    for j in range(num_kv_heads):
        M = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        for h in range(j * n_rep, (j + 1) * n_rep):
            cols = Wo[:, h * head_dim:(h + 1) * head_dim]
            M += cols.T @ cols
        out.append(M)
    return out


def key_metrics(q_weight: torch.Tensor, gram: torch.Tensor, num_kv_heads: int, head_dim: int,
                n_rep: int, rope: bool) -> list[torch.Tensor]:
    """(head_dim, head_dim) per KV head: its query heads' second moment on the calibration
    inputs, averaged over RoPE's relative rotations when the model has RoPE."""
    Wq, G = q_weight.double(), gram.double()
    half = head_dim // 2
    out = []
    for j in range(num_kv_heads):
        M = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        for h in range(j * n_rep, (j + 1) * n_rep):
            rows = Wq[h * head_dim:(h + 1) * head_dim]
            M += rows @ G @ rows.T
        if rope:
            energy = M.diagonal()
            pair = (energy[:half] + energy[half:]) / 2
            M = torch.diag(torch.cat([pair, pair]))
        out.append(M)
    return out


def block_metric(per_head: list[torch.Tensor], group: int, group_size: int) -> torch.Tensor:
    return _damped(torch.block_diag(*per_head[group * group_size:(group + 1) * group_size]))
