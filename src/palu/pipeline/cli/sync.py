"""Entry point `sync`: upload the offline W&B runs and declare their inputs (see tracking/sync.py).

    wandb login && python -m palu.pipeline.cli.sync tracking.entity=<you>
"""
from __future__ import annotations

from palu.pipeline.tracking.offline import run_folders
from palu.pipeline.tracking.sync import sync
from palu.pipeline.cli.common import entry_point, log


def run(cfg) -> None:
    if not run_folders(cfg.tracking.dir):
        raise FileNotFoundError(f"no offline W&B runs under tracking.dir={cfg.tracking.dir!r}")
    sync(cfg.tracking.dir, cfg.tracking.project, cfg.tracking.entity, dry_run=cfg.dry_run,
         log=log.info)


main = entry_point(run, config_name="sync", checked=False)

if __name__ == "__main__":
    main()
