"""How much of the rank probe's text the Gram matrices saw (issue 53, item 3: no leakage).

probe_select, error_aware's key-weight probe and error_aware_bytes score candidate allocations on
the first Fisher window(s) (`decompose.probe.PROBE_WINDOWS`), documented until 2026-12-04 as text
"the Gram never saw". Both are drawn at seeded random offsets from the same calibration text
(`data.windows.calibration_windows`: Gram seed 0, Fisher seed 1), so they may overlap. This
counts, for each model and calibration corpus of the committed grids, the probe window's tokens
that lie inside some Gram window, and the Fisher windows' tokens likewise.

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
GRIDS = [("smollm2-135m", "work/models/smollm2-135m", "wiki_standin", 24, 8, 2048, (0, 1)),
         ("gemma3-270m", "work/models/gemma3-270m", "wiki_standin", 24, 8, 2048, (0, 1))]


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
    return {"model": model, "corpus": corpus, "calibration_tokens": int(tokens.numel()),
            "gram_windows": grams, "window_text_tokens": text,
            "text_covered_by_gram_windows": float(seen.float().mean()),
            "probe_tokens": text * len(probe),
            "probe_tokens_seen_by_gram": sum(int(seen[s:s + text].sum()) for s in probe),
            "fisher_tokens": text * len(fisher),
            "fisher_tokens_seen_by_gram": sum(int(seen[s:s + text].sum()) for s in fisher)}


def main(argv=None) -> None:
    out = (argv or sys.argv[1:])[0]
    rows = [overlap(*g) for g in GRIDS]
    write_json(out, {"rows": rows})
    for r in rows:
        print(f"{r['model']} ({r['corpus']}): Gram windows cover {r['text_covered_by_gram_windows']:.0%} of "
              f"{r['calibration_tokens']} calibration tokens; probe {r['probe_tokens_seen_by_gram']} of "
              f"{r['probe_tokens']} tokens seen by the Gram; Fisher {r['fisher_tokens_seen_by_gram']} of "
              f"{r['fisher_tokens']}")


if __name__ == "__main__":
    main()
