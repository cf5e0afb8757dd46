"""The long-context table (paper Table 3 analogue) and the needle heatmap. Every suite's result
files (needles, Qasper, LongBench, RULER) give one row per method x task: the score with its 95%
interval (Wilson for 0/1 scores, bootstrap otherwise), the sample count, and the paired difference
to FP16 on the same samples; with more than one task, the average over tasks (each task weighs
the same) and its paired difference, bootstrapped within tasks."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from palu.eval.stats import paired_difference, stratified_mean, wilson_interval
from palu.artifacts import read_json
from palu.pipeline.reporting import write_frame

matplotlib.use("Agg")


def _suite(run: dict) -> str:
    return run["longcontext"].get("suite", "needles")


def _key(suite: str, sample: dict) -> tuple:
    if suite == "needles":
        return sample["kind"], sample["length"], sample["depth"], tuple(sample["answers"])
    return sample["task"], sample["id"]


def _load(paths: list[str]) -> list[dict]:
    runs = [read_json(p) for p in paths]
    first: dict[str, list] = {}
    for r in runs:
        suite = _suite(r)
        keys = [_key(suite, s) for s in r["longcontext"]["samples"]]
        if first.setdefault(suite, keys) != keys:
            raise ValueError(f"long-context {suite} results hold different samples; pairing needs the "
                             f"same longcontext.{suite}.* settings for every method")
    return runs


def _task_scores(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """method -> task -> the per-sample scores, in sample order (needles also per length)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        tasks = out.setdefault(r["summary"]["method"], {})
        samples = r["longcontext"]["samples"]
        if _suite(r) == "needles":
            tasks["needles"] = [s["score"] for s in samples]
            for n in sorted({s["length"] for s in samples}):
                tasks[f"needles_L{n}"] = [s["score"] for s in samples if s["length"] == n]
        else:
            for s in samples:
                tasks.setdefault(s["task"], []).append(s["score"])
    return out


def _interval(scores) -> tuple[float, float]:
    a = np.asarray(scores, dtype=float)
    if np.isin(a, (0.0, 1.0)).all():
        return wilson_interval(int(a.sum()), len(a))
    ci = stratified_mean([a])
    return ci["lo"], ci["hi"]


def longcontext_frame(paths: list[str]) -> pd.DataFrame:
    runs = _load(paths)
    scores = _task_scores(runs)
    meta = {r["summary"]["method"]: r["summary"] for r in runs}
    ref = scores.get("fp16")
    rows = []
    for method, tasks in scores.items():
        main = [t for t in tasks if not t.startswith("needles_L")]
        entries = list(tasks.items())
        if len(main) > 1:
            entries.append(("average", None))
        for task, values in entries:
            row = {"model": meta[method]["model"], "method": method,
                   "kv_bits": meta[method].get("kv_bits", 16), "task": task}
            if values is None:       # the average over tasks, each task one stratum
                ci = stratified_mean([tasks[t] for t in main])
                row.update(n=sum(len(tasks[t]) for t in main), score=ci["value"], lo=ci["lo"], hi=ci["hi"])
            else:
                lo, hi = _interval(values)
                row.update(n=len(values), score=float(np.mean(values)), lo=lo, hi=hi)
            if ref is not None and all(t in ref for t in main):
                if values is None:
                    d = stratified_mean([tasks[t] for t in main], reference=[ref[t] for t in main])
                    d = {"diff": d["value"], "lo": d["lo"], "hi": d["hi"], "significant": d["significant"]}
                else:
                    d = paired_difference(values, ref[task])
                row.update(diff_vs_fp16=d["diff"], diff_lo=d["lo"], diff_hi=d["hi"],
                           significant=d["significant"])
            rows.append(row)
    return pd.DataFrame(rows)


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def to_markdown(frame: pd.DataFrame, runs: list[dict]) -> str:
    tasks = list(dict.fromkeys(frame["task"]))
    n = frame.drop_duplicates("task").set_index("task")["n"]
    suites = sorted({_suite(r) for r in runs})
    lines = ["# Long-context evaluation (decode-time, through each method's cache)", "",
             f"Model {frame.iloc[0]['model']}; suites {', '.join(suites)}. Each prompt is prefilled into "
             "the method's cache and the answer generated through it (greedy; chat template where the "
             "task uses one). Scores in %: needles = share of the hidden numbers in the answer; "
             "qasper_yesno = the answer's first yes/no word is right (balanced subset, chance 50%); "
             "LongBench tasks by their official metrics. Samples per task: "
             + ", ".join(f"{t} {int(n[t])}" for t in tasks if t != "average" and not t.startswith("needles_L")) + "; the same samples for "
             "every method. Cells: score (Δ vs FP16, paired on the same samples); \"~\": the Δ's 95% "
             "interval contains 0 or the exact sign (McNemar) test is not below 0.05 — not a change. "
             "Intervals below.", ""]
    head = ["method", "bits", *[t.replace("needles_L", "needles ") + (" tok" if t.startswith("needles_L") else "")
                                for t in tasks]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, part in frame.groupby("method", sort=False):
        cells = []
        for t in tasks:
            r = part[part["task"] == t]
            if r.empty:
                cells.append("—")
                continue
            r = r.iloc[0]
            if method == "fp16" or pd.isna(r.get("diff_vs_fp16", np.nan)):
                cells.append(_pct(r["score"]))
            else:
                cells.append(f"{_pct(r['score'])} ({100 * r['diff_vs_fp16']:+.1f}"
                             + ("" if r["significant"] else " ~") + ")")
        lines.append("| " + " | ".join([method, str(int(part.iloc[0]["kv_bits"])), *cells]) + " |")
    lines += ["", "95% intervals (score; Δ vs FP16):", "",
              "| method | task | n | score | Δ vs FP16 |", "|---|---|---|---|---|"]
    for _, r in frame[~frame["task"].str.startswith("needles_L")].iterrows():
        diff = "—" if r["method"] == "fp16" or pd.isna(r.get("diff_vs_fp16", np.nan)) else (
            f"{100 * r['diff_vs_fp16']:+.1f} [{100 * r['diff_lo']:+.1f}, {100 * r['diff_hi']:+.1f}]")
        lines.append(f"| {r['method']} | {r['task']} | {int(r['n'])} | {_pct(r['score'])} "
                     f"[{_pct(r['lo'])}, {_pct(r['hi'])}] | {diff} |")
    return "\n".join(lines) + "\n"


def needle_heatmap(paths: list[str], out: str | Path) -> None:
    """Accuracy by needle depth (rows) x prompt length (columns), one panel per method."""
    import matplotlib.pyplot as plt
    runs = [r for r in _load(paths) if _suite(r) == "needles"]
    if not runs:
        raise ValueError("the needle heatmap needs needle results (longcontext.suite=needles)")
    fig, axes = plt.subplots(1, len(runs), figsize=(2.6 * len(runs) + 1, 3.2), squeeze=False)
    for ax, r in zip(axes[0], runs):
        frame = pd.DataFrame(r["longcontext"]["samples"])
        grid = frame.pivot_table(index="depth", columns="length", values="score", aggfunc="mean")
        im = ax.imshow(grid.values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid.columns)), [f"{int(c)}" for c in grid.columns])
        ax.set_yticks(range(len(grid.index)), [f"{d:g}" for d in grid.index])
        for (i, j), v in np.ndenumerate(grid.values):
            ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=8)
        ax.set_title(r["summary"]["method"], fontsize=7)
        ax.set_xlabel("prompt tokens")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)


def write_longcontext_table(paths: list[str], prefix: str | Path) -> pd.DataFrame:
    frame = longcontext_frame(paths)
    return write_frame(frame, prefix, to_markdown(frame, _load(paths)))
