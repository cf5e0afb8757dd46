"""A RULER-style suite built here from RULER's task definitions over the embedded text, at the
model's full context (issue 36): every prompt is filled to `length` tokens, prefilled into the
method's cache and answered through it (`documents.evaluate_documents`).

Tasks (RULER's names without the variant digit; haystacks from the novels stand-in, words from
its vocabulary, QA paragraphs from SQuAD's evaluation split — never a calibration paragraph):
- `niah_single`: one key-value needle at a random depth; its value asked.
- `niah_multikey`: four needles of different keys; one asked (three distractors).
- `niah_multivalue`: one key with four values; all asked.
- `niah_multiquery`: four keys; all four values asked.
- `vt`: variable tracking, one chain of five variables (`VAR A = 12345`, `VAR B = VAR A`, ...)
  scattered in the haystack; every variable holding the value asked.
- `cwe`: common-words extraction: a numbered list where 10 words occur 30 times each and the rest
  3 times (RULER's freq_cw / freq_ucw); the 10 most common asked.
- `fwe`: frequent-words extraction: coded words drawn from a Zipf law (alpha 2, RULER's); the 3
  most frequent asked.
- `qa`: a SQuAD question with its paragraph among numbered distractor paragraphs.
Scored as RULER scores: `string_match_part` for `qa`, `string_match_all` (the share of the
expected strings the answer contains) for the rest.

Sample size (`per_task`): the tables compare a method with FP16 by a paired test on the same
prompts. With n pairs and a share d of them that disagree, the 95% interval of the paired
difference is about ±1.96·sqrt(d / n): at the default n = 100 that is ±0.062 for d = 0.1 and
±0.088 for d = 0.2, so a 10-point drop is resolved while at most ~25% of the pairs disagree;
a single task's Wilson interval is at most ±0.098 wide.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

from .documents import Document, evaluate_documents
from .suites import Suite, check_positive, register_suite

# task -> (metric, answer tokens generated)
TASKS = {"niah_single": ("string_match_all", 32), "niah_multikey": ("string_match_all", 32),
         "niah_multivalue": ("string_match_all", 64), "niah_multiquery": ("string_match_all", 64),
         "vt": ("string_match_all", 30), "cwe": ("string_match_all", 120),
         "fwe": ("string_match_all", 50), "qa": ("string_match_part", 32)}
_KEYS = ("amber", "falcon", "harbor", "lantern", "meadow", "quartz", "saffron", "tundra", "violet",
         "willow", "copper", "ember", "glacier", "juniper", "marble", "orchid")


@dataclass
class RulerStyleSettings:
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])   # prompt + answer tokens
    per_task: int = 100                 # samples per task x length (the power calculation above)
    corpus: str = "novels_standin"      # haystack and word vocabulary (its evaluation part)
    seed: int = 0


NIAH_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to "
             "memorize it. I will quiz you about the numbers afterwards.\n{context}\n")


def _number(rng) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _insert(filler: str, pieces: list[str], depths: list[float]) -> str:
    """`pieces` inserted between the filler's sentences at relative `depths`."""
    sentences = re.split(r"(?<=[.!?]) ", filler)
    at = [round(d * len(sentences)) for d in depths]          # places in the filler as it was
    # from the back, so earlier places stay put; at one place the earlier piece ends up first
    for pos, _, piece in sorted(zip(at, range(len(pieces)), pieces), key=lambda p: (-p[0], -p[1])):
        sentences.insert(pos, piece)
    return " ".join(sentences)


class _Builder:
    """Fills prompts to a token length: the text around {context} is fixed, the context grows."""

    def __init__(self, tokenizer, corpus_text: str, squad: list[dict], seed: int):
        self.tok, self.rng = tokenizer, random.Random(seed)
        self.filler_ids = tokenizer(corpus_text, add_special_tokens=False)["input_ids"]
        words = sorted({w.lower() for w in re.findall(r"\b[A-Za-z]{4,10}\b", corpus_text)})
        self.vocab, self.squad = words, squad

    def length(self, template: str, context: str) -> int:
        from .documents import _chat
        text = template.format(context=context)
        if getattr(self.tok, "chat_template", None):
            return len(_chat(self.tok, text))
        return len(self.tok(text)["input_ids"])

    def haystack(self, template: str, pieces: list[str], length: int,
                 ordered: bool = False) -> tuple[str, list[float]]:
        """Novel text with `pieces` at random depths (in their order with `ordered`), the prompt
        at most `length` tokens."""
        depths = [self.rng.random() for _ in pieces]
        if ordered:
            depths.sort()
        room = length - self.length(template, " ".join(pieces)) - 8
        if room <= 0 or room > len(self.filler_ids):
            raise ValueError(f"ruler_style length {length}: no room for filler ({room} tokens; "
                             f"the corpus has {len(self.filler_ids)})")
        start = self.rng.randint(0, len(self.filler_ids) - room)
        for _ in range(8):   # re-tokenising the joined text can add a few tokens: shrink to fit
            context = _insert(self.tok.decode(self.filler_ids[start:start + room]), pieces, depths)
            over = self.length(template, context) - length
            if over <= 0:
                return context, depths
            room -= over + 4
        raise ValueError(f"ruler_style: could not fit a prompt into {length} tokens")

    def largest(self, template: str, context_of, most: int, length: int) -> str:
        """context_of(n) for the largest n <= most whose prompt stays within `length` tokens."""
        return context_of(boundary(lambda n: self.length(template, context_of(n)), most, length))


def boundary(size, most: int, length: int) -> int:
    """The largest n in [0, most] with size(n) <= length, for a size that grows with n (0 when
    none fits: n = 0 is never tested, as a plain bisection never tests it) -- the bisection's
    answer in fewer calls. Each `size` tokenises a whole prompt (~50 ms at 32K tokens), and a
    bisection over thousands of words took ~16 of them a prompt: 32K-token suites spent minutes
    a job building prompts. Prompt lengths grow about linearly in n, so each round probes where a
    line through the bracket's measured ends reaches `length`, then that probe's neighbour across
    the boundary, and bisects when the round did not halve the bracket (so never more than ~3
    log2(most) calls)."""
    if most <= 0:
        return 0
    s0 = size(0)
    lo, hi, s_lo, s_hi = 0, most + 1, s0, None   # the answer is in [lo, hi): hi is past it or past most

    def probe(n: int) -> bool:
        nonlocal lo, hi, s_lo, s_hi
        s = size(n)
        if s <= length:
            lo, s_lo = n, s
        else:
            hi, s_hi = n, s
        return s <= length

    while hi - lo > 1:
        width = hi - lo
        if s_hi is None:                  # nothing measured above yet: a small step sets the slope
            if not probe(min(hi - 1, lo + max(1, (hi - lo) // 64))) or hi - lo <= 1:
                continue
            guess = lo + int((length - s_lo) * lo / max(s_lo - s0, 1))
        else:
            guess = lo + (length - s_lo) * (hi - lo) // max(s_hi - s_lo, 1)
        guess = min(max(guess, lo + 1), hi - 1)
        neighbour = guess + 1 if probe(guess) else guess - 1
        if lo < neighbour < hi:           # the neighbour across the boundary closes a good guess
            probe(neighbour)
        if 1 < hi - lo and 2 * (hi - lo) > width:   # a round that did not halve the bracket bisects
            probe((lo + hi) // 2)
    return lo


def _niah(b: _Builder, task: str, length: int, i: int) -> Document:
    keys = b.rng.sample(_KEYS, 4)
    if task == "niah_single":
        values = [_number(b.rng)]
        needles = [f"One of the special magic numbers for {keys[0]} is: {values[0]}."]
        question, answers = f"What is the special magic number for {keys[0]} mentioned in the provided text?", values
    elif task == "niah_multikey":
        values = [_number(b.rng) for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        question, answers = f"What is the special magic number for {keys[0]} mentioned in the provided text?", values[:1]
    elif task == "niah_multivalue":
        values = [_number(b.rng) for _ in range(4)]
        needles = [f"One of the special magic numbers for {keys[0]} is: {v}." for v in values]
        question, answers = (f"What are all the special magic numbers for {keys[0]} mentioned in the "
                             "provided text?"), values
    else:   # niah_multiquery
        values = [_number(b.rng) for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        question, answers = (f"What are all the special magic numbers for {', '.join(keys[:3])} and "
                             f"{keys[3]} mentioned in the provided text?"), values
    template = NIAH_HEAD + question.replace("{", "{{").replace("}", "}}")
    context, depths = b.haystack(template, needles, length)
    return _doc(task, length, i, template, context, answers, depth=round(depths[0], 3))


def _vt(b: _Builder, length: int, i: int) -> Document:
    value = str(b.rng.randint(10_000, 99_999))
    names = ["".join(b.rng.choices(string.ascii_uppercase, k=5)) for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j]} = VAR {names[j - 1]}." for j in range(1, 5)]
    template = ("Memorize and track the chain(s) of variable assignment hidden in the following "
                "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
                f"{value} in the text above.")
    context, depths = b.haystack(template, chain, length, ordered=True)   # a chain reads in order
    return _doc("vt", length, i, template, context, names, depth=round(depths[0], 3))


def _cwe(b: _Builder, length: int, i: int) -> Document:
    words = b.rng.sample(b.vocab, len(b.vocab))
    common, rare = words[:10], words[10:]
    template = ("Below is a numbered list of words. In these words, some appear more often than "
                "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
                "the 10 most common words in the above list?")
    order = random.Random(b.rng.random())

    def listing(n):   # the 10 common words 30 times each, n rare words 3 times each, shuffled
        listed = [w for w in common for _ in range(30)] + [w for w in rare[:n] for _ in range(3)]
        order.seed(i)
        order.shuffle(listed)
        return " ".join(f"{j + 1}. {w}" for j, w in enumerate(listed))
    if b.length(template, listing(0)) > length:
        raise ValueError(f"ruler_style cwe: {length} tokens cannot hold the 300 common-word entries")
    context = b.largest(template, listing, len(rare), length)
    if b.length(template, context) < 0.9 * length:   # a prompt must be the length it is reported at
        raise ValueError(f"ruler_style cwe: the corpus's {len(b.vocab)} distinct words cannot fill "
                         f"{length} tokens (each rare word is listed 3 times)")
    return _doc("cwe", length, i, template, context, common)


def _fwe(b: _Builder, length: int, i: int) -> Document:
    codes = list(dict.fromkeys("".join(b.rng.choices(string.ascii_lowercase, k=b.rng.randint(3, 6)))
                               for _ in range(800)))
    weights = [1 / (r + 1) ** 2 for r in range(len(codes))]        # Zipf, alpha 2
    stream = b.rng.choices(codes, weights, k=4 * length)
    template = ("Read the following coded text and track the frequency of each coded word. Find "
                "the three most frequently appeared coded words. {context}\nQuestion: Do not "
                "provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    context = b.largest(template, lambda n: ".... " + " ".join(stream[:n]), len(stream), length)
    counts: dict[str, int] = {}
    for w in context.split()[1:]:
        counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=lambda w: -counts[w])
    if len(top) > 3 and counts[top[2]] == counts[top[3]]:
        raise ValueError(f"ruler_style fwe sample {i}: a tie for the third most frequent word")
    return _doc("fwe", length, i, template, context, top[:3])


def _qa(b: _Builder, length: int, i: int) -> Document:
    gold = b.squad[b.rng.randrange(len(b.squad))]
    others = list(dict.fromkeys(d["paragraph"] for d in b.squad if d["paragraph"] != gold["paragraph"]))
    b.rng.shuffle(others)
    head = ("Answer the question based on the given documents. Only give me the answer and do not "
            "output any other words.")
    template = (f"{head}\n\nThe following are given documents.\n\n{{context}}\n\n{head}\n\nQuestion: "
                + gold["question"].replace("{", "{{").replace("}", "}}"))
    join = lambda ps: "\n\n".join(f"Document {j + 1}:\n{p}" for j, p in enumerate(ps))  # noqa: E731
    n = len(b.largest(template, lambda n: join([gold["paragraph"]] + others[:n]), len(others), length)
            .split("\n\nDocument ")) - 1
    paragraphs = [gold["paragraph"]] + others[:n]
    if n == len(others) and b.length(template, join(paragraphs)) < 0.9 * length:
        raise ValueError(f"ruler_style qa: {len(others) + 1} paragraphs cannot fill {length} tokens")
    where = b.rng.randrange(len(paragraphs))
    paragraphs.insert(where, paragraphs.pop(0))
    context = "\n\n".join(f"Document {j + 1}:\n{p}" for j, p in enumerate(paragraphs))
    return _doc("qa", length, i, template, context, list(dict.fromkeys(gold["answers"])),
                depth=round(where / max(1, len(paragraphs) - 1), 3))


def _doc(task, length, i, template, context, answers, depth=None) -> Document:
    metric, new = TASKS[task]
    fields = {"length": length} if depth is None else {"length": length, "depth": depth}
    return Document(f"{task}@{length}", str(i), template, context, [str(a) for a in answers], metric, new,
                    truncate=False, fields=fields)


def squad_questions(fraction: float = 0.3) -> list[dict]:
    """SQuAD's questions whose paragraph is not in the calibration split (wiki_standin's hash)."""
    from palu.data.corpora import _in_calibration, _request_docs, _squad_paragraph
    out = []
    for doc in _request_docs("squad/bpb_5shot"):
        paragraph = _squad_paragraph(doc)
        if _in_calibration(paragraph, fraction):
            continue
        question = doc["query"][doc["query"].index("\nQuestion:") + len("\nQuestion:"):].split("\nAnswer:")[0].strip()
        out.append({"paragraph": paragraph, "question": question, "answers": doc["answers_text"]})
    return out


def make_documents(tokenizer, s: RulerStyleSettings, corpus_text: str, squad: list[dict]) -> list[Document]:
    b = _Builder(tokenizer, corpus_text, squad, s.seed)
    docs = []
    for length in s.lengths:
        for task in s.tasks:
            room = length - TASKS[task][1]   # the prompt and its answer fit in `length` positions
            for i in range(s.per_task):
                if task.startswith("niah_"):
                    doc = _niah(b, task, room, i)
                else:
                    doc = {"vt": _vt, "cwe": _cwe, "fwe": _fwe, "qa": _qa}[task](b, room, i)
                doc.task, doc.fields["length"] = f"{task}@{length}", length
                docs.append(doc)
    return docs


def check(s) -> None:
    check_positive("ruler_style", s, "per_task")
    bad = [t for t in s.tasks if t not in TASKS]
    if not s.tasks or bad:
        raise ValueError(f"longcontext.ruler_style.tasks={list(s.tasks)}: unknown {bad}; known {list(TASKS)}")
    if not s.lengths or any(not isinstance(x, int) or x < 512 for x in s.lengths):
        raise ValueError(f"longcontext.ruler_style.lengths={list(s.lengths)} must be token counts >= 512")


def prompts(tokenizer, s, prompt_cache=None) -> tuple[list[Document], str | None]:
    """The suite's documents, and their key where they are kept in the folder `prompt_cache` for
    every other job of the grid (`palu.eval.prompt_cache`: built once, ~5 min at 3,200 prompts of
    up to 32K tokens)."""
    import json
    import sys

    from palu.data.corpora import load_corpus
    from . import documents
    from .prompt_cache import cache_key, cached_documents
    corpus, squad = load_corpus(s.corpus).evaluation_text, squad_questions()
    keyed = None if prompt_cache is None else cache_key(
        tokenizer, s, {"corpus": corpus, "squad": json.dumps(squad, sort_keys=True)},
        (sys.modules[__name__], documents))
    return cached_documents(prompt_cache, "ruler_style", keyed, lambda: make_documents(tokenizer, s, corpus, squad))


def run(model, tokenizer, method, s, max_positions=None, log=None, batch_size=1, prompt_cache=None) -> dict:
    if max_positions is not None and max(s.lengths) > max_positions:
        raise ValueError(f"longcontext.ruler_style length {max(s.lengths)} exceeds the model's "
                         f"maximum context ({max_positions} positions)")
    docs, key = prompts(tokenizer, s, prompt_cache)
    r = evaluate_documents(model, tokenizer, method, docs, max(s.lengths), log=log, batch_size=batch_size)
    return {"suite": "ruler_style", **({"prompts_key": key} if key else {}), **r}


def tag(s, dtype: str) -> str:
    return (f"ruler_style-{'+'.join(s.tasks) if len(s.tasks) < len(TASKS) else 'all'}"
            f"-L{'+'.join(str(int(x)) for x in s.lengths)}-n{s.per_task}-{s.corpus}-s{s.seed}-{dtype}")


SUITE = register_suite(Suite("ruler_style", RulerStyleSettings, run, tag,
                             longest_prompt=lambda s: max(s.lengths),
                             check=check, prompts=prompts))
