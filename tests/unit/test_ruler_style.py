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


def _bisection(size, most, length):   # the search `boundary` replaced, as it was written
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(mid) <= length:
            lo = mid
        else:
            hi = mid - 1
    return lo


def test_the_boundary_search_gives_the_bisections_answer_in_fewer_calls():
    """Prompt sizes that grow with n (by steps, plateaus, bursts): the interpolating search returns
    what the plain bisection returns, for lengths below, inside and above the range, and a prompt
    of thousands of words costs a handful of tokenisations, not ~16."""
    import random
    from palu.eval.ruler_style import boundary
    rng = random.Random(0)
    calls = []
    for trial in range(400):
        most = rng.choice([0, 1, 2, 5, 40, 3000, 20000])
        steps = [rng.choice([0, 1, 2, 3, 7, 40]) if trial % 3 else rng.randint(2, 4) for _ in range(most + 1)]
        sizes = [50 + sum(steps[:i + 1]) for i in range(most + 1)] if most < 5000 else None
        size_of = (lambda n: sizes[n]) if sizes else (lambda n: 50 + 3 * n + (n * 7919) % 5)
        top = size_of(most)
        for length in (10, 50, size_of(0), rng.randint(50, top + 1), top, top + 10):
            counted = []
            got = boundary(lambda n: counted.append(n) or size_of(n), most, length)
            assert got == _bisection(size_of, most, length), (trial, most, length)
            assert all(0 <= n <= most for n in counted)
            assert len(counted) <= 3 * max(1, most).bit_length() + 3
            if most >= 3000 and not trial % 3 and size_of(0) < length < top:   # smooth growth
                bisected = []
                _bisection(lambda n: bisected.append(n) or size_of(n), most, length)
                calls.append((len(counted), len(bisected)))
    assert sum(c for c, _ in calls) < 0.65 * sum(b for _, b in calls), calls


def test_ruler_prompts_are_the_ones_the_bisection_built(monkeypatch):
    """Every task's documents, field for field, as the bisection built them (the committed
    RULER-style results stay reproducible prompt for prompt)."""
    import palu.eval.ruler_style as rs
    tok = tiny_tokenizer()
    settings = RulerStyleSettings(per_task=3, lengths=[1400, 2000], seed=5)
    new = make_documents(tok, settings, _text(), SQUAD)
    monkeypatch.setattr(rs, "boundary", _bisection)
    old = make_documents(tok, settings, _text(), SQUAD)
    assert [vars(d) for d in new] == [vars(d) for d in old]


def test_built_prompts_are_kept_once_for_a_grid_and_read_back_equal(tmp_path):
    """The prompt cache (palu/eval/prompt_cache.py): the first job builds and keeps the prompts,
    the next one reads the same documents field for field without building; other settings,
    another text or another tokenizer build anew; a file renamed onto another key is refused."""
    import gzip
    import json
    import sys

    from palu.eval import documents, prompt_cache
    import palu.eval.ruler_style as rs
    tok, text = tiny_tokenizer(), _text()
    settings = RulerStyleSettings(per_task=2, lengths=[1400], seed=4)
    modules = (sys.modules[rs.__name__], documents)
    builds = []

    def cached(s=settings, t=text, tk=tok):
        keyed = prompt_cache.cache_key(tk, s, {"corpus": t, "squad": json.dumps(SQUAD)}, modules)
        return prompt_cache.cached_documents(tmp_path, "ruler_style", keyed,
                                             lambda: builds.append(1) or make_documents(tk, s, t, SQUAD))

    first, key = cached()
    again, key_again = cached()
    assert len(builds) == 1 and key == key_again and len(list(tmp_path.iterdir())) == 1
    assert [vars(d) for d in again] == [vars(d) for d in first] == \
        [vars(d) for d in make_documents(tok, settings, text, SQUAD)]
    _, other = cached(s=RulerStyleSettings(per_task=3, lengths=[1400], seed=4))
    _, other_text = cached(t=text + " more words")
    _, other_tok = cached(tk=tiny_tokenizer(add_bos=True))
    assert len(builds) == 4 and len({key, other, other_text, other_tok}) == 4
    # a file of one key under another key's name is refused, not read
    theirs, mine = (tmp_path / f"ruler_style-{k[:24]}.json.gz" for k in (other, key))
    mine.write_bytes(theirs.read_bytes())
    with pytest.raises(ValueError, match="another key"):
        cached()
    # a call that pads or truncates leaves that set on the tokenizer: the key is the same after it
    used = tiny_tokenizer()
    used.pad_token = used.eos_token
    before, key_before = used.backend_tokenizer.to_str(), prompt_cache.tokenizer_fingerprint(used)
    used(["one two", "one"], padding="max_length", truncation=True, max_length=4)
    assert used.backend_tokenizer.to_str() != before      # the call did leave its settings there
    assert prompt_cache.tokenizer_fingerprint(used) == key_before
    # a tokenizer that cannot be keyed (no serialised state) is never cached
    assert prompt_cache.cache_key(object(), settings, {}, modules) is None
    docs, none = prompt_cache.cached_documents(tmp_path, "ruler_style", None, lambda: first)
    assert none is None and docs is first
    with gzip.open(theirs, "rt") as f:
        assert json.load(f)["inputs"]["settings"]["per_task"] == 3
