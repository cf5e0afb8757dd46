"""Does a tokenizer tokenise as its model was trained? Two symptoms of a wrong conversion, checked
on a fixed English paragraph whenever a model is loaded:

- words its vocabulary holds whole (`▁history`, `Ġhistory`) split into several tokens: a trained
  BPE or SentencePiece encoder gives such a common word as its one piece;
- far fewer bytes per token than a greedy longest match over the same vocabulary reaches: a
  trained encoder is about as long-pieced as that greedy cut (within ~15% here), a mangled one
  is half as long (Gemma-3's GGUF as transformers 5.17 converts it: 2.2 vs 4.7 bytes per token).

A tokenizer whose vocabulary spells words some other way (WordPiece's `##`) has no countable
words; it is then judged on bytes per token alone.
"""
from __future__ import annotations

import re

# Common words, numbers and punctuation: every trained English vocabulary holds most words whole.
FIDELITY_TEXT = (
    "The history of the university began in the early years of the last century, when a small "
    "group of teachers and students came together in the city to study law, medicine and the "
    "natural sciences. Over the following decades the school grew into one of the largest in the "
    "country, with more than twenty thousand students, a famous library and a hospital that is "
    "still open today. Many of its former students became important leaders in government, "
    "business and science, and several of them won international prizes for their work. The "
    "main building, which was designed by a well known architect, stands near the river in the "
    "centre of the old town, and every summer thousands of visitors come to see its gardens.")
WORD_FORMS = ("\u2581", "\u0120")     # SentencePiece's ▁ and byte-level BPE's Ġ before a word
MAX_SPLIT_SHARE = 0.10
MIN_GREEDY_SHARE = 0.60


class TokenizerFidelityError(ValueError):
    """The tokenizer does not tokenise text as its vocabulary says the model was trained."""


def tokenizer_fidelity(tok, text: str = FIDELITY_TEXT) -> dict:
    """{"words": words whose whole form is one vocabulary piece, "split": those the tokenizer
    splits, "examples": a few of them as tokenised, "bytes_per_token", "greedy_bytes_per_token"}."""
    vocab = tok.get_vocab()
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    words, split, examples = 0, 0, []
    for m in re.finditer(r"(?<= )[A-Za-z]+", text):
        if not any(form + m.group() in vocab for form in WORD_FORMS):
            continue
        words += 1
        pieces = [i for i, (a, b) in zip(ids, offsets) if a < m.end() and b > m.start()]
        if len(pieces) > 1:
            split += 1
            example = f"{m.group()!r} -> {tok.convert_ids_to_tokens(pieces)}"
            if len(examples) < 4 and example not in examples:
                examples.append(example)
    n_bytes = len(text.encode("utf-8"))
    return {"words": words, "split": split, "examples": examples,
            "bytes_per_token": n_bytes / max(len(ids), 1),
            "greedy_bytes_per_token": n_bytes / _greedy_tokens(vocab, text)}


def _greedy_tokens(vocab: dict, text: str, longest: int = 24) -> int:
    """Tokens of a greedy longest-match cut of `text` over the vocabulary's pieces read as text
    (▁ / Ġ as a space); a character no piece starts with counts one token per UTF-8 byte."""
    pieces = set()
    for piece in vocab:
        for form in WORD_FORMS:
            piece = piece.replace(form, " ")
        if len(piece) <= longest:
            pieces.add(piece)
    n, i = 0, 0
    while i < len(text):
        size = next((k for k in range(min(longest, len(text) - i), 0, -1) if text[i:i + k] in pieces), 0)
        n += 1 if size else len(text[i].encode("utf-8"))
        i += max(size, 1)
    return n


def check_tokenizer(tok, what: str = "the tokenizer") -> dict:
    """`tokenizer_fidelity`, or TokenizerFidelityError saying which symptom was seen."""
    f = tokenizer_fidelity(tok)
    if f["words"] >= 10 and f["split"] > MAX_SPLIT_SHARE * f["words"]:
        raise TokenizerFidelityError(
            f"{what} splits {f['split']} of {f['words']} common words that its vocabulary holds whole "
            f"({'; '.join(f['examples'])}): it does not tokenise as the model was trained (a wrong "
            "conversion: for a SentencePiece GGUF, scores read as unigram probabilities instead of "
            "merge priorities), and every number computed with it would be wrong")
    if f["bytes_per_token"] < MIN_GREEDY_SHARE * f["greedy_bytes_per_token"]:
        raise TokenizerFidelityError(
            f"{what} gives {f['bytes_per_token']:.2f} bytes per token on plain English text, where a "
            f"greedy longest match over its own vocabulary gives {f['greedy_bytes_per_token']:.2f}: it "
            "cuts text into pieces far shorter than its vocabulary holds (a wrong conversion), and "
            "every number computed with it would be wrong")
    return f
