"""Step `zeroshot`: lm-eval accuracy of a model through a KV-cache method (conf/method/) on the
paper's six zero-shot tasks (`zeroshot.*`); writes one JSON with every task's acc / acc_norm, 95%
intervals and the outcome of every sample (collect's zeroshot table pairs them with FP16's).
Its log-likelihoods are journaled as they come (work/journal/, as the long-context step's
answers), so a stopped job resumes; the journal is removed once the result is written."""
from __future__ import annotations

import os
from pathlib import Path

from palu.pipeline.config import method_of
from palu.artifacts import write_json
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.eval.journal import AnswerJournal
from palu.pipeline.cli.common import (entry_point, journal_path, log, model_input, model_path, record,
                                      tracked, weights_signature, without_timings)


def _quiet_datasets(cfg) -> None:
    """lm-eval and datasets cache inside the work folder, never in ~/.cache; no progress bars
    in pipeline logs."""
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(cfg.paths.work) / "hf" / "datasets"))
    if not cfg.progress:
        os.environ.setdefault("TQDM_DISABLE", "1")


def run(cfg) -> dict:
    from palu.eval.zeroshot import evaluate_zeroshot
    method = method_of(cfg)
    out = cfg.out or str(naming.zeroshot_path_of(cfg, method))
    z = cfg.zeroshot
    _quiet_datasets(cfg)
    with tracked(cfg, "zeroshot", out, used={**model_input(cfg), **method.inputs()}) as wb:
        model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        method.install(model)
        import lm_eval
        fingerprint = {"out": str(out), "method": without_timings(method.record()),
                       "zeroshot": {"tasks": list(z.tasks), "limit": z.limit, "source": z.source,
                                    "seed": z.seed},
                       "model": cfg.model.name, "weights": weights_signature(model_path(cfg)),
                       "dtype": cfg.model.dtype, "device": cfg.device, "lm_eval": lm_eval.__version__}
        journal = AnswerJournal(journal_path(cfg, out), fingerprint)
        result = evaluate_zeroshot(model, tok, method, tasks=list(z.tasks), limit=z.limit,
                                   source=z.source, seed=z.seed, batch_size=z.batch_size,
                                   journal=journal)
        summary = {"model": cfg.model.name, "method": method.tag, "dtype": cfg.model.dtype,
                   "run": naming.run_name(method.tag, method.lineage()), **method.summary()}
        write_json(out, record(cfg, "zeroshot", zeroshot=result, summary=summary, method=method.record()))
        journal.path.unlink()   # ours, written above; the result file now holds every outcome
        wb.metrics({f"{task}/{k}": v for task, r in result["tasks"].items()
                    for k, v in r.items() if k != "samples"})
        if wb.enabled:
            import pandas as pd
            wb.table("samples", pd.DataFrame([{"task": task, **s} for task, r in result["tasks"].items()
                                              for s in r["samples"]]))
        wb.make("zeroshot", out, method=method.tag)
    log.info("%s: zero-shot on %d tasks (%s samples each) -> %s", method.tag, len(result["tasks"]),
             z.limit or "all", out)
    return result


main = entry_point(run)

if __name__ == "__main__":
    main()
