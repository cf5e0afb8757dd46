"""Entry point `table`: the GPU tables and figures from committed benchmark JSON (any machine).

    python -m palu_bench.cli.table table=latency 'inputs=[results/latency/h200-llama2-7b.json]' \\
        out=results/tables/latency figure=results/figures/latency_speedup.png
`table=latency` reads results/latency/*.json, `table=decode` results/decode/*.json, `table=scale`
results/scale/*.json (and projects `grid`'s GPU-hours from its DAG), `table=throughput`
results/throughput/*.json; each writes `<out>.csv`,
`<out>.md` and the figure. Only the JSON is read: nothing here needs a GPU.
"""
from __future__ import annotations

from pathlib import Path

import hydra

from palu.artifacts import read_json, write_text

from .common import CONF_DIR, log, tracked


def latency_outputs(inputs: list[str], prefix: str, figure: str):
    from ..report.latency import latency_frame, latency_markdown, speedup_figure
    frame = latency_frame(inputs)
    write_text(f"{prefix}.csv", frame.to_csv(index=False))
    write_text(f"{prefix}.md", latency_markdown(frame, read_json(inputs[0])["ceilings"]))
    speedup_figure(frame, figure)
    return frame


def decode_outputs(inputs: list[str], prefix: str, figure: str):
    from ..report.decode_e2e import decode_frame, decode_markdown, memory_figure
    frame, meta = decode_frame(inputs)
    write_text(f"{prefix}.csv", frame.to_csv(index=False))
    write_text(f"{prefix}.md", decode_markdown(frame, meta))
    memory_figure(frame, figure)
    return frame


def scale_outputs(inputs: list[str], prefix: str, figure: str, grid: str):
    from ..report.scale import (_newest_per_shape, grid_shape, hours_figure, projection, scale_frame,
                                scale_markdown)
    frame, runs = scale_frame(inputs), _newest_per_shape(inputs)
    shape = grid_shape(grid, runs)
    proj, notes = projection(frame, grid, shape, runs[shape]["shapes"][shape]["config"])
    write_text(f"{prefix}.csv", frame.drop(columns=["resident_before_bytes"], errors="ignore").to_csv(index=False))
    write_text(f"{prefix}.md", scale_markdown(frame, runs, proj, notes, grid, shape))
    hours_figure(proj, grid, shape, figure)
    return frame


def throughput_outputs(inputs: list[str], prefix: str, figure: str):
    from ..report.throughput import throughput_figure, throughput_frame, throughput_markdown
    frame, meta = throughput_frame(inputs)
    write_text(f"{prefix}.csv", frame.to_csv(index=False))
    write_text(f"{prefix}.md", throughput_markdown(frame, meta))
    throughput_figure(frame, figure, meta)
    return frame


TABLES = {"latency": latency_outputs, "decode": decode_outputs, "scale": scale_outputs,
          "throughput": throughput_outputs}


def run(cfg) -> None:
    if cfg.table not in TABLES:
        raise ValueError(f"table={cfg.table!r} is not one of {sorted(TABLES)}")
    inputs = list(cfg.inputs)
    if not inputs:
        raise ValueError(f"table={cfg.table}: no input JSON given")
    with tracked(cfg, "collect", name=f"tables/{Path(cfg.out).name}", used={"benchmark": inputs}) as wb:
        extra = {"grid": cfg.grid} if cfg.table == "scale" else {}
        frame = TABLES[cfg.table](inputs, cfg.out, cfg.figure, **extra)
        wb.table(f"tables/{cfg.table}", frame)
        if wb.enabled:
            from palu.pipeline.tracking.plots import native_plots
            wb.log(native_plots(cfg.table, frame))
        wb.image(f"figures/{Path(cfg.figure).stem}", cfg.figure)
        wb.make("table", f"{cfg.out}.csv")
        wb.make("figure", cfg.figure)
    log.info("%s table from %d files -> %s.{csv,md}, %s", cfg.table, len(inputs), cfg.out, cfg.figure)


@hydra.main(config_path=CONF_DIR, config_name="table", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
