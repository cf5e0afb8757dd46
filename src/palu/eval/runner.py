"""Perplexity of a (possibly compressed) model on a named corpus: the library-level job."""
from __future__ import annotations

from ..data.corpora import load_corpus
from ..data.windows import bos_token_for, evaluation_windows, tokenize
from ..cache.memory import bytes_summary
from .perplexity import perplexity


def check_seqlen(model_config, seqlen: int, what: str = "seqlen") -> None:
    limit = getattr(model_config, "max_position_embeddings", None)
    if seqlen <= 0:
        raise ValueError(f"{what}: seqlen={seqlen} must be positive")
    if limit is not None and seqlen > limit:
        raise ValueError(f"{what}: seqlen={seqlen} exceeds the model's maximum of {limit} positions")


def evaluate_corpus(model, tokenizer, corpus: str, seqlen: int, max_tokens: int | None = None,
                    path: str | None = None, calibration_fraction: float = 0.3,
                    progress: bool = True, method=None, bos: str = "auto", batch_size: int = 1) -> dict:
    """Perplexity on the evaluation part of `corpus` in non-overlapping `seqlen` windows, through
    `method`'s cache (a `palu.methods.CacheMethod`, already installed; None: no cache). `bos`:
    auto | always | never, whether each window starts with the BOS token (see data/windows.py).
    `batch_size` windows a forward (the same number as one at a time, up to reductions)."""
    check_seqlen(model.config, seqlen)
    data = load_corpus(corpus, path=path, calibration_fraction=calibration_fraction)
    result = evaluate_text(model, tokenizer, text=data.evaluation_text, seqlen=seqlen,
                           max_tokens=max_tokens, method=method, bos=bos, progress=progress,
                           interval=False, batch_size=batch_size)
    return {**result, "corpus": corpus, "corpus_label": data.label, "standin": data.standin}


def evaluate_text(model, tokenizer=None, text: str | None = None, windows=None, seqlen: int = 2048,
                  max_tokens: int | None = None, method=None, bos: str = "auto",
                  progress: bool = True, interval: bool = True, batch_size: int = 1) -> dict:
    """Perplexity of your own `text` (cut into non-overlapping `seqlen` windows, as
    `evaluate_corpus` cuts a corpus) or of ready token `windows` (n, T), through `method`'s cache
    (None: no cache). With `interval`, `ppl_lo` / `ppl_hi` are its 95% block-bootstrap interval;
    `palu.eval.stats.ppl_difference` on two results' `block_nll` compares two models pairedly."""
    if (text is None) == (windows is None):
        raise ValueError("evaluate_text takes exactly one of text= or windows=")
    bos_id = None
    if windows is None:
        if tokenizer is None:
            raise ValueError("evaluate_text(text=...) needs the tokenizer")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text= must be a non-empty string")
        check_seqlen(model.config, seqlen)
        bos_id = bos_token_for(tokenizer, bos)
        windows = evaluation_windows(tokenize(tokenizer, text), seqlen, max_tokens, bos_id)
    else:
        import torch
        windows = torch.as_tensor(windows)
        if windows.ndim != 2 or windows.shape[1] < 2 or windows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"windows= must be integer token ids of shape (n, T >= 2), got "
                             f"{tuple(windows.shape)} {windows.dtype}")
        check_seqlen(model.config, windows.shape[1])
    from ..methods.base import check_one_pass
    check_one_pass(method, "perplexity")
    make_cache = None if method is None else (lambda: method.make_cache(model))
    from .generation import check_batch_size
    check_batch_size(batch_size)
    if batch_size == "auto":
        raise ValueError("perplexity batch_size must be a positive integer (windows a forward)")
    result = perplexity(model, windows, batch_size=batch_size, progress=progress, make_cache=make_cache,
                        cache_nbytes=None if method is None else method.cache_nbytes)
    if "cache_nbytes" in result:   # bytes of one window's real cache (batch 1, seqlen tokens)
        elem = next(model.parameters()).element_size()
        result.update(bytes_summary(result.pop("cache_nbytes"), elem, model.config, windows.shape[1]))
    if interval and len(result["block_nll"]) >= 2:
        from .stats import ppl_interval
        result["ppl_lo"], result["ppl_hi"] = ppl_interval(result["block_nll"], result["block_tokens"])
    return {**result, "seqlen": int(windows.shape[1]), "tokens": int(windows.numel()), "bos": bos,
            "bos_token_id": bos_id}
