"""How far do Palu's factors transfer between text domains? (issue 50; asked in the official Palu
repository's issues.) Pairs the three calibration grids (conf/grid/calibration_{wiki,novels,mix}.yaml:
the same runs, calibrated on Wikipedia paragraphs, on novels, or on both alternating) on every
evaluation corpus: for each (run, evaluation corpus), the perplexity under each calibration and its
paired difference to the in-domain calibration (the one whose corpus is the evaluation corpus) on
the same 128-token blocks, with a 95% paired-bootstrap interval.

    python benchmarks/experiments/calibration_domain.py results/calibration-domain

writes calibration_domain.{md,json} and calibration_domain.png in that folder. Ranks are uniform,
so only the factors (whitened SVD of each calibration's Gram matrices) differ between columns.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from palu.artifacts import write_json, write_text
from palu.eval.stats import ppl_difference, ppl_interval

CALIBRATIONS = ("wiki", "novels", "mix")
LABELS = {"wiki_standin": "Wikipedia", "novels_standin": "novels", "mix_standin": "mix"}


def _runs(folder: Path) -> dict:
    """(run family, eval corpus) -> metrics, for one calibration grid's results folder. The
    family is the run's name without its calibration lineage (its first component)."""
    out = {}
    for path in sorted((folder / "runs").rglob("ppl-*.json")):
        m = json.loads(path.read_text())["metrics"]
        family = m["method"]
        key = (family, m["corpus"])
        if key in out:
            raise ValueError(f"{folder}: two run files for {key}")
        out[key] = m
    if not out:
        raise ValueError(f"{folder}: no run files under runs/ (run its grid first)")
    return out


def _label(m: dict) -> str:
    """kept ratio and granularity of a run (M-LRD: one head a group; J-LRD: all KV heads)."""
    if m["method"] == "fp16":
        return "FP16"
    g, heads = m.get("group_size"), m.get("num_kv_heads")
    lrd = "M-LRD" if g == 1 else "J-LRD" if g == heads else f"G-LRD (groups of {g})"
    return f"kept {m['kept_ratio_target']:g} {lrd}"


def table(root: Path) -> dict:
    grids = {c: _runs(root / c) for c in CALIBRATIONS}
    keys = sorted(set.intersection(*(set(g) for g in grids.values())))
    missing = sorted(set.union(*(set(g) for g in grids.values())) - set(keys))
    if missing:
        raise ValueError(f"runs missing from some calibration grid: {missing}")
    rows = []
    for family, corpus in keys:
        cells = {c: grids[c][(family, corpus)] for c in CALIBRATIONS}
        tokens = cells["wiki"]["block_tokens"]
        for c, m in cells.items():
            if m["block_tokens"] != tokens:
                raise ValueError(f"{family} on {corpus}: calibration {c} scored other blocks")
            if family != "fp16" and m["calibration_samples"] != cells["wiki"]["calibration_samples"]:
                raise ValueError(f"{family}: calibration {c} used another sample count")
        home = corpus.removesuffix("_standin")
        row = {"run": family, "corpus": corpus, "in_domain": home, "label": _label(cells["wiki"])}
        for c, m in cells.items():
            lo, hi = ppl_interval(m["block_nll"], tokens)
            row[c] = {"ppl": m["ppl"], "lo": lo, "hi": hi}
            if family != "fp16" and c != home:
                row[c]["vs_in_domain"] = ppl_difference(m["block_nll"], cells[home]["block_nll"], tokens)
        rows.append(row)
    return {"rows": rows, "blocks": len(tokens), "tokens": int(sum(tokens))}


def _fmt(cell: dict) -> str:
    s = f"{cell['ppl']:.2f}"
    d = cell.get("vs_in_domain")
    if d:
        s += f" ({d['diff']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]{'' if d['significant'] else ' ~'})"
    return s


def markdown(result: dict) -> str:
    lines = ["# Calibration domain: Palu calibrated on one corpus, evaluated on every corpus", "",
             f"SmolLM2-135M, float32 on CPU; uniform ranks, whitened SVD, 24 calibration windows of 2,048 "
             f"tokens from each calibration corpus; perplexity on {result['tokens']} tokens "
             f"({result['blocks']} blocks of 128) of each evaluation corpus's held-out part. In brackets: "
             "the paired difference to the in-domain calibration on the same blocks, 95% paired bootstrap "
             "interval (\"~\": the interval contains 0). FP16 is the same under every calibration.", "",
             "| run | | evaluated on | calibrated on Wikipedia | on novels | on the mix |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        home = {"wiki": "Wikipedia", "novels": "novels", "mix": "the mix"}[r["in_domain"]]
        lines.append(f"| {r['run']} | {r['label']} | {LABELS.get(r['corpus'], r['corpus'])} (home: {home}) | "
                     + " | ".join(_fmt(r[c]) for c in CALIBRATIONS) + " |")
    return "\n".join(lines) + "\n"


def figure(result: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["run"] != "fp16"]
    fp16 = {r["corpus"]: r["wiki"]["ppl"] for r in result["rows"] if r["run"] == "fp16"}
    corpora = sorted({r["corpus"] for r in rows})
    fig, axes = plt.subplots(1, len(corpora), figsize=(5 * len(corpora), 4), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        sub = [r for r in rows if r["corpus"] == corpus]
        x = np.arange(len(sub))
        for i, c in enumerate(CALIBRATIONS):
            vals = [r[c]["ppl"] / fp16[corpus] for r in sub]
            ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=f"calibrated on {c}")
        ax.set_xticks(x, [r["label"].replace("kept ", "") for r in sub], rotation=20)
        ax.set_title(f"evaluated on {LABELS.get(corpus, corpus)}")
        ax.set_ylabel("perplexity / FP16's")
        ax.axhline(1.0, color="k", lw=0.8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(out)


def main(argv=None) -> None:
    root = Path((argv or sys.argv[1:])[0])
    result = table(root)
    write_json(root / "calibration_domain.json", result)
    write_text(root / "calibration_domain.md", markdown(result))
    figure(result, root / "calibration_domain.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
