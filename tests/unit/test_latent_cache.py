"""The HF-facing latent cache appends in place (no whole-cache copy per decode step) and keeps
exactly what concatenation would, through crop, batch selection and beam reordering."""
import pytest
import torch

from palu.quant.packed import dequantize_latent
from palu.cache.latent_cache import LatentCache


def _steps(cache, hk, hv, start=0):
    """Prefill the first 5 tokens, then decode the rest one at a time."""
    out = cache.update_latent(hk[:, :5], hv[:, :5], torch.arange(start, start + 5)[None], 0)
    for t in range(5, hk.shape[1]):
        out = cache.update_latent(hk[:, t:t + 1], hv[:, t:t + 1], torch.tensor([[start + t]]), 0)
    return out


@pytest.mark.parametrize("bits", [16, 4])
def test_decode_steps_append_in_place_and_match_concatenation(bits):
    g = torch.Generator().manual_seed(0)
    hk, hv = torch.randn(2, 300, 32, generator=g), torch.randn(2, 300, 16, generator=g)
    cache = LatentCache(num_layers=1, bits=bits)
    layer = cache.layers[0]
    cache.update_latent(hk[:, :5], hv[:, :5], torch.arange(5)[None], 0)
    assert cache.nbytes()["reserved"] == cache.nbytes()["total"]        # the prefill: exact
    cache.update_latent(hk[:, 5:6], hv[:, 5:6], torch.tensor([[5]]), 0)
    buffer = layer._room["keys"].data_ptr()
    for t in range(6, 262):   # 6 + 256 spare tokens: no new buffer until then
        cache.update_latent(hk[:, t:t + 1], hv[:, t:t + 1], torch.tensor([[t]]), 0)
        assert layer.keys.data_ptr() == buffer
    assert layer.keys.shape[-2] == 262 and layer.positions.tolist()[0] == list(range(262))
    cache.update_latent(hk[:, 262:], hv[:, 262:], torch.arange(262, 300)[None], 0)
    assert layer.keys.data_ptr() != buffer                                # grown once more
    n = cache.nbytes()
    assert n["total"] < n["reserved"] <= n["total"] * 2
    if bits == 16:
        assert torch.equal(layer.keys[:, 0], hk) and torch.equal(layer.values[:, 0], hv)
    else:
        whole = LatentCache(num_layers=1, bits=bits)
        whole.update_latent(hk, hv, torch.arange(300)[None], 0)
        ref, got = whole.layers[0], layer
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.key_sz, ref.key_sz)
        assert torch.equal(got.values, ref.values) and torch.equal(got.value_sz, ref.value_sz)
        k, _ = got.packed_groups(1)
        assert torch.equal(dequantize_latent(k, torch.float32)[:, 0], got.latents(torch.float32)[0])
    assert layer.contiguous


@pytest.mark.parametrize("bits", [16, 2])
def test_crop_select_and_reorder_then_append_keep_the_right_tokens(bits):
    g = torch.Generator().manual_seed(1)
    hk, hv = torch.randn(3, 40, 16, generator=g), torch.randn(3, 40, 16, generator=g)
    cache, ref = LatentCache(num_layers=1, bits=bits), LatentCache(num_layers=1, bits=bits)
    _steps(cache, hk[:, :30], hv[:, :30])
    cache.crop(-4)                                            # back to 26 tokens, inside the buffer
    _steps(ref, hk[:, :26], hv[:, :26])
    for t in range(26, 33):                                   # overwrite the cropped slots
        for c in (cache, ref):
            c.update_latent(hk[:, t:t + 1], hv[:, t:t + 1], torch.tensor([[t]]), 0)
    layer, want = cache.layers[0], ref.layers[0]
    assert torch.equal(layer.keys, want.keys) and torch.equal(layer.positions, want.positions)
    beams = torch.tensor([2, 0, 0])
    for c in (cache, ref):
        c.layers[0].reorder_cache(beams)                      # new tensors, not buffer prefixes
        c.update_latent(hk[:, 33:35], hv[:, 33:35], torch.tensor([[33, 34]]), 0)
        c.layers[0].batch_select_indices(torch.tensor([0, 2]))
        c.update_latent(hk[:2, 35:36], hv[:2, 35:36], torch.tensor([[35]]), 0)
    for name in ("keys", "values", "positions") + (() if bits == 16 else ("key_sz", "value_sz")):
        assert torch.equal(getattr(layer, name), getattr(want, name)), name
    assert layer.keys.shape[:3] == (2, 1, 36)


def test_append_writes_in_place_only_into_its_own_buffer():
    layer = LatentCache(num_layers=1).layers[0]
    first = layer._append("x", None, torch.arange(3.0), 0)
    grown = layer._append("x", first, torch.tensor([3.0]), 0)             # spare room from here
    buffer = layer._room["x"]
    same = layer._append("x", grown, torch.tensor([4.0]), 0)
    assert same.data_ptr() == buffer.data_ptr() and same.tolist() == [0, 1, 2, 3, 4]
    stranger = torch.full((buffer.shape[0],), 7.0)[:2]                    # same strides, other memory
    out = layer._append("x", stranger, torch.tensor([8.0]), 0)
    assert out.tolist() == [7, 7, 8] and buffer[:5].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_one_launch_quantise_into_the_buffers_matches_the_torch_path(bits, monkeypatch):
    # on a GPU (here: the Triton interpreter) new tokens are quantised by one kernel writing
    # straight into the grown buffers, group by group through strided views; bit-identical
    import palu.cache.latent_cache as lc
    g = torch.Generator().manual_seed(bits)
    hk, hv = torch.randn(2, 12, 3 * 32, generator=g), torch.randn(2, 12, 3 * 16, generator=g)
    ranks = ([32] * 3, [16] * 3)

    def fill():
        cache = LatentCache(num_layers=1, bits=bits)
        cache.update_latent(hk[:, :9], hv[:, :9], torch.arange(9)[None], 0, ranks=ranks)
        for t in range(9, 12):
            cache.update_latent(hk[:, t:t + 1], hv[:, t:t + 1], torch.tensor([[t]]), 0, ranks=ranks)
        return cache.layers[0]

    want = fill()
    monkeypatch.setattr(lc, "_use_quantize_kernel", lambda h: True)
    got = fill()
    assert got.keys.data_ptr() == got._room["keys"].data_ptr() and got.keys.shape[-2] == 12
    for name in ("keys", "values", "key_sz", "value_sz", "positions"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
