"""Per-job overhead of a Snakemake run through SLURM, read from its log and benchmark files.

    python tests/cluster/overhead.py SNAKEMAKE_LOG BENCHMARK_DIR

For every job submitted to SLURM: the seconds from its submission to the moment Snakemake saw it
finish (the log's timestamps, to the second), beside the seconds the step itself ran inside the
job (its `benchmark:` file, where the rule has one). The difference is what the cluster path adds
per job: queueing, the job's own Snakemake start-up and DAG parse, and the status polling.
"""
from __future__ import annotations

import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_SUBMIT = re.compile(r"^Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (.*)\)\.$")
_FINISH = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")
_BENCH = re.compile(r"^\s+benchmark: (.*)$")
_JOBID = re.compile(r"^\s+jobid: (\d+)$")


def job_latencies(log_text: str) -> list[dict]:
    """One row per SLURM job: Snakemake job id, SLURM job id, rule, seconds submitted -> seen
    finished, and its benchmark file (or None)."""
    now, submitted, finished, benchmark = None, {}, {}, {}
    current_job, current_bench = None, None
    for line in log_text.splitlines():
        if m := _STAMP.match(line):
            now = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := _BENCH.match(line):
            current_bench = m.group(1)
        elif m := _JOBID.match(line):
            current_job = int(m.group(1))
            benchmark[current_job] = None
        elif m := _SUBMIT.match(line):
            job = int(m.group(1))
            submitted[job] = (now, m.group(2))
            if job == current_job:
                benchmark[job] = current_bench
            current_bench = None
        elif m := _FINISH.match(line):
            finished[int(m.group(1))] = (now, m.group(2))
    rows = []
    for job, (start, slurm_id) in sorted(submitted.items()):
        if job not in finished:
            continue
        end, rule = finished[job]
        rows.append({"job": job, "slurm_id": slurm_id, "rule": rule,
                     "latency_s": (end - start).total_seconds(), "benchmark": benchmark.get(job)})
    return rows


def step_seconds(benchmark_file: str | None) -> float | None:
    """The `s` column of a Snakemake benchmark file (the step's own wall time)."""
    if not benchmark_file or not Path(benchmark_file).is_file():
        return None
    lines = Path(benchmark_file).read_text().splitlines()
    return float(lines[-1].split("\t")[0]) if len(lines) > 1 else None


def summary(log_text: str) -> dict:
    rows = job_latencies(log_text)
    for r in rows:
        r["step_s"] = step_seconds(r["benchmark"])
    timed = [r for r in rows if r["step_s"] is not None]
    overhead = [r["latency_s"] - r["step_s"] for r in timed]
    return {"jobs": len(rows),
            "median_latency_s": statistics.median(r["latency_s"] for r in rows) if rows else None,
            "median_step_s": statistics.median(r["step_s"] for r in timed) if timed else None,
            "median_overhead_s": statistics.median(overhead) if overhead else None,
            "rows": rows}


if __name__ == "__main__":
    s = summary(Path(sys.argv[1]).read_text(errors="replace"))
    for r in s["rows"]:
        step = "-" if r["step_s"] is None else f"{r['step_s']:.1f}"
        print(f"slurm {r['slurm_id']:>5}  {r['rule']:<22} submitted->finished {r['latency_s']:6.0f} s  step {step} s")
    print(f"{s['jobs']} SLURM jobs: median submitted->finished {s['median_latency_s']} s, median step "
          f"{s['median_step_s']} s, median overhead {s['median_overhead_s']} s")
