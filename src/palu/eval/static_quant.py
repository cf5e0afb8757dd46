"""Greedy decoding of a left-padded batch through a quantised KV cache with each decode step
captured once as a CUDA graph and replayed (issue 49, item 4): KIVI, KIVI + SnapKV, KIVI's value
scales, Atom, TurboQuant: the methods whose codes of a block depend on that block alone.

The prefill is the method's own, eager and left-padded (`QuantKVAttention`: a padded batch's rows
kept apart, each counting its own sink, window and key blocks; KIVI + SnapKV evicting each row
among its own tokens). Then every row's tokens move into preallocated slots in the form the cache
holds them (`cache/quant_slots.py`) and each step writes every row's token at one slot, codes the
blocks that fall due on the device and attends with the query heads grouped by KV head: one shape,
no host read, so it replays. Eagerly on the CPU, the same step is what the float64 tests compare
with the eager loop and with each prompt alone.

On by default since the H200 check of session 38 (PALU_STATIC_DECODE=palu keeps the eager loop).
"""
from __future__ import annotations

import torch

from ..models.adapters import layer_window
from .static_decode import SlotStep, _switch, replay_steps


PREFILL_CHUNK = 512   # prompt tokens a prefill step takes (`greedy_static_quant`)


def quant_enabled() -> bool:
    """On unless PALU_STATIC_DECODE is palu, fp16 or 0. Checked on the H200 (session 38,
    `results/checks/h200-static-quant-check.json`): for KIVI-2, KIVI-4 and KIVI-2 + SnapKV the
    replayed steps equal the same steps run eagerly (logits 0.0 apart, 16 of 16 rows), and 16, 15
    and 16 of 16 rows keep the eager loop's tokens over 24 steps."""
    return _switch() in ("1", "all")


def quant_unsupported(model, method) -> str | None:
    """Why this path cannot serve `method` on `model`, or None when it can."""
    from ..cache.quant_cache import QuantKVCache
    make = getattr(method, "make_cache", None)
    cache = make(model) if make is not None else None
    if not isinstance(cache, QuantKVCache):
        return f"method {getattr(method, 'name', method)!r} does not store quantised full keys and values"
    if getattr(method, "pre_rope", False):
        return f"method {method.name!r} stores keys before RoPE (rotated per token when read)"
    layer = cache.layers[0]
    codecs = (layer.k.codec, layer.v.codec)
    if not all(getattr(c, "dense", False) for c in codecs):
        return f"method {method.name!r} codes a block from more than that block"
    cfg = model.config.get_text_config(decoder=True)
    if any(layer_window(cfg, i) is not None for i in range(cfg.num_hidden_layers)):
        return "sliding-window layers"
    return None


@torch.no_grad()
def greedy_static_quant(model, method, ids, mask, max_new_tokens: int, stop: set,
                        graph: bool | None = None, trace: list | None = None, prefill_chunk: int | None = PREFILL_CHUNK):
    """Each row's new tokens (cut after its first stop token) and its bytes when it ends (the
    method's count of the row alone: its prompt and decoded tokens but the last, in the forms
    the cache holds them), for a left-padded batch `ids` whose real tokens `mask` marks (None:
    all). `graph`: capture the decode step (default: on a GPU). `trace`: each step's logits (tests).
    `prefill_chunk`: prompt tokens a prefill step takes (None: all at once)."""
    from ..cache.quant_slots import QuantSlots
    B, width = ids.shape
    device = ids.device
    if mask is None:
        pos = torch.arange(width, device=device).expand(B, -1)
    else:   # as generate places a left-padded batch: a row's own positions, pads at 1
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    graph = device.type == "cuda" if graph is None else graph
    cache = method.make_cache(model)
    # The prompt in chunks: a one-pass step shows each query every earlier token in the form the
    # cache held it then (`QuantKVView`), so a step of T tokens attends over ~3T columns (exact,
    # then coded keys, then coded values) under a dense mask: 10 s for 64 x 4K on the H200 (session
    # 38), 10x the plain model's prefill. A chunk sees the tokens coded before it in one form,
    # so it attends over ~(held + chunk) columns: the same view, as decoding is (tests: chunk 4).
    # A composition that evicts after its prefill (KIVI + SnapKV) scores the whole prompt at once.
    chunk = width if getattr(method, "eviction", None) is not None else (prefill_chunk or width)
    # the first chunk holds a token of every row: a padded batch's rows are told apart by it
    first = chunk if mask is None else max(chunk, width - int(mask.sum(-1).min()) + 1)
    for lo in [0, *range(first, width, chunk)]:
        hi = min(width, lo + (first if lo == 0 else chunk))
        logits = model(input_ids=ids[:, lo:hi], attention_mask=None if mask is None else mask[:, :hi],
                       position_ids=pos[:, lo:hi], past_key_values=cache,
                       cache_position=torch.arange(lo, hi, device=device), use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    if trace is not None:
        trace.append(logits)
    cache.slots = QuantSlots(cache, max_new_tokens, mask)
    first = logits.argmax(-1)
    step = SlotStep(model, cache, first, pos[:, -1:] + 1)
    new = replay_steps(step, lambda: step.x[:, 0], first, max_new_tokens, stop, graph, trace)
    held = [method.cache_nbytes(cache.slots.row(b, len(n) - 1)) for b, n in enumerate(new)]
    return new, held
