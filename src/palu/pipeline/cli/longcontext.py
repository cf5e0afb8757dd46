"""Step `longcontext`: decode-time long-context evaluation through a method's cache, one suite a
run (`longcontext.suite`, a name registered in palu.eval.suites; settings `longcontext.<suite>.*`).
Every prompt is prefilled into `method.make_cache(model)` and the answer generated through it.
Writes one JSON with each sample's answer and score and the per-task summaries (collect's
longcontext table and needle heatmap read it)."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from palu.pipeline.config import method_of, suite_settings
from palu.artifacts import write_json
from palu.eval.journal import answer_journal
from palu.models.loading import load_config, load_model, resolve_source
from palu.pipeline import naming
from palu.pipeline.cli.common import entry_point, log, model_input, model_path, record, tracked


def _max_positions(path: str) -> int | None:
    if resolve_source(path).kind == "hub":
        return None
    return getattr(load_config(path), "max_position_embeddings", None)


def journal_path(cfg, out: str) -> Path:
    """Where this step journals its answers (so a stopped job resumes): the work folder, named by
    the output it is for (a hash: no name read from a config becomes a path)."""
    return Path(cfg.paths.work) / "journal" / f"{hashlib.sha256(str(out).encode()).hexdigest()[:24]}.jsonl"


def weights_signature(path: str) -> dict:
    """Which weights the model was read from, as a journal must know them: a GGUF by its sha256; a
    folder `prepare` made, by the source it was made from (prepared again on another machine, it
    is the same model); any other folder by its weight files' sizes and modification times."""
    from palu.artifacts import sha256_file
    from palu.models.loading import ModelNotFoundError, prepared_from, resolve_source
    src = resolve_source(path)
    if src.kind == "hub":
        return {"hub": path}
    if src.gguf_file:
        return {"gguf_sha256": sha256_file(Path(src.path) / src.gguf_file)}
    source = prepared_from(src.path)
    if source is not None:
        try:
            return {"prepared_from": source, **weights_signature(source)}
        except (ModelNotFoundError, OSError):
            pass
    files = sorted(p for p in Path(src.path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def without_timings(record):
    """A record without its measured durations (`*_seconds`): what made the answers, so a
    checkpoint decomposed again on a fresh GPU host (the same factors, by their sha256; another
    `decompose_seconds`) resumes the journal of the first."""
    if isinstance(record, dict):
        return {k: without_timings(v) for k, v in record.items() if not str(k).endswith("_seconds")}
    if isinstance(record, list):
        return [without_timings(v) for v in record]
    return record


def run(cfg) -> dict:
    from palu.eval.suites import get_suite
    name = cfg.longcontext.suite
    suite, settings = get_suite(name), suite_settings(cfg)
    method = method_of(cfg)
    out = cfg.out or str(naming.longcontext_path_of(cfg, method, settings))
    path = model_path(cfg)
    limit = _max_positions(path)
    longest = suite.longest_prompt(settings)
    if limit is not None and longest > limit:
        raise ValueError(f"longcontext.{name}: prompts of up to {longest} tokens (with "
                         f"the answer) exceed the model's maximum context ({limit} positions)")
    with tracked(cfg, "longcontext", out, used={**model_input(cfg), **method.inputs()}) as wb:
        model, tok = load_model(path, dtype=cfg.model.dtype, device=cfg.device)
        method.install(model)
        settings_record = dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else settings
        fingerprint = {"out": str(out), "method": without_timings(method.record()), "suite": name, "settings": settings_record,
                       "model": cfg.model.name, "weights": weights_signature(path), "dtype": cfg.model.dtype,
                       "device": cfg.device}
        journal = journal_path(cfg, out)
        with answer_journal(journal, fingerprint) as answered:
            if len(answered):
                log.info("resuming: %d answers from %s", len(answered), journal)
            result = suite.run(model, tok, method, settings, max_positions=limit,
                               log=log.info if cfg.progress else None, batch_size=cfg.longcontext.batch_size)
        result["batch_size"] = cfg.longcontext.batch_size
        summary = {"model": cfg.model.name, "method": method.tag, "dtype": cfg.model.dtype,
                   "suite": name, "run": naming.run_name(method.tag, method.lineage()),
                   **method.summary()}
        write_json(out, record(cfg, "longcontext", longcontext=result, summary=summary, method=method.record()))
        journal.unlink()   # ours, written above; the result file now holds every answer
        wb.metrics({f"{task}/{k}": v[k] for task, v in result["tasks"].items() for k in ("score", "n")})
        if wb.enabled:
            import pandas as pd
            frame = pd.DataFrame(result["samples"])
            wb.table("samples", frame.astype({c: str for c in ("needles", "answers") if c in frame}))
        wb.make("longcontext", out, method=method.tag)
    for task, v in result["tasks"].items():
        log.info("%s %s: %s %.3f [%.3f, %.3f] over %d samples", method.tag, task, v["metric"],
                 v["score"], v["lo"], v["hi"], v["n"])
    log.info("-> %s", out)
    return result


main = entry_point(run)

if __name__ == "__main__":
    main()
