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
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _planned_rules(output: str) -> set[str]:
    return set(re.findall(r"^\s*(?:local)?rule (\w+):", output, re.M)) - {"all"}


def test_small_grid_end_to_end(prepared_model, tmp_path):
    results = TEST_WORK / "results"
    # every step reruns (as on a clean clone), so each one's W&B run can be checked
    for made in ("results", "calib", "ranks", "palu", "kvquant", "wandb", "journal"):
        shutil.rmtree(TEST_WORK / made, ignore_errors=True)
    _snakemake("--configfile", "conf/grid/small.yaml")
    for table in ("baseline", "granularity", "rank_allocation", "factors", "recovery", "byte_budget"):
        frame = pd.read_csv(results / "tables" / f"{table}.csv")
        assert {"model", "method", "corpus", "seqlen", "tokens", "ppl", "kept_ratio_target",
                "kept_ratio_realised", "group_size"} <= set(frame.columns)
        assert (frame["ppl"] > 1).all()
        assert "stand-in" in (results / "tables" / f"{table}.md").read_text()
    assert (results / "figures" / "rank_allocation.png").stat().st_size > 10_000
    # the (rank, bits) allocation is paired with the uniform checkpoint whose bytes it was given
    budget = pd.read_csv(results / "tables" / "byte_budget.csv")
    mixed = budget[budget["rank_method"] == "error_aware_bytes"]
    assert len(mixed) == 1 and mixed["reference"].str.contains("uniform-k0.5-g3-b4").all()
    assert mixed["diff_vs_ref"].notna().all()
    ref = budget[budget["method"] == mixed["reference"].item()]
    assert mixed["effective_bits"].item() <= ref["effective_bits"].item() + 1e-9
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

    # zero-shot through each cache, every method paired with FP16 on the same samples
    zs = pd.read_csv(results / "tables" / "zeroshot.csv")
    assert set(zs["method"]) == {"fp16", "palu-whitened-uniform-k0.5-g3-b4", "turboquant-b3"}
    assert (zs["piqa_n"] == 2).all() and (zs["winogrande_n"] == 2).all()
    assert zs["diff_lo"].le(zs["diff_vs_fp16"]).all() and zs["diff_vs_fp16"].le(zs["diff_hi"]).all()
    assert "Δ vs FP16" in (results / "tables" / "zeroshot.md").read_text()
    # needle retrieval and Qasper answers generated through each cache, and the needle heatmap
    lc = pd.read_csv(results / "tables" / "longcontext.csv")
    assert set(lc["method"]) == {"fp16", "palu-whitened-uniform-k0.5-g3-b4"}
    # each long-context job journaled its answers as it went, and removed the journal once done
    assert not list((TEST_WORK / "journal").glob("*.jsonl"))
    ruler = {"niah_single@512", "qa@512"}       # the RULER-style slice: one prompt per task
    assert set(lc["task"]) == {"needles", "needles_L160", "qasper_yesno", "average", *ruler}
    assert (lc.loc[lc["task"].isin(["needles", "needles_L160", "qasper_yesno"]), "n"] == 2).all()
    assert (lc.loc[lc["task"].isin(ruler), "n"] == 1).all() and (lc.loc[lc["task"] == "average", "n"] == 6).all()
    # the bytes each cache held per answer (document suites): Palu's 4-bit latents < FP16's K/V
    held = lc[lc["task"] == "qa@512"].set_index("method")["bytes_stored"]
    assert 0 < held["palu-whitened-uniform-k0.5-g3-b4"] < held["fp16"] / 4
    for fig in ("needle_heatmap", "ruler_bytes", "ruler_heatmap"):
        assert (results / "figures" / f"{fig}.png").stat().st_size > 10_000
    _check_wandb_runs(TEST_WORK / "wandb", results)

    # A rerun after success does nothing.
    assert "Nothing to be done" in _snakemake("--configfile", "conf/grid/small.yaml", "-n")

    # Changing the evaluation budget reruns evaluation and tables, not calibration or decomposition.
    grid = yaml.safe_load((ROOT / "conf/grid/small.yaml").read_text())
    grid["eval"]["max_tokens"] = 384
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(grid))
    planned = _planned_rules(_snakemake("--configfile", str(changed), "-n"))
    assert planned == {"evaluate", "collect_table", "ppl_vs_bytes_figure"}, planned


STEPS = {"calibrate": "gram", "fisher": "fisher", "ranks": "ranks", "decompose": "checkpoint",
         "kvquant_capture": "kvquant_activations", "fit_kvquant": "kvquant_state", "evaluate": "metrics",
         "generate": "memory", "zeroshot": "zeroshot", "longcontext": "longcontext", "recover": "checkpoint",
         "collect": None}


def _check_wandb_runs(wandb_dir, results):
    """One offline run per executed step (the small grid runs every step but prepare, which the
    fixture did), each with its config, summary and artifacts; a perplexity's lineage reaches
    the calibration through the checkpoint and the ranks; the collect runs hold the tables."""
    from palu.pipeline.cli.common import STEP_GROUPS
    from palu.pipeline.tracking import format_lineage, lineage, read_runs
    from palu.pipeline.tracking.artifacts import kinds
    KINDS = kinds()
    runs = read_runs(wandb_dir)
    jobs = {}
    for run in runs:
        jobs.setdefault(run.job_type, []).append(run)
    assert set(jobs) == set(STEPS), sorted(jobs)
    assert len({r.id for r in runs}) == len(runs)           # no step ran twice
    outputs = len(list((results / "runs").rglob("ppl-*.json")))
    assert len(jobs["evaluate"]) == outputs
    for job, kind in STEPS.items():
        for run in jobs[job]:
            assert run.exit_code == 0 and run.group in ("smollm2-135m", "tables"), (job, run.name)
            if kind:
                ours = [a["type"] for a in run.made if a["type"] in KINDS]   # W&B adds run_table ones
                assert ours == [kind], (job, run.name, run.made)
                # what it read and nothing else (an evaluating step: the checkpoint's manifest says the rest)
                groups = {k for k, v in run.config.items() if isinstance(v, dict) and k != "lineage"}
                if job in STEP_GROUPS:
                    assert groups == {"model", "paths", "tracking", *STEP_GROUPS[job]}, (job, run.name)
                if "calibration" in groups:
                    assert run.config["calibration"]["samples"] == 2, (job, run.name)
    assert all(r.summary["ppl"] > 1 for r in jobs["evaluate"])
    palu = sorted((results / "runs").rglob("palu-whitened-fisher-*/**/ppl-*.json"))[0]
    tree = lineage(palu, runs)
    text = format_lineage(tree)
    kinds = {c.kind: c for c in tree.inputs}
    assert tree.run.job_type == "evaluate" and {"checkpoint", "model"} <= set(kinds), text
    ckpt = {c.kind: c for c in kinds["checkpoint"].inputs}
    assert kinds["checkpoint"].run.job_type == "decompose" and {"gram", "ranks"} <= set(ckpt), text
    assert ckpt["gram"].run.job_type == "calibrate" and ckpt["ranks"].run.job_type == "ranks", text
    assert ckpt["ranks"].inputs[0].run.job_type == "fisher", text
    assert "different version" not in text, text
    tables = {r.name: r for r in jobs["collect"]}
    quant = tables["tables/quantization"]
    assert quant.media["tables/quantization"] == "table-file"
    assert quant.plots["quantization/ppl_vs_bits/wiki_standin"] == "wandb/scatter/v0"
    assert tables["figures/ppl_vs_bytes"].media["figures/ppl_vs_bytes"] == "image-file"


def test_slurm_profile_dry_run(prepared_model):
    out = _snakemake("--configfile", "conf/grid/small.yaml", "--profile", "workflow/profiles/slurm",
                     "-n", "--forcerun", "collect_table")
    assert "collect_table" in out
