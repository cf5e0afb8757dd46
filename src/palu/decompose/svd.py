"""Low-rank factorisation of one projection: plain SVD or truncation-aware (whitened) SVD.

For `y = W x` we return `A` (r x in) and `B` (out x r) with `y ≈ B (A x)`. The whitened variant
(SVD-LLM) minimises ‖(W - BA) X‖ over calibration inputs X through the Gram G = XᵀX = S Sᵀ.
All arithmetic is float64, on the device of its inputs (a GPU's float64 units take a 4096-wide
J-LRD block in a fraction of a second, where a CPU takes minutes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Whitening:
    S: torch.Tensor         # (in, in) with S Sᵀ = G (+ damping)
    S_inv: torch.Tensor
    method: str             # cholesky | cholesky_damped | eigen
    damping: float


def whitening(gram: torch.Tensor, max_tries: int = 6) -> Whitening:
    """Cholesky of the Gram, damped if needed, else an eigen fallback; never raises on PSD input."""
    G = gram.double()
    G = (G + G.T) / 2
    scale = G.diagonal().mean().clamp_min(1e-30).item()
    damping = 0.0
    eye = torch.eye(len(G), dtype=G.dtype, device=G.device)
    for attempt in range(max_tries):
        L, info = torch.linalg.cholesky_ex(G + damping * scale * eye)
        if info.item() == 0:
            S_inv = torch.linalg.solve_triangular(L, eye, upper=False)
            return Whitening(L, S_inv, "cholesky" if damping == 0 else "cholesky_damped", damping)
        damping = 1e-8 * 100 ** attempt
    # Eigen fallback: S = Q Λ^½ is not triangular, but any S with S Sᵀ = G serves.
    evals, Q = torch.linalg.eigh(G)
    floor = max(evals.max().item() * 1e-10, 1e-30)
    evals = evals.clamp_min(floor)
    return Whitening(Q * evals.sqrt(), (Q / evals.sqrt()).T, "eigen", floor / scale)


def canonical_svd(M: torch.Tensor):
    """torch.linalg.svd with each singular pair's sign fixed: the entry of largest magnitude of
    every left vector is positive. LAPACK returns (u, v) or (-u, -v) depending on the CPU and
    library build; the product is the same, but a latent channel's sign changes its token's min
    and max, so per-token quantised latents (and every quantised result) could differ by machine."""
    U, sigma, Vh = torch.linalg.svd(M, full_matrices=False)
    pick = U.abs().argmax(0)
    sign = torch.sign(U[pick, torch.arange(U.shape[1])])
    sign[sign == 0] = 1
    return U * sign, sigma, Vh * sign[:, None]


def factorize(W: torch.Tensor, rank: int, white: Whitening | None = None,
              out_metric: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-`rank` factors (A, B) of W (out x in); whitened when `white` is given. `out_metric`
    M (out x out, SPD) weighs the error on the output side too: the factors then minimise
    ‖L (W - BA) S‖ with LᵀL = M (decompose/metrics.py); None is the identity."""
    out_dim, in_dim = W.shape
    if not 0 < rank <= min(out_dim, in_dim):
        raise ValueError(f"rank={rank} outside 1..{min(out_dim, in_dim)} for a {out_dim}x{in_dim} matrix")
    W = W.double()
    target = W @ white.S if white is not None else W
    if out_metric is not None:
        L = torch.linalg.cholesky(out_metric.double().to(W.device)).T          # upper: LᵀL = M
        target = L @ target
    U, sigma, Vh = canonical_svd(target)
    root = sigma[:rank].sqrt()
    B = U[:, :rank] * root                          # (out, r)
    A = root[:, None] * Vh[:rank]                   # (r, in)
    if out_metric is not None:
        B = torch.linalg.solve_triangular(L, B, upper=True)
    if white is not None:
        A = A @ white.S_inv
    return A, B
