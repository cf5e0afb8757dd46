"""The cluster lane (`make test-cluster`, tests/cluster/lane.sh): the small grid's targets through
the shipped SLURM profile on a real single-node SLURM cluster, with only the documented overrides
(a CPU partition, the squeue status command of a cluster without accounting), against the same
targets run locally; and a job that fails on the cluster is reported with its log paths.

Runs only where lane.sh started the cluster (PALU_CLUSTER_LANE=1); `make test` skips it."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("PALU_CLUSTER_LANE") != "1",
                                reason="cluster lane: run `make test-cluster` (starts a SLURM cluster)")
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
WORK = ROOT / "work" / "cluster"
GRID = "conf/grid/small.yaml"
TABLES = ("baseline", "granularity", "rank_allocation")
# the README's cluster command, with the overrides its "Run on a cluster" section documents
PROFILE = ["--profile", "workflow/profiles/slurm"]
SITE = ["--slurm-status-command", "squeue"]      # no accounting storage on the test cluster


def _snakemake(*args, check=True):
    proc = subprocess.run([SNAKEMAKE, *args], cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, out[-4000:]
    return proc.returncode, out


def _targets(work: Path) -> list[str]:
    return [str(work.relative_to(ROOT) / "results" / "tables" / f"{t}.csv") for t in TABLES]


def _config(work: Path) -> list[str]:
    rel = work.relative_to(ROOT)
    return ["--configfile", GRID, "--config", f"work={rel}", f"results={rel}/results"]


@pytest.fixture(scope="module")
def runs():
    """The same targets locally and through SLURM, each from an empty work folder."""
    local, cluster = WORK / "local", WORK / "slurm-run"
    for w in (local, cluster):
        shutil.rmtree(w, ignore_errors=True)
    _snakemake("--cores", "2", *_config(local), "--", *_targets(local))
    code, out = _snakemake(*PROFILE, *_config(cluster), "--default-resources", "slurm_partition=cpu",
                           *SITE, "--", *_targets(cluster))
    (WORK / "slurm-run.log").write_text(out)
    return local, cluster, out


def test_targets_through_slurm_equal_the_local_run(runs):
    local, cluster, out = runs
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+) \(log: (.*)\)", out)
    for jobid, log in submitted:
        print(f"SLURM job {jobid}: {log}")
    # model steps went to SLURM (prepare, calibrate, fisher, probed ranks, decompositions, grouped
    # evaluations); tables and the statistics-only rank allocators ran on the submit host
    assert len(submitted) >= 10, out[-3000:]
    assert re.search(r"localrule collect_table:", out) and re.search(r"localrule ranks_uniform:", out)
    assert not re.search(r"^rule collect_table:", out, re.M)
    for table in TABLES:
        a = (local / "results" / "tables" / f"{table}.csv").read_text()
        b = (cluster / "results" / "tables" / f"{table}.csv").read_text()
        assert a.replace(str(local.relative_to(ROOT)), "W") == b.replace(str(cluster.relative_to(ROOT)), "W"), table
    runs_local = sorted(p.relative_to(local) for p in (local / "results" / "runs").rglob("*.json"))
    runs_cluster = sorted(p.relative_to(cluster) for p in (cluster / "results" / "runs").rglob("*.json"))
    assert runs_local == runs_cluster and runs_local


def test_a_failing_cluster_job_is_reported_with_its_logs(runs):
    """An evaluation on a GPU (`device=cuda`) of a machine without one: submitted with --gpus=1
    to the gpu partition (the node's GPU, and the test node's size: one CPU, 4 GB), scheduled,
    fails there; Snakemake exits non-zero and names the rule's log (which holds the step's
    error) and the SLURM job's log."""
    _, cluster, _ = runs
    rel = cluster.relative_to(ROOT)
    target = f"{rel}/results/runs/smollm2-135m/fp16/ppl-novels_standin-L128-T256-float32-cf0.3.json"
    code, out = _snakemake(*PROFILE, "--configfile", GRID, "--config", f"work={rel}",
                           f"results={rel}/results", "device=cuda", "--default-resources",
                           "slurm_partition=gpu", "--set-threads", "evaluate=1", "--set-resources",
                           "evaluate:mem_mb=4000", *SITE, "--", target, check=False)
    (WORK / "failure.log").write_text(out)
    assert code != 0
    jobid = re.search(r"has been submitted with SLURM jobid (\d+) \(log: (.*)\)", out)
    assert jobid, out[-3000:]
    assert re.search(r"Error in (rule evaluate|group evaluations)", out), out[-3000:]
    rule_log = re.search(r"log: (\S*logs/smollm2-135m/evaluate/fp16/ppl-novels_standin-L128-T256-float32-cf0\.3\.log)", out)
    assert rule_log, out[-3000:]
    text = (ROOT / rule_log.group(1)).read_text()
    assert "cuda" in text.lower() or "CUDA" in text, text[-2000:]
    assert Path(jobid.group(2)).is_file()        # the failed job's SLURM log is kept
    job = subprocess.run(["scontrol", "show", "job", jobid.group(1)], capture_output=True, text=True).stdout
    assert "Partition=gpu" in job and re.search(r"gres[:/]gpu[:=]1", job), job     # it asked for the GPU
    assert not (ROOT / target).exists()
