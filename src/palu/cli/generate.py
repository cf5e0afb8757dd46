"""Step `generate`: greedy text through a method's cache, and the cache bytes of a long prefill.

Writes a JSON (text, measured cache bytes of the method's cache and of the ordinary FP cache at
`generate.context` tokens) and a Markdown table next to it.
"""
from __future__ import annotations

import torch

from ..cache.memory import fp16_equivalent, prefill_nbytes
from ..config import method_of
from ..data.corpora import load_corpus
from ..data.windows import bos_token_for, evaluation_windows, tokenize
from ..io import write_json, write_text
from ..methods import build_method
from ..models.loading import load_model
from ..pipeline import naming
from .common import entry_point, log, model_path, record


def measure(cfg, context: int, prompt: str, new_tokens: int) -> dict:
    path = model_path(cfg)
    method, full = method_of(cfg), build_method({"name": "fp16"})
    base, tok = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
    model, _ = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
    method.install(model)
    text = tokenize(tok, load_corpus(cfg.data.corpus, path=cfg.data.path).evaluation_text)
    ids = evaluation_windows(text, context, bos=bos_token_for(tok, cfg.data.bos))[:1]
    ids = ids.to(cfg.device)
    elem = next(base.parameters()).element_size()
    dense, stored = prefill_nbytes(base, full, ids), prefill_nbytes(model, method, ids)
    prompt_ids = tok(prompt, return_tensors="pt").input_ids.to(cfg.device)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=method.make_cache(model))
        ref = base.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False)
    result = {"method": method.tag, "context": context, "dtype": cfg.model.dtype,
              "dense_cache_bytes": dense["total"], "latent_cache_bytes": stored["total"],
              "latent_positions_bytes": stored["metadata"],
              "dense_cache_bytes_fp16": fp16_equivalent(dense, elem),
              "latent_cache_bytes_fp16": fp16_equivalent(stored, elem),
              "measured_ratio": stored["total"] / dense["total"], "prompt": prompt,
              "palu_text": tok.decode(out[0, prompt_ids.shape[1]:]),
              "fp16_text": tok.decode(ref[0, prompt_ids.shape[1]:])}
    return {**record(cfg), "result": result, "manifest_summary": method.summary()}


def markdown(r: dict) -> str:
    mib = 2 ** 20
    return (f"# KV-cache memory at {r['context']} tokens (measured, {r['dtype']} tensors)\n\n"
            f"| cache | bytes | MiB | fp16-equivalent MiB |\n|---|---:|---:|---:|\n"
            f"| FP cache (transformers DynamicCache) | {r['dense_cache_bytes']} | "
            f"{r['dense_cache_bytes'] / mib:.2f} | {r['dense_cache_bytes_fp16'] / mib:.2f} |\n"
            f"| {r['method']} latent cache (incl. int32 positions) | {r['latent_cache_bytes']} | "
            f"{r['latent_cache_bytes'] / mib:.2f} | {r['latent_cache_bytes_fp16'] / mib:.2f} |\n\n"
            f"Measured ratio latent / FP: **{r['measured_ratio']:.4f}**\n\n"
            f"## Greedy generation (prompt: {r['prompt']!r})\n\n"
            f"- FP model: {r['fp16_text']!r}\n- {r['method']}: {r['palu_text']!r}\n")


def run(cfg) -> dict:
    # by hand (no `out`): under the work folder, never over the pipeline's committed table
    out = cfg.out or str(naming.by_hand(cfg.paths.work) / "tables" / "cache_memory.json")
    payload = measure(cfg, cfg.generate.context, cfg.generate.prompt, cfg.generate.new_tokens)
    write_json(out, payload)
    write_text(out.removesuffix(".json") + ".md", markdown(payload["result"]))
    log.info("cache %d -> %d bytes; wrote %s", payload["result"]["dense_cache_bytes"],
             payload["result"]["latent_cache_bytes"], out)
    return payload


main = entry_point(run)

if __name__ == "__main__":
    main()
