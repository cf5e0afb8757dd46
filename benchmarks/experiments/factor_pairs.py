"""Attention-aware factors against whitened ones at the same ranks (issue 53 item 4): for every
allocation, kept ratio and granularity of the rank-search grid, the paired perplexity difference
(attention - whitened) on the same token blocks, from the committed run files.

    python benchmarks/experiments/factor_pairs.py results/rank-search results/checks/rank-search-factor-pairs.json

The rank-allocation table pairs rows within one factor objective (against uniform, fisher and the
search's start); this pairs across the two objectives, the composition question: does the
attention objective add to an allocation, and to the searched ranks?
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from palu.artifacts import write_json
from palu.eval.stats import ppl_difference
from palu.pipeline.reporting.tables import _blocks

RUN = re.compile(r"palu-(whitened|attention)-(.+)-k([0-9.]+)-g([0-9]+)")


def main(argv: list[str]) -> None:
    folder, out = Path(argv[0]), argv[1]
    runs = {}
    for path in sorted(folder.glob("runs/*/palu-*/*/*/ppl-*.json")):
        m = RUN.fullmatch(path.parts[-4])
        if m is None:          # other latent widths (-b4) and methods: not this comparison
            continue
        corpus = path.name.split("-")[1]
        runs[(m[2], m[3], m[4], corpus, m[1])] = path
    rows = []
    for (alloc, kept, group, corpus, objective), path in sorted(runs.items()):
        if objective != "attention" or (alloc, kept, group, corpus, "whitened") not in runs:
            continue
        (a, tokens), (b, ref_tokens) = _blocks(path), _blocks(runs[(alloc, kept, group, corpus, "whitened")])
        if tokens != ref_tokens:
            raise ValueError(f"{path}: other token blocks than its whitened run")
        d = ppl_difference(a, b, tokens)
        rows.append({"allocation": alloc, "kept_ratio": float(kept), "group_size": int(group), "corpus": corpus,
                     "attention_minus_whitened": d["diff"], "lo": d["lo"], "hi": d["hi"],
                     "significant": d["significant"], "blocks": len(tokens)})
        print(f"k{kept} g{group} {alloc:14s} {corpus:15s} {d['diff']:+8.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"
              f" {'resolved' if d['significant'] else '~'}")
    if not rows:
        raise SystemExit(f"no attention / whitened pairs under {folder}/runs")
    write_json(out, {"source": str(folder), "rows": rows})
    print(f"-> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
