"""The long-context table (paper Table 3 analogue on the embedded stand-ins) and the needle
heatmap: needle-retrieval accuracy per method, overall and per prompt length, with 95% intervals
and the paired difference to FP16 on the same samples."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from ..eval.stats import paired_difference, wilson_interval
from ..io import read_json
from . import write_frame

matplotlib.use("Agg")


def _load(paths: list[str]) -> list[dict]:
    runs = [read_json(p) for p in paths]
    keys = [[(s["kind"], s["length"], s["depth"], tuple(s["answers"])) for s in r["longcontext"]["samples"]]
            for r in runs]
    if any(k != keys[0] for k in keys):
        raise ValueError("long-context results hold different samples; pairing needs the same "
                         "longcontext.* settings for every method")
    return runs


def longcontext_frame(paths: list[str]) -> pd.DataFrame:
    runs = _load(paths)
    ref = next((r for r in runs if r["summary"]["method"] == "fp16"), None)
    lengths = sorted({s["length"] for s in runs[0]["longcontext"]["samples"]})
    rows = []
    for r in runs:
        samples = r["longcontext"]["samples"]
        scores = [s["score"] for s in samples]
        lo, hi = wilson_interval(int(round(sum(scores))), len(scores))
        row = {"model": r["summary"]["model"], "method": r["summary"]["method"],
               "kv_bits": r["summary"].get("kv_bits", 16), "n": len(scores),
               "accuracy": float(np.mean(scores)), "accuracy_lo": lo, "accuracy_hi": hi}
        for n in lengths:
            part = [s["score"] for s in samples if s["length"] == n]
            row[f"L{n}"] = float(np.mean(part))
        if ref is not None:
            d = paired_difference(scores, [s["score"] for s in ref["longcontext"]["samples"]])
            row.update({"diff_vs_fp16": d["diff"], "diff_lo": d["lo"], "diff_hi": d["hi"],
                        "significant": d["significant"]})
        rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(frame: pd.DataFrame, runs: list[dict]) -> str:
    samples = runs[0]["longcontext"]["samples"]
    kinds = sorted({s["kind"] for s in samples})
    depths = sorted({s["depth"] for s in samples})
    lengths = [c for c in frame.columns if c.startswith("L") and c[1:].isdigit()]
    lines = ["# Long-context needle retrieval (decode-time, through each method's cache)", "",
             f"Model {frame.iloc[0]['model']}; kinds {', '.join(kinds)}; prompt lengths "
             f"{', '.join(c[1:] for c in lengths)} tokens; needle depths {', '.join(f'{d:g}' for d in depths)}; "
             f"{len(samples)} samples per method, the same for every method. Each prompt is prefilled "
             "into the method's cache and the answer generated through it (greedy, chat template); "
             "score = share of the expected numbers among the answer's digit strings. Accuracy (%) "
             "with its 95% Wilson interval; Δ vs FP16 paired on the same samples (95% bootstrap); "
             "\"~\": the interval contains 0 or the exact sign (McNemar) test is not below 0.05.", ""]
    head = ["method", "bits", "accuracy", *[f"{c[1:]} tok" for c in lengths], "Δ vs FP16"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in frame.iterrows():
        diff = "—" if r["method"] == "fp16" or "diff_vs_fp16" not in r else (
            f"{100 * r['diff_vs_fp16']:+.1f} [{100 * r['diff_lo']:+.1f}, {100 * r['diff_hi']:+.1f}]"
            + ("" if r["significant"] else " ~"))
        lines.append("| " + " | ".join([r["method"], str(int(r["kv_bits"])),
                                        f"{100 * r['accuracy']:.1f} [{100 * r['accuracy_lo']:.1f}, {100 * r['accuracy_hi']:.1f}]",
                                        *[f"{100 * r[c]:.0f}" for c in lengths], diff]) + " |")
    return "\n".join(lines) + "\n"


def needle_heatmap(paths: list[str], out: str | Path) -> None:
    """Accuracy by needle depth (rows) x prompt length (columns), one panel per method."""
    import matplotlib.pyplot as plt
    runs = _load(paths)
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
