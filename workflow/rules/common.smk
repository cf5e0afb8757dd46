import sys
from pathlib import Path

from palu.pipeline import naming
from palu.pipeline.grid import Grid, PaluSpec

GRID = Grid(config)
PY = sys.executable          # shell commands must use the venv's interpreter
W, R, M = GRID.work, GRID.results, GRID.model
CTAG, FTAG, MULT = GRID.ctag, GRID.ftag, config["rank_multiple"]
COMMON = " ".join(GRID.common_overrides())
TABLES = ["baseline", "granularity", "rank_search"]

wildcard_constraints:
    kept=r"[0-9.]+",
    group=r"\d+",
    method="uniform|fisher|fisher_uniform|fisher_sqrt",
    decomp="whitened|plain",
    corpus=r"[a-z0-9_]+",
    seqlen=r"\d+",
    tokens=r"\d+|all",


def max_tokens(wildcards):
    return "null" if wildcards.tokens == "all" else wildcards.tokens


def palu_overrides(w):
    return (f"palu.decomposition={w.decomp} palu.rank_method={w.method} "
            f"palu.kept_ratio={w.kept} palu.group_size={w.group}")


def checkpoint_of(w):
    tag = naming.palu_tag(w.decomp, w.method, w.kept, w.group)
    return str(naming.checkpoint_dir(W, M, CTAG, FTAG, tag, MULT, w.method))


def fisher_file():
    return str(naming.fisher_path(W, M, CTAG, FTAG))


def gram_file():
    return str(naming.gram_path(W, M, CTAG))


def ranks_of(w):
    return GRID.ranks_file(PaluSpec(w.decomp, w.method, float(w.kept), int(w.group)))
