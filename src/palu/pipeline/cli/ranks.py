"""Step `ranks`: allocate ranks for a kept ratio, group size and method; writes a JSON."""
from __future__ import annotations

import time

from palu.calib.stats_file import check_model, load_stats
from palu.decompose.allocation import allocate_ranks, check_statistics
from palu.decompose.ranks import get_allocator
from palu.artifacts import seal, write_json
from palu.models.adapters import config_fingerprint, geometry_of
from palu.models.loading import load_config
from palu.pipeline import naming
from palu.pipeline.cli.common import calibration_windows_of, entry_point, log, model_path, tracked


_AGAIN = "run `python -m palu.pipeline.cli.fisher` again"


def run(cfg) -> dict:
    p = cfg.palu
    config = load_config(model_path(cfg))
    geom = geometry_of(config)
    made_from = {"config": config_fingerprint(config)}   # the model this allocation is for
    geom.check_group_size(p.group_size)
    from palu.decompose.heads import check_head_order
    check_head_order(p.head_order, geom, p.group_size)
    allocator = get_allocator(p.rank_method)
    reorder = p.head_order != "none" and allocator.statistic is not None
    needs_model = allocator.probes or reorder
    stats, used = None, {}
    if allocator.statistic is not None:
        path = naming.fisher_path_of(cfg)
        if not path.is_file():
            raise FileNotFoundError(f"rank method {p.rank_method!r} needs Fisher scores at {path}; "
                                    "run `python -m palu.pipeline.cli.fisher` first")
        used["fisher"] = str(path)
        stats, meta = load_stats(path, "Fisher scores")
        check_model(meta, config, what=f"the Fisher scores {path}")
        check_statistics(p.rank_method, stats, str(path), _AGAIN)
        made_from = meta["model"]
    if needs_model:
        gram = naming.gram_path_of(cfg)
        if not gram.is_file():
            raise FileNotFoundError(f"rank method {p.rank_method!r} needs the calibration Gram at {gram}; "
                                    "run `python -m palu.pipeline.cli.calibrate` first")
        used["gram"] = str(gram)
    out = cfg.out or str(naming.ranks_path_of(cfg))
    with tracked(cfg, "ranks", out, used=used) as wb:
        model = grams = windows = None
        began = time.perf_counter()
        if needs_model:
            from palu.models.loading import load_model
            model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
            tensors, meta = load_stats(used["gram"], "calibration Gram")
            check_model(meta, config, made_from.get("hash"), f"the calibration Gram {used['gram']}")
            grams = tensors["gram"]
            log.info("model and Gram loaded in %.1f s", time.perf_counter() - began)
        if reorder:   # the KV heads as the decompose step will group them (decompose/heads.py)
            from palu.decompose.heads import permute_statistics, reorder_heads, similarity_orders
            orders = similarity_orders(model, grams, p.group_size)
            reorder_heads(model, orders)
            stats = permute_statistics(stats, orders)
            log.info("head order (similarity): %s", orders)
        if allocator.held_out:   # text neither the Gram nor the Fisher windows read (issue 53, item 3)
            windows, held_out = held_out_windows_of(cfg, tok, allocator.windows)
            log.info("%s: %d search windows of %d tokens at calibration-text offsets %s, disjoint from "
                     "the Gram's and the Fisher's", p.rank_method, len(windows), windows.shape[1], held_out["offsets"])
        elif allocator.probes:
            from palu.decompose.probe import PROBE_WINDOWS
            # the probe scores the first Fisher windows (drawn apart from the Gram's windows, but from the
            # same text: they overlap, results/checks/probe-window-overlap.json; issue 53, item 3)
            f = cfg.fisher
            windows = calibration_windows_of(cfg, tok, f.samples, f.seqlen, f.seed)[:PROBE_WINDOWS]
        began = time.perf_counter()
        allocation = allocate_ranks(p.rank_method, p.kept_ratio, p.group_size, p.rank_multiple, geom,
                                    stats=stats, model=model, grams=grams, probe_windows=windows,
                                    source=str(used.get("fisher")), advice=_AGAIN)
        log.info("%s allocated in %.1f s", p.rank_method, time.perf_counter() - began)
        if allocator.held_out:
            allocation["search"]["held_out"] = held_out
        if allocator.probes:
            _log_probe(allocation)
        # sealed, and naming its model: decompose refuses an edited file or another model's
        write_json(out, seal({**allocation, "model": made_from}))
        wb.metrics({"kept_ratio_realised": allocation["kept_ratio_realised"],
                    "kept_ratio_target": p.kept_ratio})
        wb.make("ranks", out)
    log.info("%s ranks: kept ratio %.4f (target %.4f) -> %s", p.rank_method,
             allocation["kept_ratio_realised"], p.kept_ratio, out)
    return allocation


def held_out_windows_of(cfg, tok, n: int):
    """`n` search windows from the calibration text that neither the Gram windows (calibration.*)
    nor the Fisher windows (fisher.*) read, and the record of all three draws' offsets."""
    from palu.data.corpora import load_corpus
    from palu.data.windows import bos_token_for, calibration_offsets, tokenize
    from palu.decompose.search import held_out_windows
    c, f = cfg.calibration, cfg.fisher
    tokens = tokenize(tok, load_corpus(c.corpus, path=c.path).calibration_text)
    bos = bos_token_for(tok, c.bos)
    gram_text, fisher_text = c.seqlen - (bos is not None), f.seqlen - (bos is not None)
    gram = calibration_offsets(tokens.numel(), c.samples, gram_text, c.seed)
    fisher = calibration_offsets(tokens.numel(), f.samples, fisher_text, f.seed)
    windows, starts = held_out_windows(tokens, [(gram, gram_text), (fisher, fisher_text)], n=n, bos=bos)
    text = windows.shape[1] - (bos is not None)
    return windows, {"offsets": starts, "text_tokens": text, "gram": {"offsets": gram, "text_tokens": gram_text},
                     "fisher": {"offsets": fisher, "text_tokens": fisher_text}}


def _log_probe(allocation: dict) -> None:
    """What the probe scored, and what it chose."""
    if allocation["method"] == "error_aware_bytes":
        b = allocation["byte_budget"]
        log.info("error_aware_bytes: %d of %d bytes per token (%.4f of FP16), widths per layer %s, "
                 "kept dims %.3f", b["used_bytes_per_token"], b["fp16_bytes_per_token"],
                 b["ratio_realised"], allocation["bits"], allocation["kept_ratio_realised"])
        return
    for row in allocation.get("probe", {}).get("candidates", []):
        if "candidate" in row:
            log.info("probe_select: %-44s key share %.3f, probe ppl %.3f", row["candidate"],
                     row["key_share"], row["ppl"])
        else:
            log.info("error_aware probe: key weight %4.1f -> key share %.3f, probe ppl %.3f",
                     row["key_weight"], row["key_share"], row["ppl"])
    if allocation.get("selected"):
        log.info("probe_select chose %s", allocation["selected"])
    if "search" in allocation:
        sr = allocation["search"]
        log.info("search: from %s, loss %.4f -> %.4f (ppl %.3f) in %d evaluations of %d, %d rounds",
                 sr["start"], sr["start_loss"], sr["loss"], sr["ppl"], sr["evaluations"], sr["budget"],
                 len(sr["rounds"]) - 1)


main = entry_point(run)

if __name__ == "__main__":
    main()
