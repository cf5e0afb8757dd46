"""Step `collect`: tables (CSV + Markdown) and figures from the runs; logs tables to W&B."""
from __future__ import annotations

from omegaconf import OmegaConf

from ..reporting.figures import rank_allocation_from_file
from ..reporting.tables import build_table, write_table
from ..tracking.wandb_run import log_table, tracked_run
from .common import entry_point, log

TITLES = {
    "baseline": "Baseline perplexity (unmodified model)",
    "granularity": "Palu granularity: M-LRD / G-LRD / J-LRD x kept ratio (uniform ranks)",
    "rank_search": "Palu rank allocation: uniform vs fisher vs fisher_uniform (vs our tempered fisher_sqrt)",
    "latent_bits": "Palu latents stored at 16 / 8 / 4 / 3 / 2 bits (per-token, per-group min-max quantisation)",
    "hadamard": "Latent rotation fused into the factors (none / Walsh-Hadamard / random orthogonal) x latent bits",
}
FIGURES = {"rank_allocation": rank_allocation_from_file}


def run(cfg) -> None:
    known = sorted(TITLES) + sorted(FIGURES)
    if cfg.table not in known:
        raise ValueError(f"table={cfg.table!r} is not one of {known} (GPU tables: "
                         "python -m palu_bench.cli.table)")
    inputs = list(cfg.inputs)
    if cfg.table in FIGURES:
        if len(inputs) != 1:
            raise ValueError(f"figure {cfg.table!r} takes exactly one input, got {len(inputs)}")
        FIGURES[cfg.table](inputs[0], cfg.out)
        log.info("figure -> %s", cfg.out)
        return
    frame = build_table(inputs)
    write_table(frame, cfg.out, TITLES[cfg.table])
    with tracked_run(cfg.tracking, OmegaConf.to_container(cfg, resolve=True), job_type="collect",
                     name=f"table/{cfg.table}", group="tables") as wb:
        log_table(wb, cfg.table, frame)
    log.info("%s: %d rows -> %s.{csv,md}", cfg.table, len(frame), cfg.out)


main = entry_point(run, config_name="collect", checked=False)


if __name__ == "__main__":
    main()
