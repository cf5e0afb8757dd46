"""Answer scorers of the long-context suites, each `score(prediction, answer, **task) -> [0, 1]`.

LongBench's official per-task metrics, written from its definitions (a sample scores the best
value over its reference answers; a task is the mean x 100):
- `qa_f1`: token F1 after SQuAD-style normalisation (lower case, no punctuation, no articles).
- `rouge_l`: ROUGE-L F of the `rouge` package (the one LongBench's scorer calls); 0 when the
  prediction is empty, as there.
- `classification`: the reference class must be among the class names the prediction contains;
  1 / (number of named classes), names that are only part of the reference not counted.
- `retrieval`: of the numbers in the prediction, the share equal to the reference paragraph id.
- `count`: of the numbers in the prediction, the share equal to the reference count.
- `code_sim`: edit similarity (difflib ratio, what `fuzzywuzzy.fuzz.ratio` computes without its
  optional C extension) of the first code line of the prediction (lines holding a back-tick or a
  comment marker skipped) against the reference line.
Ours: `yes_no` (the first yes/no word of the prediction equals the reference) and RULER's
`string_match_all` / `string_match_part` (case-insensitive containment, all / any reference).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from difflib import SequenceMatcher


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, answer: str, **_) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(answer).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_l(prediction: str, answer: str, **_) -> float:
    from rouge import Rouge
    try:
        return float(Rouge().get_scores([prediction], [answer], avg=True)["rouge-l"]["f"])
    except ValueError:          # "Hypothesis is empty." (and its twin for the reference)
        return 0.0


def classification(prediction: str, answer: str, all_classes=None, **_) -> float:
    if not all_classes:
        raise ValueError("the classification metric needs the task's class names (all_classes)")
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in answer and c != answer)]
    return 1.0 / len(named) if answer in named else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, answer: str, **_) -> float:
    ids = re.findall(r"Paragraph (\d+)", answer)
    if not ids:
        raise ValueError(f"a retrieval reference names a paragraph ('Paragraph <n>'), got {answer!r}")
    return _share_equal(prediction, ids[0])


def count(prediction: str, answer: str, **_) -> float:
    return _share_equal(prediction, str(answer))


def code_sim(prediction: str, answer: str, **_) -> float:
    lines = [ln for ln in prediction.lstrip("\n").split("\n")
             if "`" not in ln and "#" not in ln and "//" not in ln]
    first = lines[0] if lines else ""
    if first == answer:
        return 1.0
    if not first or not answer:
        return 0.0
    return round(100 * SequenceMatcher(None, first, answer).ratio()) / 100


def yes_no(prediction: str, answer: str, **_) -> float:
    found = re.search(r"\b(yes|no)\b", prediction, re.IGNORECASE)
    return float(found is not None and found.group(1).lower() == answer.strip().lower())


def string_match_all(prediction: str, answers, **_) -> float:
    """RULER's NIAH-style score over the whole reference list (not max over answers)."""
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def string_match_part(prediction: str, answers, **_) -> float:
    return float(any(a.lower() in prediction.lower() for a in answers))


# scorers that compare against one reference at a time; the sample keeps the best one
PER_ANSWER = {"qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification,
              "retrieval": retrieval, "count": count, "code_sim": code_sim, "yes_no": yes_no}
# scorers that read the whole reference list at once
WHOLE_LIST = {"string_match_all": string_match_all, "string_match_part": string_match_part}
METRICS = (*PER_ANSWER, *WHOLE_LIST)


def score(metric: str, prediction: str, answers: list[str], **task) -> float:
    if metric in WHOLE_LIST:
        return WHOLE_LIST[metric](prediction, answers, **task)
    if metric not in PER_ANSWER:
        raise ValueError(f"metric {metric!r} unknown; known: {list(METRICS)}")
    if not answers:
        raise ValueError("a sample without reference answers cannot be scored")
    return max(PER_ANSWER[metric](prediction, a, **task) for a in answers)
