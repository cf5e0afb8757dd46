"""SnapKV and PyramidKV through preallocated slots on a padded batch
(`palu.eval.static_subset.greedy_static_subset`; on by default since the H200 check of session 36). On the CPU the decode step runs eagerly on the tensors a GPU would
capture, so these float64 tests pin what the graph replays: the method's own left-padded
prefill, then one token a row a step at one slot, each row masked by the slots it keeps.
Reference: each prompt alone through the method's own cache, token by token; the bytes and
answers of the eager loop (the CPU's route)."""
import copy

import pytest
import torch

from palu.eval import generation, static_subset
from palu.methods import build_method

from tiny import (PAD, PROMPTS, SIX_PROMPTS, check_slots_refuse_misuse, greedy_alone, left_padded,
                  WordTok, decode_as_rows_leave, tiny_llama)

CONF = {"snapkv": {"name": "snapkv", "compression_ratio": 0.5, "window": 2, "kernel": 1},
        "pyramidkv": {"name": "pyramidkv", "compression_ratio": 0.5, "window": 2, "kernel": 1},
        # evicting as they decode (cache/evicting_slots.py): caps of 5 tokens a head, below every
        # row's prompt + answer (the 3-token row grows into its cap while decoding)
        "tova": {"name": "tova", "budget": 5},
        "streaming_llm": {"name": "streaming_llm", "sink": 2, "window": 4},
        # accumulating every step's attention per slot: a cap of 5 of which the newest 2 protected
        "h2o": {"name": "h2o", "budget": 5, "window": 2},
        # selecting: pages of 2 tokens, 4 read a step (cache/subset_slots.py, policy.select_rows)
        "quest": {"name": "quest", "page": 2, "budget": 4}}


def _installed(base, name):
    method = build_method(CONF[name])
    model = copy.deepcopy(base)
    method.install(model)
    model.generation_config.eos_token_id = None
    return method, model


@pytest.fixture(scope="module")
def gqa_base():
    """4 query heads over 2 KV heads, 3 layers (PyramidKV's budgets differ by layer)."""
    return tiny_llama(3, kv_heads=2, layers=3).double()


@pytest.mark.parametrize("name", sorted(CONF))
def test_every_row_of_a_padded_batch_equals_its_prompt_alone(gqa_base, name):
    method, model = _installed(gqa_base, name)
    assert static_subset.subset_unsupported(model, method) is None
    ids, mask = left_padded(PROMPTS)
    trace = []
    new, held = static_subset.greedy_static_subset(model, method, ids, mask, 8, set(), graph=False, trace=trace)
    assert len(trace) == 8
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = greedy_alone(model, method, prompt, 8)
        assert new[row] == tokens, (name, row)
        for k, ours in enumerate(trace):
            diff = (ours[row] - logits[k]).abs().max().item()
            assert diff < 1e-9, (name, row, k, diff)


@pytest.mark.parametrize("name", sorted(CONF))
def test_answers_and_bytes_equal_the_eager_loops(gqa_base, name):
    """Through `generation`: each row's answer and bytes as the eager loop reports them, rows
    stopping at their first stop token (their cache then holds fewer decoded tokens)."""
    method, model = _installed(gqa_base, name)

    class Tok:
        pad_token_id, eos_token_id = PAD, None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))
    ids, mask = left_padded(PROMPTS)
    free, _ = static_subset.greedy_static_subset(model, method, ids, mask, 8, set(), graph=False)
    for stop in (set(), {free[1][2], free[2][0]}):
        model.generation_config.eos_token_id = sorted(stop) or None
        ours = generation._generate_in_slots(static_subset.greedy_static_subset, model, Tok(), method, PROMPTS,
                                             8, ids, mask, stop)
        assert ours == generation._generate(model, Tok(), method, PROMPTS, 8)   # the eager loop
    lengths = [len(a.split()) for a, _ in ours]
    assert lengths[1] <= 3 and lengths[2] == 1, lengths
    stored = {n["stored"] for _, n in ours}
    assert len(stored) == (2 if name in ("tova", "streaming_llm", "h2o") else 3), stored   # capped rows hold alike


@pytest.mark.parametrize("name", sorted(CONF))
def test_ended_rows_leave_the_batch_and_the_rest_decode_as_before(gqa_base, name):
    """Once at most half the batch is live the slots keep the live rows only (a GPU captures the
    step again): their logits within 1e-9 of the batch that kept every row; answers and bytes the
    eager loop's, a row's bytes counted as it leaves."""
    method, model = _installed(gqa_base, name)
    ids, mask, stop, _, trace = decode_as_rows_leave(
        lambda ids, mask, n, stop, trace: static_subset.greedy_static_subset(model, method, ids, mask, n, stop, graph=False,
                                                                       trace=trace), name)
    assert any(torch.isnan(t).any() for t in trace), "no row left the batch"
    model.generation_config.eos_token_id = sorted(stop)
    ours = generation._generate_in_slots(static_subset.greedy_static_subset, model, WordTok(), method, SIX_PROMPTS,
                                         12, ids, mask, stop)
    assert ours == generation._generate(model, WordTok(), method, SIX_PROMPTS, 12)


def test_who_it_serves(gqa_base, monkeypatch):
    for name in CONF:
        method, model = _installed(gqa_base, name)
        assert static_subset.subset_unsupported(model, method) is None
    refused = {"kivi": ({"bits": 2, "group": 4, "residual": 4}, "does not keep a token subset")}
    for name, (conf, why) in refused.items():
        method = build_method({"name": name, **conf})
        model = copy.deepcopy(gqa_base)
        method.install(model)
        assert why in static_subset.subset_unsupported(model, method), name
    snap, _ = _installed(gqa_base, "snapkv")
    tova, _ = _installed(gqa_base, "tova")
    quest, _ = _installed(gqa_base, "quest")
    monkeypatch.delenv("PALU_STATIC_DECODE", raising=False)
    for on in (None, "1", "all"):   # kept, evicting every step, selecting: each checked on a GPU
        if on:
            monkeypatch.setenv("PALU_STATIC_DECODE", on)
        assert all(static_subset.subset_enabled(m) for m in (snap, tova, quest)), on
    for off in ("palu", "fp16", "0"):
        monkeypatch.setenv("PALU_STATIC_DECODE", off)
        assert not any(static_subset.subset_enabled(m) for m in (snap, tova, quest)), off


def test_a_slotted_cache_takes_one_token_a_step(gqa_base):
    from palu.cache.subset_slots import SubsetSlots
    method, model = _installed(gqa_base, "snapkv")
    check_slots_refuse_misuse(model, method, SubsetSlots)


def test_h2o_slots_hold_each_tokens_accumulated_attention_as_alone(gqa_base):
    """H2O's state in the slots: every held token's attention summed over the prefill and every
    step, per (row, KV head), equal to what the row's prompt alone accumulates token by token (a
    slot reused after a drop starts its new token from zero)."""
    method, model = _installed(gqa_base, "h2o")
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        cache = method.make_cache(model)
        new, _ = _greedy_with_cache(model, method, ids, mask, cache)
        for row, prompt in enumerate(PROMPTS):
            alone = method.make_cache(model)
            model(torch.tensor([prompt + new[row][:-1]])[:, :len(prompt)], past_key_values=alone)
            for t in new[row][:-1]:
                model(torch.tensor([[t]]), past_key_values=alone)
            for layer in range(len(cache.layers)):
                slots = cache.slots
                held = slots.held[layer][row]
                for h in range(held.shape[0]):
                    ours = {int(p): float(a) for p, a, k in zip(slots.positions[layer][row, h],
                                                               slots.accumulated[layer][row, h], held[h]) if k}
                    theirs = dict(zip(alone.layers[layer].positions[0, h].tolist(),
                                      alone.policy.accumulated[layer][0, h].tolist()))
                    assert ours.keys() == theirs.keys(), (row, layer, h)
                    assert max(abs(ours[p] - theirs[p]) for p in ours) < 1e-5, (row, layer, h)


def _greedy_with_cache(model, method, ids, mask, cache):
    """`greedy_static_subset`'s steps on a cache the test keeps (8 new tokens, no stop)."""
    orig = method.make_cache
    method.make_cache = lambda m: cache
    try:
        return static_subset.greedy_static_subset(model, method, ids, mask, 8, set(), graph=False)
    finally:
        method.make_cache = orig


def test_quest_slots_keep_the_pages_bounds_as_a_rescan_finds_them(gqa_base):
    """Quest's slots keep each row-aligned page's key bounds up to date as tokens arrive
    (`QuestPolicy.add_to_bounds`): after 8 steps (pages of 2 filled and begun) they equal the bounds
    a rescan of the buffer gives, bit for bit, so a step chooses the pages the rescan would."""
    method, model = _installed(gqa_base, "quest")
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        cache = method.make_cache(model)
        _greedy_with_cache(model, method, ids, mask, cache)
    slots, policy = cache.slots, cache.slots.policy
    assert slots.bounds is not None
    for layer, (lo, hi) in enumerate(slots.bounds):
        held = slots.step + slots.widths[layer] - slots.pads          # every token written so far
        want = policy.page_bounds(policy.aligned(slots.keys[layer], slots.pads), held)
        assert torch.equal(lo, want[0]) and torch.equal(hi, want[1]), layer
        assert bool(torch.isinf(lo).any())      # pages past a row's tokens stay empty (+inf)
