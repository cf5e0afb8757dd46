"""Zero-shot accuracy with lm-eval, every request scored through a method's real cache.

The paper's six tasks (Table 1) come as task YAMLs in `lmeval_tasks/` backed by the embedded
validation splits (`source="embedded"`), or as lm-eval's standard tasks for users with hub
access (`source="hub"`). A batch of requests (context + one answer choice each, right-padded by
lm-eval, which passes no attention mask) is one prefill into a fresh `method.make_cache(model)`,
exactly as perplexity windows are: the logits are those the cache lets the model see. Every
method with a one-pass score batches requests exactly, KIVI and KVQuant included (which refuse a
left-padded batch): lm-eval pads loglikelihood batches on the right (`pad_and_concat(...,
padding_side="right")`; tests/unit/test_zeroshot.py compares batch 4 with batch 1 through real
lm-eval for every one-pass method), so every row starts at token 0 (a sink, a window
and key blocks fall where they fall alone), and under causal attention no real token sees a pad.
The first `limit` documents of each validation split are scored, the same ones for every
method, so differences are paired.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from .stats import wilson_interval

TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "openbookqa")
SOURCES = ("embedded", "hub")
TASK_DIR = Path(__file__).parent / "lmeval_tasks"
log = logging.getLogger("palu")


def check_request(tasks, limit, source) -> None:
    """Bad task names, sample limits or sources fail here, before any model is loaded."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"zeroshot.tasks has unknown task(s) {unknown or tasks}; known: {list(TASKS)}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
        raise ValueError(f"zeroshot.limit={limit!r} must be a positive integer (or null: every sample)")
    if source not in SOURCES:
        raise ValueError(f"zeroshot.source={source!r} is not one of {list(SOURCES)}")


def lm_eval_name(task: str, source: str) -> str:
    return f"palu_{task}" if source == "embedded" else task


class _JournalHook:
    """lm-eval's cache hook (HFLM reports each request's answer as it is computed): appends them
    to the journal a few hundred at a time, so a killed job keeps what it answered."""
    EVERY = 256

    def __init__(self, journal):
        self.journal, self.pending = journal, []

    def add_partial(self, kind, args, answer) -> None:
        if kind == "loglikelihood" and args is not None:
            self.pending.append((journal_key(args), [float(answer[0]), bool(answer[1])]))
            if len(self.pending) >= self.EVERY:
                self.flush()

    def flush(self) -> None:
        self.journal.add_keyed(self.pending)
        self.pending = []


def journal_key(args) -> str:
    from .journal import AnswerJournal
    return AnswerJournal.request_key("loglikelihood", args)


def method_lm(model, tokenizer, method=None, batch_size: int | str = 1, journal=None):
    """An lm-eval `HFLM` around `model` whose every forward runs through `method`'s cache,
    `batch_size` requests at a time (an int or "auto": lm-eval's search from the longest batch
    down), right-padded as lm-eval pads (the module docstring: exact for every one-pass method).
    `journal` (a `palu.eval.journal.AnswerJournal` of this model, method and task settings): each
    log-likelihood is taken from it when answered before, and appended as it is computed."""
    from ..methods.base import check_one_pass
    from .generation import check_batch_size
    check_one_pass(method, "loglikelihood")
    check_batch_size(batch_size, "zeroshot.batch_size")
    from lm_eval.models.huggingface import HFLM

    class MethodLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            if attn_mask is not None or labels is not None:
                raise NotImplementedError("encoder-decoder models are not supported")
            with torch.no_grad():
                if method is None:
                    return self.model(input_ids=inps, use_cache=False).logits
                cache = method.make_cache(self.model)
                return self.model(input_ids=inps, past_key_values=cache, use_cache=True).logits

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            if journal is None:
                return super().loglikelihood(requests, disable_tqdm)
            keys = [journal_key(r.args) for r in requests]
            known = [journal.lookup(k) for k in keys]
            todo = [r for r, found in zip(requests, known) if found is None]
            if len(todo) < len(requests):
                log.info("resuming: %d of %d log-likelihoods from %s", len(requests) - len(todo),
                         len(requests), journal.path)
            hook = _JournalHook(journal)
            self.set_cache_hook(hook)
            fresh = iter(super().loglikelihood(todo, disable_tqdm) if todo else [])
            hook.flush()
            return [tuple(found) if found is not None else next(fresh) for found in known]

    device = str(next(model.parameters()).device)
    return MethodLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)


def evaluate_zeroshot(model, tokenizer, method=None, tasks=TASKS, limit: int | None = None,
                      source: str = "embedded", seed: int = 0, batch_size: int | str = 1,
                      journal=None) -> dict:
    """acc / acc_norm per task with 95% Wilson intervals and every sample's outcome (`journal`:
    resume from, and append to, an `AnswerJournal`; see `method_lm`)."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    check_request(list(tasks), limit, source)
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=source == "hub")
    names = {lm_eval_name(t, source): t for t in tasks}
    out = simple_evaluate(model=method_lm(model, tokenizer, method, batch_size, journal), tasks=list(names),
                          num_fewshot=0, limit=limit, log_samples=True, bootstrap_iters=0,
                          task_manager=manager, random_seed=seed, numpy_random_seed=seed,
                          torch_random_seed=seed, fewshot_random_seed=seed)
    results = {}
    for name, task in names.items():
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        rows = []
        for s in samples:
            lls = [float(r[0]) for r in s["filtered_resps"]]
            if not all(math.isfinite(x) for x in lls):
                raise FloatingPointError(f"{task} doc {s['doc_id']}: non-finite log-likelihood "
                                         "(the model or its cache produced NaN/inf)")
            rows.append({"doc_id": int(s["doc_id"]), "target": str(s["target"]),
                         "pred": max(range(len(lls)), key=lls.__getitem__), "acc": float(s["acc"]),
                         "acc_norm": float(s.get("acc_norm", s["acc"]))})
        n = len(rows)
        entry = {"n": n}
        for metric in ("acc", "acc_norm"):
            correct = int(round(sum(r[metric] for r in rows)))
            lo, hi = wilson_interval(correct, n)
            entry.update({metric: correct / n, f"{metric}_lo": lo, f"{metric}_hi": hi})
        results[task] = {**entry, "samples": rows}
        log.info("%s: acc %.3f [%.3f, %.3f], acc_norm %.3f (n=%d)", task, entry["acc"],
                 entry["acc_lo"], entry["acc_hi"], entry["acc_norm"], n)
    return {"tasks": results, "source": source, "limit": limit, "lm_eval": lm_eval.__version__,
            "batch_size": batch_size}
