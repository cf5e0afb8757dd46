"""Plain Palu through the preallocated `GraphLatentCache` on a padded batch
(`palu.eval.static_decode.greedy_static_latent`, on by default since the H200 check of session 35; before it, opt-in until a GPU run
checks its graphs). On the CPU the decode step runs eagerly on the tensors a GPU would capture, so
these float64 tests pin what the graph replays: the batch prefilled right-padded, then one token
a row at the row's own slot, each row masked by its own length. Reference: each prompt alone
through the method's own `LatentCache`, token by token in float64 (transformers' `generate` hands
its logits over in float32, so it checks the tokens only); tests/unit/test_padded_batches.py holds
that cache exact against the left-padded eager loop."""
import copy

import pytest
import torch

from palu.eval import generation, static_decode
from palu.methods import build_method

from tiny import PAD, PROMPTS, SIX_PROMPTS, WordTok, decode_as_rows_leave, greedy_alone, left_padded


def _palu(base, ckpt, bits, **extra):
    method = build_method({"name": "palu", "checkpoint": ckpt, "latent_bits": bits, **extra})
    model = copy.deepcopy(base)
    method.install(model)
    model.generation_config.eos_token_id = None
    return method, model


@pytest.mark.parametrize("bits", [16, 4, 2])
def test_every_row_of_a_padded_batch_equals_its_prompt_alone_through_the_latent_cache(
        tiny_base, tiny_palu_checkpoint, bits):
    method, model = _palu(tiny_base, tiny_palu_checkpoint, bits)
    assert static_decode.latent_unsupported(model, method) is None
    ids, mask = left_padded(PROMPTS)
    trace = []
    new, cache = static_decode.greedy_static_latent(model, method, ids, mask, 6, set(), graph=False, trace=trace)
    assert len(trace) == 6 and cache.ragged
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = greedy_alone(model, method, prompt, 6)
        assert new[row] == tokens, (bits, row)
        for k, ours in enumerate(trace):
            diff = (ours[row] - logits[k]).abs().max().item()
            assert diff < 1e-9, (bits, row, k, diff)
        with torch.no_grad():
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                       pad_token_id=PAD, past_key_values=method.make_cache(model))
        assert new[row] == generated[0, len(prompt):].tolist(), (bits, row)


def test_answers_and_bytes_equal_the_eager_loops(tiny_base, tiny_palu_checkpoint):
    """Through `generation`: each row's answer and the bytes its method's own cache holds, as
    the eager loop (the CPU's route) reports them, and rows stop at their first stop token."""
    method, model = _palu(tiny_base, tiny_palu_checkpoint, 4)

    class Tok:
        pad_token_id, eos_token_id = PAD, None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))
    ids, mask = left_padded(PROMPTS)
    free, _ = static_decode.greedy_static_latent(model, method, ids, mask, 8, set(), graph=False)
    for stop in (set(), {free[1][2], free[2][0]}):
        model.generation_config.eos_token_id = sorted(stop) or None   # what the eager loop stops at
        ours = generation._generate_static_latent(model, Tok(), method, PROMPTS, 8, ids, mask, stop)
        assert ours == generation._generate(model, Tok(), method, PROMPTS, 8)   # the CPU's eager loop
    lengths = [len(a.split()) for a, _ in ours]
    assert lengths[1] <= 3 and lengths[2] == 1, lengths


@pytest.mark.parametrize("bits", [4])   # packed slots; both kinds of buffer: test_slot_rows_keep_the_rows_asked
def test_ended_rows_leave_the_batch_and_the_rest_decode_as_before(tiny_base, tiny_palu_checkpoint, bits):
    """Once at most half the batch is live the cache keeps the live rows only (slots, lengths; a GPU
    captures each bucket again): their logits within 1e-9 of the batch that kept every row, answers
    and bytes the eager loop's."""
    method, model = _palu(tiny_base, tiny_palu_checkpoint, bits)
    ids, mask, stop, cache, _ = decode_as_rows_leave(
        lambda ids, mask, n, stop, trace: static_decode.greedy_static_latent(model, method, ids, mask, n, stop,
                                                                             graph=False, trace=trace), bits)
    held = [getattr(buf, "data", buf).shape[0] for layer in cache.layers for buf in (layer.keys, layer.values)]
    assert cache.batch < 6 and set(held) == {cache.batch} and cache.lengths.shape == (cache.batch,)
    model.generation_config.eos_token_id = sorted(stop)   # what the eager loop stops at
    ours = generation._generate_static_latent(model, WordTok(), method, SIX_PROMPTS, 12, ids, mask, stop)
    assert ours == generation._generate(model, WordTok(), method, SIX_PROMPTS, 12)


@pytest.mark.parametrize("bits", [16, 4, 2])
def test_slot_rows_keep_the_rows_asked(bits):
    from palu.cache.slots import slot_buffer, slot_nbytes, slot_rows
    buf = slot_buffer(5, 2, 7, 8, bits, "cpu", torch.float64)
    parts = (buf,) if bits == 16 else (buf.data, buf.scale, buf.zero)
    for t in parts:
        t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype))
    rows = torch.tensor([1, 4])
    got = slot_rows(buf, rows)
    for old, new in zip(parts, (got,) if bits == 16 else (got.data, got.scale, got.zero)):
        assert torch.equal(new, old[rows])
    assert slot_nbytes(got) * 5 == slot_nbytes(buf) * 2


def test_who_it_serves(tiny_base, tiny_palu_checkpoint, monkeypatch):
    method, model = _palu(tiny_base, tiny_palu_checkpoint, 4)
    assert static_decode.latent_unsupported(model, method) is None
    snap = build_method({"name": "palu_snapkv", "checkpoint": tiny_palu_checkpoint, "latent_bits": 4,
                         "evict_ratio": 0.5, "evict_window": 2, "evict_kernel": 1})
    assert "not plain Palu" in static_decode.latent_unsupported(model, snap)
    assert "not plain Palu" in static_decode.latent_unsupported(model, build_method({"name": "fp16"}))
    three, model3 = _palu(tiny_base, tiny_palu_checkpoint, 3)
    assert "3-bit latents" in static_decode.latent_unsupported(model3, three)   # the eager loop serves it
    monkeypatch.delenv("PALU_STATIC_DECODE", raising=False)
    assert static_decode.latent_enabled() and static_decode.enabled()   # the default: both graph paths
    monkeypatch.setenv("PALU_STATIC_DECODE", "palu")
    assert static_decode.latent_enabled() and static_decode.enabled()
    monkeypatch.setenv("PALU_STATIC_DECODE", "fp16")
    assert static_decode.enabled() and not static_decode.latent_enabled()
    monkeypatch.setenv("PALU_STATIC_DECODE", "0")
    assert not static_decode.enabled() and not static_decode.latent_enabled()
    monkeypatch.setenv("PALU_STATIC_DECODE", "yes")
    with pytest.raises(ValueError, match="PALU_STATIC_DECODE='yes'"):
        static_decode.enabled()


def test_the_ragged_cache_refuses_a_step_at_the_wrong_slot(tiny_base, tiny_palu_checkpoint):
    from palu.cache.graph_cache import GraphLatentCache
    method, model = _palu(tiny_base, tiny_palu_checkpoint, 16)
    cache = GraphLatentCache(model, max_tokens=16, batch=2)
    with pytest.raises(ValueError, match="prefill the right-padded batch first"):
        cache.set_row_lengths(torch.tensor([3, 4]))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), past_key_values=cache)
    with pytest.raises(ValueError, match=r"must lie in 1..4"):
        cache.set_row_lengths(torch.tensor([5, 2]))
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        cache.set_row_lengths(torch.tensor([4]))
    cache.set_row_lengths(torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="one token a row at the row's length"):
        model(torch.tensor([[1], [1]]), position_ids=torch.tensor([[4], [3]]), past_key_values=cache)
    model(torch.tensor([[1], [1]]), position_ids=torch.tensor([[4], [2]]), past_key_values=cache)
    assert cache.lengths.tolist() == [5, 3]
    cache.reset()
    assert not cache.ragged


@pytest.mark.parametrize("bits, extra", [(16, {}), (4, {}), (2, {}), (3, {}), (4, {"channel_group": 8})])
def test_row_bytes_on_their_line_equal_each_measured(tiny_base, tiny_palu_checkpoint, bits, extra):
    # a batch's row bytes come from three measurements (1, 2 and the largest count), not one a
    # length; every count's must equal its own measurement
    method, model = _palu(tiny_base, tiny_palu_checkpoint, bits, **extra)
    counts = [5, 9, 17, 33, 9]
    got = static_decode.latent_rows_bytes(method, model, counts)
    assert set(got) == {5, 9, 17, 33}
    for t in got:
        assert got[t] == static_decode.latent_row_bytes(method, model, t), (bits, extra, t)
    assert got[33]["stored"] > got[5]["stored"] > 0


def test_row_bytes_off_their_line_are_measured_each(tiny_base, tiny_palu_checkpoint, monkeypatch, caplog):
    method, model = _palu(tiny_base, tiny_palu_checkpoint, 4)
    paged = lambda method, model, t: {"stored": 100 * -(-t // 8), "read_per_step": 100 * -(-t // 8),  # noqa: E731
                                      "tokens": t}
    monkeypatch.setattr(static_decode, "latent_row_bytes", paged)
    got = static_decode.latent_rows_bytes(method, model, [3, 10, 20, 30])
    assert {t: v["stored"] for t, v in got.items()} == {3: 100, 10: 200, 20: 300, 30: 400}
    assert "not affine in its tokens" in caplog.text
