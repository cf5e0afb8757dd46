"""Step `collect`: tables (CSV + Markdown) and figures from the runs; logs tables to W&B."""
from __future__ import annotations

import hydra
from omegaconf import OmegaConf

from ..reporting.figures import rank_allocation_from_file
from ..reporting.tables import build_table, write_table
from ..tracking.wandb_run import log_table, tracked_run
from .common import CONF_DIR, log

TITLES = {
    "baseline": "Baseline perplexity (unmodified model)",
    "granularity": "Palu granularity: M-LRD / G-LRD / J-LRD x kept ratio (uniform ranks)",
    "rank_search": "Palu rank allocation: uniform vs fisher vs fisher_uniform",
}
FIGURES = {"rank_allocation": rank_allocation_from_file}


def run(cfg) -> None:
    if cfg.table not in TITLES and cfg.table not in FIGURES:
        raise ValueError(f"table={cfg.table!r} is not one of {sorted(TITLES) + sorted(FIGURES)}")
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


@hydra.main(config_path=CONF_DIR, config_name="collect", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
