"""A plainly written SentencePiece / llama.cpp encoder (score-ordered merges), the reference the
GGUF tokenizer is compared with id for id. Slow (quadratic in a fragment's length): test texts only."""
from __future__ import annotations

from palu.models.gguf_tokenizer import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED


def encode(vocab, text: str) -> list[int]:
    """Ids of `text`: whole user-defined / control pieces first (longest at the leftmost place),
    then each fragment between them merged pair by pair, highest-scoring merged piece first
    (leftmost on ties); characters outside the vocabulary become their UTF-8 bytes."""
    whole = {p: i for i, (p, t) in enumerate(zip(vocab.pieces, vocab.types))
             if t in (USER_DEFINED, CONTROL, UNKNOWN)}
    out, start, i = [], 0, 0
    while i < len(text):
        match = max((p for p in whole if text.startswith(p, i)), key=len, default=None)
        if match is None:
            i += 1
            continue
        out += _merge(vocab, text[start:i], first=start == 0)
        out.append(whole[match])
        i = start = i + len(match)
    return out + _merge(vocab, text[start:], first=start == 0)


def _merge(vocab, fragment: str, first: bool) -> list[int]:
    if not fragment:
        return []
    normal = {p: i for i, (p, t) in enumerate(zip(vocab.pieces, vocab.types)) if t == NORMAL}
    fragment = fragment.replace(" ", SPACE)
    if vocab.add_space_prefix and first:
        fragment = SPACE + fragment
    symbols = list(fragment)
    while True:
        best = None
        for k in range(len(symbols) - 1):
            piece = symbols[k] + symbols[k + 1]
            if piece in normal and (best is None or vocab.scores[normal[piece]] > best[0]):
                best = (vocab.scores[normal[piece]], k)
        if best is None:
            break
        k = best[1]
        symbols[k:k + 2] = [symbols[k] + symbols[k + 1]]
    byte = {p: i for i, (p, t) in enumerate(zip(vocab.pieces, vocab.types)) if t == BYTE}
    ids = []
    for s in symbols:
        if s in normal:
            ids.append(normal[s])
        else:
            ids += [byte[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return ids
