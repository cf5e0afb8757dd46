"""W&B logging: one run per pipeline step, grouped by model and job type.

`tracking.mode` = offline (default: files under `tracking.dir`, sync later with `wandb sync`),
online, or disabled (nothing written). A run's id is a hash of its project, job type and name
(and names are made of every setting, like result paths), so a rerun resumes the same W&B run
instead of adding a second one under the same name.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def tracked_run(tracking: Any, config: dict, job_type: str, name: str, group: str) -> Iterator[Any]:
    """Yield a W&B run (or None when disabled); always finished, also on error."""
    if tracking.mode == "disabled":
        yield None
        return
    import wandb
    Path(tracking.dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project=tracking.project, entity=tracking.entity, dir=tracking.dir,
                     mode=tracking.mode, job_type=job_type, group=group, name=name,
                     id=run_id(tracking.project, job_type, name), resume="allow",
                     config=config, reinit="finish_previous", allow_val_change=True)
    try:
        yield run
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()


def run_id(project: str, job_type: str, name: str) -> str:
    """The W&B id of a step's run: the same settings give the same run."""
    return hashlib.sha256(f"{project}\0{job_type}\0{name}".encode()).hexdigest()[:32]


def log_metrics(run: Any, metrics: dict) -> None:
    if run is None:
        return
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    run.log(scalars)
    run.summary.update(scalars)


def log_table(run: Any, key: str, frame) -> None:
    if run is None:
        return
    import wandb
    run.log({key: wandb.Table(dataframe=frame)})
