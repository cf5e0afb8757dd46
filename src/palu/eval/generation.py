"""Answers generated through a method's cache: each prompt is prefilled into
`method.make_cache(model)` and its answer decoded greedily from it, so it can only come from what
the cache stores, never from K/V recomputed at full precision.

`answer_batches` answers many prompts a batch at a time: longest first (the first batch shows
the worst memory, as lm-eval orders requests), left-padded, one cache per batch. A method whose
cache keeps every row exactly as that prompt alone (`CacheMethod.padded_batches`) gives each row
what batch 1 gives; any other method batches only prompts of one length (an unpadded batch: every
row counts its tokens alike), and says so once.
"""
from __future__ import annotations

import logging

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .journal import current as current_journal

log = logging.getLogger(__name__)
AUTO_MAX_BATCH = 128   # where `batch_size="auto"` starts halving (lm-eval's auto does the same)


def answer(model, tokenizer, method, prompt_ids: list[int], max_new_tokens: int = 24) -> str:
    """Greedy answer generated through the method's cache (None: the plain model)."""
    return answer_and_bytes(model, tokenizer, method, prompt_ids, max_new_tokens)[0]


def answer_and_bytes(model, tokenizer, method, prompt_ids: list[int], max_new_tokens: int = 24):
    """The answer, and the bytes its cache held at the end of it (stored, and read per decode
    step: they differ for selection methods; `method.cache_nbytes`), None for the plain model."""
    return _generate(model, tokenizer, method, [prompt_ids], max_new_tokens)[0]


def batchable(method) -> bool:
    """Whether `method`'s cache serves a left-padded batch exactly, row by row (None: the plain
    model, whose dynamic cache does)."""
    return method is None or bool(getattr(method, "padded_batches", False))


def answer_batches(model, tokenizer, method, prompts: list[list[int]], max_new_tokens,
                   batch_size: int | str = 1, progress=None) -> list[tuple[str, dict | None]]:
    """(answer, bytes) of every prompt, in the order given. `max_new_tokens`: one for all or one
    per prompt (a batch holds prompts of one answer length). `batch_size`: an int, or "auto" (on
    a GPU: from `AUTO_MAX_BATCH` down, halved on out-of-memory; on a CPU: 1). `progress(done,
    total)` is called after each batch. Inside `journal.answer_journal(...)` every batch's answers
    are journaled, and prompts an earlier run answered are not answered again."""
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(news) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(news)} answer lengths")
    size = resolve_batch_size(batch_size, model)
    padded = batchable(method)
    if size > 1 and not padded:
        log.info("%s batches only prompts of one length (its cache does not serve a padded batch "
                 "exactly; an unpadded batch is exact)", method.tag)
    order = sorted(range(len(prompts)), key=lambda i: (-news[i], -len(prompts[i]), i))
    out: list = [None] * len(prompts)
    journal = current_journal()   # a resumed step: what an earlier run of it answered
    if journal is not None:
        for i in order:
            out[i] = journal.get(prompts[i], news[i])
        resumed = sum(a is not None for a in out)
        if resumed:
            log.info("%d of %d prompts answered by an earlier run (%s)", resumed, len(prompts), journal.path)
        order = [i for i in order if out[i] is None]
        if progress is not None and resumed:
            progress(resumed, len(prompts))
    start, base = 0, len(prompts) - len(order)
    while start < len(order):
        first = order[start]
        group = [i for i in order[start:start + size] if news[i] == news[first]
                 and (padded or len(prompts[i]) == len(prompts[first]))]
        try:
            answers = _generate(model, tokenizer, method, [prompts[i] for i in group], news[group[0]])
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not out_of_memory(err) or batch_size != "auto" or size == 1:
                raise
            size //= 2
            log.info("out of memory at batch %d: halved to %d", 2 * size, size)
            torch.cuda.empty_cache()
            continue
        for i, a in zip(group, answers):
            out[i] = a
        if journal is not None:
            journal.add([(prompts[i], news[i], a) for i, a in zip(group, answers)])
        start += len(group)
        if progress is not None:
            progress(base + start, len(prompts))
    return out


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is the GPU running out of memory: torch's allocator raises OutOfMemoryError,
    but cuBLAS / cuDNN workspaces and some kernels' own allocations surface as a RuntimeError
    naming it (seen when several jobs share one GPU)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)


def check_batch_size(batch_size, key: str = "batch_size") -> None:
    if batch_size != "auto" and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                 or batch_size < 1):
        raise ValueError(f"{key}={batch_size!r} must be a positive integer or 'auto'")


def resolve_batch_size(batch_size, model) -> int:
    check_batch_size(batch_size)
    if batch_size == "auto":
        return AUTO_MAX_BATCH if next(model.parameters()).device.type == "cuda" else 1
    return batch_size


def eos_ids(model) -> set[int]:
    """The ids `generate` stops a row at (the generation config's): a row of a batch is cut at
    its first, which is where it would have stopped alone."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


@torch.no_grad()
def _generate(model, tokenizer, method, prompts: list[list[int]], max_new_tokens: int):
    """One left-padded batch through one cache: each row's answer (cut at its first EOS) and
    the bytes its tokens hold in the cache."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = None   # unpadded (batch 1 included): no mask, the path one prompt always took
    if any(len(p) != width for p in prompts):
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cache = None if method is None else method.make_cache(model)
    kwargs = {} if cache is None else {"past_key_values": cache}
    stop = eos_ids(model)
    snapshots = None
    # a cache whose rows hold different numbers of tokens (eviction), or one whose bytes are not a
    # per-token share (quantised codes that count tokens): each row's bytes when that row ends
    by_row = hasattr(cache, "row") and getattr(cache, "row_bytes_by_snapshot", lambda: True)()
    if cache is not None and len(prompts) > 1 and (by_row or not batchable(method)):
        snapshots = _RowBytes(method, cache, stop, len(prompts))
        kwargs["stopping_criteria"] = StoppingCriteriaList([snapshots])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, **kwargs)
    new = out[:, width:].tolist()
    held = None if cache is None or snapshots else method.cache_nbytes(cache)   # once per batch
    rows = []
    for row, p in enumerate(prompts):
        end = next((k + 1 for k, t in enumerate(new[row]) if t in stop), len(new[row]))
        tokens = len(p) + end - 1
        n = (snapshots.bytes_of(row, tokens) if snapshots
             else _row_bytes(held, tokens, len(prompts), out.shape[1] - 1, method))
        rows.append((tokenizer.decode(new[row][:end], skip_special_tokens=True), n))
    return rows


class _RowBytes(StoppingCriteria):
    """Each row's bytes when that row ends (its first EOS), from the cache's view of the row
    alone (`cache.row(b)`): an eviction cache's rows keep different numbers of tokens, and a
    finished row goes on decoding pad tokens until the batch ends. Stops nothing."""

    def __init__(self, method, cache, stop: set, rows: int):
        super().__init__()
        self.method, self.cache, self.stop = method, cache, stop
        self.at_end: dict[int, dict] = {}
        self.rows = rows

    def __call__(self, input_ids, scores, **kwargs):
        last = input_ids[:, -1].tolist()
        for b in range(self.rows):
            if b not in self.at_end and last[b] in self.stop:
                self.at_end[b] = self._row(b)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def _row(self, b: int) -> dict:
        apart = getattr(self.cache, "holds_rows_apart", None)   # a quantised cache: if padded
        if hasattr(self.cache, "row") and (apart is None or apart()):
            n = self.method.cache_nbytes(self.cache.row(b))
            return {"stored": n["total"], "read_per_step": n.get("read_per_step", n["total"])}
        # an unpadded batch: every row holds as many tokens, in tensors of one shape, so a row's
        # bytes are an even share (per-layer fixed metadata, codebooks, counted once per row)
        n = self.method.cache_nbytes(self.cache)
        fixed = n.get("fixed", 0)

        def share(v):
            return fixed + (v - fixed) / self.rows
        return {"stored": share(n["total"]), "read_per_step": share(n.get("read_per_step", n["total"]))}

    def bytes_of(self, row: int, tokens: int) -> dict:
        n = self.at_end.get(row) or self._row(row)
        return {"stored": int(round(n["stored"])), "read_per_step": int(round(n["read_per_step"])),
                "tokens": int(tokens)}


def _row_bytes(n: dict | None, tokens: int, batch: int, slots: int, method=None) -> dict | None:
    """A row's share of the batch cache's bytes `n` (`method.cache_nbytes`): what does not grow with the tokens (`fixed`:
    per-layer codebooks), and its `tokens` of the batch x `slots` tokens stored of the rest.
    Exact for the caches that serve padded batches (every other byte belongs to one token of one
    row; the tests check it against batch 1); at batch 1, the cache's own count."""
    if n is None:
        return None
    fixed, share = n.get("fixed", 0), tokens / (batch * slots)
    stored, read = n["total"], n.get("read_per_step", n["total"])
    if batch > 1 or tokens != slots:
        stored, read = fixed + (stored - fixed) * share, fixed + (read - fixed) * share
        if hasattr(method, "row_read_per_step"):   # selection: a row reads a budget of its own tokens
            read = method.row_read_per_step(n, tokens, batch, slots)
    return {"stored": int(round(stored)), "read_per_step": int(round(read)), "tokens": int(tokens)}
