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
import os

import numpy as np
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from ..models.fused_layers import fused_layers
from . import static_decode, static_quant, static_subset
from .journal import current as current_journal

log = logging.getLogger(__name__)
AUTO_MAX_BATCH = 128   # where `batch_size="auto"` starts halving (lm-eval's auto does the same)
# the environment switches that choose a decode path (static_decode, the kernels, cache/quant_dense)
DECODE_SWITCHES = ("PALU_STATIC_DECODE", "PALU_DENSE_DECODE", "PALU_QUANT_DENSE", "PALU_BANDED_PREFILL",
                   "PALU_FUSED_OPS")


def decode_switches() -> dict:
    """The decode-path switches set now: every output records the ones its answers ran under."""
    return {k: os.environ[k] for k in DECODE_SWITCHES if k in os.environ}


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
    a GPU: from `AUTO_MAX_BATCH` down, halved on out-of-memory, then sized to the prompt + answer
    tokens the halved batch held, so shorter prompts batch more; on a CPU: 1). `progress(done,
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
    with fused_layers(model) as fused:   # on a GPU: the model's norms, MLPs and RoPE fused
        if fused and order:
            log.info("%d norms, MLPs and rotary functions run fused (PALU_FUSED_OPS=0: torch's)", fused)
        _answer_in_batches(model, tokenizer, method, prompts, news, order, out, size, batch_size, padded,
                           journal, progress)
    return out


def _answer_in_batches(model, tokenizer, method, prompts, news, order, out, size, batch_size, padded,
                       journal, progress) -> None:
    start, base = 0, len(prompts) - len(order)
    # "auto": once a batch ran out of memory, a batch holds at most `tokens` prompt + answer
    # positions (half of those that did not fit), so a batch halved to one 32K-token prompt grows
    # back to eight of 4K (what a job holds is about linear in them: the cache, the activations)
    tokens, most = None, size
    while start < len(order):
        first = order[start]
        width = len(prompts[first]) + news[first]   # the longest row of the batch: it is padded to it
        if tokens is not None:
            size = max(1, min(most, tokens // width))
        group = [i for i in order[start:start + size] if news[i] == news[first]
                 and (padded or len(prompts[i]) == len(prompts[first]))]
        try:
            answers = _generate(model, tokenizer, method, [prompts[i] for i in group], news[group[0]])
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not out_of_memory(err) or batch_size != "auto" or len(group) == 1:
                raise
            size = len(group) // 2
            tokens = size * width
            log.info("out of memory at batch %d of %d tokens: halved to %d (at most %d tokens a batch "
                     "from now on)", len(group), width, size, tokens)
            torch.cuda.empty_cache()
            continue
        for i, a in zip(group, answers):
            out[i] = a
        if journal is not None:
            journal.add([(prompts[i], news[i], a) for i, a in zip(group, answers)])
        start += len(group)
        if progress is not None:
            progress(base + start, len(prompts))


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
    the bytes its tokens hold in the cache when it ends."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_padded(prompts, pad, device)
    stop = eos_ids(model)
    if not plain_greedy(model):
        return _generate_with_transformers(model, tokenizer, method, prompts, max_new_tokens, ids, mask, pad, stop)
    if static_decode.enabled() and device.type == "cuda" and static_decode.unsupported(model, method) is None:
        return _generate_static(model, tokenizer, method, prompts, max_new_tokens, ids, mask, stop)
    if static_decode.latent_enabled() and device.type == "cuda" and \
            static_decode.latent_unsupported(model, method) is None:
        return _generate_static_latent(model, tokenizer, method, prompts, max_new_tokens, ids, mask, stop)
    if static_subset.subset_enabled(method) and device.type == "cuda" and \
            static_subset.subset_unsupported(model, method) is None:
        return _generate_in_slots(static_subset.greedy_static_subset, model, tokenizer, method, prompts,
                                  max_new_tokens, ids, mask, stop)
    if static_quant.quant_enabled() and device.type == "cuda" and \
            static_quant.quant_unsupported(model, method) is None:
        return _generate_in_slots(static_quant.greedy_static_quant, model, tokenizer, method, prompts,
                                  max_new_tokens, ids, mask, stop)
    cache = DynamicCache() if method is None else method.make_cache(model)
    rows = _decode_dropping_ended_rows(model, cache, ids, mask, max_new_tokens, stop,
                                       None if method is None else _RowBytesNow(method, cache, prompts))
    return [(tokenizer.decode(new, skip_special_tokens=True), n) for new, n in rows]


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids, mask) of `prompts` left-padded to the longest; mask None when none is padded (batch 1
    included: the path one prompt always took). Built from one array of every token (a batch of 64
    x 4K tokens took ~90 ms of host time as nested Python lists, while the GPU waited)."""
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    flat = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]))
    real = torch.arange(width) >= (width - lengths)[:, None]
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    ids[real] = flat
    mask = None if bool(real.all()) else real.long().to(device)
    return ids.to(device), mask


def _generate_static(model, tokenizer, method, prompts, max_new_tokens, ids, mask, stop):
    """The plain model / FP16 on a GPU: a preallocated cache, the decode step a CUDA graph
    (`static_decode`); bytes as the dynamic cache counts them (a row's tokens, not the spare room)."""
    new, cache = static_decode.greedy_static(model, ids, mask, max_new_tokens, stop)
    held = None if method is None else method.cache_nbytes(cache)
    total = ids.shape[1] + max_new_tokens
    rows = cache.layers[0].keys.shape[0]   # the rows still held: fewer where ended rows left
    return [(tokenizer.decode(n, skip_special_tokens=True),
             _row_bytes(held, len(p) + len(n) - 1, rows, total, method)) for p, n in zip(prompts, new)]


def _generate_static_latent(model, tokenizer, method, prompts, max_new_tokens, ids, mask, stop):
    """Plain Palu on a GPU (`static_decode.latent_enabled`): latents in preallocated
    slots, each decode step a replayed CUDA graph; a row's bytes are what the method's own cache
    holds for its tokens (`static_decode.latent_row_bytes`)."""
    new, _ = static_decode.greedy_static_latent(model, method, ids, mask, max_new_tokens, stop)
    held = static_decode.latent_rows_bytes(method, model, [len(p) + len(n) - 1 for p, n in zip(prompts, new)])
    return [(tokenizer.decode(n, skip_special_tokens=True), dict(held[len(p) + len(n) - 1]))
            for p, n in zip(prompts, new)]


def _generate_in_slots(greedy, model, tokenizer, method, prompts, max_new_tokens, ids, mask, stop):
    """A method whose decode steps run in preallocated slots on a GPU, replayed as a CUDA graph
    after its own eager prefill (`greedy`: SnapKV / PyramidKV and the other token subsets,
    `static_subset`; KIVI and the quantised caches, `static_quant`); a row's bytes are its own
    tokens' as the method counts them."""
    new, held = greedy(model, method, ids, mask, max_new_tokens, stop)
    return [(tokenizer.decode(n, skip_special_tokens=True),
             {"stored": int(round(h["total"])), "read_per_step": int(round(h.get("read_per_step", h["total"]))),
              "tokens": len(p) + len(n) - 1})
            for p, n, h in zip(prompts, new, held)]


# generation-config settings that change greedy decoding's choice (transformers applies them in
# `generate` even without sampling); with none set, greedy decoding is the argmax
_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
               "min_length": 0, "min_new_tokens": None, "suppress_tokens": None,
               "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
               "sequence_bias": None, "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None}


def plain_greedy(model) -> bool:
    """Whether the model's generation config leaves greedy decoding the plain argmax."""
    cfg = model.generation_config
    return all(getattr(cfg, key, default) in (default, None) for key, default in _PROCESSORS.items())


def _decode_dropping_ended_rows(model, cache, ids, mask, max_new_tokens: int, stop: set,
                                bytes_now=None) -> list[tuple[list[int], dict | None]]:
    """Greedy decoding of a left-padded batch through `cache`, as transformers' `generate` places
    it (positions count a row's own tokens, pads at 1; the prefill keeps only the last logits),
    except that a row leaves the batch, its cache rows with it (`Cache.batch_select_indices`), at
    its first stop token: finished rows stop costing work. Every cache that serves a padded batch
    exactly keeps each row's state apart, so the rows left are unchanged (the tests compare with
    `generate`). Each row's new tokens (its stop token last) and `bytes_now(row, tokens, rows)`
    taken as it ends; one host sync a step (the tokens)."""
    B, width = ids.shape
    if mask is None:
        pos = torch.arange(width, device=ids.device).expand(B, -1)
    else:
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    alive = list(range(B))             # batch row -> prompt
    new: list[list[int]] = [[] for _ in range(B)]
    held: list = [None] * B
    x, cache_position = ids, torch.arange(width, device=ids.device)
    for step in range(max_new_tokens):
        logits = model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       cache_position=cache_position, use_cache=True, logits_to_keep=1).logits[:, -1]
        nxt = logits.argmax(-1)
        ended = []
        for r, t in enumerate(nxt.tolist()):
            new[alive[r]].append(t)
            if t in stop:
                ended.append(r)
        last = step == max_new_tokens - 1
        if bytes_now is not None:   # the cache holds the prompt and every new token but the last
            for r in (range(len(alive)) if last else ended):
                held[alive[r]] = bytes_now(r, alive[r], width + step, len(alive))
        if last or len(ended) == len(alive):
            break
        if ended:
            gone = set(ended)
            keep = [r for r in range(len(alive)) if r not in gone]
            index = torch.tensor(keep, device=ids.device)
            cache.batch_select_indices(index)
            nxt, pos = nxt[index], pos[index]
            mask = None if mask is None else mask[index]
            alive = [alive[r] for r in keep]
        x, pos = nxt[:, None], pos[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], 1)
        cache_position = cache_position[-1:] + 1
    return list(zip(new, held))


class _RowBytesNow:
    """A row's bytes as it ends: from the cache's view of the row alone (`cache.row(r)`) where the
    rows hold different numbers of tokens (eviction) or their codes count tokens; otherwise its
    share of the batch's per-token bytes (every byte but `fixed` belongs to one token of one row)."""

    def __init__(self, method, cache, prompts):
        self.method, self.cache, self.prompts = method, cache, prompts
        by_row = getattr(cache, "row_bytes_by_snapshot", None)
        self.by_row = hasattr(cache, "row") and (by_row is None or by_row())

    def __call__(self, r: int, prompt: int, slots: int, rows: int) -> dict:
        tokens = len(self.prompts[prompt]) + slots - max(map(len, self.prompts))
        apart = getattr(self.cache, "holds_rows_apart", None)
        if self.by_row and (apart is None or apart()):
            n = self.method.cache_nbytes(self.cache.row(r))
            return {"stored": int(round(n["total"])), "read_per_step": int(round(n.get("read_per_step", n["total"]))),
                    "tokens": int(tokens)}
        n = self.method.cache_nbytes(self.cache)
        if self.by_row:   # an unpadded batch of codes that count tokens: every row holds alike
            fixed = n.get("fixed", 0)
            stored, read = n["total"], n.get("read_per_step", n["total"])
            return {"stored": int(round(fixed + (stored - fixed) / rows)),
                    "read_per_step": int(round(fixed + (read - fixed) / rows)), "tokens": int(tokens)}
        return _row_bytes(n, tokens, rows, slots, self.method)


def _generate_with_transformers(model, tokenizer, method, prompts, max_new_tokens, ids, mask, pad, stop):
    """`generate` itself, for a model whose generation config changes greedy decoding
    (`plain_greedy`): finished rows decode pads until the batch ends."""
    cache = None if method is None else method.make_cache(model)
    kwargs = {} if cache is None else {"past_key_values": cache}
    snapshots = None
    # a cache whose rows hold different numbers of tokens (eviction), or one whose bytes are not a
    # per-token share (quantised codes that count tokens): each row's bytes when that row ends
    by_row = hasattr(cache, "row") and getattr(cache, "row_bytes_by_snapshot", lambda: True)()
    if cache is not None and len(prompts) > 1 and (by_row or not batchable(method)):
        snapshots = _RowBytes(method, cache, stop, len(prompts))
        kwargs["stopping_criteria"] = StoppingCriteriaList([snapshots])
    width = ids.shape[1]
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
