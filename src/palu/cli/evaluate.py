"""Step `evaluate`: perplexity of the FP16 baseline or a Palu checkpoint on one corpus."""
from __future__ import annotations

import hydra

from ..config import validate
from ..data.corpora import load_corpus
from ..eval.runner import check_seqlen, evaluate_corpus
from ..io import write_json
from ..models.loading import load_config, load_model, resolve_source
from ..pipeline import naming
from ..tracking.wandb_run import log_metrics, tracked_run
from .common import CONF_DIR, log, model_path, record


def method_tag(cfg) -> str:
    if cfg.method == "fp16":
        return "fp16"
    from ..decompose.checkpoint import read_manifest
    return read_manifest(cfg.checkpoint)["tag"]


def output_path(cfg) -> str:
    return cfg.out or str(naming.metrics_path(cfg.paths.results, cfg.model.name, method_tag(cfg),
                                              cfg.data.corpus, cfg.data.seqlen, cfg.data.max_tokens))


def check_matches_config(manifest: dict, cfg) -> None:
    """The recorded `palu.*` config must describe the checkpoint that was evaluated."""
    summary = manifest["summary"]
    wanted = {"kept_ratio_target": cfg.palu.kept_ratio, "group_size": cfg.palu.group_size,
              "rank_method": cfg.palu.rank_method, "decomposition": cfg.palu.decomposition}
    bad = {k: (v, summary[k]) for k, v in wanted.items() if summary[k] != v}
    if bad:
        detail = ", ".join(f"{k}: config {a!r} vs checkpoint {b!r}" for k, (a, b) in bad.items())
        raise ValueError(f"checkpoint {cfg.checkpoint} does not match the palu.* config ({detail}); "
                         "pass the palu.* settings it was made with")


def _preflight(cfg, path: str) -> None:
    """Everything that can be checked without the weights, so bad input fails in seconds."""
    if resolve_source(path).kind != "hub":  # a hub id without local files fails at load time
        check_seqlen(load_config(path), cfg.data.seqlen)
    load_corpus(cfg.data.corpus, path=cfg.data.path)


def run(cfg) -> dict:
    path = model_path(cfg)
    out = output_path(cfg)
    _preflight(cfg, path)
    model, tok = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
    manifest = None
    if cfg.method == "palu":
        from ..decompose.checkpoint import load_compressed
        manifest = load_compressed(model, cfg.checkpoint)
        check_matches_config(manifest, cfg)
    tag = method_tag(cfg)
    name = f"{cfg.model.name}/{tag}/{cfg.data.corpus}-L{cfg.data.seqlen}"
    with tracked_run(cfg.tracking, record(cfg)["config"], job_type="evaluate", name=name,
                     group=cfg.model.name) as wb:
        metrics = evaluate_corpus(model, tok, cfg.data.corpus, cfg.data.seqlen, cfg.data.max_tokens,
                                  path=cfg.data.path,
                                  calibration_fraction=cfg.data.calibration_fraction,
                                  progress=cfg.progress)
        metrics.update(model=cfg.model.name, method=tag, dtype=cfg.model.dtype)
        if manifest is not None:
            metrics.update(manifest["summary"])
        log_metrics(wb, metrics)
    write_json(out, record(cfg, metrics=metrics, manifest=manifest))
    log.info("%s: ppl %.3f on %s (%d tokens) -> %s", tag, metrics["ppl"], cfg.data.corpus,
             metrics["tokens"], out)
    return metrics


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    run(validate(cfg))


if __name__ == "__main__":
    main()
