"""W&B logging: one run per pipeline step, with the artifacts it used and made.

`tracking.mode` = offline (default: files under `tracking.dir`, sync later with
`python -m palu.pipeline.cli.sync`), online, or disabled (nothing written, nothing imported).

A run: job_type = the step, group = the model, name = the parameter tag of what it makes, config =
the step's full resolved config plus `lineage.used` (the artifacts it read: kind, name, path,
fingerprint). Its outputs are logged as artifacts (`StepRun.make`). Online, inputs are also
declared with `use_artifact`, so W&B's lineage graph is the Snakemake DAG; W&B cannot declare an
input offline, so offline runs keep the record in their config and `palu.pipeline.cli.sync` declares it
after uploading. A run's id is a hash of project, job type and name, so a rerun replaces its
offline run (the old folder is removed) or resumes its online one, never adds a second.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from palu.pipeline.tracking.artifacts import UPLOADS, alias_of, build, describe

MODES = ("offline", "online", "disabled")
log = logging.getLogger("palu")


class TrackingError(ValueError):
    """A `tracking.*` setting cannot work; raised before the step does any work."""


def check_tracking(tracking: Any) -> None:
    """Fail early on an unknown mode / upload policy or a W&B folder that cannot be written."""
    if tracking.mode not in MODES:
        raise TrackingError(f"tracking.mode={tracking.mode!r} is not one of {list(MODES)}")
    upload = getattr(tracking, "upload", "small")
    if upload not in UPLOADS:
        raise TrackingError(f"tracking.upload={upload!r} is not one of {list(UPLOADS)}")
    if tracking.mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise TrackingError(f"tracking.mode={tracking.mode} needs the wandb package, which is not "
                            "installed here (pip install wandb), or pass tracking.mode=disabled")
    folder = Path(tracking.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise TrackingError(f"tracking.dir={str(folder)!r} cannot be written ({err.strerror}); "
                            "choose a writable folder or tracking=disabled") from None


def run_id(project: str, job_type: str, name: str) -> str:
    """The W&B id of a step's run: the same settings give the same run."""
    return hashlib.sha256(f"{project}\0{job_type}\0{name}".encode()).hexdigest()[:32]


class StepRun:
    """A step's W&B run. Every method is a no-op when tracking is disabled (`run` None)."""

    def __init__(self, run: Any, tracking: Any, used: list[dict]):
        self.run, self.tracking, self.used = run, tracking, used
        self.made: list[dict] = []

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def make(self, kind: str, path: str | Path, **metadata) -> None:
        """Log an output as an artifact (call once the file or folder is complete)."""
        if self.run is None:
            return
        art, info = build(kind, path, getattr(self.tracking, "upload", "small"), metadata)
        self.run.log_artifact(art, aliases=["latest", alias_of(info["fingerprint"])])
        self.made.append(info)

    def metrics(self, metrics: dict) -> None:
        """Scalars of a result into the run's history and summary."""
        if self.run is None:
            return
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(scalars)
        self.run.summary.update(scalars)

    def table(self, key: str, frame) -> None:
        if self.run is None:
            return
        import wandb
        self.run.log({key: wandb.Table(dataframe=frame)})

    def image(self, key: str, png: str | Path) -> None:
        if self.run is None:
            return
        import wandb
        self.run.log({key: wandb.Image(str(png))})

    def log(self, items: dict) -> None:
        """Anything W&B can log (native plots from `tracking.plots`, say)."""
        if self.run is not None and items:
            self.run.log(items)


def _declare_used(run: Any, used: list[dict]) -> None:
    """Online: name each input as the exact version it was read at. An input that W&B does not
    hold (made offline and not synced yet, or not made by the pipeline) stays in the config."""
    for item in used:
        ref = f"{item['name']}:{alias_of(item['fingerprint'])}"
        try:
            run.use_artifact(ref, type=item["kind"])
        except Exception as err:   # W&B raises CommError / ValueError for a missing version
            log.warning("W&B has no artifact %s yet (%s); recorded in the run's config only", ref, err)


def _drop_offline_runs(folder: Path, rid: str) -> None:
    for old in (folder / "wandb").glob(f"offline-run-*-{rid}"):
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def tracked_step(tracking: Any, config: dict, job_type: str, name: str, group: str,
                 used: dict[str, Any] | None = None, args: list[str] | None = None) -> Iterator[StepRun]:
    """Yield the step's `StepRun`; the W&B run is always finished, with exit code 1 on error.

    `used` maps an artifact kind to the path (or list of paths) the step reads. `args`: the command
    line W&B records for this run (default: the process's); one job of a Hydra multirun passes its
    own overrides, not the whole sweep's."""
    check_tracking(tracking)
    if tracking.mode == "disabled":
        yield StepRun(None, tracking, [])
        return
    inputs = [describe(kind, p) for kind, paths in (used or {}).items()
              for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    import wandb
    folder = Path(tracking.dir)
    # The environment as it was: W&B's variables set here (and WANDB_SERVICE, which wandb sets when
    # it starts its service) are restored when the step ends, so a process that runs steps and
    # then launches others (a test, a notebook calling Snakemake) does not hand its children this
    # step's folders or a socket to its own service.
    saved = {k: os.environ.get(k) for k in _WANDB_ENV}
    try:
        # keep W&B's staging copies and caches inside the tracking folder, not in ~/.cache
        os.environ.setdefault("WANDB_CACHE_DIR", str(folder / ".cache"))
        os.environ.setdefault("WANDB_DATA_DIR", str(folder / ".data"))
        os.environ.setdefault("WANDB_SILENT", "true")
        yield from _run_step(wandb, tracking, folder, config, job_type, name, group, inputs, args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_WANDB_ENV = ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_SILENT", "WANDB_SERVICE")


@contextlib.contextmanager
def _argv(args: list[str] | None) -> Iterator[None]:
    """W&B reads the command line it records from sys.argv when the run starts."""
    if args is None:
        yield
        return
    saved = sys.argv
    sys.argv = [saved[0], *args]
    try:
        yield
    finally:
        sys.argv = saved


def _run_step(wandb, tracking, folder, config, job_type, name, group, inputs, args) -> Iterator[StepRun]:
    rid = run_id(tracking.project, job_type, name)
    if tracking.mode == "offline":
        _drop_offline_runs(folder, rid)      # a rerun replaces its run
    with _argv(args):
        run = _init(wandb, tracking, folder, config, job_type, name, group, rid, inputs)
    if tracking.mode == "online":
        _declare_used(run, inputs)
    step = StepRun(run, tracking, inputs)
    try:
        yield step
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.summary.update({"lineage/made": [m["name"] for m in step.made]})
    run.finish()


def _init(wandb, tracking, folder, config, job_type, name, group, rid, inputs):
    return wandb.init(project=tracking.project, entity=tracking.entity, dir=str(folder),
                      mode=tracking.mode, job_type=job_type, group=group, name=name, id=rid,
                      resume="allow", config={**config, "lineage": {"used": inputs}},
                      reinit="finish_previous", allow_val_change=True)
