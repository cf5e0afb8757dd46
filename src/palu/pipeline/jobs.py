"""What each pipeline job asks of its scheduler: CPU threads, host memory, wall time and a GPU.

One home for the defaults. A grid's `resources:` block overrides them for every model job, and
per step where it names one:

    resources:
      threads: 8            # CPU threads of every model job (OMP threads; SLURM --cpus-per-task)
      mem_mb: 64000         # host memory (SLURM --mem)
      runtime: 240          # minutes (SLURM --time)
      zeroshot: {runtime: 720}     # one step's own

A model job is one that loads the model (`MODEL_STEPS`). It asks for one GPU when the grid's
device is `cuda`; the GPU benchmarks always do. Everything else (tables, figures, the rank
allocators that only read statistics) runs where Snakemake runs (`localrules`), so it never
queues on a cluster. On a cluster the settings of the site (partition, account) are Snakemake
overrides, never part of a grid: see the README's "Run on a cluster".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from palu.pipeline.fitted import fitted_steps

# Steps that load the model, by rule name (a fitted method's capture and fit steps among them).
# `prepare` converts it on the CPU: no GPU.
MODEL_STEPS = ("prepare_model", "calibrate", "fisher", "ranks_probed", "decompose", "recover",
               *fitted_steps(), "evaluate", "zeroshot", "longcontext",
               "cache_memory_run", "latent_outliers_figure")
CPU_ONLY_STEPS = ("prepare_model",)
GPU_BENCHMARKS = ("latency", "decode", "scale")


@dataclass(frozen=True)
class JobResources:
    threads: int
    mem_mb: int
    runtime: int      # minutes
    # Of a local run's `--resources gpu=N` (N jobs sharing one GPU), the shares one job of the step
    # holds: k of the N slots and k / N of the run's memory (`gpu_share`). Qwen2.5-1.5B's Fisher
    # step needs ~12 GB where an evaluation needs ~8: `fisher: {gpu_shares: 2}`. At most N are
    # taken; on a cluster each GPU job has a GPU of its own and this is not used.
    gpu_shares: int = 1

    def check(self, where: str) -> "JobResources":
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"grid {where}.{f.name} must be a positive integer, got {value!r}")
        return self


# Per device: a CPU job is one thread (so `--cores 2` runs two of the embedded model's jobs at
# once; their resident memory peaks near 1.5 GB); a GPU job holds one GPU and feeds it from a few
# cores, with the host memory to load a 7B-8B model (README "Run on a cluster": measured needs).
DEFAULTS = {"cpu": JobResources(threads=1, mem_mb=6000, runtime=60),
            "cuda": JobResources(threads=8, mem_mb=64000, runtime=240)}


def _whole(value):
    """A whole number given as text (`--config 'resources={threads: 8}'` delivers strings)."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def job_resources(grid_resources: dict | None, device: str, step: str) -> JobResources:
    """The resources of one model job: the device's defaults, then the grid's `resources:`
    values, then the grid's entry for `step`. Unknown keys and bad values are errors. The GPU
    benchmarks take the GPU defaults whatever the grid's device."""
    device = "cuda" if step in GPU_BENCHMARKS else device
    if device not in DEFAULTS:
        raise ValueError(f"grid device {device!r} is not one of {sorted(DEFAULTS)}")
    given = dict(grid_resources or {})
    names = {f.name for f in fields(JobResources)}
    per_step = {k: v for k, v in given.items() if k not in names}
    stray = sorted(set(per_step) - set(MODEL_STEPS) - set(GPU_BENCHMARKS))
    if stray:
        raise ValueError(f"grid resources: {stray} are neither settings {sorted(names)} nor model "
                         f"steps {list(MODEL_STEPS + GPU_BENCHMARKS)}")
    out = replace(DEFAULTS[device], **{k: _whole(given[k]) for k in names & set(given)})
    own = per_step.get(step) or {}
    if not isinstance(own, dict) or set(own) - names:
        raise ValueError(f"grid resources.{step} must map some of {sorted(names)} to values, got {own!r}")
    return replace(out, **{k: _whole(v) for k, v in own.items()}).check(f"resources.{step}" if own else "resources")


def uses_gpu(device: str, step: str) -> bool:
    return step in GPU_BENCHMARKS or (device == "cuda" and step not in CPU_ONLY_STEPS)


def scheduler_resources(grid_resources: dict | None, device: str, step: str,
                        shared_by: int | None = None) -> dict:
    """The Snakemake `resources:` of a model job: `gpu: 1` where it runs on a GPU (the SLURM
    plugin turns it into `--gpus=1`); in a local run whose N GPU jobs share one GPU (`shared_by`
    = N), the step's `gpu_shares` of those N slots (at most N)."""
    r = asdict(job_resources(grid_resources, device, step))
    del r["threads"]
    shares = r.pop("gpu_shares")
    if not uses_gpu(device, step):
        return r
    return {**r, "gpu": min(shares, shared_by) if shared_by else 1}


GPU_MEMORY_ENV = "PALU_GPU_MEMORY"


def gpu_share(jobs_sharing: int, memory: str | None = None, shares: int = 1) -> str | None:
    """A local GPU job's memory cap (`PALU_GPU_SHARE`) when `jobs_sharing` jobs of this run share
    one GPU (`--resources gpu=N`): the run's part of the GPU (`PALU_GPU_MEMORY`, default 0.95) over
    N, times the job's `shares` of the N (at most N). Two runs on one GPU (two grids at once) each
    claim 0.95 by default and starve each other's jobs into out-of-memory errors (session 52);
    `PALU_GPU_MEMORY=0.6` for one and `0.35` for the other divides it. None: no cap (one job, the
    whole GPU)."""
    if isinstance(shares, bool) or not isinstance(shares, int) or shares < 1:
        raise ValueError(f"gpu_shares={shares!r} must be a positive integer")
    if memory is None and jobs_sharing <= 1:
        return None
    try:
        part = float(memory) if memory is not None else 0.95
    except ValueError:
        part = -1.0
    if not 0 < part <= 1:
        raise ValueError(f"{GPU_MEMORY_ENV}={memory!r} must be a fraction of the GPU in (0, 1]")
    n = max(1, jobs_sharing)
    return f"{part * min(shares, n) / n:.4f}"
