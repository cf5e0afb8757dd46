"""RULER from the files its `prepare.py` writes: `<dir>/<task>/validation.jsonl`, a line per
sample with `input` (the whole prompt, already in the template RULER was prepared with),
`outputs` (the reference strings) and optionally `answer_prefix` (appended to the prompt, as
RULER's own harness does). Scored as RULER scores: `string_match_part` for the QA tasks,
`string_match_all` for the rest. A prompt is never cut: one longer than `max_length` is an error
(prepare RULER at a length the model holds). The embedded default uses `longcontext.make_samples`
instead (the same NIAH family, built here over the novels).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .documents import Document, evaluate_documents
from .suites import Suite, check_limit, check_positive, local_files_tag, register_suite

# answer lengths RULER generates with
TASKS = {**{f"niah_single_{i}": 128 for i in (1, 2, 3)},
         **{f"niah_multikey_{i}": 128 for i in (1, 2, 3)},
         "niah_multivalue": 128, "niah_multiquery": 128, "vt": 30, "cwe": 120, "fwe": 50,
         "qa_1": 32, "qa_2": 32}


@dataclass
class RulerSettings:
    dir: str | None = None              # <dir>/<task>/validation.jsonl
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_multikey_1",
                                                      "niah_multivalue", "vt", "cwe", "qa_1"])
    limit: int | None = None            # first N samples per task (null: all)
    max_length: int = 8192


def load_ruler(folder: str | None, tasks, limit: int | None = None) -> list[Document]:
    if folder is None:
        raise ValueError("longcontext.ruler.dir is not set: give the folder RULER's prepare.py "
                         "wrote (<dir>/<task>/validation.jsonl)")
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"RULER tasks {unknown} unknown; known: {list(TASKS)}")
    if limit is not None and limit <= 0:
        raise ValueError(f"longcontext.ruler.limit must be positive or null, got {limit}")
    root = Path(folder)
    missing = [f"{t}/validation.jsonl" for t in tasks if not (root / t / "validation.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(f"missing RULER files in {root}: {', '.join(missing)}")
    docs = []
    for name in tasks:
        path = root / name / "validation.jsonl"
        metric = "string_match_part" if name.startswith("qa_") else "string_match_all"
        rows = [json.loads(line) for line in path.open() if line.strip()][:limit]
        if not rows:
            raise ValueError(f"{path} holds no samples")
        for number, row in enumerate(rows, 1):
            if "input" not in row or not isinstance(row.get("outputs"), list):
                raise ValueError(f"{path}:{number} lacks RULER fields input / outputs (a list)")
            docs.append(Document(name, str(row.get("index", number)), "{context}",
                                 row["input"] + row.get("answer_prefix", ""),
                                 [str(o) for o in row["outputs"]], metric, TASKS[name],
                                 chat=False, truncate=False))
    return docs


def check(s) -> None:
    check_limit("ruler", s.limit)
    check_positive("ruler", s, "max_length")


def check_data(s) -> None:
    load_ruler(s.dir, s.tasks, limit=1)


def run(model, tokenizer, method, s, max_positions=None, log=None, batch_size=1) -> dict:
    docs = load_ruler(s.dir, s.tasks, s.limit)
    return {"suite": "ruler", **evaluate_documents(model, tokenizer, method, docs, s.max_length, log=log,
                                                 batch_size=batch_size)}


SUITE = register_suite(Suite("ruler", RulerSettings, run, lambda s, dtype: local_files_tag("ruler", s, dtype),
                             longest_prompt=lambda s: s.max_length, check=check,
                             check_data=check_data))
