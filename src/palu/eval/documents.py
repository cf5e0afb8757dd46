"""Long-document question answering through a method's cache (Qasper, LongBench, RULER files).

A `Document` is one question over one long context. Its prompt is built from a template with
`{context}` and the task's other fields, cut to `max_length` tokens in the middle of the context
when too long (LongBench's rule: keep the first and last halves, since instructions and the
question sit at the two ends), wrapped in the model's chat template when the task asks for it,
prefilled into `method.make_cache(model)` and answered greedily through it
(`generation.answer`). The answer is scored by the task's metric (`scorers`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import scorers
from .stats import stratified_mean, wilson_interval


@dataclass
class Document:
    task: str
    id: str
    template: str            # with {context} and any of `fields`
    context: str
    answers: list[str]
    metric: str              # a scorers.METRICS name
    max_new_tokens: int
    chat: bool = True        # wrap in the chat template (LongBench leaves few-shot / code tasks raw)
    first_line: bool = False  # score only the first line of the answer (LongBench's few-shot tasks)
    truncate: bool = True    # cut the context's middle to fit; False: too long is an error (RULER)
    fields: dict = field(default_factory=dict)
    all_classes: list[str] | None = None


def _chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_ids(tokenizer, doc: Document, max_length: int) -> tuple[list[int], bool]:
    """The prompt's token ids (at most `max_length`) and whether the context was cut."""
    chat = doc.chat and bool(getattr(tokenizer, "chat_template", None))
    encode = (lambda t: _chat(tokenizer, t)) if chat else (lambda t: tokenizer(t)["input_ids"])
    ids = encode(doc.template.format(context=doc.context, **doc.fields))
    if len(ids) <= max_length:
        return ids, False
    if not doc.truncate:
        raise ValueError(f"{doc.task} sample {doc.id!r} has {len(ids)} prompt tokens, over "
                         f"longcontext max_length {max_length} (its prompt cannot be cut)")
    overhead = len(encode(doc.template.format(context="", **doc.fields)))
    room = max_length - overhead - 2          # the join may re-tokenise a token or two longer
    if room < 16:
        raise ValueError(f"longcontext max_length {max_length} cannot hold {doc.task} sample "
                         f"{doc.id!r} without its context ({overhead} tokens)")
    ctx = tokenizer(doc.context, add_special_tokens=False)["input_ids"]
    cut = tokenizer.decode(ctx[:room // 2]) + tokenizer.decode(ctx[len(ctx) - (room - room // 2):])
    ids = encode(doc.template.format(context=cut, **doc.fields))
    if len(ids) > max_length:                 # a merge across the join: drop the overflow at the cut
        ids = ids[:max_length // 2] + ids[len(ids) - (max_length - max_length // 2):]
    return ids, True


def score_answer(doc: Document, text: str) -> float:
    """The document's metric on a generated answer (its first line where the task asks for one)."""
    scored = text.lstrip("\n").split("\n")[0] if doc.first_line else text
    return scorers.score(doc.metric, scored, doc.answers, all_classes=doc.all_classes)


def evaluate_documents(model, tokenizer, method, docs: list[Document], max_length: int,
                       log=None, batch_size: int | str = 1) -> dict:
    """Every document answered through the method's cache (`batch_size` prompts at a time,
    `generation.answer_batches`) and scored; per-task means with 95% intervals (Wilson for 0/1
    metrics, bootstrap otherwise)."""
    from .generation import answer_batches
    prompts = [prompt_ids(tokenizer, d, max_length) for d in docs]
    answers = answer_batches(model, tokenizer, method, [ids for ids, _ in prompts],
                             [d.max_new_tokens for d in docs], batch_size, progress=_progress(log, len(docs)))
    rows = []
    for d, (ids, cut), (text, nbytes) in zip(docs, prompts, answers):
        value = score_answer(d, text)
        rows.append({"task": d.task, "id": d.id, "metric": d.metric, "prompt_tokens": len(ids),
                     "truncated": cut, "answers": d.answers, "answer": text, "score": value,
                     **({"cache_bytes": nbytes} if nbytes else {}), **d.fields})
        if log is not None:
            log(f"{len(rows)}/{len(docs)} {d.task} {d.id}: {d.metric} {value:.2f} "
                f"({len(ids)} tokens{', cut' if cut else ''}; {text.strip()[:40]!r})")
    return {"samples": rows, "tasks": task_summary(rows)}


def _progress(log, total: int):
    """Batches answered, logged as they finish (the per-sample lines come once all are)."""
    if log is None:
        return None
    return lambda done, _: log(f"answered {done}/{total} prompts")


def task_summary(rows: list[dict]) -> dict:
    out = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        scores = np.array([r["score"] for r in rows if r["task"] == task])
        if np.isin(scores, (0.0, 1.0)).all():
            lo, hi = wilson_interval(int(scores.sum()), len(scores))
        elif len(scores) < 2:   # one fractional score: no spread to estimate an interval from
            lo, hi = 0.0, 1.0
        else:
            ci = stratified_mean([scores])
            lo, hi = ci["lo"], ci["hi"]
        out[task] = {"n": int(len(scores)), "score": float(scores.mean()), "lo": lo, "hi": hi,
                     "metric": next(r["metric"] for r in rows if r["task"] == task)}
        held = [r["cache_bytes"] for r in rows if r["task"] == task and "cache_bytes" in r]
        if held:   # bytes the cache held at the end of an answer, mean over the task's samples
            out[task]["bytes_stored"] = float(np.mean([h["stored"] for h in held]))
            out[task]["bytes_read_per_step"] = float(np.mean([h["read_per_step"] for h in held]))
    return out
