"""Step `evaluate`: perplexity of a model through a KV-cache method (conf/method/) on one corpus."""
from __future__ import annotations


from palu.pipeline.config import method_of
from palu.data.corpora import load_corpus
from palu.eval.runner import check_seqlen, evaluate_corpus
from palu.artifacts import write_json
from palu.models.loading import load_config, load_model, resolve_source
from palu.pipeline import naming
from palu.pipeline.cli.common import entry_point, log, model_input, model_path, record, tracked


def output_path(cfg, method) -> str:
    return cfg.out or str(naming.metrics_path_of(cfg, method))


def _preflight(cfg, path: str) -> None:
    """Everything that can be checked without the weights, so bad input fails in seconds."""
    if resolve_source(path).kind != "hub":  # a hub id without local files fails at load time
        check_seqlen(load_config(path), cfg.data.seqlen)
    load_corpus(cfg.data.corpus, path=cfg.data.path)


def run(cfg) -> dict:
    method = method_of(cfg)
    path = model_path(cfg)
    out = output_path(cfg, method)
    _preflight(cfg, path)
    model, tok = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
    method.install(model)
    summary = method.summary()      # a checkpoint's settings come from its manifest
    run_name = naming.run_name(method.tag, method.lineage())
    # one W&B run per result file (named by its path), replaced by a rerun
    with tracked(cfg, "evaluate", out, used={**model_input(cfg), **method.inputs()}) as wb:
        metrics = evaluate_corpus(model, tok, cfg.data.corpus, cfg.data.seqlen, cfg.data.max_tokens,
                                  path=cfg.data.path,
                                  calibration_fraction=cfg.data.calibration_fraction,
                                  progress=cfg.progress, method=method, bos=cfg.data.bos,
                                  batch_size=cfg.data.batch_size)
        metrics.update(model=cfg.model.name, method=method.tag, dtype=cfg.model.dtype,
                       run=run_name,
                       calibration_fraction=cfg.data.calibration_fraction, **summary)
        write_json(out, record(cfg, "evaluate", metrics=metrics, method=method.record()))
        wb.metrics({k: v for k, v in metrics.items() if not k.startswith("block_")})
        wb.make("metrics", out, method=method.tag, corpus=cfg.data.corpus)
    log.info("%s: ppl %.3f on %s (%d tokens) -> %s", method.tag, metrics["ppl"], cfg.data.corpus,
             metrics["tokens"], out)
    return metrics


main = entry_point(run)

if __name__ == "__main__":
    main()
