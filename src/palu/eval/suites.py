"""The long-context suites a `longcontext` step runs (`longcontext.suite`), one result file each:

- `needles`: RULER-style needle retrieval built here over the novels (`longcontext`), embedded.
- `qasper`: yes/no questions over the embedded full papers (`qasper`).
- `longbench`: THUDM LongBench from local files (`longbench`), for users who have them.
- `ruler`: RULER's own prepared files (`ruler`), for users who have them.

Every answer is generated through the method's cache after the prompt is prefilled into it.
"""
from __future__ import annotations

SUITES = ("needles", "qasper", "longbench", "ruler")


def check_suite(lc) -> None:
    """Settings errors before any model is loaded (unknown names, bad counts, missing files)."""
    from .longcontext import KINDS
    if lc.suite not in SUITES:
        raise ValueError(f"longcontext.suite={lc.suite!r} is not one of {list(SUITES)}")
    n = lc.needles
    if not n.kinds or any(k not in KINDS for k in n.kinds):
        raise ValueError(f"longcontext.needles.kinds={list(n.kinds)} must be from {list(KINDS)}")
    if not n.lengths or any(x <= 0 for x in n.lengths):
        raise ValueError(f"longcontext.needles.lengths={list(n.lengths)} must be positive token counts")
    if not n.depths or any(not 0.0 <= d <= 1.0 for d in n.depths):
        raise ValueError(f"longcontext.needles.depths={list(n.depths)} must lie in [0, 1]")
    for part in ("qasper", "longbench", "ruler"):
        limit = lc[part].limit
        if limit is not None and limit <= 0:
            raise ValueError(f"longcontext.{part}.limit={limit} must be positive or null")
    if lc.suite == "longbench":
        from .longbench import load_longbench
        load_longbench(lc.longbench.dir, lc.longbench.tasks, limit=1, prompts=lc.longbench.prompts)
    if lc.suite == "ruler":
        from .ruler import load_ruler
        load_ruler(lc.ruler.dir, lc.ruler.tasks, limit=1)


def longest_prompt(lc) -> int:
    """The most prompt tokens the suite may prefill (checked against the model's context)."""
    if lc.suite == "needles":
        return max(lc.needles.lengths) + lc.needles.max_new_tokens
    return lc[lc.suite].max_length


def documents(lc) -> list:
    if lc.suite == "qasper":
        from .qasper import load_qasper
        return load_qasper(lc.qasper.limit, lc.qasper.seed, lc.qasper.max_new_tokens)
    if lc.suite == "longbench":
        from .longbench import load_longbench
        b = lc.longbench
        return load_longbench(b.dir, b.tasks, b.limit, b.prompts)
    if lc.suite == "ruler":
        from .ruler import load_ruler
        return load_ruler(lc.ruler.dir, lc.ruler.tasks, lc.ruler.limit)
    raise ValueError(f"suite {lc.suite!r} has no document loader")


def run_suite(model, tokenizer, method, lc, filler: str | None = None, max_positions=None,
              log=None) -> dict:
    """The suite's result: its samples with answers and scores, and per-task summaries."""
    if lc.suite == "needles":
        from .longcontext import evaluate_needles, make_samples
        n = lc.needles
        samples = make_samples(tokenizer, filler, list(n.kinds), list(n.lengths), list(n.depths),
                               n.per_cell, n.seed, max_positions=max_positions)
        r = evaluate_needles(model, tokenizer, method, samples, n.max_new_tokens, log=log)
        task = {"n": r["n"], "score": r["accuracy"], "lo": r["accuracy_lo"], "hi": r["accuracy_hi"],
                "metric": "needle"}
        return {"suite": "needles", **r, "tasks": {"needles": task}}
    from .documents import evaluate_documents
    result = evaluate_documents(model, tokenizer, method, documents(lc), lc[lc.suite].max_length, log=log)
    return {"suite": lc.suite, **result}
