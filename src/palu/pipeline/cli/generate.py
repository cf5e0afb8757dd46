"""Step `generate`: greedy text through a method's cache, and the cache bytes of a long prefill.

Writes a JSON: the text, and the measured bytes of the method's cache after a
`generate.context`-token prefill (collect's cache_memory table gathers the methods, FP16 too).
"""
from __future__ import annotations

import torch

from palu.cache.memory import bytes_summary, prefill_nbytes
from palu.pipeline.config import method_of
from palu.data.corpora import load_corpus
from palu.data.windows import bos_token_for, evaluation_windows, tokenize
from palu.artifacts import write_json
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import entry_point, log, model_input, model_path, record, tracked


def measure(cfg, method, context: int, prompt: str, new_tokens: int) -> dict:
    model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
    method.install(model)
    text = tokenize(tok, load_corpus(cfg.data.corpus, path=cfg.data.path).evaluation_text)
    ids = evaluation_windows(text, context, bos=bos_token_for(tok, cfg.data.bos))[:1]
    ids = ids.to(cfg.device)
    elem = next(model.parameters()).element_size()
    stored = prefill_nbytes(model, method, ids)
    prompt_ids = tok(prompt, return_tensors="pt").input_ids.to(cfg.device)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=method.make_cache(model))
    result = {"method": method.tag, "run": naming.run_name(method.tag, method.lineage()),
              "context": context, "dtype": cfg.model.dtype,
              **bytes_summary(stored, elem, model.config, ids.shape[1]),
              "prompt": prompt, "text": tok.decode(out[0, prompt_ids.shape[1]:])}
    return {**record(cfg, "generate"), "result": result, "summary": method.summary()}


def run(cfg) -> dict:
    # by hand (no `out`): under the work folder, never over the pipeline's committed results
    out = cfg.out or str(naming.by_hand(cfg.paths.work) / "memory" / "generate.json")
    method = method_of(cfg)
    with tracked(cfg, "generate", out, used={**model_input(cfg), **method.inputs()}) as wb:
        payload = measure(cfg, method, cfg.generate.context, cfg.generate.prompt, cfg.generate.new_tokens)
        write_json(out, payload)
        wb.metrics(payload["result"])
        wb.make("memory", out, method=payload["result"]["method"])
    r = payload["result"]
    log.info("%s at %d tokens: %d bytes (%.2f bits per element); wrote %s",
             r["method"], r["context"], r["cache_bytes"], r["effective_bits"], out)
    return payload


main = entry_point(run)

if __name__ == "__main__":
    main()
