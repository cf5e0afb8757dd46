"""Step `longcontext`: decode-time long-context evaluation through a method's cache, one suite a
run (`longcontext.suite`, a name registered in palu.eval.suites; settings `longcontext.<suite>.*`).
Every prompt is prefilled into `method.make_cache(model)` and the answer generated through it.
Writes one JSON with each sample's answer and score and the per-task summaries (collect's
longcontext table and needle heatmap read it)."""
from __future__ import annotations

import dataclasses

from palu.pipeline.config import method_of, suite_settings
from palu.artifacts import write_json
from palu.eval.journal import answer_journal
from palu.models.loading import load_config, load_model, resolve_source
from palu.pipeline import naming
from palu.pipeline.cli.common import (entry_point, journal_path, log, model_input, model_path,
                                      prompt_cache_dir, record, tracked, weights_signature, without_timings)


def _max_positions(path: str) -> int | None:
    if resolve_source(path).kind == "hub":
        return None
    return getattr(load_config(path), "max_position_embeddings", None)


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
    if cfg.longcontext.prompts_only:
        return _prompts_only(cfg, suite, settings, path)
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
            # built prompts kept for the grid's other jobs (the RULER-style suite: minutes a job)
            cache = {"prompt_cache": prompt_cache_dir(cfg)} if suite.prompts else {}
            result = suite.run(model, tok, method, settings, max_positions=limit,
                               log=log.info if cfg.progress else None, batch_size=cfg.longcontext.batch_size,
                               **cache)
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


def _prompts_only(cfg, suite, settings, path) -> dict:
    """Build (or read) the suite's prompts into the grid's cache, nothing else: the tokenizer as
    a job loads it (with the model, on the CPU, so its key is the job's)."""
    from palu.eval.suites import SUITES
    if suite.prompts is None:
        raise ValueError(f"longcontext.prompts_only: suite {cfg.longcontext.suite!r} keeps no prompts "
                         f"(suites that do: {[n for n, s in SUITES.items() if s.prompts]})")
    _, tok = load_model(path, dtype=cfg.model.dtype, device="cpu")
    docs, key = suite.prompts(tok, settings, prompt_cache_dir(cfg))
    if key is None:
        raise ValueError(f"longcontext.prompts_only: the tokenizer of {path!r} cannot be keyed (no "
                         "serialised state), so no job could read its prompts back")
    log.info("%s: %d prompts under key %s in %s", cfg.longcontext.suite, len(docs), key, prompt_cache_dir(cfg))
    done = {"suite": cfg.longcontext.suite, "prompts": len(docs), "key": key, "folder": str(prompt_cache_dir(cfg))}
    if cfg.out:   # the workflow's record that they are built (never a result file)
        write_json(cfg.out, done)
    return done


main = entry_point(run)

if __name__ == "__main__":
    main()
