"""Step `collect`: tables (CSV + Markdown) and figures from the runs; logs tables to W&B."""
from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import OmegaConf

from ..reporting.figures import rank_allocation_from_file
from ..reporting.tables import build_table, write_table
from ..tracking.wandb_run import log_table, tracked_run
from .common import CONF_DIR, log

TITLES = {
    "baseline": "Baseline perplexity (unmodified model)",
    "granularity": "Palu granularity: M-LRD / G-LRD / J-LRD x kept ratio (uniform ranks)",
    "rank_search": "Palu rank allocation: uniform vs fisher vs fisher_uniform (vs our tempered fisher_sqrt)",
}
FIGURES = {"rank_allocation": rank_allocation_from_file}


def latency_outputs(inputs: list[str], prefix: str) -> None:
    """results/tables/latency.{csv,md} and results/figures/latency_speedup.png."""
    from ..io import read_json, write_text
    from ..reporting.latency import latency_frame, latency_markdown, speedup_figure
    frame = latency_frame(inputs)
    write_text(f"{prefix}.csv", frame.to_csv(index=False))
    write_text(f"{prefix}.md", latency_markdown(frame, read_json(inputs[0])["ceilings"]))
    figure = Path(prefix).parent.parent / "figures" / "latency_speedup.png"
    speedup_figure(frame, figure)


def decode_outputs(inputs: list[str], prefix: str) -> None:
    """results/tables/decode.{csv,md} and results/figures/memory_vs_context.png."""
    from ..io import write_text
    from ..reporting.decode import decode_frame, decode_markdown, memory_figure
    frame, meta = decode_frame(inputs)
    write_text(f"{prefix}.csv", frame.to_csv(index=False))
    write_text(f"{prefix}.md", decode_markdown(frame, meta))
    memory_figure(frame, Path(prefix).parent.parent / "figures" / "memory_vs_context.png")


GPU_TABLES = {"latency": latency_outputs, "decode": decode_outputs}


def run(cfg) -> None:
    known = sorted(TITLES) + sorted(FIGURES) + sorted(GPU_TABLES)
    if cfg.table not in known:
        raise ValueError(f"table={cfg.table!r} is not one of {known}")
    inputs = list(cfg.inputs)
    if cfg.table in GPU_TABLES:
        GPU_TABLES[cfg.table](inputs, cfg.out)
        log.info("%s table from %d files -> %s.{csv,md}", cfg.table, len(inputs), cfg.out)
        return
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
