"""How far a long-context grid's unfinished jobs have got, from their answer journals: each job's
answers so far scored by task and length, **partial** (a job's result file, the table's input,
is written only once every prompt is answered; this reads what a stopped lease left).

    python benchmarks/experiments/journal_progress.py MODEL_DIR PROMPTS.json.gz JOURNAL ...
    # Qwen2.5-Coder-1.5B's RULER-style grid (session 54: FP16 1,490 of 3,200):
    python benchmarks/experiments/journal_progress.py work/qwen25/models/qwen25-coder-1.5b \\
        work/qwen25/prompts/ruler_style-*.json.gz results/checks/qwen25-journals/*.jsonl

Each prompt is tokenised as a job does (`documents.prompt_ids`, the prepared model's tokenizer) and
looked up by the journal's key; an answer is scored as the job scores it (`documents.score_answer`).
Prints, per journal (its method from the journal's fingerprint) and length: answered / asked, and
the mean score over the tasks answered at that length with a 95 % bootstrap interval
(`stats.stratified_mean`); a length with few answers is a biased view (answers come longest first
within each answer length, so tasks fill unevenly).
"""
from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

from palu.eval.documents import Document, prompt_ids, score_answer
from palu.eval.journal import AnswerJournal
from palu.eval.stats import stratified_mean


def main(model_dir: str, prompts: str, *journals: str) -> None:
    from transformers import AutoTokenizer
    if not journals:
        raise SystemExit(__doc__)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with gzip.open(prompts, "rt", encoding="utf-8") as f:
        docs = [Document(**d) for d in json.load(f)["documents"]]
    longest = max(d.fields["length"] for d in docs)
    keyed = {AnswerJournal.key(prompt_ids(tok, d, longest)[0], d.max_new_tokens): d for d in docs}
    asked = defaultdict(int)
    for d in docs:
        asked[d.fields["length"]] += 1
    print("| journal | method | length | answered | tasks answered | mean score [95 %] |")
    print("|---|---|---|---|---|---|")
    by_task = []
    for path in journals:
        lines = open(path).read().split("\n")
        method = json.loads(lines[0])["fingerprint"]["method"]
        scores = defaultdict(lambda: defaultdict(list))
        unknown = 0
        for text in lines[1:]:
            if not text.strip():
                continue
            entry = json.loads(text)
            d = keyed.get(entry["key"])
            if d is None:
                unknown += 1
                continue
            scores[d.fields["length"]][d.task].append(score_answer(d, entry["answer"][0]))
        if unknown:
            raise SystemExit(f"{path}: {unknown} answers match no prompt of {prompts} (other prompts or tokenizer)")
        name = method.get("name", "?") + "".join(f" {k}={v}" for k, v in method.items()
                                                  if k in ("bits", "kept_ratio", "compression_ratio"))
        for length in sorted(asked):
            tasks = scores.get(length, {})
            n = sum(len(v) for v in tasks.values())
            if not n:
                print(f"| {path.rsplit('/', 1)[-1][:12]} | {name} | {length} | 0 / {asked[length]} | 0 | |")
                continue
            m = stratified_mean([tasks[t] for t in sorted(tasks)])
            by_task += [(t, name, len(v), stratified_mean([v])) for t, v in sorted(tasks.items())]
            print(f"| {path.rsplit('/', 1)[-1][:12]} | {name} | {length} | {n} / {asked[length]} | {len(tasks)} "
                  f"| {100 * m['value']:.1f} [{100 * m['lo']:.1f}, {100 * m['hi']:.1f}] |")

    print("\n| task@length | method | answered | score [95 %] |\n|---|---|---|---|")
    for task, name, n, m in sorted(by_task, key=lambda r: (int(r[0].split("@")[1]), r[0], r[1])):
        print(f"| {task} | {name} | {n} | {100 * m['value']:.1f} [{100 * m['lo']:.1f}, {100 * m['hi']:.1f}] |")


if __name__ == "__main__":
    main(*sys.argv[1:])
