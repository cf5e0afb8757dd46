"""LongBench (THUDM) from local files: `<dir>/<task>.jsonl`, one sample a line with the fields
`input`, `context`, `answers` (list), `all_classes` (classification tasks), `_id`, `length`,
`language` (the format of the LongBench data release). Nothing is fetched: LongBench cannot be
downloaded here, so the default run uses the embedded stand-ins (needles, Qasper papers).

The sixteen English tasks the paper reports (its Table 3), each with LongBench's metric and answer
length; LongBench's own rules: few-shot and code tasks are prompted without the chat template and
only their answer's first line is scored; a prompt longer than `max_length` keeps the first and
last halves (`documents.prompt_ids`). The prompt templates below are ours, written to the same
structure; for numbers comparable with published LongBench scores pass the release's prompt file
(`longcontext.longbench.prompts=<path>/dataset2prompt.json`, task -> template with `{context}` and
`{input}`), which then replaces them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .documents import Document, evaluate_documents
from .suites import Suite, check_limit, check_positive, local_files_tag, register_suite

_SINGLE = ("Answer the question as briefly as you can, using only the text below. If the text does "
           "not answer it, write \"unanswerable\".\n\n{context}\n\nQuestion: {input}\nAnswer:")
_MULTI = ("Answer the question using the passages below. Give only the answer, no explanation.\n\n"
          "{context}\n\nQuestion: {input}\nAnswer:")
_CODE = "Complete the next line of the code below.\n\n{context}{input}Next line of code:\n"


@dataclass(frozen=True)
class Task:
    metric: str
    max_new_tokens: int
    template: str
    chat: bool = True
    first_line: bool = False


TASKS = {
    "narrativeqa": Task("qa_f1", 128, _SINGLE),
    "qasper": Task("qa_f1", 128, _SINGLE),
    "multifieldqa_en": Task("qa_f1", 64, _SINGLE),
    "hotpotqa": Task("qa_f1", 32, _MULTI),
    "2wikimqa": Task("qa_f1", 32, _MULTI),
    "musique": Task("qa_f1", 32, _MULTI),
    "gov_report": Task("rouge_l", 512, "Summarise the government report below in one paragraph."
                       "\n\n{context}\n\nSummary:"),
    "qmsum": Task("rouge_l", 512, "Answer the query about the meeting transcript below in a few "
                  "sentences.\n\n{context}\n\nQuery: {input}\nAnswer:"),
    "multi_news": Task("rouge_l", 512, "Summarise the news articles below in one paragraph.\n\n"
                       "{context}\n\nSummary:"),
    "trec": Task("classification", 64, "Give the type of the last question, as in the examples."
                 "\n\n{context}\n{input}", chat=False, first_line=True),
    "triviaqa": Task("qa_f1", 32, "Answer the last question as in the examples.\n\n{context}\n\n{input}",
                     chat=False, first_line=True),
    "samsum": Task("rouge_l", 128, "Summarise the last dialogue as in the examples.\n\n{context}\n\n"
                   "{input}", chat=False, first_line=True),
    "passage_count": Task("count", 32, "Some of the paragraphs below are duplicates. How many "
                          "different paragraphs are there? Reply with the number only.\n\n{context}"
                          "\n\nNumber of different paragraphs:"),
    "passage_retrieval_en": Task("retrieval", 32, "Below are numbered paragraphs and then a summary of "
                                 "one of them. Which paragraph is summarised? Reply as \"Paragraph "
                                 "<number>\".\n\n{context}\n\nSummary: {input}\n\nAnswer:"),
    "lcc": Task("code_sim", 64, _CODE, chat=False),
    "repobench-p": Task("code_sim", 64, _CODE, chat=False),
}
CHINESE = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
_FIELDS = ("input", "context", "answers")


def check_tasks(tasks) -> None:
    chinese = [t for t in tasks if t in CHINESE]
    if chinese:
        raise ValueError(f"LongBench tasks {chinese} are Chinese (scored on jieba words), not "
                         f"supported; the English tasks: {list(TASKS)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"LongBench tasks {unknown} unknown; known: {list(TASKS)}")


def _prompts(path: str | None) -> dict[str, str]:
    if path is None:
        return {}
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"longcontext.longbench.prompts file {file} not found")
    prompts = json.loads(file.read_text())
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{file} must map task names to prompt templates")
    return prompts


def load_longbench(folder: str | None, tasks, limit: int | None = None,
                   prompts: str | None = None) -> list[Document]:
    """The first `limit` samples of every task (all when None), in file order."""
    if folder is None:
        raise ValueError("longcontext.longbench.dir is not set: give the folder holding LongBench's "
                         "<task>.jsonl files (the data release's data/ folder)")
    tasks = list(tasks)
    check_tasks(tasks)
    if limit is not None and limit <= 0:
        raise ValueError(f"longcontext.longbench.limit must be positive or null, got {limit}")
    root = Path(folder)
    missing = [f"{t}.jsonl" for t in tasks if not (root / f"{t}.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(f"missing LongBench files in {root}: {', '.join(missing)}")
    templates = {t: task.template for t, task in TASKS.items()} | _prompts(prompts)
    docs = []
    for name in tasks:
        task, path = TASKS[name], root / f"{name}.jsonl"
        with path.open() as fh:
            for number, line in enumerate(fh, 1):
                if limit is not None and number > limit:
                    break
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number} is not JSON ({e})") from None
                lost = [f for f in _FIELDS if f not in row]
                if lost or not isinstance(row["answers"], list):
                    raise ValueError(f"{path}:{number} lacks LongBench fields {lost or ['answers (a list)']}")
                docs.append(Document(name, str(row.get("_id", number)), templates[name], row["context"],
                                     [str(a) for a in row["answers"]], task.metric, task.max_new_tokens,
                                     chat=task.chat, first_line=task.first_line,
                                     fields={"input": row["input"]}, all_classes=row.get("all_classes")))
        if not any(d.task == name for d in docs):
            raise ValueError(f"{path} holds no samples")
    return docs


@dataclass
class LongBenchSettings:
    dir: str | None = None              # <dir>/<task>.jsonl (the data release's data/ folder)
    tasks: list[str] = field(default_factory=lambda: [
        "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report",
        "qmsum", "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en",
        "lcc", "repobench-p"])          # the paper's sixteen English tasks
    limit: int | None = None            # first N samples per task (null: all)
    max_length: int = 7500              # prompt tokens (the paper: 31500 on 32K models)
    prompts: str | None = None          # LongBench's dataset2prompt.json for its exact prompts


def check(s) -> None:
    check_limit("longbench", s.limit)
    check_positive("longbench", s, "max_length")


def check_data(s) -> None:
    load_longbench(s.dir, s.tasks, limit=1, prompts=s.prompts)


def run(model, tokenizer, method, s, max_positions=None, log=None, batch_size=1) -> dict:
    docs = load_longbench(s.dir, s.tasks, s.limit, s.prompts)
    return {"suite": "longbench", **evaluate_documents(model, tokenizer, method, docs, s.max_length, log=log,
                                                 batch_size=batch_size)}


SUITE = register_suite(Suite("longbench", LongBenchSettings, run,
                             lambda s, dtype: local_files_tag("longbench", s, dtype),
                             longest_prompt=lambda s: s.max_length, check=check,
                             check_data=check_data))
