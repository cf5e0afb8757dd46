"""Step `collect`: tables (CSV + Markdown) and figures from the runs; logs tables to W&B."""
from __future__ import annotations

from omegaconf import OmegaConf

from ..reporting.figures import latent_outliers_figure, ppl_vs_bytes_figure, rank_allocation_from_file
from ..reporting.memory_table import write_memory_table
from ..reporting.tables import build_table, write_table
from ..tracking.wandb_run import log_table, tracked_run
from .common import entry_point, log

TITLES = {
    "baseline": "Baseline perplexity (unmodified model)",
    "granularity": "Palu granularity: M-LRD / G-LRD / J-LRD x kept ratio (uniform ranks)",
    "rank_search": "Palu rank allocation: uniform vs fisher vs fisher_uniform (vs our tempered fisher_sqrt)",
    "latent_bits": "Palu latents stored at 16 / 8 / 4 / 3 / 2 bits (per-token, per-group min-max quantisation)",
    "hadamard": "Latent rotation fused into the factors (none / Walsh-Hadamard / random orthogonal) x latent bits",
    "quantization": "Palu + low-bit latents vs KV-cache quantisation (Atom, KIVI, TurboQuant, KVQuant) "
                    "at the bytes each cache really stores",
}
NEED_BYTES = {"quantization"}   # tables that compare methods at measured bytes
FIGURES = {"rank_allocation": rank_allocation_from_file, "ppl_vs_bytes": ppl_vs_bytes_figure}


def run(cfg) -> None:
    known = sorted(TITLES) + sorted(FIGURES) + ["latent_outliers", "cache_memory"]
    if cfg.table not in known:
        raise ValueError(f"table={cfg.table!r} is not one of {known} (GPU tables: "
                         "python -m palu_bench.cli.table)")
    inputs = list(cfg.inputs)
    if cfg.table == "latent_outliers":   # inputs: the model folder, then checkpoints
        if len(inputs) < 2:
            raise ValueError("latent_outliers takes the model folder and at least one checkpoint")
        latent_outliers_figure(inputs[0], inputs[1:], cfg.corpus, cfg.out)
        log.info("figure -> %s", cfg.out)
        return
    if cfg.table == "cache_memory":
        write_memory_table(inputs, cfg.out)
        log.info("cache_memory: %d methods -> %s.{csv,md}", len(inputs), cfg.out)
        return
    if cfg.table in FIGURES:
        if len(inputs) != 1:
            raise ValueError(f"figure {cfg.table!r} takes exactly one input, got {len(inputs)}")
        FIGURES[cfg.table](inputs[0], cfg.out)
        log.info("figure -> %s", cfg.out)
        return
    frame = build_table(inputs, need_bytes=cfg.table in NEED_BYTES)
    write_table(frame, cfg.out, TITLES[cfg.table])
    with tracked_run(cfg.tracking, OmegaConf.to_container(cfg, resolve=True), job_type="collect",
                     name=f"table/{cfg.table}", group="tables") as wb:
        log_table(wb, cfg.table, frame)
    log.info("%s: %d rows -> %s.{csv,md}", cfg.table, len(frame), cfg.out)


main = entry_point(run, config_name="collect", checked=False)


if __name__ == "__main__":
    main()
