"""The one path from statistics to ranks, what `palu.compress` and the pipeline's `ranks` step both
call: the allocator's Fisher statistic picked from the statistics, then its split of the budget
(`ranks.allocate`) or, for an allocator that probes, its allocation scored with the model on probe
windows (`probe.allocate_probed`, over the calibration Gram's whitened factors)."""
from __future__ import annotations

import logging
import time

import torch

from ..models.adapters import Geometry
from .ranks import allocate, get_allocator

log = logging.getLogger(__name__)


def allocate_ranks(method: str, kept_ratio: float, group_size: int, multiple: int, geom: Geometry, *,
                   stats: dict | None = None, model=None, grams: torch.Tensor | None = None,
                   probe_windows: torch.Tensor | None = None, key_weight: float | str = "auto",
                   source: str = "the Fisher statistics",
                   advice: str = "collect them again (palu.calib.fisher.collect_fisher)") -> dict:
    """Ranks of `method` for a kept ratio. `stats`: every Fisher statistic
    (`calib.fisher.collect_fisher`, of the model in the head order the factors will use);
    `model`, `grams` and `probe_windows` (calibration text apart from the Gram's windows, though
    in the pipeline not disjoint from them: results/checks/probe-window-overlap.json): for
    allocators that probe. `source` names the statistics in errors (a file path, say), `advice` says how to renew them."""
    allocator = get_allocator(method)
    fisher = None
    if allocator.statistic is not None:
        check_statistics(method, stats, source, advice)
        fisher = stats if allocator.statistic == "all" else stats[allocator.statistic]
    if not allocator.probes:
        return allocate(geom, kept_ratio, group_size, method, multiple, fisher)
    if model is None or grams is None:
        raise ValueError(f"rank method {method!r} scores allocations with the model: it needs the "
                         "model and the calibration Gram (its whitened factors)")
    if probe_windows is None and (method != "error_aware" or key_weight == "auto"):
        raise ValueError(f"{method if method != 'error_aware' else 'key_weight=auto'} probes on "
                         "probe windows (text the Gram was not built from): pass probe_windows= (palu.compress also takes the first "
                         "fisher_windows=)" + ("" if method != "error_aware" else ", or a numeric key_weight"))
    from .probe import allocate_probed
    from .spectra import whitened_svds
    began = time.perf_counter()
    svds = whitened_svds(model, grams, group_size)
    log.info("%s: %d whitened SVDs in %.1f s", method, len(svds), time.perf_counter() - began)
    return allocate_probed(model, svds, fisher, method, kept_ratio, group_size, multiple, probe_windows,
                           key_weight)


def required_statistics(method: str) -> list[str]:
    """The Fisher statistics `method` reads (calib.fisher); "all" reads every one an allocator uses."""
    from .ranks import ALLOCATORS
    statistic = get_allocator(method).statistic
    if statistic is None:
        return []
    if statistic == "all":
        return sorted({a.statistic for a in ALLOCATORS.values() if a.statistic not in (None, "all")})
    return [statistic]


def check_statistics(method: str, stats: dict | None, source: str = "the Fisher statistics",
                     advice: str = "collect them again (palu.calib.fisher.collect_fisher)") -> None:
    """Refuse statistics that lack what `method` reads, before any model work."""
    needed = required_statistics(method)
    if needed and stats is None:
        raise ValueError(f"rank method {method!r} needs Fisher statistics {needed}")
    missing = [k for k in needed if k not in stats]
    if missing:
        raise ValueError(f"{source} has no {missing} (written before {method} existed): {advice}")
