"""Decode-time long-context evaluation: RULER-style retrieval over real filler text.

A sample hides one or more "needles" (a key and a number) at a relative depth of a prompt of
`length` tokens made of real text (the novels stand-in), then asks for the number(s). The prompt
is prefilled into the method's cache and the answer generated through it (`model.generate` with
`past_key_values=method.make_cache(model)`): the answer can only come from what the cache
stores, never from K/V recomputed at full precision. Prompts use the model's chat template
where it has one. An answer is parsed as the digit strings in the generated text; a sample
scores the fraction of its expected numbers that appear among them.

Kinds (as in RULER's NIAH family): `passkey` (one pass key), `single` (one key-value needle),
`multikey` (four needles, one asked), `multivalue` (one key with three values, all asked).
"""
from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field

from .generation import answer_batches
from .stats import wilson_interval
from .suites import Suite, check_positive, register_suite

KINDS = ("passkey", "single", "multikey", "multivalue")
_WORDS = ("amber", "falcon", "harbor", "lantern", "meadow", "quartz", "saffron", "tundra", "violet",
          "willow", "copper", "ember", "glacier", "juniper", "marble", "orchid")


@dataclass
class NeedlesSettings:
    kinds: list[str] = field(default_factory=lambda: ["single"])     # from KINDS
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])  # prompt tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    per_cell: int = 1                   # samples per kind x length x depth
    corpus: str = "novels_standin"      # the filler text (its evaluation part)
    max_new_tokens: int = 24
    seed: int = 0


@dataclass
class Sample:
    kind: str
    length: int            # target prompt length in tokens (the filler is cut to fit)
    depth: float           # relative position of the (first) needle in the filler, 0..1
    question: str
    needles: list[str]
    answers: list[str]     # the numbers the answer must contain
    context: str = ""


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _needles(kind: str, rng: random.Random):
    if kind == "passkey":
        key = str(rng.randint(10_000, 99_999))
        return [f"The pass key is {key}. Remember it. {key} is the pass key."], [key], \
            "What is the pass key? The pass key is"
    words = rng.sample(_WORDS, 4)
    if kind == "single":
        value = _number(rng)
        return [f"One of the special magic numbers for {words[0]} is: {value}."], [value], \
            f"What is the special magic number for {words[0]} mentioned in the text?"
    if kind == "multikey":
        values = [_number(rng) for _ in words]
        needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
        return needles, [values[0]], f"What is the special magic number for {words[0]} mentioned in the text?"
    if kind == "multivalue":
        values = [_number(rng) for _ in range(3)]
        needles = [f"One of the special magic numbers for {words[0]} is: {v}." for v in values]
        return needles, values, f"What are all the special magic numbers for {words[0]} mentioned in the text?"
    raise ValueError(f"needle kind {kind!r} is not one of {list(KINDS)}")


def build_prompt(tokenizer, context: str, question: str) -> list[int]:
    """The token ids of the prompt: the model's chat template when it has one."""
    text = (f"Some special magic numbers are hidden in the following text. Memorise them.\n\n"
            f"{context}\n\n{question}")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)   # BatchEncoding or ids
    return tokenizer(text)["input_ids"]


def make_samples(tokenizer, filler: str, kinds, lengths, depths, per_cell: int = 1,
                 seed: int = 0, max_positions: int | None = None) -> list[Sample]:
    """Samples for every kind x length x depth, each prompt cut to `length` tokens of text."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"longcontext kinds {bad} unknown; known: {list(KINDS)}")
    if max_positions is not None and max(lengths) > max_positions:
        raise ValueError(f"longcontext length {max(lengths)} exceeds the model's maximum context "
                         f"({max_positions} positions)")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"longcontext depths must lie in [0, 1], got {list(depths)}")
    filler_ids = tokenizer(filler)["input_ids"]
    rng, out = random.Random(seed), []
    for kind in kinds:
        for length in lengths:
            for depth in depths:
                for _ in range(per_cell):
                    needles, answers, question = _needles(kind, rng)
                    # the room the filler may take: the prompt without filler, then cut to fit
                    overhead = len(build_prompt(tokenizer, " ".join(needles), question))
                    room = length - overhead
                    if room <= 0 or room > len(filler_ids):
                        raise ValueError(f"longcontext length {length} cannot hold the question "
                                         f"({overhead} tokens) or exceeds the filler ({len(filler_ids)})")
                    start = rng.randint(0, len(filler_ids) - room)
                    text = tokenizer.decode(filler_ids[start:start + room])
                    sentences = re.split(r"(?<=[.!?]) ", text)
                    # the asked needle at `depth`; the others (multikey, multivalue) anywhere
                    positions = [round(depth * len(sentences))] + [
                        rng.randint(0, len(sentences)) for _ in needles[1:]]
                    for pos, needle in sorted(zip(positions, needles), key=lambda p: -p[0]):
                        sentences.insert(pos, needle)
                    out.append(Sample(kind, length, depth, question, needles, answers, " ".join(sentences)))
    return out


def score(text: str, answers: list[str]) -> float:
    """The fraction of expected numbers among the digit strings of the generated text."""
    found = set(re.findall(r"\d+", text))
    return sum(a in found for a in answers) / len(answers)


def evaluate_needles(model, tokenizer, method, samples: list[Sample], max_new_tokens: int = 24,
                     log=None, batch_size: int | str = 1) -> dict:
    from .documents import _progress
    prompts = [build_prompt(tokenizer, s.context, s.question) for s in samples]
    answers = answer_batches(model, tokenizer, method, prompts, max_new_tokens, batch_size,
                             progress=_progress(log, len(samples)))
    rows = []
    for s, ids, (text, _) in zip(samples, prompts, answers):
        rows.append({**{k: v for k, v in asdict(s).items() if k != "context"},
                     "prompt_tokens": len(ids), "answer": text, "score": score(text, s.answers)})
        if log is not None:
            log(f"{len(rows)}/{len(samples)} {s.kind} L={s.length} depth={s.depth:.2f}: "
                f"score {rows[-1]['score']:.2f} ({text.strip()[:40]!r})")
    n = len(rows)
    mean = sum(r["score"] for r in rows) / n
    lo, hi = wilson_interval(int(round(sum(r["score"] for r in rows))), n)
    return {"samples": rows, "n": n, "accuracy": mean, "accuracy_lo": lo, "accuracy_hi": hi}


def check(s) -> None:
    check_positive("needles", s, "per_cell", "max_new_tokens")
    if not s.kinds or any(k not in KINDS for k in s.kinds):
        raise ValueError(f"longcontext.needles.kinds={list(s.kinds)} must be from {list(KINDS)}")
    if not s.lengths or any(x <= 0 for x in s.lengths):
        raise ValueError(f"longcontext.needles.lengths={list(s.lengths)} must be positive token counts")
    if not s.depths or any(not 0.0 <= d <= 1.0 for d in s.depths):
        raise ValueError(f"longcontext.needles.depths={list(s.depths)} must lie in [0, 1]")


def run(model, tokenizer, method, s, max_positions=None, log=None, batch_size=1) -> dict:
    from palu.data.corpora import load_corpus
    filler = load_corpus(s.corpus).evaluation_text
    samples = make_samples(tokenizer, filler, list(s.kinds), list(s.lengths), list(s.depths),
                           s.per_cell, s.seed, max_positions=max_positions)
    r = evaluate_needles(model, tokenizer, method, samples, s.max_new_tokens, log=log, batch_size=batch_size)
    task = {"n": r["n"], "score": r["accuracy"], "lo": r["accuracy_lo"], "hi": r["accuracy_hi"],
            "metric": "needle"}
    return {"suite": "needles", **r, "tasks": {"needles": task}}


def tag(s, dtype: str) -> str:
    """Every setting that changes a needle score (the grid of kinds x lengths x depths)."""
    return (f"needles-{'+'.join(s.kinds)}-L{'+'.join(str(int(x)) for x in s.lengths)}"
            f"-d{'+'.join(f'{float(d):g}' for d in s.depths)}-n{s.per_cell}-{s.corpus}-s{s.seed}-{dtype}")


SUITE = register_suite(Suite("needles", NeedlesSettings, run, tag,
                             longest_prompt=lambda s: max(s.lengths) + s.max_new_tokens, check=check))
