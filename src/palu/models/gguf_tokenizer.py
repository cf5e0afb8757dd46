"""A SentencePiece-style GGUF tokenizer rebuilt to tokenise as the model was trained.

A GGUF whose `tokenizer.ggml.model` is `llama` holds a SentencePiece vocabulary: pieces, one score
each, and token types. llama.cpp (and SentencePiece's BPE model) encode text by merging adjacent
pieces, always the pair whose concatenation is a piece of highest score first (leftmost on ties),
starting from single characters, with bytes `<0xXX>` for characters the vocabulary lacks. The
scores are merge priorities there, not log-probabilities: Gemma-3's are `▁t` 0, `he` -5, `▁the`
-12. transformers 5.17 converts Gemma GGUFs into a Unigram model over those scores, which
segments "the" as `▁t he` (the sum -5 beats -12): 2.24 bytes per token on Wikipedia text instead
of ~4.5, and every number computed on it is computed on text the model never saw.

`spm_backend` builds the same encoder with the `tokenizers` library: a BPE model whose merges are
every split of every normal piece into two normal pieces, ranked by the merged piece's score
(highest first), so BPE's lowest-rank-first rule is the score-ordered rule. User-defined pieces
(newline and space runs) and control pieces are matched whole before the model, as llama.cpp's
special-token partition does. The tests compare it, id for id, with a plainly written
score-ordered merge (`tests/unit/test_gguf_tokenizer.py`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"   # SentencePiece's ▁


@dataclass(frozen=True)
class SpmVocab:
    """What a SentencePiece GGUF says about its tokenizer."""
    pieces: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool = False
    unk_id: int | None = None

    def __post_init__(self):
        if not len(self.pieces) == len(self.scores) == len(self.types):
            raise ValueError(f"a SentencePiece vocabulary needs one score and type per piece: "
                             f"{len(self.pieces)} pieces, {len(self.scores)} scores, {len(self.types)} types")
        if len(set(self.pieces)) != len(self.pieces):
            raise ValueError("a SentencePiece vocabulary holds a piece twice")

    def ids(self, *types: int) -> dict[str, int]:
        return {p: i for i, (p, t) in enumerate(zip(self.pieces, self.types)) if t in types}


def read_spm_vocab(gguf_path: str | Path) -> SpmVocab | None:
    """The SentencePiece vocabulary of a GGUF, None when its tokenizer is not SentencePiece
    (`tokenizer.ggml.model` other than `llama`: GPT-2-style BPE with real merges, say)."""
    import gguf
    fields = gguf.GGUFReader(str(gguf_path)).fields

    def scalar(key, default=None):
        f = fields.get(key)
        if f is None:
            return default
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0].item()

    def array(key):
        f = fields[key]
        return [f.parts[i] for i in f.data]

    if scalar("tokenizer.ggml.model") != "llama":
        return None
    return SpmVocab(pieces=[bytes(p).decode("utf-8") for p in array("tokenizer.ggml.tokens")],
                    scores=[float(s[0]) for s in array("tokenizer.ggml.scores")],
                    types=[int(t[0]) for t in array("tokenizer.ggml.token_type")],
                    # llama.cpp's default for SentencePiece vocabularies that do not say
                    add_space_prefix=bool(scalar("tokenizer.ggml.add_space_prefix", True)),
                    unk_id=scalar("tokenizer.ggml.unknown_token_id"))


def score_ordered_merges(vocab: SpmVocab) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two normal pieces, highest merged score
    first (ties: the lower piece id, then the shorter left part: a fixed order)."""
    normal = vocab.ids(NORMAL)
    ranked = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[i], i, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_backend(vocab: SpmVocab, post_processor: dict | None = None):
    """A `tokenizers.Tokenizer` that encodes as llama.cpp encodes this vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    unk = vocab.pieces[vocab.unk_id] if vocab.unk_id is not None else None
    model = BPE(vocab={p: i for i, p in enumerate(vocab.pieces)}, merges=score_ordered_merges(vocab),
                unk_token=unk, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    # matched whole before the model: control pieces (special) and user-defined ones (text)
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, t in zip(vocab.pieces, vocab.types) if t == USER_DEFINED])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(vocab.pieces, vocab.types) if t in (CONTROL, UNKNOWN)])
    if post_processor is not None:
        data = json.loads(tok.to_str())
        data["post_processor"] = post_processor
        tok = Tokenizer.from_str(json.dumps(data))
    return tok


def rebuild_spm_tokenizer(tok, gguf_path: str | Path) -> bool:
    """Give `tok` (transformers' conversion of the GGUF's tokenizer) the score-ordered encoder,
    keeping its special tokens, post-processor (BOS) and chat template. False (nothing changed)
    for a GGUF whose tokenizer is not SentencePiece."""
    vocab = read_spm_vocab(gguf_path)
    if vocab is None:
        return False
    if len(vocab.pieces) != len(tok):
        raise ValueError(f"{gguf_path}: {len(vocab.pieces)} pieces in the GGUF, {len(tok)} in "
                         "transformers' conversion of it")
    post = json.loads(tok.backend_tokenizer.to_str()).get("post_processor")
    tok._tokenizer = spm_backend(vocab, post)
    log.info("tokenizer of %s rebuilt with score-ordered merges (SentencePiece / llama.cpp)", Path(gguf_path).name)
    return True
