"""The key / value balance of `error_aware` ranks, probed on calibration text.

error_aware's loss model is quadratic: a block's output error costs its output Fisher times the
discarded whitened energy. That holds for small errors. A key error, though, passes through the
softmax, so once most of a key spectrum is cut the first-order Fisher underestimates what it
costs and might starve the keys (kept 0.3 on SmolLM2 gave them 28% of the dims and lost to every
Fisher variant; measured since: the probe keeps key weight 1 there, so it was not the keys, see the
README). One scalar corrects the balance where it is off: the keys' weights are
multiplied by `key_weight` before the greedy allocation, and `probe_key_weight` picks it from
KEY_WEIGHTS by the real LM loss of the truncated model (each block replaced by its best rank-r
whitened reconstruction, which is the Palu model without quantisation) on probe windows that the
Gram was not built from (the first Fisher windows; drawn apart from the Gram's, not disjoint from
them: results/checks/probe-window-overlap.json). With key_weight 1 it is the plain quadratic model.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..models.adapters import adapter_for, geometry_of
from .ranks import (Allocator, Slot, allocate, blend, error_aware_units, get_allocator, ranks_table,
                    register_allocator)

KEY_WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0)
PROBE_WINDOWS = 1        # Fisher windows the probe scores (one 2048-token window by default)


@contextlib.contextmanager
def truncated(model, svds: dict, allocation: dict):
    """The model with every K/V block at its allocated rank (dense weights), restored after."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    rows = allocation["group_size"] * geom.head_dim
    ranks = ranks_table(allocation)
    saved = []
    try:
        for l, layer in enumerate(adapter.layers(model)):
            _, k, v, _ = adapter.projections(adapter.attention(layer))
            for kind, proj in (("k", k), ("v", v)):
                saved.append((proj, proj.weight.data.clone()))
                W = proj.weight.data.double().cpu().clone()
                for g in range(geom.num_kv_heads // allocation["group_size"]):
                    U, sigma, V = svds[Slot(l, kind, g)]
                    r = ranks[(l, kind, g)]
                    W[g * rows:(g + 1) * rows] = (U[:, :r] * sigma[:r]) @ V[:r]
                proj.weight.data.copy_(W.to(proj.weight.dtype))
        yield model
    finally:
        for proj, weight in saved:
            proj.weight.data.copy_(weight)


@torch.no_grad()
def probe_loss(model, windows: torch.Tensor, before_window=None) -> float:
    """Mean next-token loss over `windows`, one window a forward. `before_window(i)` is called
    before window i's (the search's kept layer outputs are per window)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i, window in enumerate(windows):
        if before_window is not None:
            before_window(i)
        batch = window[None].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss.item()
        total += loss * (batch.shape[1] - 1)
        count += batch.shape[1] - 1
    if not math.isfinite(total):
        raise FloatingPointError("non-finite probe loss: the truncated model's loss on the probe / search "
                                 "windows is not finite")
    return total / count


def probe_key_weight(model, svds: dict, fisher: torch.Tensor, kept_ratio: float, group_size: int,
                     multiple: int, windows: torch.Tensor, weights=KEY_WEIGHTS) -> tuple[float, list[dict]]:
    """The key weight of KEY_WEIGHTS whose allocation gives the lowest probe loss (ties: the
    smaller weight), and every candidate's loss and key share."""
    geom = geometry_of(model.config)
    spectra = {s: sigma.pow(2) for s, (_, sigma, _) in svds.items()}
    rows = []
    for w in weights:
        allocation = allocate(geom, kept_ratio, group_size, "error_aware", multiple, fisher, spectra,
                              key_weight=w)
        with truncated(model, svds, allocation):
            loss = probe_loss(model, windows)
        keys = sum(r["rank"] for r in allocation["ranks"] if r["kind"] == "k")
        rows.append({"key_weight": w, "loss": loss, "ppl": math.exp(loss),
                     "key_share": keys / allocation["latent_size"]})
    best = min(rows, key=lambda r: (r["loss"], r["key_weight"]))
    return best["key_weight"], rows


# probe_select's candidates: the other allocators' ranks (error_aware at several key weights;
# 0.25 reaches the key-starved regime where the Fisher variants win at high compression).
# fisher_uniform and error_aware at 16 are left out: never the probe's best on SmolLM2 at kept
# 0.3 / 0.5 (M- and J-LRD), and each candidate costs a forward of the probe window.
SELECT_CANDIDATES = (("uniform", None), ("fisher", None), ("fisher_sqrt", None), ("fisher_rms", None),
                     ("error_aware", 0.25), ("error_aware", 1.0), ("error_aware", 4.0))


def candidate_name(method: str, key_weight: float | None) -> str:
    return method if key_weight is None else f"{method}@k{key_weight:g}"


# the best candidate's share in the blends probe_select tries (0.25 was never the probe's best on
# SmolLM2 over kept 0.3 / 0.5 / 0.7 x M- / J-LRD, and each blend costs a probe forward)
BLEND_WEIGHTS = (0.5, 0.75)


def probe_select(model, svds: dict, stats: dict, kept_ratio: float, group_size: int, multiple: int,
                 windows: torch.Tensor, candidates=SELECT_CANDIDATES, blends=BLEND_WEIGHTS) -> dict:
    """The allocation with the lowest probe loss among `candidates` ((method, key_weight) pairs;
    key_weight only for error_aware) and their blends, each scored as its truncated model on
    `windows` (the first Fisher windows: not disjoint from the Gram's in the pipeline). `stats` holds every Fisher statistic
    (calib.fisher.collect_fisher). After the candidates, the best one is blended with uniform
    ranks and with the runner-up at each weight of `blends` (`ranks.blend`: a block's units
    w * best + (1 - w) * other): on SmolLM2 at kept 0.5 the half-way point between fisher_rms
    and uniform beats both on both corpora, at kept 0.3 fisher_rms alone wins. Returns the
    winner's allocation relabelled `probe_select`, with every candidate's loss under "probe"
    (ties: the earlier candidate). Model selection on calibration text, not a new loss
    model: it is never worse on the probe than the best allocation it chooses from."""
    if not candidates:
        raise ValueError("probe_select needs at least one candidate allocator")
    geom = geometry_of(model.config)
    spectra = {s: sigma.pow(2) for s, (_, sigma, _) in svds.items()}
    rows, scored = [], []

    def score(name: str, allocation: dict) -> None:
        with truncated(model, svds, allocation):
            loss = probe_loss(model, windows)
        keys = sum(r["rank"] for r in allocation["ranks"] if r["kind"] == "k")
        rows.append({"candidate": name, "loss": loss, "ppl": math.exp(loss),
                     "key_share": keys / allocation["latent_size"]})
        scored.append((loss, len(scored), name, allocation))

    for method, key_weight in candidates:
        if method == "probe_select":
            raise ValueError("probe_select cannot be its own candidate")
        statistic = get_allocator(method).statistic
        fisher = None if statistic is None else stats[statistic]
        extra = {"key_weight": key_weight} if method == "error_aware" else {}
        score(candidate_name(method, key_weight),
              allocate(geom, kept_ratio, group_size, method, multiple, fisher,
                       spectra if method == "error_aware" else None, **extra))
    ranked = sorted(scored)
    (_, _, best, best_alloc) = ranked[0]
    partners = [(name, a) for _, _, name, a in ranked[1:] if name == "uniform"][:1]
    partners += [(name, a) for _, _, name, a in ranked[1:2] if name != "uniform"]
    for name, other in partners:
        for w in blends:
            if best_alloc["ranks"] != other["ranks"]:
                score(f"{best}*{w:g}+{name}", blend(best_alloc, other, w))
    _, _, name, allocation = min(scored)
    return {**allocation, "method": "probe_select", "selected": name,
            "probe": {"windows": int(len(windows)), "seqlen": int(windows.shape[1]), "candidates": rows}}


def allocate_probed(model, svds: dict, fisher, method: str, kept_ratio: float, group_size: int,
                    multiple: int, windows: torch.Tensor | None, key_weight: float | str = "auto") -> dict:
    """The ranks of a method that scores allocations with the model (its `Allocator.probe`):
    error_aware (its key weight probed on `windows` when "auto"), probe_select, error_aware_bytes
    (its kept ratio: the fraction of the FP16 cache's bytes). `fisher`: the method's statistic (all
    of them, a dict, for probe_select)."""
    allocator = get_allocator(method)
    if not allocator.probes:
        raise ValueError(f"rank method {method!r} does not score allocations with the model")
    return allocator.probe(model, svds, fisher, kept_ratio, group_size, multiple, windows, key_weight)


def _error_aware(model, svds, fisher, kept_ratio, group_size, multiple, windows, key_weight) -> dict:
    probe = None
    if key_weight == "auto":
        key_weight, probe = probe_key_weight(model, svds, fisher, kept_ratio, group_size, multiple, windows)
    allocation = allocate(geometry_of(model.config), kept_ratio, group_size, "error_aware", multiple,
                          fisher, {s: sigma.pow(2) for s, (_, sigma, _) in svds.items()},
                          key_weight=key_weight)
    if probe is not None:
        allocation["probe"] = {"windows": int(len(windows)), "seqlen": int(windows.shape[1]),
                               "candidates": probe}
    return allocation


def _probe_select(model, svds, stats, kept_ratio, group_size, multiple, windows, key_weight) -> dict:
    return probe_select(model, svds, stats, kept_ratio, group_size, multiple, windows)


register_allocator("error_aware", Allocator("output_fisher", units=error_aware_units, probe=_error_aware,
                                            spectra=True))
register_allocator("probe_select", Allocator("all", probe=_probe_select))
