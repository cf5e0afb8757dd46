"""Token windows: non-overlapping evaluation windows and seeded random calibration windows."""
from __future__ import annotations

import torch


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one 1-D LongTensor of token ids (no special tokens)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def evaluation_windows(tokens: torch.Tensor, seqlen: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `seqlen` over the joined text (the paper's method): [n, seqlen].

    `max_tokens` keeps only the first windows covering at most that many tokens (quick runs).
    """
    if seqlen <= 0:
        raise ValueError(f"seqlen must be positive, got {seqlen}")
    n = tokens.numel() // seqlen
    if max_tokens is not None:
        n = min(n, max_tokens // seqlen)
    if n == 0:
        raise ValueError(
            f"no full window of seqlen={seqlen} fits in {tokens.numel()} evaluation tokens"
            + (f" with max_tokens={max_tokens}" if max_tokens is not None else ""))
    return tokens[: n * seqlen].view(n, seqlen)


def calibration_windows(tokens: torch.Tensor, n: int, seqlen: int, seed: int) -> torch.Tensor:
    """`n` windows of `seqlen` tokens at seeded random offsets: [n, seqlen]."""
    if n <= 0 or seqlen <= 0:
        raise ValueError(f"calibration needs n > 0 and seqlen > 0, got n={n}, seqlen={seqlen}")
    if tokens.numel() <= seqlen:
        raise ValueError(f"calibration text has {tokens.numel()} tokens, fewer than seqlen={seqlen}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seqlen, (n,), generator=gen)
    return torch.stack([tokens[s: s + seqlen] for s in starts.tolist()])
