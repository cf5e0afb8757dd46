"""(rank, bits) under a byte budget (decompose/bit_alloc.py): the error tables measure what a
rank cut and a quantiser really lose, the allocation keeps its byte budget and beats one width
for every layer under its own loss model, and a checkpoint with per-layer widths evaluates
through a cache that stores each layer at its width, one pass equal to token-by-token decoding."""
import copy
import math

import pytest
import torch

import palu
from palu.calib.fisher import collect_fisher
from palu.calib.gram import collect_grams
from palu.decompose.bit_alloc import (BIT_OPTIONS, allocate_bytes, block_bytes, error_table,
                                      projection_inputs)
from palu.decompose.ranks import allocate
from palu.decompose.spectra import whitened_svds
from palu.eval.perplexity import perplexity
from palu.methods import build_method
from palu.methods.base import MethodError
from palu.models.adapters import geometry_of
from tiny import tiny_llama


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(0, layers=3).double()
    calib = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(0))
    probe = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    grams = collect_grams(model, calib, progress=False)["gram"]
    stats = collect_fisher(model, calib, progress=False)
    svds = whitened_svds(model, grams, 1)
    tables = error_table(svds, projection_inputs(model, probe), 4)
    return model, calib, probe, grams, stats, svds, tables


def test_block_bytes_count_packed_codes_and_their_scales():
    assert block_bytes(64, 16) == 128
    assert block_bytes(64, 8) == 64 + 4 and block_bytes(64, 4) == 32 + 4 and block_bytes(64, 2) == 16 + 4
    assert block_bytes(64, 3) == 24 + 4


def test_the_error_table_is_the_exact_truncation_error_plus_the_real_quantiser(setup):
    model, calib, _, grams, _, svds, _ = setup
    # on the Gram's own inputs the whitened coordinates have E[z z^T] = I / tokens, so the
    # 16-bit column is the spectrum's tail over the token count
    tables = error_table(svds, projection_inputs(model, calib), 4)
    tokens = calib.numel()
    for slot, (U, sigma, V) in svds.items():
        t = tables[slot]
        for u in range(t.shape[0]):
            r = (u + 1) * 4
            assert t[u, 0].item() == pytest.approx(float(sigma[r:].pow(2).sum()) / tokens, rel=1e-6, abs=1e-12)
        assert t[-1, 0].item() == pytest.approx(0.0, abs=1e-12)       # full rank, unquantised
        # fewer bits lose more (strictly, at full rank where no truncation hides it)
        row = t[-1, 1:]
        assert all(row[i] < row[i + 1] for i in range(len(row) - 1)), row
    # the quantiser term is the real one: rebuild one block's error by hand
    from palu.quant.packed import dequantize_latent, quantize_latent
    slot = next(iter(svds))
    U, sigma, V = svds[slot]
    X = projection_inputs(model, calib)[slot.layer]
    r = 8
    A = sigma[:r].sqrt()[:, None] * V[:r]
    B = U[:, :r] * sigma[:r].sqrt()
    h = (X @ A.T).float()
    q = dequantize_latent(quantize_latent(h[None, None], 4), torch.float32)[0, 0].double()
    by_hand = ((h.double() - q) @ B.T).pow(2).sum(1).mean() + float(sigma[r:].pow(2).sum()) / tokens
    assert tables[slot][1, BIT_OPTIONS.index(4)].item() == pytest.approx(float(by_hand), rel=1e-5)


def _model_loss(alloc, tables, fisher, geom, group_size=1):
    loss = 0.0
    for r in alloc["ranks"]:
        w = float(fisher[r["layer"], 0 if r["kind"] == "k" else 1,
                         r["group"] * group_size:(r["group"] + 1) * group_size].sum())
        from palu.decompose.ranks import Slot
        j = BIT_OPTIONS.index(alloc["bits"][r["layer"]])
        loss += w * float(tables[Slot(r["layer"], r["kind"], r["group"])][r["rank"] // 4 - 1, j])
    return loss


def test_the_allocation_keeps_its_budget_and_beats_one_width_for_all_layers(setup):
    model, _, _, _, stats, _, tables = setup
    geom = geometry_of(model.config)
    fisher = stats["output_fisher"]
    fp16 = geom.num_layers * geom.kv_size() * 2
    losses = []
    for kept, bits in ((0.5, 4), (0.5, 2), (0.25, 8), (0.75, 3)):
        uniform = allocate(geom, kept, 1, "uniform", 4)
        uniform["bits"] = [bits] * geom.num_layers
        spent = sum(block_bytes(r["rank"], bits) for r in uniform["ranks"])
        alloc = allocate_bytes(geom, spent / fp16, 1, 4, fisher, tables)
        used = sum(block_bytes(r["rank"], alloc["bits"][r["layer"]]) for r in alloc["ranks"])
        assert used == alloc["byte_budget"]["used_bytes_per_token"] <= spent
        assert set(alloc["bits"]) <= set(BIT_OPTIONS) and len(alloc["bits"]) == geom.num_layers
        assert all(r["rank"] % 4 == 0 and 4 <= r["rank"] <= r["full"] for r in alloc["ranks"])
        ours = _model_loss(alloc, tables, fisher, geom)
        assert ours == pytest.approx(alloc["byte_budget"]["model_loss"], rel=1e-9)
        assert ours <= _model_loss(uniform, tables, fisher, geom) * (1 + 1e-9)
        losses.append((spent, ours))
    # more bytes never cost more loss
    for (b1, l1), (b2, l2) in zip(sorted(losses), sorted(losses)[1:]):
        assert l2 <= l1 * (1 + 1e-9)
    full = allocate_bytes(geom, 1.0, 1, 4, fisher, tables)   # the FP16 cache's bytes: full rank at 16
    assert set(full["bits"]) == {16} and full["kept_ratio_realised"] == 1.0


def test_bad_budgets_and_widths_are_refused(setup):
    model, _, _, _, stats, _, tables = setup
    geom = geometry_of(model.config)
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="byte ratio"):
            allocate_bytes(geom, bad, 1, 4, stats["output_fisher"], tables)
    with pytest.raises(ValueError, match="leaves"):
        allocate_bytes(geom, 0.01, 1, 4, stats["output_fisher"], tables)
    with pytest.raises(ValueError, match="bit options"):
        allocate_bytes(geom, 0.3, 1, 4, stats["output_fisher"], tables, bit_options=(16, 5))
    with pytest.raises(ValueError, match="error_aware_bytes"):
        allocate(geom, 0.3, 1, "error_aware_bytes", 4, stats["output_fisher"])


def test_a_latent_cache_stores_each_layer_at_its_width():
    cache = palu.LatentCache(num_layers=3, bits=[16, 4, 2])
    assert [layer.bits for layer in cache.layers] == [16, 4, 2] and cache.bits is None
    assert palu.LatentCache(num_layers=3, bits=[4, 4, 4]).bits == 4
    with pytest.raises(ValueError, match="3 layers"):
        palu.LatentCache(num_layers=3, bits=[4, 4])
    with pytest.raises(ValueError, match="bits=5"):
        palu.LatentCache(num_layers=3, bits=[4, 5, 4])


def test_a_byte_allocated_checkpoint_evaluates_at_its_widths(setup, tmp_path):
    model, calib, probe, grams, stats, _, _ = setup
    base = copy.deepcopy(model)
    geom = geometry_of(model.config)
    fp16 = geom.num_layers * geom.kv_size() * 2
    result = palu.compress(copy.deepcopy(base), None, 0.2, 1, "error_aware_bytes", multiple=4, progress=False,
                           grams=grams, fisher_stats=stats, probe_windows=probe)
    alloc = result.allocation
    assert alloc["method"] == "error_aware_bytes" and alloc["byte_budget"]["used_bytes_per_token"] <= 0.2 * fp16
    path = tmp_path / "ckpt"
    result.save(path)
    method = build_method({"name": "palu", "checkpoint": str(path), "latent_bits": "alloc"})
    installed = copy.deepcopy(base)
    method.install(installed)
    assert method.layer_bits() == alloc["bits"] and method.tag.endswith("-balloc")
    cache = method.make_cache(installed)
    assert [layer.bits for layer in cache.layers] == alloc["bits"]
    windows = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(9))
    one = perplexity(installed, windows, progress=False, make_cache=lambda: method.make_cache(installed),
                     cache_nbytes=method.cache_nbytes)
    with torch.no_grad():   # one pass equals feeding the tokens one at a time through the cache
        c = method.make_cache(installed)
        steps = [installed(windows[:, t:t + 1], past_key_values=c, use_cache=True).logits[0, -1]
                 for t in range(windows.shape[1])]
        full = installed(windows, past_key_values=method.make_cache(installed), use_cache=True).logits[0]
    assert (torch.stack(steps) - full).abs().max().item() < 1e-9
    assert math.isfinite(one["ppl"])
    # the bytes the cache holds: the allocation's latents and scales plus int32 positions
    nbytes = one["cache_nbytes"]
    latent = sum(block_bytes(r["rank"], alloc["bits"][r["layer"]]) for r in alloc["ranks"]) * windows.shape[1]
    from palu.cache.memory import fp16_equivalent
    positions = 4 * geom.num_layers * windows.shape[1]
    assert fp16_equivalent(nbytes, 8) == pytest.approx(latent + positions, rel=1e-12)
    summary = method.summary()
    assert summary["byte_ratio_target"] == alloc["byte_budget"]["ratio_target"]
    # a checkpoint without widths refuses bits=alloc, naming the setting
    plain_ckpt = palu.compress(copy.deepcopy(base), None, 0.5, 1, multiple=4, progress=False, grams=grams)
    plain_ckpt.save(tmp_path / "plain")
    refused = build_method({"name": "palu", "checkpoint": str(tmp_path / "plain"), "latent_bits": "alloc"})
    with pytest.raises(MethodError, match="alloc"):
        refused.install(copy.deepcopy(base))
