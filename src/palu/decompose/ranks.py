"""Rank allocation under a kept-ratio budget: uniform, fisher (per group), fisher_uniform (per matrix).

`fisher` and `fisher_uniform` weigh a block by its raw Fisher diagonal (the sum of its weights'
squared gradients); `fisher_rms` is the official Palu code's scoring: the mean over the block's
weights of each weight's RMS gradient (calib.fisher `rms_fisher`), proportional per group.
`fisher_sqrt` is our tempered variant (ranks proportional to the square root of the Fisher
importance): plain proportional allocation starves the keys on small models (see the rank_allocation
table), the square root keeps the ordering but flattens the extremes.

`error_aware` allocates from what a rank cut costs rather than from weight sensitivity: a block
truncated to rank r loses exactly the whitened singular values beyond r in output energy on the
calibration inputs (`spectra`, sigma_i^2 of W S), and the loss responds to that block's output
error by its output Fisher lambda (`calib.fisher.output_fisher`). Units of `multiple` dims go one
at a time to the block whose next unit recovers the most lambda * sum(sigma_i^2), which is the
optimum of the quadratic loss model because each block's gains only shrink (sigma sorted).
With equal lambdas it keeps the largest whitened singular values overall.

`probe_select` (decompose/probe.py) is model selection rather than a loss model: it builds every
allocation above (error_aware at several key weights), scores each truncated model's LM loss on
probe windows (the first Fisher windows, which overlap the Gram's:
results/checks/probe-window-overlap.json), and keeps the best. No single loss model wins at every budget on
SmolLM2 (fisher_rms at kept 0.3, uniform at 0.5; results/tables/rank_allocation.md); the probe
reads which one does for this model, budget and granularity.

`search` (decompose/search.py) starts from probe_select's choice and moves ranks between blocks
by the truncated model's measured loss on held-out windows (text neither the Gram nor the Fisher
windows read), the budget unchanged.

`error_aware_bytes` (decompose/bit_alloc.py) spends a byte budget instead of a dims budget: ranks
per block and a latent width per layer, its kept ratio read as the fraction of the FP16 cache's
bytes.

A *slot* is one factorised block: (layer, "k" | "v", group). Ranks are whole multiples of
`multiple`, each at least one multiple and at most the block's full rank, and their sum equals the
budget `floor(kept_ratio * original / multiple) * multiple` exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.adapters import Geometry
from ..registry import Registry


@dataclass(frozen=True)
class Budget:
    """What a statistics allocator splits: `total` units of `multiple` dims over `slots`, each
    block 1..`cap` units, weighed by `fisher` ((layers, 2, kv_heads), the allocator's statistic)."""
    geom: Geometry
    slots: list
    group_size: int
    multiple: int
    cap: int
    total: int
    fisher: torch.Tensor | None
    spectra: dict | None          # {Slot: sigma^2 descending}, for allocators with `spectra`
    key_weight: float


@dataclass(frozen=True)
class Allocator:
    """One rank allocator: the Fisher statistic it weighs blocks by (calib.fisher; None: none,
    "all": every one), `units` (its split of a `Budget`, what `allocate` calls: from the statistic
    alone) and/or `probe` (its allocation scored with the model itself on probe windows:
    `probe(model, svds, fisher, kept_ratio, group_size, multiple, windows, key_weight)`, what
    `decompose.allocation.allocate_ranks` calls; it needs the Gram's whitened factors and the
    model). `spectra`: `units` also reads the blocks' whitened spectra and a key weight."""
    statistic: str | None
    units: Callable[[Budget], list[int]] | None = None
    probe: Callable[..., dict] | None = None
    spectra: bool = False
    # its probe windows must be text neither the Gram nor the Fisher windows read (`search`):
    # the callers cut them (`decompose.search.held_out_windows`), never the first Fisher windows
    held_out: bool = False
    windows: int = 0   # held-out windows its probe reads (`held_out` allocators)

    @property
    def probes(self) -> bool:
        return self.probe is not None

    @property
    def kind(self) -> str:
        """uniform (reads only the model's config) | statistics | probed (runs the model)."""
        return "probed" if self.probes else "statistics" if self.statistic else "uniform"


# The one table of allocators: a new one is a module with its function(s) and
# `register_allocator(name, Allocator(...))`, imported by the package's __init__.
ALLOCATORS: Registry = Registry("rank allocator")


def register_allocator(name: str, allocator: Allocator) -> Allocator:
    if allocator.units is None and allocator.probe is None:
        raise ValueError(f"rank allocator {name!r} has neither units nor probe")
    if allocator.held_out and allocator.windows < 1:   # its callers cut `windows` held-out windows
        raise ValueError(f"rank allocator {name!r} probes held-out text but reads {allocator.windows} windows")
    return ALLOCATORS.register(name, allocator)


# allocators whose settings are spelled in their name (`search-e800-w8`): a registered name's
# variants, made by a function of the full name (None: not one of them; ValueError: a bad one)
VARIANTS: dict[str, Callable[[str], Allocator | None]] = {}


def register_variants(name: str, make: Callable[[str], Allocator | None]) -> None:
    if name not in ALLOCATORS or name in VARIANTS:
        raise ValueError(f"rank allocator {name!r}: register it once before its variants")
    VARIANTS[name] = make


def get_allocator(name: str) -> Allocator:
    if name in ALLOCATORS:
        return ALLOCATORS[name]
    base = str(name).split("-", 1)[0]
    made = VARIANTS[base](name) if base in VARIANTS else None
    if made is None:
        variants = "".join(f", {b}-<settings>" for b in VARIANTS)
        raise ValueError(f"rank method {name!r} is not one of {tuple(ALLOCATORS)}{variants}")
    return made


def is_rank_method(name) -> bool:
    """Whether `name` is a registered allocator or a variant of one (`get_allocator` says why not)."""
    try:
        get_allocator(name)
    except ValueError:
        return False
    return True


def allocator_kind(name: str) -> str:
    return get_allocator(name).kind


@dataclass(frozen=True)
class Slot:
    layer: int
    kind: str   # "k" or "v"
    group: int


def slots(geom: Geometry, group_size: int) -> list[Slot]:
    n_groups = geom.check_group_size(group_size)
    return [Slot(l, kind, g) for l in range(geom.num_layers) for kind in ("k", "v")
            for g in range(n_groups)]


def _spread_key(i: int) -> float:
    # Low-discrepancy tie-break, so equal remainders are spread over the layers, not front-loaded.
    return (i * 0.6180339887498949) % 1.0


def water_fill(weights: list[float], caps: list[int], total: int, floor: int = 1) -> list[int]:
    """Integers proportional to `weights`, each in [floor, cap], summing to `total` exactly."""
    n = len(weights)
    if not floor * n <= total <= sum(caps):
        raise ValueError(f"budget of {total} units cannot be split over {n} blocks with "
                         f"{floor}..cap units each (caps sum to {sum(caps)})")
    share = [0.0] * n
    free = set(range(n))
    remaining = float(total)
    while free:  # proportional shares; pin anything that crosses its bounds and repeat
        wsum = sum(max(weights[i], 0.0) for i in free)
        for i in free:
            share[i] = remaining / len(free) if wsum <= 0 else remaining * max(weights[i], 0.0) / wsum
        pinned = {i for i in free if share[i] > caps[i] or share[i] < floor}
        if not pinned:
            break
        for i in pinned:
            share[i] = float(min(max(share[i], floor), caps[i]))
        free -= pinned
        remaining = total - sum(share[i] for i in range(n) if i not in free)
    units = [min(max(math.floor(s + 1e-9), floor), caps[i]) for i, s in enumerate(share)]
    order = sorted(range(n), key=lambda i: (-(share[i] - units[i]), _spread_key(i)))
    deficit = total - sum(units)
    while deficit != 0:  # largest remainder first; loops only for blocks that still have room
        step = 1 if deficit > 0 else -1
        moved = False
        for i in order if step > 0 else reversed(order):
            if deficit == 0:
                break
            if floor <= units[i] + step <= caps[i]:
                units[i] += step
                deficit -= step
                moved = True
        if not moved:
            raise RuntimeError("rank allocation could not meet the budget")  # guarded above
    return units


def allocate(geom: Geometry, kept_ratio: float, group_size: int, method: str = "uniform",
             multiple: int = 8, fisher: torch.Tensor | None = None,
             spectra: dict | None = None, key_weight: float = 1.0) -> dict:
    """Ranks for every slot from a statistics allocator (its `units`); `fisher` is
    (layers, 2, kv_heads) importance for methods using it (for `error_aware`: the output Fisher),
    `spectra` {Slot: sigma^2 descending} its error profiles (`decompose.spectra.whitened_spectra`),
    `key_weight` the factor on the keys' weights in `error_aware` (decompose/probe.py chooses it)."""
    if not 0 < kept_ratio <= 1:
        raise ValueError(f"kept_ratio={kept_ratio} must lie in (0, 1]")
    allocator = get_allocator(method)
    if allocator.units is None:
        raise ValueError(f"rank method {method!r} scores allocations with the model on probe windows: "
                         "call palu.decompose.allocation.allocate_ranks (or palu.compress)")
    if allocator.statistic is not None and fisher is None:
        raise ValueError(f"rank method {method!r} needs Fisher scores")
    if allocator.spectra:
        if spectra is None:
            raise ValueError(f"rank method {method!r} needs the blocks' whitened spectra")
        if not (isinstance(key_weight, (int, float)) and math.isfinite(key_weight) and key_weight > 0):
            raise ValueError(f"key_weight={key_weight!r} must be a positive number")
    block = group_size * geom.head_dim
    full = min(block, geom.hidden_size)
    if full % multiple:
        raise ValueError(f"rank_multiple={multiple} does not divide the full block rank {full}")
    all_slots = slots(geom, group_size)
    original = geom.num_layers * geom.kv_size()
    budget_units = math.floor(kept_ratio * original / multiple + 1e-9)
    budget_units = min(budget_units, len(all_slots) * full // multiple)
    cap = full // multiple
    if budget_units < len(all_slots):
        raise ValueError(f"kept_ratio={kept_ratio} leaves {budget_units * multiple} latent dims for "
                         f"{len(all_slots)} blocks: less than rank_multiple={multiple} each; "
                         "raise the kept ratio or lower rank_multiple")
    units = allocator.units(Budget(geom, all_slots, group_size, multiple, cap, budget_units, fisher,
                                   spectra, key_weight))
    ranks = [u * multiple for u in units]
    total = sum(ranks)
    extra = {"key_weight": float(key_weight)} if allocator.spectra else {}
    return {
        **extra,
        "method": method, "kept_ratio_target": kept_ratio, "group_size": group_size,
        "multiple": multiple, "original_size": original, "latent_size": total,
        "kept_ratio_realised": total / original,
        "ranks": [{"layer": s.layer, "kind": s.kind, "group": s.group, "rank": r, "full": full}
                  for s, r in zip(all_slots, ranks)],
    }


def _uniform(b: Budget) -> list[int]:
    return water_fill([1.0] * len(b.slots), [b.cap] * len(b.slots), b.total)


def _proportional(power: float):
    """Ranks proportional to each block's Fisher importance to `power` (1: fisher, fisher_rms)."""
    def units(b: Budget) -> list[int]:
        return water_fill([_slot_importance(b.fisher, s, b.group_size) ** power for s in b.slots],
                          [b.cap] * len(b.slots), b.total)
    return units


def error_aware_units(b: Budget) -> list[int]:
    return greedy_by_gain([_slot_importance(b.fisher, s, b.group_size) * (b.key_weight if s.kind == "k" else 1.0)
                           for s in b.slots], [b.spectra[s] for s in b.slots], b.multiple, b.cap, b.total)


def _fisher_uniform(b: Budget) -> list[int]:
    return _fisher_per_matrix(b.fisher, b.slots, b.geom, b.group_size, b.cap, b.total)


def greedy_by_gain(weights: list[float], spectra: list[torch.Tensor], multiple: int, cap: int,
                   total: int) -> list[int]:
    """Units per block (each 1..cap, summing to `total`): every block starts at one unit, then
    each next unit goes to the block where weight * (energy of its next `multiple` singular
    values) is largest; ties go by the spread key, so equal blocks share evenly."""
    import heapq
    energy = [torch.as_tensor(s, dtype=torch.float64) for s in spectra]

    def gain(i: int, unit: int) -> float:          # value of block i's (unit+1)-th unit
        return float(weights[i]) * float(energy[i][unit * multiple:(unit + 1) * multiple].sum())

    units = [1] * len(spectra)
    heap = [(-gain(i, 1), _spread_key(i), i) for i in range(len(spectra)) if cap > 1]
    heapq.heapify(heap)
    for _ in range(total - len(spectra)):
        _, key, i = heapq.heappop(heap)
        units[i] += 1
        if units[i] < cap:
            heapq.heappush(heap, (-gain(i, units[i]), key, i))
    return units


def _slot_importance(fisher: torch.Tensor, slot: Slot, group_size: int) -> float:
    heads = slice(slot.group * group_size, (slot.group + 1) * group_size)
    return float(fisher[slot.layer, 0 if slot.kind == "k" else 1, heads].sum())


def _fisher_per_matrix(fisher, all_slots, geom, group_size, cap, budget_units) -> list[int]:
    n_groups = geom.num_kv_heads // group_size
    matrices = [(l, kind) for l in range(geom.num_layers) for kind in ("k", "v")]
    weights = [float(fisher[l, 0 if kind == "k" else 1].sum()) for l, kind in matrices]
    per_matrix = water_fill(weights, [cap * n_groups] * len(matrices), budget_units, floor=n_groups)
    units = []
    for m_units in per_matrix:  # even split of each matrix's share over its groups
        base, extra = divmod(m_units, n_groups)
        units.extend(base + (1 if g < extra else 0) for g in range(n_groups))
    return units


def blend(a: dict, b: dict, alpha: float) -> dict:
    """The allocation between `a` and `b` (same budget and blocks): each block's units
    alpha * a + (1 - alpha) * b, rounded by largest remainder to the same total, labelled as `a`."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"blend weight {alpha} must lie in [0, 1]")
    same = ("group_size", "multiple", "original_size", "latent_size")
    if any(a[k] != b[k] for k in same) or [(r["layer"], r["kind"], r["group"]) for r in a["ranks"]] != \
            [(r["layer"], r["kind"], r["group"]) for r in b["ranks"]]:
        raise ValueError("only allocations of the same blocks and budget blend")
    m = a["multiple"]
    mixed = [alpha * ra["rank"] / m + (1 - alpha) * rb["rank"] / m for ra, rb in zip(a["ranks"], b["ranks"])]
    caps = [r["full"] // m for r in a["ranks"]]
    units = water_fill(mixed, caps, a["latent_size"] // m)
    return {**a, "ranks": [{**r, "rank": u * m} for r, u in zip(a["ranks"], units)]}


def ranks_table(allocation: dict) -> dict[tuple[int, str, int], int]:
    return {(r["layer"], r["kind"], r["group"]): r["rank"] for r in allocation["ranks"]}


def check_allocation(allocation: dict, geom: Geometry, where: str = "the rank allocation") -> None:
    """Refuse an allocation that cannot be this model's (ValueError naming the bad value): a group
    size that does not divide its KV heads, a block missing or twice, a rank that is not a whole
    number in 1..the block's dimension, or a realised kept ratio other than its ranks give."""
    for key in ("group_size", "ranks", "kept_ratio_realised"):
        if key not in allocation:
            raise ValueError(f"{where} has no {key!r}")
    s = allocation["group_size"]
    if isinstance(s, bool) or not isinstance(s, int):
        raise ValueError(f"{where}: group_size {s!r} is not a whole number")
    geom.check_group_size(s)
    full, seen = s * geom.head_dim, {}
    for r in allocation["ranks"]:
        slot = (r.get("layer"), r.get("kind"), r.get("group"))
        rank = r.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
            raise ValueError(f"{where}: block {slot} has rank {rank!r}; ranks are whole numbers in "
                             f"1..{full} (group size {s} x head_dim {geom.head_dim})")
        if slot in seen:
            raise ValueError(f"{where}: block {slot} is listed twice")
        seen[slot] = rank
    want = {(x.layer, x.kind, x.group) for x in slots(geom, s)}
    missing, stray = sorted(want - set(seen)), sorted(set(seen) - want, key=str)
    if missing or stray:
        raise ValueError(f"{where}: blocks {missing[:3]} missing, {stray[:3]} not in this model "
                         f"({geom.num_layers} layers x k/v x {geom.num_kv_heads // s} groups)")
    realised = sum(seen.values()) / (geom.num_layers * geom.kv_size())
    if abs(realised - allocation["kept_ratio_realised"]) > 1e-9:
        raise ValueError(f"{where}: its ranks keep {realised:.6f} of the K/V dimensions, but it "
                         f"records kept_ratio_realised {allocation['kept_ratio_realised']!r}")


register_allocator("uniform", Allocator(None, units=_uniform))
register_allocator("fisher", Allocator("fisher", units=_proportional(1.0)))
register_allocator("fisher_uniform", Allocator("fisher", units=_fisher_uniform))
register_allocator("fisher_sqrt", Allocator("fisher", units=_proportional(0.5)))
register_allocator("fisher_rms", Allocator("rms_fisher", units=_proportional(1.0)))
# error_aware, probe_select (decompose/probe.py), error_aware_bytes (decompose/bit_alloc.py) and
# search (decompose/search.py) register themselves the same way; the package's __init__ imports
# them after this file, so nothing here imports them back (no import circle).


def rank_method_names() -> tuple[str, ...]:
    """Every registered allocator's name (after `import palu.decompose`, which registers them all)."""
    return tuple(ALLOCATORS)
