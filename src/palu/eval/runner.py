"""Perplexity of a (possibly compressed) model on a named corpus: the library-level job."""
from __future__ import annotations

from ..data.corpora import load_corpus
from ..data.windows import evaluation_windows, tokenize
from .perplexity import perplexity


def check_seqlen(model_config, seqlen: int) -> None:
    limit = getattr(model_config, "max_position_embeddings", None)
    if seqlen <= 0:
        raise ValueError(f"seqlen={seqlen} must be positive")
    if limit is not None and seqlen > limit:
        raise ValueError(f"seqlen={seqlen} exceeds the model's maximum of {limit} positions")


def evaluate_corpus(model, tokenizer, corpus: str, seqlen: int, max_tokens: int | None = None,
                    path: str | None = None, calibration_fraction: float = 0.3,
                    progress: bool = True, method=None) -> dict:
    """Perplexity on the evaluation part of `corpus` in non-overlapping `seqlen` windows, through
    `method`'s cache (a `palu.methods.CacheMethod`, already installed; None: no cache)."""
    check_seqlen(model.config, seqlen)
    data = load_corpus(corpus, path=path, calibration_fraction=calibration_fraction)
    windows = evaluation_windows(tokenize(tokenizer, data.evaluation_text), seqlen, max_tokens)
    make_cache = None if method is None else (lambda: method.make_cache(model))
    result = perplexity(model, windows, progress=progress, make_cache=make_cache)
    return {**result, "corpus": corpus, "corpus_label": data.label, "standin": data.standin,
            "seqlen": seqlen, "tokens": int(windows.numel())}
