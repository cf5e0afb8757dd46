"""Step `decompose`: factorise K/V under the allocated ranks; writes a compressed checkpoint."""
from __future__ import annotations

import time

from palu.calib.stats_file import check_model, dtype_name, load_stats
from palu.compress import build_manifest
from palu.pipeline.config import to_dict
from palu.decompose.checkpoint import save_compressed, source_hash
from palu.decompose.factors import NEEDS_GRAM, decompose_model
from palu.artifacts import read_json, sha256_file, unseal
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    p = cfg.palu
    ranks = naming.ranks_path_of(cfg)
    allocation = unseal(read_json(ranks), f"rank file {ranks}")
    if allocation.get("group_size") != p.group_size or allocation.get("method") != p.rank_method:
        raise ValueError(f"rank file {ranks} does not match palu.group_size / rank_method")
    grams, used = None, {**model_input(cfg), "ranks": str(ranks)}
    if p.decomposition in NEEDS_GRAM:
        gpath = naming.gram_path_of(cfg)
        if not gpath.is_file():
            raise FileNotFoundError(f"{p.decomposition} SVD needs the Gram matrices at {gpath}; "
                                    "run `python -m palu.pipeline.cli.calibrate` first")
        grams, used["gram"] = gpath, str(gpath)     # read once the model is loaded (checked against it)
    out = cfg.out or str(naming.checkpoint_dir_of(cfg))
    with tracked(cfg, "decompose", out, used=used) as wb:
        factors, manifest = _decompose(cfg, allocation, grams, ranks)
        save_compressed(out, factors, manifest)
        wb.metrics({"kept_ratio_realised": allocation["kept_ratio_realised"],
                    "decompose_seconds": manifest["settings"]["decompose_seconds"]})
        wb.make("checkpoint", out, tag=manifest["tag"])
    log.info("%s: kept %.4f -> %s", manifest["tag"], allocation["kept_ratio_realised"], out)
    return out


def _decompose(cfg, allocation, grams, ranks) -> tuple[dict, dict]:
    """The factors and the checkpoint's manifest."""
    p = cfg.palu
    model, _ = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
    base_hash = source_hash(model)
    check_model(allocation, model.config, base_hash, f"the rank file {ranks}", dtype=dtype_name(model))
    if grams is not None:
        tensors, meta = load_stats(grams, "calibration Gram")
        check_model(meta, model.config, base_hash, f"the calibration Gram {grams}", dtype=dtype_name(model))
        grams = tensors["gram"]
    start = time.perf_counter()
    orders = None
    if p.head_order != "none":     # G-LRD groups of similar heads (decompose/heads.py)
        from palu.decompose.heads import check_head_order, reorder_heads, similarity_orders
        from palu.models.adapters import geometry_of
        check_head_order(p.head_order, geometry_of(model.config), p.group_size)
        if grams is None:
            raise ValueError("palu.head_order=similarity compares heads through the calibration Gram: "
                             "use decomposition=whitened or attention")
        orders = similarity_orders(model, grams, p.group_size)
        reorder_heads(model, orders)
    factors, report = decompose_model(model, allocation, grams, p.decomposition, cfg.progress,
                                      p.rotation, p.rotation_seed)
    settings = {"calibration": to_dict(cfg.calibration), "fisher": to_dict(cfg.fisher),
                "calibration_samples": cfg.calibration.samples,
                "calibration_seqlen": cfg.calibration.seqlen,
                "calibration_dtype": cfg.model.dtype,   # the model's dtype in the calibration run
                "fisher_samples": cfg.fisher.samples if p.rank_method != "uniform" else 0,
                "decompose_seconds": time.perf_counter() - start,
                # lineage: the exact bytes this checkpoint was made from
                "inputs": {"ranks": sha256_file(ranks)}}
    if grams is not None:
        settings["inputs"]["gram"] = sha256_file(naming.gram_path_of(cfg))
    manifest = build_manifest(model, cfg.model.id, allocation, p.decomposition, p.fuse, report, settings,
                              base_hash=base_hash, head_order=orders)
    return factors, manifest


main = entry_point(run)

if __name__ == "__main__":
    main()
