"""A quantised cache's banded prefill (`attention/banded_prefill.py`) against the masked view it
replaces: in float64 the same attention for every query (within 1e-12), over schedules with a
sink, a window, key blocks and none, grouped-query heads, prompts of one chunk and several, and
the batch split; the fused causal kernel's log-sum-exp against explicit scores; the switch."""
import pytest
import torch

from palu.attention import banded_prefill
from palu.cache.quant_cache import QuantKVCache, QuantKVView, Schedule
from palu.quant.codecs import UniformCodec

D = 16
TOL = 1e-12


def _cache(schedule, key_block, bits=2):
    # keys per channel over `key_block` tokens (block > 1), values per token (block 1)
    return QuantKVCache(UniformCodec(bits, key_block, "token"), UniformCodec(bits, 8, "channel"), schedule, 1)


def _masked(q, view, rep):
    keys, values = (t.repeat_interleave(rep, 1) for t in (view.keys, view.values))
    s = (q @ keys.transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~view.mask, float("-inf"))
    return s.softmax(-1) @ values


@pytest.mark.parametrize("T", [40, 150])
@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("schedule,key_block", [
    (Schedule(window=8), 4),            # KIVI: reach 11
    (Schedule(window=0), 8),            # KIVI without a residual: reach 7
    (Schedule(sink=3, window=5), 4),    # a sink, a window and blocks
    (Schedule(), 1),                    # every token coded at its own step: reach 0, no band
])
def test_band_equals_the_masked_view(schedule, key_block, rep, T):
    g = torch.Generator().manual_seed(T + rep)
    B, H = 2, 2
    q = torch.randn(B, H * rep, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    view = _cache(schedule, key_block).step(0, k, v, None, None)
    band = _cache(schedule, key_block).step(0, k, v, None, None, banded=True)
    assert isinstance(band, banded_prefill.QuantKVBand)
    assert band.reach == key_block - 1 + schedule.window
    out = banded_prefill.attend(q, band, D ** -0.5)
    assert (out - _masked(q, view, rep)).abs().max().item() < TOL


def test_the_band_splits_the_batch_without_changing_it(monkeypatch):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 100, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 100, D, generator=g, dtype=torch.float64) for _ in range(2))
    band = _cache(Schedule(window=8), 4).step(0, k, v, None, None, banded=True)
    whole = banded_prefill.attend(q, band, D ** -0.5)
    monkeypatch.setattr(banded_prefill, "BAND_BYTES", 1)   # one row at a time
    assert (banded_prefill.attend(q, band, D ** -0.5) - whole).abs().max().item() < TOL


def test_short_prompts_later_steps_and_padding_keep_the_masked_view():
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(2, 2, 20, D, generator=g, dtype=torch.float64) for _ in range(2))
    schedule = Schedule(window=8)
    # a prompt not more than twice the reach (11): nothing to gain
    assert isinstance(_cache(schedule, 4).step(0, k, v, None, None, banded=True), QuantKVView)
    # a second multi-token step (the band is a first step's)
    cache = _cache(schedule, 4)
    cache.step(0, k[:, :, :5], v[:, :, :5], None, None)
    assert isinstance(cache.step(0, k, v, None, None, banded=True), QuantKVView)
    # a left-padded batch whose shortest row is too short for a band: every row the masked view
    long_k, long_v = (torch.randn(2, 2, 30, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 1, 30, 30, dtype=torch.bool).tril()
    mask[1, :, :, :9] = False
    assert isinstance(_cache(schedule, 4).step(0, long_k, long_v, None, mask, banded=True), QuantKVView)


@pytest.mark.parametrize("rep", [1, 3])
def test_a_left_padded_batch_bands_each_row_as_alone(rep):
    """Rows kept apart (a method that counts tokens): each row's real queries get what its
    prompt alone gets through the masked view."""
    g = torch.Generator().manual_seed(10)
    B, T, pads = 3, 90, [0, 7, 33]
    q = torch.randn(B, 2 * rep, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, 2, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    for b, p in enumerate(pads):
        mask[b, :, :, :p] = False
    rows = _cache(Schedule(window=8), 4).step(0, k, v, None, mask, banded=True)
    assert isinstance(rows, banded_prefill.RowBands) and rows.skips == pads
    out = banded_prefill.attend_rows(q, rows, D ** -0.5)
    for b, p in enumerate(pads):
        alone = _cache(Schedule(window=8), 4).step(0, k[b:b + 1, :, p:], v[b:b + 1, :, p:], None, None)
        ref = _masked(q[b:b + 1, :, p:], alone, rep)
        assert (out[b:b + 1, :, p:] - ref).abs().max().item() < TOL


def test_the_switch(monkeypatch):
    g = torch.Generator().manual_seed(7)
    k, v = (torch.randn(1, 2, 60, D, generator=g, dtype=torch.float64) for _ in range(2))
    monkeypatch.setenv("PALU_BANDED_PREFILL", "0")
    assert isinstance(_cache(Schedule(window=8), 4).step(0, k, v, None, None, banded=True), QuantKVView)
    mask = torch.ones(1, 1, 60, 60, dtype=torch.bool).tril()
    mask[0, :, :, :3] = False   # a left-padded row: the rows-apart path obeys the switch too
    assert isinstance(_cache(Schedule(window=8), 4).step(0, k, v, None, mask, banded=True), QuantKVView)
    monkeypatch.setenv("PALU_BANDED_PREFILL", "yes")
    with pytest.raises(ValueError, match="PALU_BANDED_PREFILL='yes'"):
        _cache(Schedule(window=8), 4).step(0, k, v, None, None, banded=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_causal_kernel_log_sum_exp_equals_explicit_scores(dtype, tol):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 37, D, generator=g).to(dtype) for _ in range(3))
    out, lse = banded_prefill.causal_with_lse(q, k, v, 0.3)
    ref_out, ref_lse = banded_prefill.causal_math(q, k, v, 0.3)
    assert (out - ref_out).abs().max().item() < tol
    assert (lse.to(ref_lse.dtype) - ref_lse).abs().max().item() < tol


@pytest.mark.parametrize("rep,T,reach_case", [(1, 150, 0), (3, 150, 1), (3, 70, 2)])
def test_band_kernel_equals_the_torch_band(rep, T, reach_case, monkeypatch):
    """`palu_kernels.quant_band` through the Triton interpreter, float32, against the torch band."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from palu_kernels.quant_band import quant_band
    schedule, key_block = [(Schedule(window=8), 4), (Schedule(sink=3, window=5), 4), (Schedule(window=0), 8)][reach_case]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 2 * rep, T, D, generator=g)
    k, v = (torch.randn(2, 2, T, D, generator=g) for _ in range(2))
    band = _cache(schedule, key_block).step(0, k, v, None, None, banded=True)
    ref_out, ref_lse = banded_prefill.band_torch(q, band, D ** -0.5)
    out, lse = banded_prefill._band(q, band, D ** -0.5, kernel=quant_band)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5
