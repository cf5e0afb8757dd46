"""A plainly written SentencePiece / llama.cpp encoder (score-ordered merges), the reference the
GGUF tokenizer is compared with id for id. Slow (quadratic in a fragment's length): test texts only."""
from __future__ import annotations

from palu.models.gguf_tokenizer import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED


def encode(vocab, text: str) -> list[int]:
    """Ids of `text`: whole user-defined / control pieces first (longest at the leftmost place),
    then each fragment between them (with a leading ▁ where the vocabulary says to add one) merged pair by pair, highest-scoring merged piece first
    (leftmost on ties); characters outside the vocabulary become their UTF-8 bytes."""
    whole = vocab.ids(USER_DEFINED, CONTROL, UNKNOWN)
    normal, byte = vocab.ids(NORMAL), vocab.ids(BYTE)
    by_first = {}
    for piece in whole:
        by_first.setdefault(piece[0], []).append(piece)
    out, start, i = [], 0, 0
    while i < len(text):
        match = max((p for p in by_first.get(text[i], ()) if text.startswith(p, i)), key=len, default=None)
        if match is None:
            i += 1
            continue
        out += _merge(vocab, normal, byte, text[start:i])
        out.append(whole[match])
        i = start = i + len(match)
    return out + _merge(vocab, normal, byte, text[start:])


def _merge(vocab, normal: dict, byte: dict, fragment: str) -> list[int]:
    if not fragment:
        return []
    fragment = fragment.replace(" ", SPACE)
    # llama.cpp prefixes a space to every text fragment that starts the text or follows a whole piece
    if vocab.add_space_prefix:
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
    ids = []
    for s in symbols:
        if s in normal:
            ids.append(normal[s])
        else:
            ids += [byte[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return ids
