"""The quantised caches' decode steps in preallocated slots on a padded batch
(`palu.eval.static_quant.greedy_static_quant`, `cache/quant_slots.py`). On the CPU the decode step
runs eagerly on the tensors a GPU would capture, so these float64 tests pin what the graph replays:
the method's own left-padded prefill, then one token a row a step at one slot, the blocks that fall
due coded on the device. Reference: each prompt alone through the method's own cache, token by
token; the answers and bytes of the eager loop (the CPU's route)."""
import copy

import pytest
import torch

from palu.eval import generation, static_quant
from palu.methods import build_method

from tiny import (PAD, PROMPTS, SIX_PROMPTS, check_slots_refuse_misuse, fitted_state, greedy_alone, left_padded,
                  WordTok, decode_as_rows_leave, tiny_llama)

# windows and key blocks small enough that every row codes blocks while it decodes (prompts of
# 7, 12 and 3 tokens, 10 new tokens); a sink for the schedule's other counter (Atom's codes are
# per token: nothing to count, the path must still serve it)
CONF = {"kivi": {"name": "kivi", "bits": 2, "group": 4, "residual": 4},
        "kivi_b4_r0": {"name": "kivi", "bits": 4, "group": 2, "residual": 0},
        "kivi_snapkv": {"name": "kivi_snapkv", "bits": 2, "group": 2, "residual": 2,
                        "evict_ratio": 0.5, "evict_window": 2, "evict_kernel": 1},
        "atom": {"name": "atom", "bits": 4},
        "turboquant": {"name": "turboquant", "bits": 3},
        "kivi_vscale": {"name": "kivi_vscale", "bits": 2, "group": 4, "residual": 4}}
NEW = 10


@pytest.fixture(autouse=True)
def every_slot_path(monkeypatch):
    """Every slot path on (the right-padded prefill is on by default since session 46's check;
    `all` also takes the subset methods' opt-in paths)."""
    monkeypatch.setenv("PALU_STATIC_DECODE", "all")


@pytest.fixture(scope="module")
def gqa_base():
    """4 query heads over 2 KV heads, 3 layers."""
    return tiny_llama(3, kv_heads=2, layers=3).double()


@pytest.fixture(scope="module")
def vscale_state(gqa_base, tmp_path_factory):
    return str(fitted_state("kivi_vscale", gqa_base, tmp_path_factory.mktemp("vscale") / "state"))


def _installed(base, name, state):
    conf = dict(CONF[name])
    if name == "kivi_vscale":
        conf["state"] = state
    method = build_method(conf)
    model = copy.deepcopy(base)
    method.install(model)
    model.generation_config.eos_token_id = None
    return method, model


class Tok:
    pad_token_id, eos_token_id = PAD, None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("name", sorted(CONF))
def test_every_row_of_a_padded_batch_equals_its_prompt_alone(gqa_base, vscale_state, name):
    """Right-padded prefill (KIVI + SnapKV: each row evicting among its own first tokens)."""
    method, model = _installed(gqa_base, name, vscale_state)
    assert static_quant.quant_unsupported(model, method) is None
    assert static_quant.right_padded_prefill(model, method)
    ids, mask = left_padded(PROMPTS)
    trace = []
    new, _ = static_quant.greedy_static_quant(model, method, ids, mask, NEW, set(), graph=False, trace=trace)
    assert len(trace) == NEW
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = greedy_alone(model, method, prompt, NEW)
        assert new[row] == tokens, (name, row)
        for k, ours in enumerate(trace):
            diff = (ours[row] - logits[k]).abs().max().item()
            assert diff < 1e-9, (name, row, k, diff)


@pytest.mark.parametrize("name", sorted(CONF))
def test_answers_and_bytes_equal_the_eager_loops(gqa_base, vscale_state, name):
    """Through `generation`: each row's answer and bytes as the eager loop reports them, rows
    stopping at their first stop token (their cache then holds fewer decoded tokens)."""
    method, model = _installed(gqa_base, name, vscale_state)
    ids, mask = left_padded(PROMPTS)
    free, _ = static_quant.greedy_static_quant(model, method, ids, mask, NEW, set(), graph=False)
    for stop in (set(), {free[1][2], free[2][0]}):
        model.generation_config.eos_token_id = sorted(stop) or None
        ours = generation._generate_in_slots(static_quant.greedy_static_quant, model, Tok(), method, PROMPTS,
                                             NEW, ids, mask, stop)
        assert ours == generation._generate(model, Tok(), method, PROMPTS, NEW)   # the eager loop
    lengths = [len(a.split()) for a, _ in ours]
    assert lengths[1] <= 3 and lengths[2] == 1, lengths


@pytest.mark.parametrize("name", sorted(CONF))
def test_ended_rows_leave_the_batch_and_the_rest_decode_as_before(gqa_base, vscale_state, name):
    """Once at most half the batch is live the slots keep the live rows only (codes, windows, block
    counters; a GPU captures the step again): their logits within 1e-9 of the batch that kept
    every row; answers and bytes the eager loop's, a row's bytes counted as it leaves."""
    method, model = _installed(gqa_base, name, vscale_state)
    ids, mask, stop, _, trace = decode_as_rows_leave(
        lambda ids, mask, n, stop, trace: static_quant.greedy_static_quant(model, method, ids, mask, n, stop, graph=False,
                                                                       trace=trace), name)
    assert any(torch.isnan(t).any() for t in trace), "no row left the batch"
    model.generation_config.eos_token_id = sorted(stop)
    ours = generation._generate_in_slots(static_quant.greedy_static_quant, model, WordTok(), method, SIX_PROMPTS,
                                         12, ids, mask, stop)
    assert ours == generation._generate(model, WordTok(), method, SIX_PROMPTS, 12)


def test_an_unpadded_batch_equals_the_eager_loop(gqa_base, vscale_state):
    method, model = _installed(gqa_base, "kivi", vscale_state)
    prompts = [PROMPTS[1], PROMPTS[1][::-1]]
    ids = torch.tensor(prompts)
    new, held = static_quant.greedy_static_quant(model, method, ids, None, NEW, set(), graph=False)
    ours = [(" ".join(map(str, n)), {"stored": int(round(h["total"])), "tokens": len(p) + len(n) - 1})
            for p, n, h in zip(prompts, new, held)]
    eager = [(a, {"stored": b["stored"], "tokens": b["tokens"]})
             for a, b in generation._generate(model, Tok(), method, prompts, NEW)]
    assert ours == eager


def test_who_it_serves(gqa_base, tmp_path, monkeypatch):
    for name in ("kivi", "atom", "turboquant", "kivi_snapkv"):
        method, model = _installed(gqa_base, name, None)
        assert static_quant.quant_unsupported(model, method) is None, name
    kv_state = str(fitted_state("kvquant", gqa_base, tmp_path / "kvq"))
    refused = {"kvquant": ({"state": kv_state}, "before RoPE"),
               "snapkv": ({"compression_ratio": 0.5}, "does not store quantised"),
               "fp16": ({}, "does not store quantised")}
    for name, (conf, why) in refused.items():
        method = build_method({"name": name, **conf})
        model = copy.deepcopy(gqa_base)
        method.install(model)
        assert why in static_quant.quant_unsupported(model, method), name
    monkeypatch.delenv("PALU_STATIC_DECODE", raising=False)
    assert static_quant.quant_enabled()        # the default since the H200 check
    kivi, model = _installed(gqa_base, "kivi", None)
    atom, model_a = _installed(gqa_base, "atom", None)          # counts no tokens
    snap, model_s = _installed(gqa_base, "kivi_snapkv", None)   # evicts per row
    for on in (None, "1", "all"):   # right-padded by default for each since the H100 checks
        if on:
            monkeypatch.setenv("PALU_STATIC_DECODE", on)
        assert static_quant.quant_enabled(), on
        assert all(static_quant.right_padded_prefill(m, q) for m, q in
                   ((model, kivi), (model_a, atom), (model_s, snap))), on
    for off in ("palu", "fp16", "0"):
        monkeypatch.setenv("PALU_STATIC_DECODE", off)
        assert not static_quant.quant_enabled() and not static_quant.right_padded_prefill(model, kivi), off


def test_a_slotted_cache_takes_one_token_a_step(gqa_base):
    from palu.cache.quant_slots import QuantSlots
    method, model = _installed(gqa_base, "kivi", None)
    check_slots_refuse_misuse(model, method, QuantSlots)


def test_a_first_step_of_padding_alone_is_refused(gqa_base):
    """A row all padding in its first step: its pads may go on past the step, so where its tokens
    start is unknown; refused by name rather than counted from the step's width."""
    method, model = _installed(gqa_base, "kivi", None)
    ids, mask = left_padded(PROMPTS)                    # the 3-token row has 9 pads
    with torch.no_grad(), pytest.raises(ValueError, match="row 2 of a padded batch is all padding"):
        model(ids[:, :8], attention_mask=mask[:, :8], past_key_values=method.make_cache(model))


@pytest.mark.parametrize("name", ["kivi", "atom", "kivi_vscale", "kivi_snapkv"])
def test_the_left_padded_prefill_equals_each_prompt_alone(gqa_base, vscale_state, name, monkeypatch):
    """A family whose logits are not the decoder's last hidden state through the output
    embedding prefills left-padded, its rows apart (counting codes, evicting rows) or in one
    tensor (Atom)."""
    monkeypatch.setattr(static_quant, "FAMILIES", set())
    method, model = _installed(gqa_base, name, vscale_state)
    assert not static_quant.right_padded_prefill(model, method)
    ids, mask = left_padded(PROMPTS)
    new, _ = static_quant.greedy_static_quant(model, method, ids, mask, NEW, set(), graph=False)
    assert new == [greedy_alone(model, method, p, NEW)[0] for p in PROMPTS]


@pytest.mark.parametrize("name, shared", [("kivi", True), ("kivi_snapkv", None)])
def test_layers_of_equal_counts_share_a_steps_due_blocks(gqa_base, vscale_state, name, shared, monkeypatch):
    """The due blocks' index kernels run once a step (per block length), not once a layer and
    buffer, where every layer's rows hold the same counts; KIVI + SnapKV's layers evict apart
    and may not. The answers stay the rows' own (the tests above)."""
    from palu.cache.quant_slots import QuantSlots
    calls = []
    real = QuantSlots._quantised_end
    monkeypatch.setattr(QuantSlots, "_quantised_end", lambda self, n, b: calls.append(b) or real(self, n, b))
    method, model = _installed(gqa_base, name, vscale_state)
    ids, mask = left_padded(PROMPTS)
    made = []
    init = QuantSlots.__init__
    monkeypatch.setattr(QuantSlots, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    static_quant.greedy_static_quant(model, method, ids, mask, NEW, set(), graph=False)
    slots, = made
    if shared is not None:
        assert slots._shares_due is shared
    blocks = {c.block for c in slots.codecs}
    per_step = 2 * len(blocks) * (1 if slots._shares_due else len(slots.keys))
    prefill = len(calls) - (NEW - 1) * per_step   # `_row_forms` counts too, once per layer and buffer
    assert 0 <= prefill <= 2 * len(slots.keys), (len(calls), per_step)
