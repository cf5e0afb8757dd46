"""The RULER-style suite (palu/eval/ruler_style.py): every task's prompts fit their length with the
answer, hide what they ask for, and score as RULER scores; bad settings are refused."""
import collections
import re

import pytest

from palu.eval.documents import prompt_ids
from palu.eval.ruler_style import TASKS, RulerStyleSettings, check, make_documents, tag
from tiny import WORDS, tiny_tokenizer

SQUAD = [{"paragraph": f"Paragraph {i}: " + " ".join(WORDS[i:i + 40]), "question": f"question {i} ends here",
          "answers": [WORDS[i + 3]]} for i in range(60)]


def _text() -> str:
    """The tiny vocabulary's sentences, and distinct made-up words (the cwe task lists each rare
    word three times: it needs a corpus of many distinct words)."""
    import random
    rng = random.Random(0)
    filler = ". ".join(" ".join(WORDS[i:i + 8]) for i in range(0, 400, 8)) + "."
    made_up = " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=7)) for _ in range(2000))
    return " ".join([filler] * 30) + " " + made_up


@pytest.fixture(scope="module")
def docs():
    tok = tiny_tokenizer()
    return tok, make_documents(tok, RulerStyleSettings(per_task=2, lengths=[1400, 2000], seed=3), _text(), SQUAD)


def test_every_prompt_and_its_answer_fit_the_length(docs):
    tok, ds = docs
    assert len(ds) == len(TASKS) * 2 * 2
    for d in ds:
        task, length = d.task.split("@")
        ids, cut = prompt_ids(tok, d, int(length))
        assert not cut and len(ids) + TASKS[task][1] <= int(length)
        assert len(ids) + TASKS[task][1] > 0.9 * int(length)      # filled, not short
        assert d.metric == TASKS[task][0] and d.fields["length"] == int(length)


def test_each_task_hides_what_it_asks_for(docs):
    _, ds = docs
    by = collections.defaultdict(list)
    for d in ds:
        by[d.task.split("@")[0]].append(d)
    for d in by["niah_single"] + by["niah_multikey"] + by["niah_multivalue"] + by["niah_multiquery"]:
        assert all(f"is: {a}." in d.context for a in d.answers) and 0 <= d.fields["depth"] <= 1
    assert all(len(d.answers) == 4 for d in by["niah_multivalue"] + by["niah_multiquery"])
    assert all(len(re.findall(r"special magic numbers? for", d.context)) == 4 for d in by["niah_multikey"])
    for d in by["vt"]:   # the chain, in order: VAR A = value, VAR B = VAR A, ...
        value = re.search(r"assigned the value (\d+)", d.template).group(1)
        chain = [m.start() for m in (re.search(rf"VAR {n} = ", d.context) for n in d.answers)]
        assert f"VAR {d.answers[0]} = {value}." in d.context and chain == sorted(chain)
    for d in by["cwe"]:  # the 10 answers are the 10 words listed 30 times; every other word 3 times
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", d.context))
        assert sorted(w for w, c in counts.items() if c == 30) == sorted(d.answers)
        assert set(c for w, c in counts.items() if w not in d.answers) == {3}
    for d in by["fwe"]:
        counts = collections.Counter(d.context.split()[1:])
        top = [w for w, _ in counts.most_common(3)]
        assert sorted(top) == sorted(d.answers) and counts.most_common(4)[2][1] > counts.most_common(4)[3][1]
    for d in by["qa"]:
        gold = next(s for s in SQUAD if d.template.endswith(s["question"]))
        assert gold["paragraph"] in d.context and d.answers == gold["answers"]
        assert d.context.count("Document ") > 3          # among distractors


def test_the_same_seed_builds_the_same_prompts_and_the_tag_names_the_settings(docs):
    tok, ds = docs
    again = make_documents(tok, RulerStyleSettings(per_task=2, lengths=[1400, 2000], seed=3), _text(), SQUAD)
    assert [d.context for d in again] == [d.context for d in ds]
    assert tag(RulerStyleSettings(), "float32") == "ruler_style-all-L4096+8192-n100-novels_standin-s0-float32"
    assert tag(RulerStyleSettings(tasks=["vt", "qa"], per_task=5), "bfloat16").startswith("ruler_style-vt+qa-")


@pytest.mark.parametrize("settings, match", [
    ({"tasks": ["niah_single", "nope"]}, "unknown"),
    ({"tasks": []}, "tasks"),
    ({"per_task": 0}, "per_task"),
    ({"lengths": [256]}, "lengths"),
])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        check(RulerStyleSettings(**settings))


def test_a_corpus_too_small_to_fill_a_prompt_is_an_error_not_a_short_prompt():
    tok = tiny_tokenizer()
    filler = ". ".join(" ".join(WORDS[i:i + 8]) for i in range(0, 400, 8)) + "."
    with pytest.raises(ValueError, match="distinct words cannot fill 1880 tokens"):
        make_documents(tok, RulerStyleSettings(per_task=1, lengths=[2000], tasks=["cwe"]), filler * 30, SQUAD)
