import os
import re
import sys
from pathlib import Path

from palu.decompose.ranks import allocator_kind
from palu.pipeline import jobs, naming
from palu.pipeline.grid import Grid
from palu.pipeline.specs import shell_join
from palu.pipeline.tracking import check_tracking

GRID = Grid(config)
PY = sys.executable          # shell commands must use the venv's interpreter
W, R, M = GRID.work, GRID.results, GRID.model
CTAG, FTAG, MULT = GRID.ctag, GRID.ftag, config["rank_multiple"]
COMMON = " ".join(GRID.common_overrides())
# W&B for the steps that take no COMMON (collect, figures); a bad mode or an unwritable W&B
# folder stops the workflow here, before any step runs
TRACK = f"tracking={GRID.tracking.mode} paths.work={W} paths.results={R}"
check_tracking(GRID.tracking)
TABLES = GRID.tables()
# What each job asks of its scheduler (src/palu/pipeline/jobs.py, the grid's `resources:` block):
# a model job (one that loads the model) takes `threads: threads_of(step)` and `resources:
# **needs(step)` (host memory, wall time, `gpu=1` when the grid's device is cuda); every other job
# is a local rule (runs where Snakemake runs, never queued on a cluster). On CPU a model job is one
# thread: `--cores 2` runs two at once, and one job's imports (~8 s single-threaded) overlap the
# other's compute.
# Two `local` resources (a limit on what runs in one place, not on what is submitted): `gpu`, so
# a local run, which drives one GPU, runs its GPU jobs one at a time (`--resources gpu=N` to
# change that), and `model_jobs`, so the model jobs that the cluster profile bundles into one SLURM
# job run there one after another with one job's resources (unbounded, Snakemake sums them:
# four 1-CPU evaluations asked for 4 CPUs and 24 GB). Inside a cluster job (remote mode) it is 1,
# so the bundle keeps to what the job was given; locally the core count, which the
# one-thread-or-more model jobs never exceed anyway.
resource_scopes:
    gpu="local",
    model_jobs="local",

if "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", 1)
# GPU jobs sharing one GPU locally (`--resources gpu=N`, N > 1) each hold to 1/N of its memory
# (palu.pipeline.cli.common.limit_gpu_share), so no job starves the others; two runs on one GPU
# divide it with PALU_GPU_MEMORY (palu.pipeline.jobs.gpu_share). A step whose jobs need more
# (the grid's `resources: {<step>: {gpu_shares: k}}`) takes k of the N slots and k/N of the memory:
# `gpu_env(step)` puts its cap before its command (one value per step; empty on a cluster, where
# every GPU job has a GPU of its own).
GPUS_SHARED = getattr(workflow.global_resources["gpu"], "value", workflow.global_resources["gpu"]) or 1
LOCAL_GPU = workflow.local_exec and not workflow.remote_exec
if LOCAL_GPU:
    _share = jobs.gpu_share(GPUS_SHARED, os.environ.get(jobs.GPU_MEMORY_ENV))
    if _share is not None:
        os.environ["PALU_GPU_SHARE"] = _share

if "model_jobs" not in workflow.global_resources:
    workflow.register_resource("model_jobs", 1 if workflow.remote_exec
                               else workflow.global_resources["_cores"].value or 1)


def threads_of(step):
    return GRID.job_resources(step).threads


def gpu_env(step):
    share = GRID.gpu_share(step, GPUS_SHARED, os.environ.get(jobs.GPU_MEMORY_ENV)) if LOCAL_GPU else None
    return f"PALU_GPU_SHARE={share} " if share else ""


def needs(step):
    return {**GRID.scheduler_resources(step, GPUS_SHARED if LOCAL_GPU else None), "model_jobs": 1}


MODEL_DIR = GRID.prepared_model()

wildcard_constraints:
    corpus=r"[a-z0-9_]+",
    run="|".join(re.escape(tag) for tag in GRID.runs()),


def log(step, name):
    return str(naming.log_path(W, M, step, name))


def bench(step, name):
    return str(naming.benchmark_path(W, M, step, name))
