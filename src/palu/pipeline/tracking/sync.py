"""Uploading offline runs, then declaring what each one used, so W&B's lineage graph is the DAG.

W&B cannot record an input artifact offline (`use_artifact` needs the server), so an offline run
keeps its inputs in its config (`lineage.used`). `sync` uploads every run folder with `wandb sync`
(producers first: runs in order of start time, and a step starts after the steps it reads from), then
resumes each run that used something and calls `use_artifact` on the exact version it read (the
`fp-<fingerprint>` alias its producer gave it).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from palu.pipeline.tracking.artifacts import alias_of
from palu.pipeline.tracking.offline import OfflineRun, _wandb_cli, read_runs


@dataclass
class SyncPlan:
    folders: list[Path]                       # uploaded in this order
    uses: dict[str, list[str]]                # run id -> "name:alias" of every input to declare


def plan(wandb_dir: str | Path) -> tuple[SyncPlan, list[OfflineRun]]:
    runs = read_runs(wandb_dir)
    uses = {r.id: [f"{u['name']}:{alias_of(u['fingerprint'])}" for u in r.used]
            for r in runs if r.used}
    return SyncPlan([r.folder for r in runs], uses), runs


def sync(wandb_dir: str | Path, project: str, entity: str | None = None,
         dry_run: bool = False, log=print) -> SyncPlan:
    """Upload every offline run under `wandb_dir`, then declare the inputs of each."""
    todo, runs = plan(wandb_dir)
    log(f"{len(todo.folders)} offline runs, {sum(map(len, todo.uses.values()))} inputs to declare")
    if dry_run:
        for run in runs:
            log(f"  {run.job_type:16s} {run.name}: uses {todo.uses.get(run.id, [])}")
        return todo
    cmd = [_wandb_cli(), "sync", "--project", project] + (["--entity", entity] if entity else [])
    for folder in todo.folders:
        subprocess.run([*cmd, str(folder)], check=True)
    import wandb
    for run in runs:
        if run.id not in todo.uses:
            continue
        live = wandb.init(project=project, entity=entity, id=run.id, resume="must",
                          job_type=run.job_type, mode="online")
        for ref in todo.uses[run.id]:
            live.use_artifact(ref)
        live.finish()
    log("synced; lineage declared")
    return todo
