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
    if len(a) < 2:      # one fractional score: no spread to estimate an interval from
        return 0.0, 1.0
    ci = stratified_mean([a])
    return ci["lo"], ci["hi"]


def _task_bytes(runs: list[dict]) -> dict[tuple[str, str], dict]:
    """(method, task) -> the mean bytes its cache held at the end of an answer (stored; read per
    decode step), where the results recorded them."""
    out = {}
    for r in runs:
        by_task: dict[str, list] = {}
        for s in r["longcontext"]["samples"]:
            if "cache_bytes" in s:
                by_task.setdefault(s.get("task", "needles"), []).append(s["cache_bytes"])
        for task, held in by_task.items():
            out[(r["summary"]["method"], task)] = {
                "bytes_stored": float(np.mean([h["stored"] for h in held])),
                "bytes_read_per_step": float(np.mean([h["read_per_step"] for h in held]))}
    return out


def longcontext_frame(paths: list[str]) -> pd.DataFrame:
    runs = _load(paths)
    scores = _task_scores(runs)
    held = _task_bytes(runs)
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
                elif len(values) < 2:   # one pair: no interval to estimate (a bootstrap says zero width)
                    d = {"diff": float(np.mean(values) - np.mean(ref[task])), "lo": -1.0, "hi": 1.0,
                         "significant": False}
                else:
                    d = paired_difference(values, ref[task])
                row.update(diff_vs_fp16=d["diff"], diff_lo=d["lo"], diff_hi=d["hi"],
                           significant=d["significant"])
            row.update(held.get((method, task), {}))
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


FOUND, MISSED = "#2166ac", "#f4a582"      # blue / light orange: apart for red-green colour blindness


def needle_heatmap(paths: list[str], out: str | Path, columns: int = 4) -> None:
    """Needles found by depth (rows) x prompt length (columns), one panel per method, `columns`
    panels a row. Each cell says how many of its prompts found the needle (k/n); with one prompt
    a cell the colours are two (found / missed), otherwise a share scale."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    runs = [r for r in _load(paths) if _suite(r) == "needles"]
    if not runs:
        raise ValueError("the needle heatmap needs needle results (longcontext.suite=needles)")
    frames = [pd.DataFrame(r["longcontext"]["samples"]) for r in runs]
    binary = all(f["score"].isin([0.0, 1.0]).all() and f.groupby(["depth", "length"]).size().max() == 1
                 for f in frames)
    cols = min(columns, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.5 * cols + 0.6, 2.7 * rows + 0.6), squeeze=False,
                             sharey=True)
    cmap = ListedColormap([MISSED, FOUND]) if binary else plt.get_cmap("cividis")
    for k, (ax, r, frame) in enumerate(zip(axes.flat, runs, frames)):
        share = frame.pivot_table(index="depth", columns="length", values="score", aggfunc="mean")
        found = frame.pivot_table(index="depth", columns="length", values="score", aggfunc="sum")
        count = frame.pivot_table(index="depth", columns="length", values="score", aggfunc="size")
        im = ax.imshow(share.values, vmin=0, vmax=1, cmap=cmap, aspect="auto")
        ax.set_xticks(range(len(share.columns)), [f"{int(c)}" for c in share.columns], fontsize=8)
        ax.set_yticks(range(len(share.index)), [f"{d:g}" for d in share.index], fontsize=8)
        for (i, j), v in np.ndenumerate(found.values):
            text = f"{v:g}/{count.values[i, j]}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="white" if share.values[i, j] >= 0.5 else "black")
        ax.set_title(textwrap.fill(r["summary"]["method"].replace("-", "-\u200b"), 24).replace("\u200b", ""),
                     fontsize=7.5)
        if k % cols == 0:
            ax.set_ylabel("needle depth")
        if k // cols == rows - 1 or k + cols >= len(runs):
            ax.set_xlabel("prompt tokens", fontsize=8)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    if binary:
        fig.legend(handles=[Patch(color=FOUND, label="needle found"), Patch(color=MISSED, label="missed")],
                   loc="lower center", ncol=2, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.02))
    else:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="share of the needles found")
    fig.suptitle("Needle retrieval through each cache: found / prompts per depth x length", fontsize=9)
    fig.tight_layout(rect=(0, 0.04 if binary else 0, 1, 0.97))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)


def write_longcontext_table(paths: list[str], prefix: str | Path) -> pd.DataFrame:
    frame = longcontext_frame(paths)
    return write_frame(frame, prefix, to_markdown(frame, _load(paths)))
