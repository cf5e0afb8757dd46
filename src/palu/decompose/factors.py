"""Factorise every layer's K and V projections group by group under a rank allocation."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.adapters import adapter_for, geometry_of, partial_rotary
from ..progress import steps
from .ranks import check_allocation, ranks_table
from .rotation import ROTATIONS, rotate_layer
from .metrics import block_metric, key_metrics, value_metrics
from .svd import factorize, whitening

# whitened: SVD-LLM's input-whitened SVD; plain: the SVD of W; attention: whitened and weighed on
# the output side by what attention does with each block (decompose/metrics.py)
DECOMPOSITIONS = ("whitened", "plain", "attention")
NEEDS_GRAM = ("whitened", "attention")


def stored_dtype(model) -> torch.dtype:
    """The dtype factors are kept and saved in: float32, or float64 for a float64 model (its
    exactness tests). Factors are computed in float64; `decompose_model` returns them already
    rounded, so the in-memory model and a saved-and-reloaded one are the same bit for bit
    (fusing float64 factors in memory once differed by 6e-5 in the logits from a reload)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


@dataclass
class LayerFactors:
    """Per group g: A[g] (r_g, hidden) makes the latent, B[g] (group_size*head_dim, r_g) rebuilds."""
    A_k: list[torch.Tensor] = field(default_factory=list)
    B_k: list[torch.Tensor] = field(default_factory=list)
    A_v: list[torch.Tensor] = field(default_factory=list)
    B_v: list[torch.Tensor] = field(default_factory=list)

    def to(self, dtype: torch.dtype) -> "LayerFactors":
        return LayerFactors(*([t.to(dtype) for t in getattr(self, name)]
                              for name in ("A_k", "B_k", "A_v", "B_v")))

    @property
    def ranks_k(self) -> list[int]:
        return [a.shape[0] for a in self.A_k]

    @property
    def ranks_v(self) -> list[int]:
        return [a.shape[0] for a in self.A_v]


def _output_error(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gram: torch.Tensor) -> float:
    """Relative error of the block's outputs on the calibration inputs: ‖E X‖ / ‖W X‖ via the Gram."""
    E = W - B @ A
    num = torch.einsum("oi,ij,oj->", E, gram, E)
    den = torch.einsum("oi,ij,oj->", W, gram, W)
    return float((num / den).clamp_min(0).sqrt())


def check_attention_metrics(config) -> None:
    """The attention-weighted objective models queries as `W_q x` rotated over whole heads: a
    family that normalises q/k first, or rotates part of each head, is refused by name."""
    adapter = adapter_for(config)
    if adapter.qk_norm is not None:
        raise ValueError(f"decomposition='attention' is not supported for {config.model_type!r}: its "
                         f"q/k norm ({adapter.qk_norm}) makes the queries' second moment other than "
                         "W_q G W_qᵀ; use decomposition='whitened'")
    if partial_rotary(config) != 1.0:
        raise ValueError(f"decomposition='attention' is not supported with partial_rotary_factor="
                         f"{partial_rotary(config)} (its key metric averages RoPE over whole heads); "
                         "use decomposition='whitened'")


@torch.no_grad()
def decompose_model(model, allocation: dict, grams: torch.Tensor | None = None,
                    method: str = "whitened", progress: bool = True, rotation: str = "none",
                    rotation_seed: int = 0) -> tuple[list[LayerFactors], dict]:
    """Factors for every layer (in `stored_dtype(model)`) plus a report (whitening method and
    output error per block, computed in float64; the rotation's construction per block).
    `rotation`: none | hadamard | random_orthogonal, fused into the factors (decompose/rotation.py)."""
    if method not in DECOMPOSITIONS:
        raise ValueError(f"decomposition {method!r} is not one of {DECOMPOSITIONS}")
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is not one of {list(ROTATIONS)}")
    if method in NEEDS_GRAM and grams is None:
        raise ValueError(f"{method} decomposition needs calibration Gram matrices")
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    if method == "attention":
        check_attention_metrics(model.config)
    check_allocation(allocation, geom)
    s = allocation["group_size"]
    n_groups = geom.check_group_size(s)
    ranks = ranks_table(allocation)
    rows = s * geom.head_dim
    factors, report = [], {"whitening": [], "output_error": []}
    used: dict[str, int] = {}
    dtype = stored_dtype(model)
    layers = adapter.layers(model)
    device = next(model.parameters()).device   # float64 arithmetic there; factors kept on the CPU
    for l, layer in enumerate(steps(layers, "decompose", "layers", progress)):
        q, k, v, o = adapter.projections(adapter.attention(layer))
        gram = None if grams is None else grams[l].to(device)
        white = whitening(gram) if method in NEEDS_GRAM else None
        metrics = None
        if method == "attention":
            metrics = {"k": key_metrics(q.weight.cpu(), grams[l], geom.num_kv_heads, geom.head_dim,
                                        geom.n_rep, geom.rope),
                       "v": value_metrics(o.weight.cpu(), geom.num_kv_heads, geom.head_dim, geom.n_rep)}
        report["whitening"].append({"layer": l, "method": white.method if white else "none",
                                    "damping": white.damping if white else 0.0})
        lf = LayerFactors()
        for kind, proj in (("k", k), ("v", v)):
            W = proj.weight.double()
            for g in range(n_groups):
                Wg = W[g * rows:(g + 1) * rows]
                M = None if metrics is None else block_metric(metrics[kind], g, s)
                A, B = factorize(Wg, ranks[(l, kind, g)], white, M)
                getattr(lf, f"A_{kind}").append(A.cpu())
                getattr(lf, f"B_{kind}").append(B.cpu())
                if grams is not None:
                    report["output_error"].append({"layer": l, "kind": kind, "group": g,
                                                   "rel_error": _output_error(Wg, A, B, gram)})
        for how in rotate_layer(lf, l, rotation, rotation_seed):
            used[how] = used.get(how, 0) + 1
        factors.append(lf.to(dtype))
    report["rotation"] = {"kind": rotation, "seed": rotation_seed, "blocks": used}
    return factors, report
