"""Step `collect`: tables (CSV + Markdown) and figures from the runs; logs them to W&B (tables as
W&B tables with their native plots, figures as images, each output an artifact of its inputs)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from palu.pipeline.reporting.figures import latent_outliers_figure, ppl_vs_bytes_figure, rank_allocation_figures
from palu.pipeline.reporting.memory_table import write_memory_table
from palu.pipeline.reporting.tables import build_table, write_table
from palu.pipeline.reporting.longcontext_table import needle_heatmap, write_longcontext_table
from palu.pipeline.reporting.ruler_figures import accuracy_vs_bytes, ruler_heatmap
from palu.pipeline.reporting.zeroshot_table import write_zeroshot_table
from palu.pipeline.cli.common import entry_point, log, tracked

TITLES = {
    "baseline": "Baseline perplexity (unmodified model)",
    "granularity": "Palu granularity: M-LRD / G-LRD / J-LRD x kept ratio (uniform ranks)",
    "rank_allocation": "Palu rank allocation: uniform vs the Fisher variants vs error_aware vs probe_select, "
                       "paired against uniform ranks",
    "latent_bits": "Palu latents stored at 16 / 8 / 4 / 3 / 2 bits (per-token, per-group min-max quantisation)",
    "hadamard": "Latent rotation fused into the factors (none / Walsh-Hadamard / random orthogonal) x latent bits",
    "quantization": "Palu + low-bit latents vs KV-cache quantisation (Atom, KIVI, TurboQuant, KVQuant) "
                    "at the bytes each cache really stores",
    "factors": "Factor objective: whitened SVD vs attention-weighted (values through W_o, keys by "
               "RoPE-averaged query energy), the same uniform ranks",
    "byte_budget": "(rank, bits) under a byte budget: error_aware_bytes (ranks per block, a latent width "
                   "per layer) against uniform ranks at one width, at the same latent bytes",
    "recovery": "LoRA recovery: each checkpoint before and after its latent projections are refined "
                "towards the uncompressed model (same ranks, same cache bytes)",
}
NEED_BYTES = {"quantization"}   # tables that compare methods at measured bytes
FIGURES = {"ppl_vs_bytes": ppl_vs_bytes_figure}


# what each output's inputs are, as tracked artifact kinds (default: metrics JSON)
INPUT_KINDS = {"rank_figure": "ranks", "ppl_vs_bytes": "table", "cache_memory": "memory",
               "zeroshot": "zeroshot", "longcontext": "longcontext", "needle_heatmap": "longcontext",
               "ruler_bytes": "longcontext", "ruler_heatmap": "longcontext"}
WRITERS = {"cache_memory": write_memory_table, "zeroshot": write_zeroshot_table,   # own formats
           "longcontext": write_longcontext_table}
MULTI_FIGURES = {"needle_heatmap": needle_heatmap,    # figures of several result files
                 "rank_figure": rank_allocation_figures, "ruler_bytes": accuracy_vs_bytes,
                 "ruler_heatmap": ruler_heatmap}


def _used(cfg, inputs: list[str]) -> dict:
    if cfg.table == "latent_outliers":          # the model folder, then checkpoints
        return {"model": inputs[0], "checkpoint": inputs[1:]}
    return {INPUT_KINDS.get(cfg.table, "metrics"): inputs}


def _check(cfg, inputs: list[str]) -> None:
    known = sorted(TITLES) + sorted(FIGURES) + ["latent_outliers"] + sorted(WRITERS) + sorted(MULTI_FIGURES)
    if cfg.table not in known:
        raise ValueError(f"table={cfg.table!r} is not one of {known} (GPU tables: "
                         "python -m palu_bench.cli.table)")
    if cfg.table == "latent_outliers" and len(inputs) < 2:
        raise ValueError("latent_outliers takes the model folder and at least one checkpoint")
    if cfg.table in FIGURES and len(inputs) != 1:
        raise ValueError(f"figure {cfg.table!r} takes exactly one input, got {len(inputs)}")
    missing = [p for p in inputs if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"table={cfg.table}: input(s) not found: {missing}")


def run(cfg) -> None:
    inputs = list(cfg.inputs)
    _check(cfg, inputs)
    config = OmegaConf.to_container(cfg, resolve=True)
    with tracked(cfg, "collect", cfg.out, used=_used(cfg, inputs), config=config) as wb:
        if cfg.table == "latent_outliers":
            latent_outliers_figure(inputs[0], inputs[1:], cfg.corpus, cfg.out)
        elif cfg.table in FIGURES:
            FIGURES[cfg.table](inputs[0], cfg.out)
        elif cfg.table in MULTI_FIGURES:
            MULTI_FIGURES[cfg.table](inputs, cfg.out)
        elif cfg.table in WRITERS:
            frame = WRITERS[cfg.table](inputs, cfg.out)
            _log_table(wb, cfg.table, frame, cfg.out)
        else:
            frame = build_table(inputs, need_bytes=cfg.table in NEED_BYTES, table=cfg.table)
            write_table(frame, cfg.out, TITLES[cfg.table])
            _log_table(wb, cfg.table, frame, cfg.out)
        if str(cfg.out).endswith(".png"):
            wb.image(f"figures/{cfg.table}", cfg.out)
            wb.make("figure", cfg.out)
    log.info("%s -> %s", cfg.table, cfg.out)


def _log_table(wb, table: str, frame, prefix: str) -> None:
    """The table as a W&B table, its native plots, and the CSV as an artifact."""
    wb.table(f"tables/{table}", frame)
    if wb.enabled:
        from palu.pipeline.tracking.plots import native_plots
        wb.log(native_plots(table, frame))
    wb.make("table", f"{prefix}.csv")


main = entry_point(run, config_name="collect", checked=False)


if __name__ == "__main__":
    main()
