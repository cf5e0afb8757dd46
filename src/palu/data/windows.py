"""Token windows: non-overlapping evaluation windows and seeded random calibration windows.

A model that is trained with a BOS token at the start of every sequence scores text without one
badly (Gemma-3: ppl 773 without, 200 with). Each window then starts with BOS followed by
seqlen - 1 text tokens; `bos_token_for` decides, following the tokenizer (`data.bos: auto`) or
the user (`always` / `never`). The BOS is context only, never a scored target.
"""
from __future__ import annotations

import torch

BOS_SETTINGS = ("auto", "always", "never")


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer itself puts BOS before a text, as seen on a probe text with special
    tokens on (its `add_bos_token` flag is not reliable: a fast tokenizer's post-processor
    decides, and the flag may say False while it adds one)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos is not None and len(ids) > 0 and ids[0] == bos


def bos_token_for(tokenizer, setting: str = "auto") -> int | None:
    """The BOS id each window starts with, or None (`setting`: auto | always | never)."""
    if setting not in BOS_SETTINGS:
        raise ValueError(f"bos={setting!r} is not one of {list(BOS_SETTINGS)}")
    if setting == "never" or (setting == "auto" and not tokenizer_adds_bos(tokenizer)):
        return None
    if tokenizer.bos_token_id is None:
        raise ValueError("bos=always, but the tokenizer has no BOS token")
    return int(tokenizer.bos_token_id)


def _with_bos(windows: torch.Tensor, bos: int | None) -> torch.Tensor:
    if bos is None:
        return windows
    return torch.cat([torch.full((windows.shape[0], 1), bos, dtype=windows.dtype), windows], 1)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one 1-D LongTensor of token ids (no special tokens); an empty text or
    one a tokenizer cannot encode (a lone surrogate) is refused by name."""
    from .corpora import check_text
    check_text(text, "text=")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def evaluation_windows(tokens: torch.Tensor, seqlen: int, max_tokens: int | None = None,
                       bos: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `seqlen` over the joined text (the paper's method): [n, seqlen].

    `max_tokens` keeps only the first windows covering at most that many tokens (quick runs).
    `bos`: each window is that id followed by the next seqlen - 1 text tokens.
    """
    if seqlen < 2:
        raise ValueError(f"seqlen={seqlen}: a window needs at least 2 tokens (one to predict from, "
                         "one to score)")
    text = seqlen - (bos is not None)
    n = tokens.numel() // text
    if max_tokens is not None:
        n = min(n, max_tokens // seqlen)
    if n == 0:
        raise ValueError(
            f"no full window of seqlen={seqlen} fits in {tokens.numel()} evaluation tokens"
            + (f" with max_tokens={max_tokens}" if max_tokens is not None else ""))
    return _with_bos(tokens[: n * text].view(n, text), bos)


def calibration_windows(tokens: torch.Tensor, n: int, seqlen: int, seed: int,
                        bos: int | None = None, offsets: list[int] | None = None) -> torch.Tensor:
    """`n` windows of `seqlen` tokens at seeded random offsets: [n, seqlen] (`bos`: as in
    `evaluation_windows`). `offsets`: the token offsets to start at instead (then `n` and `seed`
    are not used), to match another code's calibration draw exactly."""
    if seqlen <= 0:
        raise ValueError(f"calibration needs seqlen > 0, got seqlen={seqlen}")
    text = seqlen - (bos is not None)
    if tokens.numel() <= text:
        raise ValueError(f"calibration text has {tokens.numel()} tokens, fewer than seqlen={seqlen}")
    if offsets is not None:
        starts = _checked_offsets(offsets, last=tokens.numel() - text)
        return _with_bos(torch.stack([tokens[s: s + text] for s in starts]), bos)
    if n <= 0:
        raise ValueError(f"calibration needs n > 0 windows, got n={n}")
    if tokens.numel() - text < n:
        # the offsets are drawn from tokens - text places: fewer places than windows repeats
        # windows (a text of one window once gave 16 identical ones)
        raise ValueError(f"calibration text has {tokens.numel()} tokens: room for "
                         f"{tokens.numel() - text} different windows of seqlen={seqlen}, fewer than "
                         f"the {n} asked for (give more text, or fewer / shorter windows)")
    starts = calibration_offsets(tokens.numel(), n, text, seed)
    return _with_bos(torch.stack([tokens[s: s + text] for s in starts]), bos)


def calibration_offsets(n_tokens: int, n: int, text: int, seed: int) -> list[int]:
    """The start offsets `calibration_windows` draws for `n` windows of `text` text tokens (what
    a held-out search window must avoid: `decompose.search.held_out_windows`)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - text, (n,), generator=gen).tolist()


def _checked_offsets(offsets, last: int) -> list[int]:
    """Explicit window starts: integers in [0, last] (a window must fit in the text)."""
    offsets = [int(o) if isinstance(o, torch.Tensor) and o.numel() == 1 else o for o in offsets]
    if not offsets:
        raise ValueError("calibration offsets= is empty: give at least one token offset")
    for o in offsets:
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o <= last:
            raise ValueError(f"calibration offset {o!r} is not an integer in [0, {last}] (the last "
                             "start at which a whole window fits in the text's tokens)")
    return offsets
