"""Greedy decoding of a left-padded batch through a quantised KV cache with each decode step
captured once as a CUDA graph and replayed (issue 49, item 4): KIVI, KIVI + SnapKV, KIVI's value
scales, Atom, TurboQuant: the methods whose codes of a block depend on that block alone.

The prefill is the method's own one-pass step (`QuantKVAttention`), right-padded where the family
allows it (`right_padded_prefill`, the default: every row counted from its first token in one set
of tensors; the rows' forms then coded per row from the exact keys and values), else left-padded (a padded batch's rows kept apart,
each counting its own sink, window and key blocks; KIVI + SnapKV evicting each row among its own
tokens). Then every row's tokens move into preallocated slots in the form the cache holds them
(`cache/quant_slots.py`) and each step writes every row's token at one slot, codes the
blocks that fall due on the device and attends with the query heads grouped by KV head: one shape,
no host read, so it replays. Eagerly on the CPU, the same step is what the float64 tests compare
with the eager loop and with each prompt alone.

On by default since the H200 check of session 38 (PALU_STATIC_DECODE=palu keeps the eager loop).
"""
from __future__ import annotations

import torch

from ..models.adapters import layer_window
from .static_decode import FAMILIES, SlotStep, _switch, replay_steps


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
                        graph: bool | None = None, trace: list | None = None):
    """Each row's new tokens (cut after its first stop token) and its bytes when it ends (the
    method's count of the row alone: its prompt and decoded tokens but the last, in the forms
    the cache holds them), for a left-padded batch `ids` whose real tokens `mask` marks (None:
    all). `graph`: capture the decode step (default: on a GPU). `trace`: each step's logits (tests)."""
    from ..cache.quant_slots import QuantSlots
    B, width = ids.shape
    device = ids.device
    graph = device.type == "cuda" if graph is None else graph
    cache = method.make_cache(model)
    if mask is not None and right_padded_prefill(model, method):
        # Every row's tokens first, at positions 0, 1, ...: causal attention alone keeps them from
        # the pads after them, and a token's form at a query depends only on their two places,
        # counted from the row's first token, so the batch's one-pass view is each row's own. A
        # left-padded batch of a method that counts tokens (KIVI's window and key blocks) keeps its
        # rows apart instead, one row layer stepped after another: 8 of the 10 s KIVI-2 spent on
        # 64 prompts of 3.5-4K tokens on the H200 (session 38). The rows' window and blocks are
        # then coded per row from the exact keys and values (`QuantSlots._row_forms`).
        lengths = mask.long().sum(-1)
        ids = ids.gather(1, torch.argsort((mask == 0).to(torch.int8), dim=-1, stable=True))
        steps = torch.arange(width, device=device)
        cache.stash_prompt(lengths.tolist())
        hidden = model.get_decoder()(input_ids=ids, position_ids=steps.expand(B, -1), past_key_values=cache,
                                     cache_position=steps, use_cache=True).last_hidden_state
        logits = model.get_output_embeddings()(hidden[torch.arange(B, device=device), lengths - 1])
        del hidden
        cache.slots = QuantSlots(cache, max_new_tokens, lengths=lengths)
        pos = lengths[:, None]
    else:   # as generate places a left-padded batch: a row's own positions, pads at 1
        pos = (torch.arange(width, device=device).expand(B, -1) if mask is None
               else (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1))
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       cache_position=torch.arange(width, device=device), use_cache=True,
                       logits_to_keep=1).logits[:, -1]
        cache.slots = QuantSlots(cache, max_new_tokens, mask)
        pos = pos[:, -1:] + 1
    if trace is not None:
        trace.append(logits)
    first = logits.argmax(-1)
    step = SlotStep(model, cache, first, pos)
    held = [None] * B

    def leaving(rows):   # a row holds its prompt and every new token but the last
        for r, place, n in rows:
            held[r] = method.cache_nbytes(cache.slots.row(place, n - 1))
    new = replay_steps(step, lambda: step.x[:, 0], first, max_new_tokens, stop, graph, trace, leaving)
    return new, held


def right_padded_prefill(model, method) -> bool:
    """Whether a padded batch prefills right-padded (`greedy_static_quant`): by default
    (PALU_STATIC_DECODE=1 or all) for every quantised cache of the families whose logits are the
    output embedding of the decoder's last hidden state (`static_decode.FAMILIES`: no soft-capping
    or scaling after it). Both prefills are exact per row in float64. Checked on an H100 at 64
    prompts of 3.5-4K tokens + 64: KIVI in session 46 with the real weights
    (`results/checks/h100-kivi-prefill-alone-session46.json`: the first 16 rows alone equal their
    batch rows in 15 / 16 (KIVI-2) and 16 / 16 (KIVI-4), as with the left-padded prefill, at 35.0
    against 10.1 prompts/s); KIVI + SnapKV (each row choosing among its own first tokens with its
    own last queries: `QuantKVAttention._evict`, `QuantSlots._row_forms`), Atom and TurboQuant in
    session 49 with SmolLM2's shapes and random weights
    (`results/throughput/h100-smollm2-random-4k-*session49.json`): answers differing between batch 1
    and 64, right- against left-padded, KIVI + SnapKV 2 / 2 of 24 at 30.5 against 7.2 prompts/s,
    TurboQuant 4 / 6 of 24 at 28.9 against 24.0, Atom 0 / 0 of 8 at 39.9 against 31.5 (FP16 4 of 24,
    3 of 8: near-tied argmaxes flip at another batch shape in fp16). With the real weights (session
    50, `results/checks/h100-static-subset-check-session50.json`): the first 16 rows' answers equal
    the prompts' alone in 15 (KIVI + SnapKV; its left-padded path keeps 2 of them), 3 (Atom, TurboQuant:
    they code every new token at once, so fp16 rounding that differs between batch shapes flips codes
    the next query reads most; the left-padded path is no closer: 4 of 4 differ in session 46), and
    the prefill's logits are bit for bit the prompt's alone (`benchmarks/experiments/batch_invariance.py`)."""
    return _switch() in ("1", "all") and model.config.model_type in FAMILIES
