"""Entry point `lineage`: the offline W&B runs read back, or one output's lineage through them.

    python -m palu.pipeline.cli.lineage target=results/runs/<model>/<run>/ppl-<corpus>-....json
prints the output, the step run that made it and, indented, what that step read, down to the
prepared model (the same DAG Snakemake ran). Without `target`: one line per step type.
"""
from __future__ import annotations

from pathlib import Path

from palu.pipeline.tracking.offline import format_lineage, lineage, overview, read_runs, run_folders
from palu.pipeline.cli.common import entry_point


def run(cfg) -> str:
    if not run_folders(cfg.tracking.dir):
        raise FileNotFoundError(f"no offline W&B runs under tracking.dir={cfg.tracking.dir!r}")
    runs = read_runs(cfg.tracking.dir)
    if cfg.target is None:
        text = f"{len(runs)} runs under {cfg.tracking.dir}\n{overview(runs)}"
    else:
        if not Path(cfg.target).exists():
            raise FileNotFoundError(f"target={cfg.target!r} does not exist")
        text = format_lineage(lineage(cfg.target, runs))
    print(text)
    return text


main = entry_point(run, config_name="lineage", checked=False)

if __name__ == "__main__":
    main()
