"""Orthogonal rotations of the latent space, fused into the factors (Palu §3.4, Table 7).

For a group's factors `A` (r, in) and `B` (out, r) and an orthogonal R (r, r):
    A' = Rᵀ A,  B' = B R    so  B' A' = B A   (the model is unchanged without quantisation),
while the latents h' = Rᵀ h spread an outlier channel over all r coordinates, which is what a
per-token quantiser needs. The fused `o_proj` / `q_proj` are built from the rotated `B` at install
time, so they follow without extra work.

`hadamard`: a normalised Hadamard matrix of order r when one is known here: Sylvester 2^k, Paley
(q + 1 for a prime q ≡ 3 mod 4: 4, 8, 12, 20, 24, 32, 44, 48, 60, ...) and Kronecker products of
the two (r = 96 = 12 x 8). Any other r (ranks are multiples of `rank_multiple`, not powers of two)
takes a seeded random orthogonal matrix, and the construction used is recorded per block:
a rank never makes the rotation fail. `random_orthogonal`: always the seeded random one (QR of a
Gaussian, signs fixed so it is Haar-distributed).
"""
from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard", "random_orthogonal")


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _paley(n: int) -> torch.Tensor:
    """Paley construction I: a Hadamard matrix of order n = q + 1, q prime, q ≡ 3 (mod 4)."""
    q = n - 1
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    Q = chi[(idx[None, :] - idx[:, None]) % q]            # Jacobsthal matrix, Q[i, j] = χ(j - i)
    S = torch.zeros(n, n, dtype=torch.float64)
    S[0, 1:], S[1:, 0], S[1:, 1:] = 1.0, -1.0, Q
    return S + torch.eye(n, dtype=torch.float64)           # skew S with S Sᵀ = q I  ->  H = S + I


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> torch.Tensor | None:
    """An (unnormalised, ±1) Hadamard matrix of order n, or None if none is known here."""
    power = 1
    while n % (2 * power) == 0:
        power *= 2
    # n = m * power with m odd: try m' = m * 2^j (Paley order) times a Sylvester 2^(k - j)
    m = n // power
    j_power = 1
    while j_power <= power:
        order = m * j_power
        if order == 1:
            return _sylvester(n)
        if order % 4 == 0 and _is_prime(order - 1) and (order - 1) % 4 == 3:
            return torch.kron(_paley(order), _sylvester(n // order))
        j_power *= 2
    return None


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, R = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return Q * torch.sign(torch.diagonal(R))[None, :]


def rotation_matrix(kind: str, n: int, seed: int = 0) -> tuple[torch.Tensor | None, str]:
    """(R (n, n) float64 orthogonal or None for `none`, the construction used)."""
    if kind not in ROTATIONS:
        raise ValueError(f"rotation={kind!r} is not one of {list(ROTATIONS)}")
    if kind == "none":
        return None, "none"
    if kind == "hadamard":
        H = hadamard(n)
        if H is not None:
            return H / n ** 0.5, "hadamard"
    return random_orthogonal(n, seed), "random_orthogonal"


def block_seed(seed: int, layer: int, kind: str, group: int) -> int:
    """A distinct, reproducible seed per factorised block."""
    return ((seed * 1_000_003 + layer) * 2 + (kind == "v")) * 4099 + group


def rotate_layer(lf, layer: int, kind: str, seed: int = 0) -> list[str]:
    """Rotate every block of one layer's factors in place (float64); returns each block's
    construction, in (k groups..., v groups...) order."""
    used = []
    for name in ("k", "v"):
        A_list, B_list = getattr(lf, f"A_{name}"), getattr(lf, f"B_{name}")
        for g, (A, B) in enumerate(zip(A_list, B_list)):
            R, how = rotation_matrix(kind, A.shape[0], block_seed(seed, layer, name, g))
            used.append(how)
            if R is not None:
                A_list[g], B_list[g] = R.T.to(A) @ A, B @ R.to(B)
    return used
