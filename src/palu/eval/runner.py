"""Perplexity of a (possibly compressed) model on a named corpus: the library-level job."""
from __future__ import annotations

from ..data.corpora import load_corpus
from ..data.windows import bos_token_for, evaluation_windows, tokenize
from ..cache.memory import bytes_summary
from .perplexity import perplexity


def check_seqlen(model_config, seqlen: int) -> None:
    limit = getattr(model_config, "max_position_embeddings", None)
    if seqlen <= 0:
        raise ValueError(f"seqlen={seqlen} must be positive")
    if limit is not None and seqlen > limit:
        raise ValueError(f"seqlen={seqlen} exceeds the model's maximum of {limit} positions")


def evaluate_corpus(model, tokenizer, corpus: str, seqlen: int, max_tokens: int | None = None,
                    path: str | None = None, calibration_fraction: float = 0.3,
                    progress: bool = True, method=None, bos: str = "auto") -> dict:
    """Perplexity on the evaluation part of `corpus` in non-overlapping `seqlen` windows, through
    `method`'s cache (a `palu.methods.CacheMethod`, already installed; None: no cache). `bos`:
    auto | always | never, whether each window starts with the BOS token (see data/windows.py)."""
    check_seqlen(model.config, seqlen)
    data = load_corpus(corpus, path=path, calibration_fraction=calibration_fraction)
    bos_id = bos_token_for(tokenizer, bos)
    tokens = tokenize(tokenizer, data.evaluation_text)
    windows = evaluation_windows(tokens, seqlen, max_tokens, bos_id)
    make_cache = None if method is None else (lambda: method.make_cache(model))
    result = perplexity(model, windows, progress=progress, make_cache=make_cache,
                        cache_nbytes=None if method is None else method.cache_nbytes)
    if "cache_nbytes" in result:   # bytes of one window's real cache (batch 1, seqlen tokens)
        elem = next(model.parameters()).element_size()
        result.update(bytes_summary(result.pop("cache_nbytes"), elem, model.config, windows.shape[1]))
    return {**result, "corpus": corpus, "corpus_label": data.label, "standin": data.standin,
            "seqlen": seqlen, "tokens": int(windows.numel()), "bos": bos, "bos_token_id": bos_id}
