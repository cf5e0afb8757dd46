"""The quantised cache's batch path past the prefill (`cache/quant_dense.py`) against the reference
layer it replaces (PALU_QUANT_DENSE=0): the same (key, value) pairs seen by every query of every
row at every step, in float64, the same bytes, and the same rows after batch edits; schedules with
a sink, a window and key blocks, rows of different lengths (a left-padded batch kept apart) and
rows that evicted after their prefill."""
import copy

import pytest
import torch

from palu.cache.quant_cache import QuantKVCache, Schedule
from palu.quant.codecs import TurboCodec, UniformCodec

H, D = 2, 8


def _attend(view, q):
    """Softmax attention of q (B, H, 1, D) over a step's view, in float64."""
    s = (q @ view.keys.transpose(-1, -2)) * D ** -0.5
    if view.mask is not None:
        s = s.masked_fill(~view.mask, float("-inf"))
    return s.softmax(-1) @ view.values


def _pair(codecs, schedule, evicts=False):
    return [QuantKVCache(*codecs, schedule, 1, evicts=evicts) for _ in range(2)]


def _run(monkeypatch, codecs, schedule, pads, prefill=12, steps=40, evict_keep=None, edits=()):
    """The same prefill and `steps` one-token steps through a reference cache and a batch-path
    cache; every step's attention output and bytes compared."""
    B = len(pads)
    g = torch.Generator().manual_seed(7)
    ref, fast = _pair(codecs, schedule, evicts=evict_keep is not None)
    mask = None
    if any(pads):
        m = torch.ones(B, prefill, dtype=torch.bool)
        for b, p in enumerate(pads):
            m[b, :p] = False
        causal = torch.ones(prefill, prefill, dtype=torch.bool).tril()
        mask = m[:, None, None, :] & causal   # as transformers builds it: a pad column is seen by no query
    k, v = (torch.randn(B, H, prefill, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(prefill)[None]
    for cache, dense in ((ref, "0"), (fast, "1")):
        monkeypatch.setenv("PALU_QUANT_DENSE", dense)
        cache.step(0, k, v, pos, mask)
        if evict_keep is not None:
            layer = cache.layers[0]
            for b, row in enumerate(layer.rows or [layer]):
                n = prefill - (layer.pads[b] if layer.rows else 0)
                keep = torch.arange(n - evict_keep, n)
                kb, vb = (t[b:b + 1, :, prefill - n:] if layer.rows else t for t in (k, v))
                row.evict(kb[:, :, keep], vb[:, :, keep], n)
    width = prefill
    for step in range(steps):
        if step in edits:
            for cache in (ref, fast):
                cache.batch_select_indices(edits[step])
            B = len(edits[step])
        k1, v1, q = (torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
        outs = []
        for cache, dense in ((ref, "0"), (fast, "1")):
            monkeypatch.setenv("PALU_QUANT_DENSE", dense)
            view = cache.step(0, k1, v1, torch.tensor([[width]]), None)
            outs.append(_attend(view, q))
        width += 1
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-12, step
        assert ref.get_seq_length() == fast.get_seq_length()
        for b in range(B):
            rb = ref.row(b).nbytes() if ref.holds_rows_apart() else None
            fb = fast.row(b).nbytes() if fast.holds_rows_apart() else None
            assert rb == fb, (step, b, rb, fb)
        assert ref.nbytes() == fast.nbytes(), step
    assert fast.layers[0].dense is not None and ref.layers[0].dense is None


KIVI = (UniformCodec(2, 4, "token"), UniformCodec(2, 4, "channel"))


@pytest.mark.parametrize("schedule", [Schedule(window=8), Schedule(sink=3, window=5), Schedule(), Schedule(sink=2)])
@pytest.mark.parametrize("pads", [[0, 0, 0], [3, 0, 7]])
def test_the_batch_path_sees_what_the_reference_layer_sees(monkeypatch, schedule, pads):
    _run(monkeypatch, KIVI, schedule, pads)


def test_rows_that_evicted_after_their_prefill(monkeypatch):
    _run(monkeypatch, KIVI, Schedule(window=4), [0, 2, 5], evict_keep=5)
    _run(monkeypatch, KIVI, Schedule(window=4), [0, 0], evict_keep=6)


def test_rows_leave_and_repeat(monkeypatch):
    _run(monkeypatch, KIVI, Schedule(window=4), [2, 0, 5], edits={5: torch.tensor([0, 2]), 9: torch.tensor([1, 1, 0])})


def test_per_token_codes(monkeypatch):
    turbo = TurboCodec(3, D, 1)
    _run(monkeypatch, (turbo, turbo), Schedule(), [0, 0])


def test_several_tokens_after_decoding_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("PALU_QUANT_DENSE", "1")
    cache = QuantKVCache(*KIVI, Schedule(window=4), 1)
    x = torch.randn(1, H, 6, D, dtype=torch.float64)
    cache.step(0, x, x, torch.arange(6)[None], None)
    cache.step(0, x[:, :, :1], x[:, :, :1], torch.tensor([[6]]), None)
    with pytest.raises(ValueError, match="PALU_QUANT_DENSE=0"):
        cache.step(0, x[:, :, :2], x[:, :, :2], torch.tensor([[7, 8]]), None)
