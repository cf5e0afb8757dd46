"""Full-rank Palu on a real model equals the model (issue 37): compress at kept ratio 1.0 (plain
SVD: no calibration needed, every rank full), then compare with the uncompressed model on a
window of real text: the logits (one pass through `palu.LatentCache`, float32), the greedy tokens
generated through it, and the perplexity. Exits non-zero (writing nothing) unless all three
agree to float32 rounding; else writes one JSON with the numbers and the versions.

    .venv/bin/python benchmarks/experiments/full_rank_check.py work/models/gemma3-270m \
        results/checks/gemma3-full-rank.json
"""
from __future__ import annotations

import copy
import json
import platform
import sys
import time

import torch
import transformers

import palu
from palu.artifacts import write_json
from palu.data.corpora import load_corpus
from palu.data.windows import bos_token_for, evaluation_windows, tokenize


def main(model_path: str, out: str, tokens: int = 2048, prompt_tokens: int = 600, new_tokens: int = 32) -> None:
    """`tokens` and the prompt longer than Gemma-3's sliding window (512): local layers really slide."""
    torch.manual_seed(0)
    start = time.perf_counter()
    base, tok = palu.load_model(model_path, dtype="float32")
    text = load_corpus("wiki_standin").evaluation_text
    window = evaluation_windows(tokenize(tok, text), tokens, bos=bos_token_for(tok, "auto"))[:1]
    model = copy.deepcopy(base)
    kv = palu.geometry_of(base.config).num_kv_heads
    palu.compress(model, None, kept_ratio=1.0, group_size=kv, decomposition="plain", progress=False)
    with torch.no_grad():
        a = base(window, use_cache=False).logits
        b = model(window, past_key_values=palu.LatentCache(model), use_cache=True).logits
        prompt = window[:, :prompt_tokens]
        want = base.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        got = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=palu.LatentCache(model))
    ppl_base = palu.evaluate_text(base, tok, windows=window, progress=False)["ppl"]
    ppl_palu = palu.evaluate_text(model, tok, windows=window, progress=False)["ppl"]
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    result = {
        "model": model_path, "model_type": base.config.model_type, "tokens": tokens,
        "bos": window[0, 0].item() == tok.bos_token_id,
        "max_abs_logit_diff": diff, "max_abs_logit": scale, "relative": diff / scale,
        "greedy_tokens_equal": bool(torch.equal(want, got)), "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "sliding_window": getattr(base.config, "sliding_window", None),
        "ppl_base": ppl_base, "ppl_full_rank_palu": ppl_palu,
        "ppl_rel_diff": abs(ppl_palu - ppl_base) / ppl_base,
        "seconds": round(time.perf_counter() - start, 1),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads(),
                        "device": "cpu"},
    }
    print(json.dumps(result, indent=2))
    if not (result["relative"] < 1e-4 and result["greedy_tokens_equal"] and result["ppl_rel_diff"] < 1e-4):
        sys.exit("full-rank Palu does not reproduce the model: " + json.dumps(result))
    write_json(out, result)


if __name__ == "__main__":
    main(*sys.argv[1:3])
