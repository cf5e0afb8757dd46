"""Recall of Palu's latent-space selection on the real model (issue 36): the exact attention mass
that the tokens chosen from their latents carry, per decode step, layer, group and query head,
after a prefill of `prompt` tokens of the novels stand-in, for several budgets and sketch sizes.
A token budget of B reads B + window of `prompt` tokens; `oracle_mean` is the mass the best set of
that size (the exact top tokens of each head) would carry. Writes one JSON.

    .venv/bin/python benchmarks/experiments/latent_selection_recall.py CHECKPOINT OUT.json
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch
import transformers

import palu
from palu.artifacts import write_json
from palu.data.corpora import load_corpus
from palu.data.windows import bos_token_for, evaluation_windows, tokenize
from palu.methods import build_method


def main(checkpoint: str, out: str, model_path: str = "work/models/smollm2-135m", prompt: int = 2048,
         steps: int = 8) -> None:
    torch.manual_seed(0)
    rows = []
    for tokens in (64, 128, 256, 512):
        for sketch in (None, 32, 8):
            model, tok = palu.load_model(model_path)
            ids = evaluation_windows(tokenize(tok, load_corpus("novels_standin").evaluation_text),
                                     prompt + steps, bos=bos_token_for(tok, "auto"))[:1]
            method = build_method({"name": "palu_select", "checkpoint": checkpoint, "tokens": tokens,
                                   "window": 32, "sketch": sketch})
            method.install(model)
            method.selection.recalls = []
            cache = method.make_cache(model)
            start = time.perf_counter()
            with torch.no_grad():
                model(ids[:, :prompt], past_key_values=cache, use_cache=True)
                for t in range(prompt, prompt + steps):
                    model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            r, best = method.selection.recalls, method.selection.oracle
            n = method.cache_nbytes(cache)
            q = statistics.quantiles(r, n=20)
            rows.append({"tokens": tokens, "window": 32, "sketch": sketch, "read_share": (tokens + 32) / (prompt + steps),
                         "recall_mean": statistics.fmean(r), "recall_p5": q[0], "recall_min": min(r),
                         "oracle_mean": statistics.fmean(best),   # the best set of the same size
                         "samples": len(r), "read_per_step": n["read_per_step"], "stored": n["total"],
                         "seconds": round(time.perf_counter() - start, 1)})
            print(json.dumps(rows[-1]))
    write_json(out, {"checkpoint": checkpoint, "model": model_path, "prompt_tokens": prompt,
                     "decode_steps": steps, "corpus": "novels_standin", "rows": rows,
                     "environment": {"python": platform.python_version(), "torch": torch.__version__,
                                     "transformers": transformers.__version__, "device": "cpu"}})


if __name__ == "__main__":
    main(*sys.argv[1:3])
