import re
import sys

from palu.decompose.factors import DECOMPOSITIONS
from palu.decompose.ranks import PROBED, RANK_METHODS
from palu.pipeline import naming
from palu.pipeline.grid import Grid, KVQuantSpec, PaluSpec
from palu.tracking import check_tracking

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
# Threads of every model job (calibration, Fisher, KVQuant, evaluate, zero-shot, long context,
# generate, decompose). On CPU one by default, so `--cores 2` runs two at once and one job's
# imports (~8 s of single-threaded start-up) overlap the other's compute (measured: two 4K-token
# evaluations 33 s in parallel against 41 s one after the other at 2 threads); calibration and
# Fisher, on the critical path, share the cores with the runs that need neither (FP16, the
# quantisation baselines). On a GPU every core, i.e. one job at a time, so jobs never share the
# device's memory. The grid's `job_threads` sets it.
JOB_THREADS = max(1, min(int(config.get("job_threads", 1 if GRID.device == "cpu" else workflow.cores)),
                         workflow.cores))
MODEL_DIR = GRID.prepared_model()

wildcard_constraints:
    kept=r"[0-9.]+",
    group=r"\d+",
    method="|".join(RANK_METHODS),
    decomp="|".join(DECOMPOSITIONS),
    corpus=r"[a-z0-9_]+",
    seqlen=r"\d+",
    tokens=r"\d+|all",
    run="|".join(re.escape(tag) for tag in GRID.runs()),
    rot=r"(-rot_[a-z_]+-s0)?",


def log(step, name):
    return str(naming.log_path(W, step, name))


def bench(step, name):
    return str(naming.benchmark_path(W, step, name))


def max_tokens(wildcards):
    return "null" if wildcards.tokens == "all" else wildcards.tokens


def spec_of(w):
    rotation = w.rot[len("-rot_"):-len("-s0")] if w.rot else "none"
    return PaluSpec(w.decomp, w.method, float(w.kept), int(w.group), rotation=rotation)
