"""How much of the rank probe's text the Gram matrices saw (issue 53, item 3: no leakage).

probe_select, error_aware's key-weight probe and error_aware_bytes score candidate allocations on
the first Fisher window(s) (`decompose.probe.PROBE_WINDOWS`), documented until 2026-12-04 as text
"the Gram never saw". Both are drawn at seeded random offsets from the same calibration text
(`data.windows.calibration_windows`: Gram seed 0, Fisher seed 1), so they may overlap. This
counts, for each model and calibration corpus of the committed grids, the probe window's tokens
that lie inside some Gram window, the Fisher windows' tokens likewise, and the text that neither
reads (where a held-out search window could come from without changing the Gram: on the wiki
stand-in too little for one 2,048-token window).

    python benchmarks/experiments/probe_window_overlap.py results/checks/probe-window-overlap.json
"""
from __future__ import annotations

import sys

import torch

from palu.artifacts import write_json
from palu.data.corpora import load_corpus
from palu.data.windows import bos_token_for, tokenize
from palu.decompose.probe import PROBE_WINDOWS

# (model, prepared folder, calibration corpus, Gram windows, Fisher windows, seqlen, seeds)
GRIDS = [(model, f"work/models/{model}", corpus, 24, 8, 2048, (0, 1))
         for model in ("smollm2-135m", "gemma3-270m") for corpus in ("wiki_standin", "novels_standin")]


def starts(n_tokens: int, n: int, text: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)      # as calibration_windows draws them
    return torch.randint(0, n_tokens - text, (n,), generator=gen).tolist()


def overlap(model: str, folder: str, corpus: str, grams: int, fishers: int, seqlen: int, seeds) -> dict:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tokens = tokenize(tok, load_corpus(corpus).calibration_text)
    text = seqlen - (bos_token_for(tok, "auto") is not None)
    seen = torch.zeros(tokens.numel(), dtype=torch.bool)
    for s in starts(tokens.numel(), grams, text, seeds[0]):
        seen[s:s + text] = True
    fisher = starts(tokens.numel(), fishers, text, seeds[1])
    probe = fisher[:PROBE_WINDOWS]
    free = ~seen                                   # text neither the Gram nor the Fisher windows read
    for s in fisher:
        free[s:s + text] = False
    gaps, run = [], 0
    for f in free.tolist() + [False]:
        if f:
            run += 1
        elif run:
            gaps.append(run)
            run = 0
    return {"model": model, "corpus": corpus, "calibration_tokens": int(tokens.numel()),
            "gram_windows": grams, "window_text_tokens": text,
            "text_covered_by_gram_windows": float(seen.float().mean()),
            "probe_tokens": text * len(probe),
            "probe_tokens_seen_by_gram": sum(int(seen[s:s + text].sum()) for s in probe),
            "fisher_tokens": text * len(fisher),
            "fisher_tokens_seen_by_gram": sum(int(seen[s:s + text].sum()) for s in fisher),
            # what a held-out search window could be cut from, as the windows are drawn today
            "tokens_read_by_neither": int(free.sum()), "largest_unread_spans": sorted(gaps, reverse=True)[:5]}


def main(argv=None) -> None:
    out = (argv or sys.argv[1:])[0]
    rows = [overlap(*g) for g in GRIDS]
    write_json(out, {"rows": rows})
    for r in rows:
        print(f"{r['model']} ({r['corpus']}): Gram windows cover {r['text_covered_by_gram_windows']:.0%} of "
              f"{r['calibration_tokens']} calibration tokens; probe {r['probe_tokens_seen_by_gram']} of "
              f"{r['probe_tokens']} tokens seen by the Gram; Fisher {r['fisher_tokens_seen_by_gram']} of "
              f"{r['fisher_tokens']}; read by neither {r['tokens_read_by_neither']} tokens, longest spans "
              f"{r['largest_unread_spans']}")


if __name__ == "__main__":
    main()
