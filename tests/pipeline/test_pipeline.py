"""The Snakemake DAG on the small grid: builds every table, then has nothing to do, and a changed
parameter reruns only what depends on it."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import ROOT, TEST_WORK

pytestmark = pytest.mark.slow
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def _snakemake(*args):
    proc = subprocess.run([SNAKEMAKE, "--cores", "2", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _planned_rules(output: str) -> set[str]:
    return set(re.findall(r"^\s*(?:local)?rule (\w+):", output, re.M)) - {"all"}


def test_small_grid_end_to_end(prepared_model, tmp_path):
    results = TEST_WORK / "results"
    shutil.rmtree(results, ignore_errors=True)
    _snakemake("--configfile", "conf/grid/small.yaml")
    for table in ("baseline", "granularity", "rank_search"):
        frame = pd.read_csv(results / "tables" / f"{table}.csv")
        assert {"model", "method", "corpus", "seqlen", "tokens", "ppl", "kept_ratio_target",
                "kept_ratio_realised", "group_size"} <= set(frame.columns)
        assert (frame["ppl"] > 1).all()
        assert "stand-in" in (results / "tables" / f"{table}.md").read_text()
    assert (results / "figures" / "rank_allocation.png").stat().st_size > 10_000
    # the quantization table compares every method at the bytes its real cache held
    quant = pd.read_csv(results / "tables" / "quantization.csv")
    assert {"fp16", "palu", "kivi", "turboquant", "kvquant"} == set(quant["family"])
    assert quant["effective_bits"].notna().all() and (quant["effective_bits"] < 16).sum() == len(quant) - 1
    assert (results / "figures" / "ppl_vs_bytes.png").stat().st_size > 10_000
    memory = pd.read_csv(results / "tables" / "cache_memory.csv")
    assert {"atom-b4", "kvquant-b3-uniform-o0.01"} <= set(memory["method"])
    assert (memory["context"] == 256).all() and memory["text"].str.len().gt(0).all()
    assert memory.loc[memory["method"] == "fp16", "ratio_vs_fp16"].item() == 1.0
    gran = pd.read_csv(results / "tables" / "granularity.csv")
    assert set(gran["granularity"]) == {"-", "M-LRD", "J-LRD"}
    # The grid's name for each run (its result path) is the one evaluate derived from the
    # checkpoint's own manifest: calibration, Fisher and rank multiple included.
    runs = sorted((results / "runs").rglob("ppl-*.json"))
    assert len(runs) >= 5   # the small grid: fp16 and four Palu runs on one corpus
    for path in runs:
        run = json.loads(path.read_text())["metrics"]["run"]
        assert path.parent == results / "runs" / "smollm2-135m" / run, (path, run)

    # A rerun after success does nothing.
    assert "Nothing to be done" in _snakemake("--configfile", "conf/grid/small.yaml", "-n")

    # Changing the evaluation budget reruns evaluation and tables, not calibration or decomposition.
    grid = yaml.safe_load((ROOT / "conf/grid/small.yaml").read_text())
    grid["eval"]["max_tokens"] = 384
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(grid))
    planned = _planned_rules(_snakemake("--configfile", str(changed), "-n"))
    assert planned == {"evaluate", "collect_table", "ppl_vs_bytes_figure"}, planned


def test_slurm_profile_dry_run(prepared_model):
    out = _snakemake("--configfile", "conf/grid/small.yaml", "--profile", "workflow/profiles/slurm",
                     "-n", "--forcerun", "collect_table")
    assert "collect_table" in out
