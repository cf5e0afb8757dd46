import pytest
import torch

from palu.decompose.ranks import Slot, allocate, slots, water_fill
from palu.models.adapters import Geometry

GEOM = Geometry(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, num_layers=30, rope=True)


def _fisher(seed=0):
    g = torch.Generator().manual_seed(seed)
    f = torch.rand(30, 2, 3, generator=g, dtype=torch.float64) ** 4
    f[:, 1] *= 10  # values matter more than keys, as in the paper
    return f


def _spectra(group, seed=0):
    """Decaying whitened spectra (sigma^2, descending) of every block, its scale varying by block."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in slots(GEOM, group):
        decay = torch.rand(1, generator=g, dtype=torch.float64) * 0.1 + 0.01
        scale = torch.rand(1, generator=g, dtype=torch.float64) * 10
        out[s] = scale * torch.exp(-decay * torch.arange(64 * group, dtype=torch.float64))
    return out


@pytest.mark.parametrize("method", ["uniform", "fisher", "fisher_uniform", "fisher_sqrt", "fisher_rms", "error_aware"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kept", [0.3, 0.5, 0.7, 1.0])
def test_budget_is_met_exactly(method, group, kept):
    a = allocate(GEOM, kept, group, method, 8, _fisher(), _spectra(group))
    original = 30 * 2 * 3 * 64
    budget = int(round(kept * original, 6) // 8 * 8)  # 0.7 * 11520 is 8063.99.. in floats
    ranks = [r["rank"] for r in a["ranks"]]
    assert sum(ranks) == a["latent_size"] == budget
    assert all(r % 8 == 0 and 8 <= r <= 64 * group for r in ranks)
    assert a["kept_ratio_realised"] == pytest.approx(budget / original)


def test_uniform_is_uniform_and_fisher_follows_importance():
    uni = [r["rank"] for r in allocate(GEOM, 0.5, 1, "uniform", 8)["ranks"]]
    assert set(uni) == {32}
    fis = allocate(GEOM, 0.5, 1, "fisher", 8, _fisher())["ranks"]
    k = sum(r["rank"] for r in fis if r["kind"] == "k")
    v = sum(r["rank"] for r in fis if r["kind"] == "v")
    assert v > k


def test_fisher_uniform_splits_each_matrix_evenly():
    a = allocate(GEOM, 0.5, 1, "fisher_uniform", 8, _fisher())
    by_matrix = {}
    for r in a["ranks"]:
        by_matrix.setdefault((r["layer"], r["kind"]), []).append(r["rank"])
    assert all(max(v) - min(v) <= 8 for v in by_matrix.values())


def test_water_fill_caps_and_redistributes():
    units = water_fill([100.0, 1.0, 1.0], caps=[4, 10, 10], total=12)
    assert units == [4, 4, 4]
    with pytest.raises(ValueError, match="budget"):
        water_fill([1.0, 1.0], caps=[2, 2], total=5)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_kept_ratio_out_of_range(bad):
    with pytest.raises(ValueError, match="kept_ratio"):
        allocate(GEOM, bad, 1)


def test_group_size_must_divide_kv_heads():
    with pytest.raises(ValueError, match=r"group_size=2 does not divide the 3 KV heads"):
        allocate(GEOM, 0.5, 2)


def test_fisher_methods_need_scores():
    with pytest.raises(ValueError, match="Fisher"):
        allocate(GEOM, 0.5, 1, "fisher")


def test_budget_below_one_multiple_per_block_is_explained():
    with pytest.raises(ValueError, match="less than rank_multiple=8 each"):
        allocate(GEOM, 0.05, 1, "uniform", 8)


def test_error_aware_with_equal_sensitivities_keeps_the_largest_singular_values_overall():
    spectra = _spectra(1, seed=3)
    a = allocate(GEOM, 0.5, 1, "error_aware", 8, torch.ones(30, 2, 3, dtype=torch.float64), spectra)
    kept = {(r["layer"], r["kind"], r["group"]): r["rank"] for r in a["ranks"]}
    # in units of 8 (each block's first unit is its floor): the chosen units are the largest
    # unit energies of all blocks, i.e. no unchosen unit beats a chosen one
    energy = {s: [float(v[u * 8:(u + 1) * 8].sum()) for u in range(8)] for s, v in spectra.items()}
    chosen = [energy[s][u] for s in spectra for u in range(1, kept[(s.layer, s.kind, s.group)] // 8)]
    left = [energy[s][u] for s in spectra for u in range(kept[(s.layer, s.kind, s.group)] // 8, 8)]
    assert min(chosen) >= max(left)
    # and a block that matters more to the loss gets more of the budget than its spectrum alone gives
    weights = torch.ones(30, 2, 3, dtype=torch.float64)
    weights[0, 0, 0] = 1e6
    heavy = allocate(GEOM, 0.5, 1, "error_aware", 8, weights, spectra)
    assert heavy["ranks"][0]["rank"] == 64 >= a["ranks"][0]["rank"]


def test_error_aware_needs_spectra():
    with pytest.raises(ValueError, match="whitened spectra"):
        allocate(GEOM, 0.5, 1, "error_aware", 8, _fisher())
