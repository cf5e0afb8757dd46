"""error_aware's probed key weight (decompose/probe.py): the probe scores the real Palu model,
restores the weights, and picks the candidate with the lowest loss."""
import copy

import pytest
import torch

import palu
from palu.calib.fisher import collect_fisher
from palu.calib.gram import collect_grams
from palu.decompose.probe import probe_key_weight, probe_loss, truncated
from palu.decompose.ranks import allocate
from palu.decompose.spectra import spectra_of, whitened_svds
from palu.models.adapters import geometry_of
from tiny import tiny_llama


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(0).double()
    calib = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    grams = collect_grams(model, calib, progress=False)["gram"]
    stats = collect_fisher(model, calib, progress=False)
    return model, calib, grams, stats


def test_the_truncated_model_is_the_palu_model_and_is_restored(setup):
    model, calib, grams, _ = setup
    geom = geometry_of(model.config)
    svds = whitened_svds(model, grams, 1)
    alloc = allocate(geom, 0.5, 1, "uniform", 4)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad(), truncated(model, svds, alloc):
        cut = model(ids).logits
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    compressed = copy.deepcopy(model)
    palu.compress(compressed, None, 0.5, 1, multiple=4, grams=grams, progress=False, fuse=False)
    with torch.no_grad():
        assert torch.allclose(compressed(ids).logits, cut, atol=1e-9)
    with torch.no_grad():
        reference = model(ids).logits
        with truncated(model, svds, allocate(geom, 1.0, 1, "uniform", 4)):   # full rank: the model
            assert torch.allclose(model(ids).logits, reference, atol=1e-9)


def test_key_weight_one_is_the_plain_allocation_and_weights_move_dims_to_keys(setup):
    model, _, grams, stats = setup
    geom = geometry_of(model.config)
    spectra = spectra_of(whitened_svds(model, grams, 1))
    f = stats["output_fisher"]
    plain = allocate(geom, 0.5, 1, "error_aware", 2, f, spectra)
    assert allocate(geom, 0.5, 1, "error_aware", 2, f, spectra, key_weight=1.0) == plain
    shares = []
    for w in (0.25, 1.0, 1e3, 1e6):
        a = allocate(geom, 0.5, 1, "error_aware", 2, f, spectra, key_weight=w)
        assert a["latent_size"] == plain["latent_size"] and a["key_weight"] == w
        shares.append(sum(r["rank"] for r in a["ranks"] if r["kind"] == "k"))
    assert shares == sorted(shares) and shares[-1] > shares[0]
    for bad in (0, -1.0, float("nan"), "4"):
        with pytest.raises(ValueError, match="key_weight"):
            allocate(geom, 0.5, 1, "error_aware", 2, f, spectra, key_weight=bad)


def test_the_probe_picks_the_lowest_loss(setup):
    model, calib, grams, stats = setup
    svds = whitened_svds(model, grams, 1)
    best, rows = probe_key_weight(model, svds, stats["output_fisher"], 0.5, 1, 2, calib[:1],
                                  weights=(1.0, 4.0, 16.0))
    assert [r["key_weight"] for r in rows] == [1.0, 4.0, 16.0]
    assert best == min(rows, key=lambda r: r["loss"])["key_weight"]
    geom = geometry_of(model.config)
    for r in rows:      # each candidate's loss is the loss of that allocation's truncated model
        a = allocate(geom, 0.5, 1, "error_aware", 2, stats["output_fisher"], spectra_of(svds),
                     key_weight=r["key_weight"])
        with truncated(model, svds, a):
            assert probe_loss(model, calib[:1]) == pytest.approx(r["loss"], rel=1e-12)


def test_compress_records_the_probe_and_a_fixed_weight_skips_it(setup):
    model, calib, grams, stats = setup
    auto = palu.compress(copy.deepcopy(model), calib, 0.5, 1, "error_aware", multiple=2, progress=False,
                         fisher_windows=calib)
    assert auto.allocation["key_weight"] in [r["key_weight"] for r in auto.allocation["probe"]["candidates"]]
    fixed = palu.compress(copy.deepcopy(model), None, 0.5, 1, "error_aware", multiple=2, progress=False,
                          grams=grams, fisher_stats=stats, key_weight=1.0)
    assert "probe" not in fixed.allocation and fixed.allocation["key_weight"] == 1.0
    with pytest.raises(ValueError, match="probe_windows"):
        palu.compress(copy.deepcopy(model), None, 0.5, 1, "error_aware", multiple=2, progress=False,
                      grams=grams, fisher_stats=stats)
