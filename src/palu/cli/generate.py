"""Step `generate`: sample text from a Palu checkpoint and measure the cache of a long prefill.

Writes a JSON (text, measured cache bytes for FP and latent caches at `context` tokens) and a
Markdown table next to it.
"""
from __future__ import annotations

import hydra
import torch

from ..bench.cache_memory import cache_bytes, fp16_equivalent
from ..config import validate
from ..data.corpora import load_corpus
from ..data.windows import tokenize
from ..decompose.checkpoint import load_compressed
from ..io import write_json, write_text
from ..models.loading import load_model
from .common import CONF_DIR, log, model_path, record


def run(cfg, context: int, prompt: str, new_tokens: int) -> dict:
    path = model_path(cfg)
    base, tok = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
    model, _ = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
    manifest = load_compressed(model, cfg.checkpoint)
    ids = tokenize(tok, load_corpus(cfg.data.corpus).evaluation_text)[:context][None]
    if ids.shape[1] < context:
        raise ValueError(f"corpus {cfg.data.corpus!r} has fewer than context={context} tokens")
    elem = next(base.parameters()).element_size()
    dense, latent = cache_bytes(base, ids, latent=False), cache_bytes(model, ids, latent=True)
    prompt_ids = tok(prompt, return_tensors="pt").input_ids
    from ..cache.latent_cache import LatentCache
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=LatentCache(model))
        ref = base.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False)
    result = {"method": manifest["tag"], "context": context, "dtype": cfg.model.dtype,
              "dense_cache_bytes": dense["total"], "latent_cache_bytes": latent["total"],
              "latent_positions_bytes": latent["positions"],
              "dense_cache_bytes_fp16": fp16_equivalent(dense, elem),
              "latent_cache_bytes_fp16": fp16_equivalent(latent, elem),
              "measured_ratio": latent["total"] / dense["total"], "prompt": prompt,
              "palu_text": tok.decode(out[0, prompt_ids.shape[1]:]),
              "fp16_text": tok.decode(ref[0, prompt_ids.shape[1]:])}
    return {**record(cfg), "result": result, "manifest_summary": manifest["summary"]}


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


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    cfg = validate(cfg)
    if cfg.method != "palu":
        raise ValueError("generate needs method=palu checkpoint=<compressed checkpoint>")
    out = cfg.out or f"{cfg.paths.results}/tables/cache_memory.json"
    payload = run(cfg, cfg.generate.context, cfg.generate.prompt, cfg.generate.new_tokens)
    write_json(out, payload)
    write_text(out.removesuffix(".json") + ".md", markdown(payload["result"]))
    log.info("cache %d -> %d bytes; wrote %s", payload["result"]["dense_cache_bytes"],
             payload["result"]["latent_cache_bytes"], out)


if __name__ == "__main__":
    main()
