"""Would probe_select choose otherwise on held-out text? (issue 53, item 3: no leakage)

probe_select scores its candidate allocations on the first Fisher window, which on the Wikipedia
stand-in lies inside the Gram's windows (`results/checks/probe-window-overlap.json`: all 2,048 of
its tokens on SmolLM2, 962 on Gemma-3). `search` starts from probe_select run on held-out search
windows (text neither the Gram nor the Fisher windows read), and records that start. Every
committed run holds its checkpoint's manifest, so for each cell (model, calibration corpus, kept
ratio, group size) both choices are on record, with every candidate's loss on either text: this
compares them, without running anything. Where both choose the same candidate, the committed
probe_select row is exactly what a held-out probe gives (a candidate's name fixes its ranks); where
they differ, that row's choice leaned on text the Gram saw.

    python benchmarks/experiments/probe_choice_held_out.py results/checks/probe-choice-held-out.json
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from palu.artifacts import write_json

CELL = re.compile(r"palu-(?P<decomp>[a-z]+)-(?P<method>probe_select|search[-a-z0-9]*)-k(?P<kept>[0-9.]+)-g(?P<g>[0-9]+)$")


def _allocations(root: Path):
    """(grid folder, model, decomposition, method, kept, group, calibration, allocation) of every
    unquantised probe_select / search checkpoint a committed run evaluated (one per checkpoint)."""
    seen = set()
    for path in sorted(root.glob("*/runs/*/*/*/*/ppl-*.json")):
        ckpt_dir, calib = path.parts[-4], path.parts[-3]
        m = CELL.match(ckpt_dir)
        if m is None:
            continue
        key = (path.parts[-7], path.parts[-5], ckpt_dir, calib)
        if key in seen:
            continue
        seen.add(key)
        method = json.loads(path.read_text())["method"]
        allocation = method["manifest"]["allocation"]
        yield (path.parts[-7], path.parts[-5], m["decomp"], m["method"], float(m["kept"]), int(m["g"]),
               calib.split("-")[0], allocation)


def _losses(probe: dict) -> dict:
    return {c["candidate"]: c["loss"] for c in probe["candidates"]}


def _rank_agreement(a: dict, b: dict) -> float | None:
    """Spearman's rho of the candidates both scored (None: fewer than 3 in common)."""
    common = sorted(set(a) & set(b))
    if len(common) < 3:
        return None

    def ranks(d):
        order = sorted(common, key=lambda c: d[c])
        return {c: i for i, c in enumerate(order)}
    ra, rb = ranks(a), ranks(b)
    n = len(common)
    return 1 - 6 * sum((ra[c] - rb[c]) ** 2 for c in common) / (n * (n * n - 1))


def compare(root: Path) -> dict:
    """Per grid (a CPU and a GPU run of the same cell may choose differently: their probe losses
    differ in the last digits, and near-ties flip) and cell, the two choices."""
    leaky, held = {}, {}
    for grid, model, decomp, method, kept, g, calib, alloc in _allocations(root):
        cell = (grid, model, decomp, calib, kept, g)
        if method == "probe_select":
            leaky[cell] = alloc
        elif "search" in alloc and "held_out" in alloc["search"]:
            held.setdefault(cell, []).append((method, alloc))
    rows = []
    for cell in sorted(set(leaky) & set(held)):
        grid, model, decomp, calib, kept, g = cell
        a = leaky[cell]
        starts = {(json.dumps(h["search"]["held_out"]["offsets"]), h["search"]["start"]) for _, h in held[cell]}
        if len({w for w, _ in starts}) != len(starts):
            raise SystemExit(f"{cell}: searches on the same windows started from different choices: {starts}")
        for method, h in held[cell]:
            lk, hl = _losses(a["probe"]), _losses(h["probe"])
            rows.append({
                "grid": grid, "model": model, "decomposition": decomp, "calibration": calib,
                "kept_ratio": kept, "group_size": g, "search": method,
                "probe_window": {"windows": a["probe"]["windows"], "seqlen": a["probe"]["seqlen"]},
                "held_out_windows": {"windows": h["probe"]["windows"], "seqlen": h["probe"]["seqlen"],
                                     "offsets": h["search"]["held_out"]["offsets"]},
                "chosen_on_probe_window": a["selected"], "chosen_held_out": h["search"]["start"],
                "same_choice": a["selected"] == h["search"]["start"],
                "candidate_rank_agreement": _rank_agreement(lk, hl),
                # the probe window's choice scored on the held-out windows, against the held-out
                # best: what leaning on text the Gram saw cost there (equal where both chose alike;
                # None where the held-out probe did not score that blend)
                "held_out_loss_of_probe_choice": hl.get(a["selected"]),
                "held_out_loss_of_held_out_choice": hl[h["search"]["start"]],
            })
    cells = {}
    for r in rows:   # one verdict per cell and set of held-out windows
        cells.setdefault((r["grid"], r["model"], r["decomposition"], r["calibration"], r["kept_ratio"],
                          r["group_size"], json.dumps(r["held_out_windows"]["offsets"])), r)
    return {"rows": rows, "cells": len(cells),
            "same_choice_cells": sum(r["same_choice"] for r in cells.values()),
            "note": "the probe window is the first Fisher window (2,048 tokens); the held-out windows are the "
                    "search's (512 tokens each), cut from text neither the Gram nor the Fisher windows read"}


def main(argv):
    if len(argv) != 1:
        raise SystemExit(__doc__)
    result = compare(Path("results"))
    write_json(argv[0], result)
    for r in result["rows"]:
        print(f"{r['grid']:>24} {r['model']:>12} {r['decomposition']:>9} k{r['kept_ratio']} g{r['group_size']} "
              f"{r['search']:>15}: probe window -> {r['chosen_on_probe_window']:<26} held out -> "
              f"{r['chosen_held_out']:<26} rho {r['candidate_rank_agreement']}")
    print(f"{result['same_choice_cells']} of {result['cells']} cells choose alike -> {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
