"""Packed latent storage at 2 / 3 / 4 / 8 bits (issue 16, item 3: real 3-bit packing)."""
import pytest
import torch

import palu
from palu.quant.packed import dequantize_latent, packed_width, quantize_latent


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rank", [8, 16, 24, 96])
def test_packing_round_trips_and_stays_within_half_a_step(bits, rank):
    h = torch.randn(2, 3, 7, rank, generator=torch.Generator().manual_seed(bits * rank))
    q = quantize_latent(h, bits)
    assert q.data.dtype == torch.uint8 and q.data.shape[-1] == packed_width(rank, bits) == rank * bits // 8
    back = dequantize_latent(q, torch.float32)
    # every value within half a quantisation step (plus the fp16 rounding of scale and zero)
    step = q.scale.float()[..., None]
    assert ((back - h).abs() <= 0.5 * step + 1e-3 * h.abs().amax(-1, keepdim=True)).all()
    # what is unpacked are integer codes in [0, 2^bits - 1]
    codes = back / step + q.zero.float()[..., None]
    assert (codes - codes.round()).abs().max() < 1e-3
    assert codes.round().min() >= 0 and codes.round().max() <= 2 ** bits - 1


def test_three_bit_packs_eight_values_in_three_bytes():
    levels = torch.arange(8, dtype=torch.float32)                 # 0..7: every 3-bit code once
    h = levels.repeat(2)[None, None, None, :]                      # rank 16
    q = quantize_latent(h, 3)
    assert q.data.shape[-1] == 6
    assert torch.equal(dequantize_latent(q, torch.float32), h)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rank", [1, 3, 5, 12, 13, 27])
def test_odd_ranks_are_padded_to_the_pack_unit_and_round_trip(bits, rank):
    """A rank that is not a multiple of the pack unit (rank_multiple=1 allows any) is stored with
    zero codes up to one: packed_width bytes, and the rank's values come back within half a step."""
    h = torch.randn(1, 2, 5, rank, generator=torch.Generator().manual_seed(rank))
    q = quantize_latent(h, bits)
    unit = {2: 4, 3: 8, 4: 2, 8: 1}[bits]
    assert q.data.shape[-1] == packed_width(rank, bits) == -(-rank // unit) * unit * bits // 8
    back = dequantize_latent(q, torch.float32)
    assert back.shape == h.shape
    assert ((back - h).abs() <= 0.5 * q.scale.float()[..., None] + 1e-3 * h.abs().amax(-1, keepdim=True)).all()


def test_a_latent_cache_with_odd_ranks_holds_what_it_was_given():
    cache = palu.LatentCache(num_layers=1, bits=4)
    hk, hv = torch.randn(1, 6, 2 * 13), torch.randn(1, 6, 2 * 5)
    cache.update_latent(hk, hv, torch.arange(6)[None], 0, ranks=([13, 13], [5, 5]))
    assert cache.nbytes()["latents"] == 6 * (2 * 7 + 2 * 3)        # 13 -> 14 codes, 5 -> 6 codes
    keys, values = cache.layers[0].latents(torch.float32)
    assert keys.shape == hk.shape and values.shape == hv.shape
    assert (keys - hk).abs().max() < 0.5 and (values - hv).abs().max() < 0.5


def test_a_three_bit_latent_cache_counts_the_bytes_it_holds():
    cache = palu.LatentCache(num_layers=1, bits=3)
    hk, hv = torch.randn(1, 10, 2 * 16), torch.randn(1, 10, 2 * 8)
    cache.update_latent(hk, hv, torch.arange(10)[None], 0, ranks=([16, 16], [8, 8]))
    n = cache.nbytes()
    assert n["latents"] == 10 * (2 * 6 + 2 * 3)                   # 3 bytes per 8 latents
    assert n["scales"] == 10 * 2 * 2 * 2 * 2                       # (scale, zero) fp16 per token and group, K and V
    keys, values = cache.layers[0].latents(torch.float32)
    assert keys.shape == hk.shape and (keys - hk).abs().max() < 0.5


def test_the_graph_cache_refuses_three_bit_latents():
    import copy

    from tiny import tiny_llama
    model = copy.deepcopy(tiny_llama(0))
    palu.compress(model, None, kept_ratio=0.5, decomposition="plain", progress=False)
    with pytest.raises(ValueError, match="3-bit latents: use palu.LatentCache"):
        palu.GraphLatentCache(model, max_tokens=16, bits=3)
