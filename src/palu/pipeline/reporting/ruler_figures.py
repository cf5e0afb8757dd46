"""Figures of the RULER-style suite (`palu.eval.ruler_style`): accuracy against the bytes each
cache measured (stored, and read per decode step), one point per method with its 95% interval and
the Pareto front; and the needle heatmap over depth x length per method with n in every cell."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from palu.eval.stats import stratified_mean
from palu.methods import family_of

matplotlib.use("Agg")

FAMILY_COLOURS = {"fp16": "black", "low-rank": "#1b9e77", "quantisation": "#d95f02",
                  "eviction": "#7570b3", "selection": "#e7298a", "composition": "#66a61e"}


def _family(summary: dict) -> str:
    """The figure's colour group: the method's family (`family_of`), Palu as low-rank and the
    quantisers (their own names as families) as quantisation."""
    fam = family_of(summary)
    if fam in FAMILY_COLOURS:
        return fam
    return "low-rank" if fam == "palu" else "quantisation"


def _ruler_runs(runs: list[dict]) -> list[dict]:
    out = [r for r in runs if r["longcontext"].get("suite") == "ruler_style"]
    if not out:
        raise ValueError("these figures need ruler_style results (longcontext.suite=ruler_style)")
    return out


def method_points(runs: list[dict]) -> pd.DataFrame:
    """Per method: the average over tasks (each task one stratum) with its interval, and the mean
    bytes its cache held at the end of an answer (stored; read per decode step)."""
    rows = []
    for r in _ruler_runs(runs):
        samples = r["longcontext"]["samples"]
        tasks = list(dict.fromkeys(s["task"] for s in samples))
        ci = stratified_mean([[s["score"] for s in samples if s["task"] == t] for t in tasks])
        held = [s["cache_bytes"] for s in samples if "cache_bytes" in s]
        if len(held) != len(samples):
            raise ValueError(f"{r['summary']['method']}: {len(samples) - len(held)} samples lack the "
                             "bytes their cache held (results written before bytes were recorded)")
        rows.append({"method": r["summary"]["method"], "family": _family(r["summary"]),
                     "score": ci["value"], "lo": ci["lo"], "hi": ci["hi"], "n": len(samples),
                     "stored_mb": np.mean([h["stored"] for h in held]) / 2 ** 20,
                     "read_mb": np.mean([h["read_per_step"] for h in held]) / 2 ** 20})
    return pd.DataFrame(rows)


def pareto(frame: pd.DataFrame, x: str) -> pd.DataFrame:
    """The points no other point beats on both fewer bytes and a higher score."""
    ordered = frame.sort_values([x, "score"], ascending=[True, False])
    best, keep = -np.inf, []
    for i, row in ordered.iterrows():
        if row["score"] > best:
            keep.append(i)
            best = row["score"]
    return ordered.loc[keep]


def accuracy_vs_bytes(paths: list[str], out: str | Path) -> None:
    import matplotlib.pyplot as plt
    from palu.artifacts import read_json
    frame = method_points([read_json(p) for p in paths])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    for ax, x, label in ((axes[0], "stored_mb", "MiB stored at the end of an answer"),
                         (axes[1], "read_mb", "MiB read per decode step")):
        for fam, part in frame.groupby("family"):
            ax.errorbar(part[x], part["score"] * 100,
                        yerr=[(part["score"] - part["lo"]) * 100, (part["hi"] - part["score"]) * 100],
                        fmt="o", color=FAMILY_COLOURS[fam], label=fam, capsize=3, ms=6)
        front = pareto(frame, x)
        ax.plot(front[x], front["score"] * 100, color="grey", ls="--", lw=1, label="Pareto front")
        for _, row in frame.iterrows():
            ax.annotate(textwrap.shorten(row["method"].split("/")[0], 34, placeholder="…"),
                        (row[x], row["score"] * 100), fontsize=6.5, xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RULER-style average over tasks (%), 95% interval")
    axes[0].legend(fontsize=8)
    n = int(frame["n"].iloc[0])
    fig.suptitle(f"Accuracy against measured cache bytes ({n} prompts per method; overlapping "
                 "intervals: no difference shown)", fontsize=10)
    fig.tight_layout()
    _save(fig, out)


def ruler_heatmap(paths: list[str], out: str | Path, bins: int = 5, columns: int = 4) -> None:
    """Share of needle values found (the niah_* tasks) by depth bin x prompt length, a panel per
    method, each cell labelled with its share and n."""
    import matplotlib.pyplot as plt
    from palu.artifacts import read_json
    runs = _ruler_runs([read_json(p) for p in paths])
    cols = min(columns, len(runs))
    rows = -(-len(runs) // cols)
    # constrained layout: wrapped panel titles and the colour bar get their own room (with a fixed
    # grid, a two-line title ran into the x labels of the panel above)
    fig, axes = plt.subplots(rows, cols, figsize=(2.9 * cols + 0.8, 2.9 * rows + 0.6), squeeze=False,
                             sharey=True, layout="constrained")
    edges = np.linspace(0, 1, bins + 1)
    labels = [f"{edges[i]:.1f}-{edges[i + 1]:.1f}" for i in range(bins)]
    im = None
    for k, (ax, r) in enumerate(zip(axes.flat, runs)):
        s = pd.DataFrame([x for x in r["longcontext"]["samples"] if x["task"].startswith("niah_")])
        if s.empty:
            raise ValueError("the RULER heatmap needs niah_* tasks in longcontext.ruler_style.tasks")
        s["bin"] = np.clip(np.digitize(s["depth"], edges[1:-1]), 0, bins - 1)
        share = s.pivot_table(index="bin", columns="length", values="score", aggfunc="mean").reindex(range(bins))
        count = s.pivot_table(index="bin", columns="length", values="score", aggfunc="size").reindex(range(bins))
        im = ax.imshow(share.values, vmin=0, vmax=1, cmap="cividis", aspect="auto")
        ax.set_xticks(range(len(share.columns)), [f"{int(c)}" for c in share.columns], fontsize=8)
        ax.set_yticks(range(bins), labels, fontsize=7)
        for (i, j), v in np.ndenumerate(share.values):
            n = count.values[i, j]
            text = "no\nprompt" if np.isnan(v) else f"{100 * v:.0f}%\nn={int(n)}"
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5,
                    color="black" if np.isnan(v) or v >= 0.5 else "white")
        ax.set_title(textwrap.fill(r["summary"]["method"].split("/")[0], 26), fontsize=7)
        if k % cols == 0:
            ax.set_ylabel("needle depth")
        if k + cols >= len(runs):   # the lowest panel of its column
            ax.set_xlabel("prompt + answer tokens", fontsize=7)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="share of needle values found")
    fig.suptitle("RULER-style needles (niah_*) through each cache, by depth and length", fontsize=9)
    _save(fig, out)


def _save(fig, out) -> None:
    import matplotlib.pyplot as plt
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)
