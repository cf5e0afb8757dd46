"""error_aware's probed key weight (decompose/probe.py): the probe scores the real Palu model,
restores the weights, and picks the candidate with the lowest loss."""
import copy
import math

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


def test_probe_select_keeps_the_candidate_with_the_lowest_probe_loss(setup):
    from palu.decompose.probe import probe_select
    model, calib, grams, stats = setup
    svds = whitened_svds(model, grams, 1)
    geom = geometry_of(model.config)
    candidates = (("uniform", None), ("fisher", None), ("fisher_rms", None), ("error_aware", 0.25),
                  ("error_aware", 4.0))
    chosen = probe_select(model, svds, stats, 0.5, 1, 2, calib[:1], candidates, blends=())
    rows = chosen["probe"]["candidates"]
    assert [r["candidate"] for r in rows] == ["uniform", "fisher", "fisher_rms", "error_aware@k0.25",
                                              "error_aware@k4"]
    best = min(rows, key=lambda r: r["loss"])
    assert chosen["method"] == "probe_select" and chosen["selected"] == best["candidate"]
    method, _, weight = best["candidate"].partition("@k")
    from palu.decompose.ranks import get_allocator
    extra = {"key_weight": float(weight)} if weight else {}
    again = allocate(geom, 0.5, 1, method, 2, None if method == "uniform" else stats[get_allocator(method).statistic],
                     spectra_of(svds), **extra)
    assert chosen["ranks"] == again["ranks"] and chosen["latent_size"] == again["latent_size"]
    for r in rows:       # the losses differ, so the choice is not a tie broken by order
        assert math.isfinite(r["loss"])
    assert len({round(r["loss"], 9) for r in rows}) > 1
    # with blends: the best is blended with uniform and the runner-up, and the winner is the
    # lowest loss over everything scored
    blended = probe_select(model, svds, stats, 0.5, 1, 2, calib[:1], candidates, blends=(0.5,))
    names = [r["candidate"] for r in blended["probe"]["candidates"]]
    assert names[:5] == [r["candidate"] for r in rows] and len(names) > 5
    assert all("*0.5+" in n for n in names[5:]) and all(n.startswith(best["candidate"] + "*") for n in names[5:])
    assert blended["selected"] == min(blended["probe"]["candidates"], key=lambda r: r["loss"])["candidate"]
    assert sum(r["rank"] for r in blended["ranks"]) == chosen["latent_size"]
    with pytest.raises(ValueError, match="its own candidate"):
        probe_select(model, svds, stats, 0.5, 1, 2, calib[:1], (("probe_select", None),))
    with pytest.raises(ValueError, match="probe_select"):
        allocate(geom, 0.5, 1, "probe_select", 2, stats["fisher"])


def test_compress_with_probe_select_needs_probe_windows(setup):
    model, calib, grams, stats = setup
    picked = palu.compress(copy.deepcopy(model), None, 0.5, 1, "probe_select", multiple=2, progress=False,
                           grams=grams, fisher_stats=stats, probe_windows=calib[:1])
    assert picked.allocation["method"] == "probe_select"
    assert picked.allocation["selected"] in [r["candidate"] for r in picked.allocation["probe"]["candidates"]]
    assert picked.manifest["summary"]["rank_method"] == "probe_select"
    with pytest.raises(ValueError, match="probe_windows"):
        palu.compress(copy.deepcopy(model), None, 0.5, 1, "probe_select", multiple=2, progress=False,
                      grams=grams, fisher_stats=stats)


def test_a_blend_lies_between_its_allocations_and_keeps_the_budget():
    from palu.decompose.ranks import blend
    geom = geometry_of(tiny_llama(0).config)
    stats_like = torch.rand(geom.num_layers, 2, geom.num_kv_heads, generator=torch.Generator().manual_seed(1))
    a = allocate(geom, 0.5, 1, "fisher", 2, stats_like)
    b = allocate(geom, 0.5, 1, "uniform", 2)
    assert blend(a, b, 1.0)["ranks"] == a["ranks"] and blend(a, b, 0.0)["ranks"] == b["ranks"]
    mid = blend(a, b, 0.5)
    assert sum(r["rank"] for r in mid["ranks"]) == a["latent_size"]
    for ra, rb, rm in zip(a["ranks"], b["ranks"], mid["ranks"]):
        assert min(ra["rank"], rb["rank"]) - 2 <= rm["rank"] <= max(ra["rank"], rb["rank"]) + 2
        assert rm["rank"] % 2 == 0 and 2 <= rm["rank"] <= rm["full"]
    with pytest.raises(ValueError, match="blend"):
        blend(a, allocate(geom, 0.3, 1, "uniform", 2), 0.5)
