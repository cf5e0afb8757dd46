"""Step `longcontext`: decode-time needle retrieval through a method's cache (`longcontext.*`):
every prompt is prefilled into `method.make_cache(model)` and the answer generated through it.
Writes one JSON with each sample's answer and score, and the accuracy per kind x length x depth
(collect's longcontext table and needle heatmap read it)."""
from __future__ import annotations

from ..config import method_of
from ..data.corpora import load_corpus
from ..io import write_json
from ..models.loading import load_config, load_model, resolve_source
from ..pipeline import naming
from .common import entry_point, log, model_input, model_path, record, tracked


def _max_positions(path: str) -> int | None:
    if resolve_source(path).kind == "hub":
        return None
    return getattr(load_config(path), "max_position_embeddings", None)


def run(cfg) -> dict:
    from ..eval.longcontext import evaluate_needles, make_samples
    c = cfg.longcontext
    method = method_of(cfg)
    out = cfg.out or str(naming.longcontext_path_of(cfg, method))
    path = model_path(cfg)
    limit = _max_positions(path)
    if limit is not None and max(c.lengths) + c.max_new_tokens > limit:
        raise ValueError(f"longcontext.lengths max {max(c.lengths)} + {c.max_new_tokens} new tokens "
                         f"exceeds the model's maximum context ({limit} positions)")
    filler = load_corpus(c.corpus).evaluation_text
    with tracked(cfg, "longcontext", out, used={**model_input(cfg), **method.inputs()}) as wb:
        model, tok = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
        method.install(model)
        samples = make_samples(tok, filler, list(c.kinds), list(c.lengths), list(c.depths),
                               c.per_cell, c.seed, max_positions=limit)
        result = evaluate_needles(model, tok, method, samples, c.max_new_tokens,
                                  log=log.info if cfg.progress else None)
        summary = {"model": cfg.model.name, "method": method.tag, "dtype": cfg.model.dtype,
                   "run": naming.run_name(method.tag, method.lineage()), **method.summary()}
        write_json(out, record(cfg, longcontext=result, summary=summary, method=method.record()))
        wb.metrics({"accuracy": result["accuracy"], "n": result["n"]})
        if wb.enabled:
            import pandas as pd
            wb.table("samples", pd.DataFrame(result["samples"]).astype({"needles": str, "answers": str}))
        wb.make("longcontext", out, method=method.tag)
    log.info("%s: needle accuracy %.3f over %d samples -> %s", method.tag, result["accuracy"],
             result["n"], out)
    return result


main = entry_point(run)

if __name__ == "__main__":
    main()
