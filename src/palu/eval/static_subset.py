"""Greedy decoding of a left-padded batch through a token-subset method with each decode step
captured once as a CUDA graph and replayed (issue 49, item 4): SnapKV and PyramidKV (choosing once,
after the prefill: `cache/subset_slots.py`), StreamingLLM, TOVA and H2O (dropping a token a step:
`cache/evicting_slots.py`), Quest (choosing the pages each step reads, over the same slots).

The prefill is the method's own, eager and left-padded (`SubsetKVAttention`: each row scores and
keeps its own tokens, as its prompt alone would). Then the kept tokens move into preallocated
slots (`cache/subset_slots.py`) and every step writes each row's token at one slot, opens that
column of the row's mask and attends with the query heads grouped by KV head
(`attention/grouped_decode.py`): the step has one shape and reads nothing back, so it replays.
Eagerly on the CPU, the same step is what the float64 tests compare with the eager loop and with
each prompt alone.

On by default since the H200 check of session 36 (`PALU_STATIC_DECODE=palu` keeps these methods
on the eager loop): 30.7 prompts/s for SnapKV at 64 prompts of 4K tokens + 64, against 7.1.
"""
from __future__ import annotations

import torch

from .static_decode import SlotStep, _switch, replay_steps


def subset_enabled(method) -> bool:
    """Every token-subset method: on unless PALU_STATIC_DECODE is palu, fp16 or 0. SnapKV /
    PyramidKV since the H200 check of session 36 (`results/checks/h200-static-subset-check.json`:
    replayed steps equal the same steps run eagerly, 14 of 16 rows keep the eager loop's tokens over
    24 steps). The methods that evict every step (StreamingLLM, TOVA, H2O: `EvictingSlots`) and
    Quest (selecting each step) since session 49's H100 check at 64 x 4K + 64, SmolLM2's shapes with
    random weights (`results/throughput/h100-smollm2-random-4k-paths-session49.json`): answers
    differing between batch 1 and 64 over 24 prompts, replayed against the eager loop: H2O 4 / 3,
    Quest 11 / 11, FP16 4 (fp16 reductions at another batch shape flip near-tied argmaxes, and random
    weights tie often), at 29.7 against 8.6 (H2O) and 29.5 against 10.5 prompts/s (Quest); TOVA and
    StreamingLLM 36.2 and 32.5 prompts/s with the real weights on the H200 (session 41), 0 / 8 and
    1 / 8 differing. Every path is exact per row in float64 (tests/unit/test_static_subset_decode.py)."""
    return _switch() in ("1", "all")


def subset_unsupported(model, method) -> str | None:
    """Why this path cannot serve `method` on `model`, or None when it can."""
    from ..cache.subset_cache import SubsetKVCache, SubsetPolicy
    from ..methods.token_subset import TokenSubset
    if not isinstance(method, TokenSubset):
        return f"method {getattr(method, 'name', method)!r} does not keep a token subset of full keys"
    cache = method.make_cache(model)
    if type(cache) is not SubsetKVCache:
        return f"method {method.name!r} has a cache of its own ({type(cache).__name__})"
    policy = type(cache.policy)
    if policy.select is not SubsetPolicy.select and getattr(cache.policy, "select_rows", None) is None:
        return f"method {method.name!r} chooses what a decode step reads by a rule with no batch form"
    if cache.policy.keeps_after_prefill and cache.policy.slot_cap is None:
        return f"method {method.name!r} evicts after the prefill by a rule without a slot form (slot_cap)"
    return None


@torch.no_grad()
def greedy_static_subset(model, method, ids, mask, max_new_tokens: int, stop: set,
                         graph: bool | None = None, trace: list | None = None):
    """Each row's new tokens (cut after its first stop token) and its bytes when it ends (the
    method's count of the row alone: kept prompt tokens and its decoded tokens but the last), for
    a left-padded batch `ids` whose real tokens `mask` marks (None: all). `graph`: capture the
    decode step (default: on a GPU). `trace`: gets each step's logits (tests)."""
    from ..cache.evicting_slots import EvictingSlots
    from ..cache.subset_slots import SubsetSlots
    B, width = ids.shape
    device = ids.device
    if mask is None:
        pos = torch.arange(width, device=device).expand(B, -1)
    else:   # as generate places a left-padded batch: a row's own positions, pads at 1
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    graph = device.type == "cuda" if graph is None else graph
    cache = method.make_cache(model)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   cache_position=torch.arange(width, device=device), use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    if trace is not None:
        trace.append(logits)
    policy = cache.policy
    cache.slots = (EvictingSlots(cache, max_new_tokens, policy) if policy.keeps_after_prefill
                   else SubsetSlots(cache, max_new_tokens, policy))
    first = logits.argmax(-1)
    step = SlotStep(model, cache, first, pos[:, -1:] + 1)
    held = [None] * B

    def leaving(rows):   # a row holds its kept prompt tokens and every new token but the last
        tokens = cache.slots.row_tokens({place: n - 1 for _, place, n in rows})
        for r, place, _ in rows:
            held[r] = row_nbytes(method, cache, tokens[place])
    new = replay_steps(step, lambda: step.x[:, 0], first, max_new_tokens, stop, graph, trace, leaving)
    return new, held


def row_nbytes(method, cache, tokens: list[int]) -> dict:
    """The method's own count (`cache_nbytes`) of a row alone that holds `tokens[l]` tokens in layer
    l, as the batch cache's layers hold them (dtype, KV heads, head width, positions), on the meta
    device: shapes only, nothing allocated."""
    from ..cache.subset_cache import SubsetKVCache
    shapes = {i: (lay.keys.shape[1], n) for i, (lay, n) in enumerate(zip(cache.layers, tokens))}
    policy = cache.policy.state_for_bytes({i: torch.empty(1, H, n, device="meta") for i, (H, n) in shapes.items()})
    row = SubsetKVCache(policy, len(cache.layers), cache.owner)
    for i, (lay, n) in enumerate(zip(cache.layers, tokens)):
        _, H, _, d = lay.keys.shape
        kv = torch.empty(1, H, n, d, dtype=lay.keys.dtype, device="meta")
        row.store(i, kv, kv, torch.empty(1, H, n, dtype=lay.positions.dtype, device="meta"), n)
    return method.cache_nbytes(row)
