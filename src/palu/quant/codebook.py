"""Scalar codebooks: Lloyd-Max for a known density (TurboQuant) and weighted 1-D k-means on
samples (KVQuant's non-uniform datatypes), and nearest-entry encoding."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sphere_coordinate_codebook(d: int, bits: int, iterations: int = 300) -> torch.Tensor:
    """Lloyd-Max levels (2^bits, float64, ascending) for one coordinate of a uniformly random
    unit vector in R^d, whose density is ∝ (1 - x²)^((d - 3) / 2) on [-1, 1] (≈ N(0, 1/d))."""
    x = torch.linspace(-1, 1, 200_001, dtype=torch.float64)[1:-1]
    w = (1 - x * x) ** ((d - 3) / 2)
    return lloyd_max(x, w, 2 ** bits, iterations)


def lloyd_max(x: torch.Tensor, w: torch.Tensor, levels: int, iterations: int = 100) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd's algorithm) of points x with weights w: `levels` centroids,
    ascending. Starts from weighted quantiles, so it is deterministic. Runs on x's device.

    The points are sorted once, so each cell is a contiguous run of them and its mass and moment
    are differences of two prefix sums: an iteration costs O(levels log n), not O(n) (KVQuant's
    codebooks at Llama-2-7B shapes fit 33M points per layer; the per-point pass took minutes)."""
    x, w = x.double().flatten(), w.double().flatten().clamp_min(0)
    order = torch.argsort(x)
    x, w = x[order], w[order]
    cdf = torch.cumsum(w, 0) / w.sum()
    targets = (torch.arange(levels, dtype=torch.float64, device=x.device) + 0.5) / levels
    c = x[torch.searchsorted(cdf, targets).clamp_max(x.numel() - 1)]
    zero = x.new_zeros(1)
    mass_before = torch.cat([zero, torch.cumsum(w, 0)])          # [i]: weight of the i smallest
    moment_before = torch.cat([zero, torch.cumsum(w * x, 0)])
    ends = torch.tensor([x.numel()], device=x.device)
    for _ in range(iterations):
        edges = (c[1:] + c[:-1]) / 2
        # cell j holds edges[j-1] < x <= edges[j]: the points up to searchsorted(x, edges[j], right)
        bounds = torch.cat([ends * 0, torch.searchsorted(x, edges, right=True), ends])
        mass = mass_before[bounds[1:]] - mass_before[bounds[:-1]]
        moment = moment_before[bounds[1:]] - moment_before[bounds[:-1]]
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), c)
        if torch.allclose(new, c, rtol=0, atol=1e-12):
            c = new
            break
        c = new
    return torch.sort(c).values


def nearest(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest entry of an ascending `codebook` for each element of x."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = codebook.to(x.device, work)
    edges = (c[1:] + c[:-1]) / 2
    return torch.searchsorted(edges, x.to(work).contiguous()).to(torch.uint8)
