"""The zero-shot table (paper Table 1 analogue): method x task accuracy with 95% intervals, the
average over tasks, and each method's paired difference to FP16 on the same samples.

Accuracy is lm-eval's `acc` (log-likelihood of each choice; WinoGrande's partial scoring);
`acc_norm` is in the CSV. A difference whose interval contains zero is printed as "~" (no
evidence of a change), never as a win or a loss."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from palu.eval.stats import paired_difference, stratified_mean
from palu.artifacts import read_json
from palu.methods import family_of
from palu.pipeline.reporting import write_frame

LABELS = {"piqa": "PIQA", "arc_easy": "ARC-e", "arc_challenge": "ARC-c", "hellaswag": "HellaSwag",
          "winogrande": "WinoGrande", "openbookqa": "OBQA"}


def _load(paths: list[str]) -> list[dict]:
    runs = [read_json(p) for p in paths]
    tasks = [list(r["zeroshot"]["tasks"]) for r in runs]
    if any(t != tasks[0] for t in tasks):
        raise ValueError(f"zero-shot results cover different tasks: {sorted(map(tuple, tasks))}")
    ids = [{t: [s["doc_id"] for s in r["zeroshot"]["tasks"][t]["samples"]] for t in tasks[0]} for r in runs]
    if any(i != ids[0] for i in ids):
        raise ValueError("zero-shot results scored different samples; pairing needs the same "
                         "zeroshot.limit and source for every method")
    methods = [r["summary"]["method"] for r in runs]
    if len(set(methods)) != len(methods):
        raise ValueError(f"two zero-shot results for one method: {methods}")
    return runs


def _granularity(summary: dict) -> str:
    g, heads = summary.get("group_size"), summary.get("num_kv_heads")
    if g is None:
        return "-"
    return "M-LRD" if g == 1 else "J-LRD" if g == heads else f"G-LRD-{g}"


def zeroshot_frame(paths: list[str]) -> pd.DataFrame:
    runs = _load(paths)
    tasks = list(runs[0]["zeroshot"]["tasks"])
    ref = next((r for r in runs if r["summary"]["method"] == "fp16"), None)
    acc = {id(r): [[s["acc"] for s in r["zeroshot"]["tasks"][t]["samples"]] for t in tasks] for r in runs}
    rows = []
    for r in runs:
        z, summary = r["zeroshot"], r["summary"]
        row = {"model": summary["model"], "method": summary["method"],
               "family": family_of(summary),
               "granularity": _granularity(summary),
               "kv_bits": summary.get("kv_bits", 16), "kept_ratio": summary.get("kept_ratio_realised", 1.0),
               "source": z["source"], "limit": z["limit"], "lm_eval": z["lm_eval"]}
        for t in tasks:
            e = z["tasks"][t]
            row.update({f"{t}_n": e["n"], f"{t}": e["acc"], f"{t}_lo": e["acc_lo"], f"{t}_hi": e["acc_hi"],
                        f"{t}_acc_norm": e["acc_norm"]})
            if ref is not None:
                i = tasks.index(t)
                d = paired_difference(acc[id(r)][i], acc[id(ref)][i])
                row.update({f"{t}_diff": d["diff"], f"{t}_diff_lo": d["lo"], f"{t}_diff_hi": d["hi"]})
        avg = stratified_mean(acc[id(r)])
        row.update({"average": avg["value"], "average_lo": avg["lo"], "average_hi": avg["hi"],
                    "samples": sum(z["tasks"][t]["n"] for t in tasks)})
        if ref is not None:
            d = stratified_mean(acc[id(r)], reference=acc[id(ref)])
            row.update({"diff_vs_fp16": d["value"], "diff_lo": d["lo"], "diff_hi": d["hi"],
                        "significant": d["significant"] and r is not ref})
        rows.append(row)
    frame = pd.DataFrame(rows)
    order = frame["method"].ne("fp16")       # FP16 first, then by average accuracy
    return frame.assign(_o=order).sort_values(["_o", "average"], ascending=[True, False]).drop(columns="_o")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _diff(value: float, lo: float, hi: float, significant: bool) -> str:
    mark = "" if significant else " ~"
    return f"{100 * value:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}"


def to_markdown(frame: pd.DataFrame) -> str:
    tasks = [t for t in LABELS if f"{t}_n" in frame.columns]
    first = frame.iloc[0]
    sizes = ", ".join(f"{LABELS[t]} n={int(first[t + '_n'])}" for t in tasks)
    lines = ["# Zero-shot accuracy (lm-eval, through each method's cache)", "",
             f"Model {first['model']}; lm-eval {first['lm_eval']}; {first['source']} validation splits, "
             f"the first {first['limit'] or 'all'} documents of each task "
             f"({sizes}), "
             "the same documents for every method. Accuracy (%) = lm-eval `acc`, with its 95% Wilson "
             "interval; Avg = mean over tasks with a 95% bootstrap interval (resampled within tasks); "
             "Δ vs FP16 = paired difference on the same samples, 95% paired bootstrap interval. "
             "\"~\": the interval contains 0 or the exact sign test on the changed answers is not below "
             "0.05 (no evidence of a change).", ""]
    head = ["method", "LRD", "bits", *[LABELS[t] for t in tasks], "Avg", "Δ vs FP16 (Avg)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in frame.iterrows():
        cells = [r["method"], r["granularity"], str(int(r["kv_bits"]))]
        cells += [f"{_pct(r[t])} [{_pct(r[t + '_lo'])}, {_pct(r[t + '_hi'])}]" for t in tasks]
        cells.append(f"{_pct(r['average'])} [{_pct(r['average_lo'])}, {_pct(r['average_hi'])}]")
        cells.append("—" if r["method"] == "fp16" or "diff_vs_fp16" not in r
                     else _diff(r["diff_vs_fp16"], r["diff_lo"], r["diff_hi"], r["significant"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_zeroshot_table(paths: list[str], prefix: str | Path) -> pd.DataFrame:
    frame = zeroshot_frame(paths)
    return write_frame(frame, prefix, to_markdown(frame))
