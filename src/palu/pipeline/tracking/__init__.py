"""Experiment tracking (W&B): one run per pipeline step, artifacts with lineage, tables,
figures and native plots; offline runs can be read back without a server."""
from palu.pipeline.tracking.offline import format_lineage, lineage, read_run, read_runs
from palu.pipeline.tracking.wandb_run import StepRun, TrackingError, check_tracking, run_id, tracked_step

__all__ = ["StepRun", "TrackingError", "check_tracking", "format_lineage", "lineage", "read_run",
           "read_runs", "run_id", "tracked_step"]
