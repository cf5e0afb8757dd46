"""results/tables/scale.{csv,md}: the paper-scale benchmark (results/scale/*.json) step by step,
and what a grid (conf/grid/paper.yaml) costs on that GPU, projected from the measured rates.

The projection counts the grid's jobs from its real DAG (a Snakemake dry run of the grid, with
the measured shape's config.json standing in for the prepared model, so nothing is loaded) and
prices each job by the rate its step ran at. Every assumption a price needs (corpus sizes, the
number of lm-eval requests, prompt lengths) is a row of `ASSUMPTIONS`, printed under the table.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from palu.artifacts import atomic_path, read_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
COLUMNS = ["device", "shape", "step", "variant", "seconds", "tokens", "tokens_per_s", "job_gpu_gib",
           "peak_gpu_gib", "ppl", "error"]
# What a job's price needs beyond the measured rates (tokens of a whole evaluation corpus under the
# Llama-2 tokenizer; lm-eval's own task sizes; the paper grid's long-context prompts).
ASSUMPTIONS = {
    "tokens:wikitext2": (341_469, "WikiText-2 test, Llama-2 tokenizer (GPTQ's 166 x 2048 windows)"),
    "tokens:c4": (524_288, "C4: the first 1100 validation documents, ~256 x 2048 tokens as in GPTQ"),
    "zeroshot_requests": (62_570, "lm-eval requests of the six tasks (hub splits, one per choice): "
                                  "PIQA 1838x2, ARC-e 2376x4, ARC-c 1172x4, HellaSwag 10042x4, "
                                  "WinoGrande 1267x2, OpenBookQA 500x4"),
    "tokens:needles": (160 * 2536, "needles: 4 kinds x 4 lengths x 5 depths x 2 = 160 prompts, "
                                   "mean 2536 tokens"),
    "tokens:qasper": (319 * 4000, "qasper: 319 questions, papers cut to 4000 tokens"),
}
# the grid section whose `batch_size` batches a measured step (the others: the step's own name)
SECTION = {"ppl": "eval"}
STEP_ORDER = ["calibrate", "fisher", "ranks_probed", "decompose", "kvquant_capture", "fit_kvquant",
              "evaluate", "zeroshot", "longcontext", "cache_memory_run"]


def _runs_per_shape(paths: list[str]) -> dict[str, list[dict]]:
    """Every run that measured a shape, oldest first (a partial run, `steps=[...]`, adds rows)."""
    runs: dict[str, list[dict]] = {}
    for p in paths:
        run = read_json(p)
        for shape in run["shapes"]:
            runs.setdefault(shape, []).append(run)
    if not runs:
        raise ValueError(f"no scale results in {paths}")
    return {shape: sorted(rs, key=lambda r: r["created"]) for shape, rs in runs.items()}


def _newest_per_shape(paths: list[str]) -> dict[str, dict]:
    return {shape: rs[-1] for shape, rs in _runs_per_shape(paths).items()}


def scale_frame(paths: list[str]) -> pd.DataFrame:
    """One row per (shape, step, variant): the newest run's that measured it (`run`: its date)."""
    rows = []
    for shape, runs in _runs_per_shape(paths).items():
        newest: dict[tuple, dict] = {}
        for run in runs:
            weights = run["shapes"][shape]["weight_bytes"]
            for r in run["rows"]:
                if r["shape"] != shape:
                    continue
                row = {**r, "device": run["device"], "run": run["created"]}
                if "peak_gpu_bytes" in r:
                    row["peak_gpu_gib"] = r["peak_gpu_bytes"] / 2 ** 30
                    # what a pipeline job holds: the model and this step's own extra (an install's
                    # extra is the benchmark's copy of the model, not part of a job; build and load
                    # make the model itself)
                    own = r["step"] not in ("install", "build", "load", "save")
                    extra = r["peak_gpu_bytes"] - r["resident_before_bytes"] if own else 0
                    row["job_gpu_gib"] = (weights + max(extra, 0)) / 2 ** 30
                newest.pop((r["step"], r["variant"]), None)   # re-inserted: the newer run's order
                newest[(r["step"], r["variant"])] = row
        rows += newest.values()
    frame = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in frame:
            frame[c] = None
    return frame[COLUMNS + [c for c in frame.columns if c not in COLUMNS]]


# ---- the grid's jobs -------------------------------------------------------------------------------
def grid_jobs(grid: str, model_config: dict, snakefile: Path = ROOT / "Snakefile") -> list[dict]:
    """Every model job of `grid`'s DAG: its rule and wildcards (a dry run in a scratch work folder
    whose prepared model is `model_config`, so the DAG is the one the grid would run)."""
    raw = yaml.safe_load(Path(grid).read_text())
    with tempfile.TemporaryDirectory() as work:
        models = Path(work) / "models" / raw["model"]
        models.mkdir(parents=True)
        (models / "config.json").write_text(json.dumps(model_config))
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("snakemake")), "-n", "--nolock", "--cores", "1",
             "--snakefile", str(snakefile), "--directory", str(snakefile.parent), "--configfile", str(grid),
             "--config", f"work={work}", f"results={work}/results"],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"dry run of {grid} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        # a checkpoint's settings are the grid's spec of its folder (the decompose wildcard)
        from palu.pipeline import naming
        from palu.pipeline.grid import Grid
        checkpoints = Grid({**raw, "work": work, "results": f"{work}/results"}).checkpoints()
        root = naming.palu_root(work, raw["model"])
    jobs, current = [], None
    for line in proc.stdout.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            current = {"rule": m.group(1), "wildcards": {}}
            jobs.append(current)
        elif current is not None and (m := re.match(r"^\s+wildcards: (.*)$", line)):
            current["wildcards"] = dict(kv.split("=", 1) for kv in m.group(1).split(", "))
            if current["rule"] == "decompose":
                current["spec"] = checkpoints[str(root / current["wildcards"]["name"])]
    return jobs


def method_label(run: str) -> str:
    """A run's cache method as the benchmark labels it ('palu-b4', 'kivi-b2', 'fp16', ...)."""
    tag = run.split("/")[0]
    if tag.startswith("palu-"):
        bits = re.search(r"-b(\d+)$", tag)
        return f"palu-b{bits.group(1) if bits else 16}"
    name = tag.split("-")[0]
    bits = re.search(r"-b(\d+)", tag)
    return name + (f"-b{bits.group(1)}" if bits else "")


class Rates:
    """One shape's measured steps, as seconds for a job's parts."""

    def __init__(self, frame: pd.DataFrame, shape: str):
        self.ok = frame[(frame["shape"] == shape) & frame["error"].isna()]
        self.notes: list[str] = []

    def seconds(self, step: str, variant: str = "") -> float:
        hit = self.ok[(self.ok["step"] == step) & (self.ok["variant"] == variant)]
        if hit.empty:
            raise KeyError(f"no measured {step} {variant!r}")
        return float(hit["seconds"].iloc[0])

    def rate(self, step: str, variant: str) -> tuple[float, str]:
        """tokens/s of `step` for a method, else of its family's measured width (noted)."""
        rows = self.ok[self.ok["step"] == step]
        hit = rows[rows["variant"] == variant]
        if hit.empty:
            family = rows[rows["variant"].str.split("-").str[0] == variant.split("-")[0]]
            if family.empty:
                raise KeyError(f"no measured {step} for {variant}")
            hit = family.iloc[[0]]
            self.notes.append(f"{step} {variant}: at the measured rate of {hit['variant'].iloc[0]}")
        return float(hit["tokens_per_s"].iloc[0]), hit["variant"].iloc[0]

    def suite_rate(self, step: str, variant: str, grid: dict) -> tuple[float, str]:
        """The rate a suite's job runs at: `step`_batched where the grid batches it
        (`<section>.batch_size` other than 1; perplexity's section is `eval`) and it was
        measured, else one at a time (noted)."""
        if (grid.get(SECTION.get(step, step)) or {}).get("batch_size", 1) != 1:
            try:
                return self.rate(f"{step}_batched", variant)
            except KeyError:
                self.notes.append(f"{step} {variant}: at the one-at-a-time rate (no batched rate measured)")
        return self.rate(step, variant)

    def decompose(self, group: int) -> float:
        measured = {int(v[1:]): v for v in self.ok[self.ok["step"] == "decompose"]["variant"]}
        g = min(measured, key=lambda m: abs(m - group))
        return sum(self.seconds(s, measured[g]) for s in ("decompose", "source_hash", "save_checkpoint"))


def job_seconds(job: dict, rates: Rates, grid: dict) -> float | None:
    """One job's GPU seconds: loading the model, then its work at the measured rate."""
    rule, w = job["rule"], job["wildcards"]
    load = rates.seconds("load")
    if rule == "calibrate":
        c = grid["calibration"]
        return load + c["samples"] * c["seqlen"] / rates.rate("gram", "")[0]
    if rule == "fisher":
        f = grid["fisher"]
        return load + f["samples"] * f["seqlen"] / rates.rate("fisher", "")[0]
    if rule == "ranks_probed":
        probed = [v for v in rates.ok[rates.ok["step"] == "ranks"]["variant"] if v.startswith("probe_select")][0]
        svds = [v for v in rates.ok[rates.ok["step"] == "whitened_svds"]["variant"]][0]
        return load + rates.seconds("whitened_svds", svds) + rates.seconds("ranks", probed)
    if rule == "decompose":
        return load + rates.decompose(job["spec"].group_size)
    if rule == "kvquant_capture":
        k = grid["quantization"]["kvquant"]
        return load + k["samples"] * k["seqlen"] / rates.rate("kvquant_capture", "")[0]
    if rule == "fit_kvquant":
        return rates.seconds("fit_kvquant", [v for v in rates.ok[rates.ok["step"] == "fit_kvquant"]["variant"]][0])
    if rule not in ("evaluate", "zeroshot", "longcontext", "cache_memory_run"):
        return None
    method = method_label(w["run"])
    start = load + (rates.seconds("install", method) if method in set(rates.ok["variant"]) else 0.0)
    if rule == "evaluate":
        return start + ASSUMPTIONS[f"tokens:{w['corpus']}"][0] / rates.suite_rate("ppl", method, grid)[0]
    if rule == "zeroshot":
        rate, _ = rates.suite_rate("zeroshot", method, grid)
        req = rates.ok[rates.ok["step"].isin(["zeroshot", "zeroshot_batched"])]
        tokens = float((req["tokens"] / req["requests"]).iloc[0])   # tokens per timed request
        return start + ASSUMPTIONS["zeroshot_requests"][0] * tokens / rate
    if rule == "longcontext":
        suite = w["suite"].split("-")[0]
        return start + ASSUMPTIONS[f"tokens:{suite}"][0] / rates.suite_rate("longcontext", method, grid)[0]
    return start + grid["memory"]["context"] / rates.rate("longcontext", method)[0]


def projection(frame: pd.DataFrame, grid: str, shape: str, model_config: dict) -> tuple[pd.DataFrame, list[str]]:
    """GPU-hours of `grid` per step kind at `shape`'s measured rates."""
    raw = yaml.safe_load(Path(grid).read_text())
    rates, out = Rates(frame, shape), {}
    for job in grid_jobs(grid, model_config):
        seconds = job_seconds(job, rates, raw)
        if seconds is None:
            continue
        row = out.setdefault(job["rule"], {"step": job["rule"], "jobs": 0, "gpu_hours": 0.0, "max_job_min": 0.0})
        row["jobs"] += 1
        row["gpu_hours"] += seconds / 3600
        row["max_job_min"] = max(row["max_job_min"], seconds / 60)
    rows = [out[s] for s in STEP_ORDER if s in out]
    table = pd.DataFrame(rows)
    table["min_per_job"] = table["gpu_hours"] * 60 / table["jobs"]
    return table, sorted(set(rates.notes))


# ---- outputs ---------------------------------------------------------------------------------------
def scale_markdown(frame: pd.DataFrame, runs: dict, proj: pd.DataFrame, notes: list[str],
                   grid: str, shape: str) -> str:
    out = ["# Paper scale on one GPU (`palu_bench.scale`, results/scale/)", "",
           "Every library step of the paper grid at 7B-8B shapes, random fp16 weights (times and "
           "memory, not quality). `job GPU GiB`: what a pipeline job of that step holds (the model's "
           "weights plus the step's own peak). Windows of 4096 tokens; tokens/s per step.", ""]
    for shape_name, run in runs.items():
        sub = frame[frame["shape"] == shape_name].copy()
        cfg = run["config"]
        made = sorted(set(sub["run"]))
        devices = sorted(set(sub["device"]))
        out += [f"## {shape_name} on {' and '.join(devices)} ({', '.join(made)}; torch {run['versions']['torch']}, "
                f"transformers {run['versions']['transformers']})", "",
                f"Weights {run['shapes'][shape_name]['weight_bytes'] / 2**30:.1f} GiB; Gram {cfg['gram_windows']}, "
                f"Fisher {cfg['fisher_windows']}, perplexity {cfg['eval_windows']} windows of {cfg['seqlen']}; "
                f"long context {cfg['longcontext']['context']} + {cfg['longcontext']['new_tokens']} tokens; "
                f"zero-shot {cfg['zeroshot']['requests']} requests of {cfg['zeroshot']['length']} tokens."]
        if cfg.get("eval_batch"):
            out[-1] += (f" Batched perplexity: {cfg['eval_batch']['windows']} windows, "
                        f"{cfg['eval_batch']['batch']} a forward.")
        if "batch" in cfg["zeroshot"]:
            out[-1] += (f" Batched: zero-shot {cfg['zeroshot']['batch_requests']} requests, "
                        f"{cfg['zeroshot']['batch']} a forward; long context {cfg['longcontext']['batch']} prompts "
                        f"of {cfg['longcontext']['batch_context']} + {cfg['longcontext']['new_tokens']} tokens "
                        "together (`answer_batches`).")
        if len(made) > 1:
            out[-1] += (f" Rows from {len(made)} runs (a later partial run measured some steps again): "
                        "each row is its step's newest measurement, `run` says which.")
        if len(devices) > 1:
            out[-1] += (f" The runs used {len(devices)} kinds of GPU (`device` says which): the projection "
                        "below prices each step at the rate of the GPU that measured it last.")
        out.append("")
        sub["step"] = sub["step"] + sub["variant"].map(lambda v: f" {v}" if v else "")
        sub["error"] = sub["error"].fillna("")
        cols = (["step", "seconds", "tokens_per_s", "job_gpu_gib", "error"] + (["run"] if len(made) > 1 else [])
                + (["device"] if len(devices) > 1 else []))
        shown = sub[cols].astype(object).where(sub[cols].notna(), None)
        out.append(shown.rename(columns={"tokens_per_s": "tokens/s", "job_gpu_gib": "job GPU GiB"})
                   .to_markdown(index=False, floatfmt=".2f", missingval=""))
        if run.get("checks"):
            out += ["", "GPU against CPU (float64, tiny model): " + "; ".join(
                f"{c['check']} {c['rel_diff']:.1e}" for c in run["checks"])]
        out.append("")
    total = proj["gpu_hours"].sum()
    out += [f"## Projected GPU-hours of `{grid}` at {shape}'s rates", "",
            "Jobs from the grid's own DAG (Snakemake dry run); each job = loading the model + its work at "
            "the measured rate (process start and imports not included).", "",
            proj.rename(columns={"gpu_hours": "GPU-hours", "min_per_job": "min / job",
                                 "max_job_min": "longest job (min)"})
            [["step", "jobs", "min / job", "longest job (min)", "GPU-hours"]].to_markdown(index=False, floatfmt=".2f"),
            "", f"**Total: {total:.1f} GPU-hours** ({proj['jobs'].sum()} GPU jobs).", "", "Assumptions:"]
    out += [f"- {text} ({value:,})" for value, text in ASSUMPTIONS.values()]
    g = yaml.safe_load(Path(grid).read_text())
    for job, step in (("evaluate", "ppl"), ("zeroshot", "zeroshot"), ("longcontext", "longcontext")):
        section = SECTION.get(step, step)
        size = (g.get(section) or {}).get("batch_size", 1)
        out.append(f"- {job} jobs: the grid's `{section}.batch_size` is {size!r}, so "
                   + ("one window / request / prompt at a time" if size == 1 else
                      f"at the `{step}_batched` rates where measured, else one at a time (listed below; a "
                      "fixed batch: `auto` searches for the largest that fits, and another fixed size runs "
                      "at another rate: a bound, not a measurement)"))
    out += ["- every Palu run at the rates of the G-LRD-4 checkpoint the benchmark evaluates "
            "(M-LRD rebuilds keys faster, J-LRD slower); probed ranks at probe_select's G-LRD-4 time",
            "- loading: the measured `load` (from the page cache); a cold read from a cluster file "
            "system adds ~weights / its bandwidth"]
    out += [f"- {n}" for n in _grouped(notes)]
    return "\n".join(out) + "\n"


def _grouped(notes: list[str]) -> list[str]:
    """The one-at-a-time fallbacks as one line a step (variants listed), the other notes as given."""
    alone: dict[str, list[str]] = {}
    rest = []
    for n in notes:
        if m := re.match(r"^(\w+) (\S+): at the one-at-a-time rate \(no batched rate measured\)$", n):
            alone.setdefault(m.group(1), []).append(m.group(2))
        else:
            rest.append(n)
    return [f"{step}: at the one-at-a-time rate (no batched rate measured) for {', '.join(v)}"
            for step, v in alone.items()] + rest


def hours_figure(proj: pd.DataFrame, grid: str, shape: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh(proj["step"][::-1], proj["gpu_hours"][::-1], color="tab:blue")
    for y, (h, n) in enumerate(zip(proj["gpu_hours"][::-1], proj["jobs"][::-1])):
        ax.text(h, y, f" {h:.1f} h ({n} jobs)", va="center", fontsize=8)
    ax.set_xlabel("projected GPU-hours")
    ax.set_title(f"{Path(grid).name} at {shape} shapes: {proj['gpu_hours'].sum():.1f} GPU-hours", fontsize=10)
    ax.set_xlim(0, proj["gpu_hours"].max() * 1.35)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130, format="png")
    plt.close(fig)


def grid_shape(grid: str, runs: dict) -> str:
    """The measured shape that stands for the grid's model (llama2-7b for conf/grid/paper.yaml)."""
    model = yaml.safe_load(Path(grid).read_text())["model"]
    for shape in runs:
        if model.startswith(shape.split("-")[0]) and shape.split("-")[1] in model:
            return shape
    raise ValueError(f"grid model {model!r}: no measured shape among {sorted(runs)}")
