import pytest
import torch

from palu.decompose.ranks import allocate, water_fill
from palu.models.adapters import Geometry

GEOM = Geometry(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, num_layers=30, rope=True)


def _fisher(seed=0):
    g = torch.Generator().manual_seed(seed)
    f = torch.rand(30, 2, 3, generator=g, dtype=torch.float64) ** 4
    f[:, 1] *= 10  # values matter more than keys, as in the paper
    return f


@pytest.mark.parametrize("method", ["uniform", "fisher", "fisher_uniform", "fisher_sqrt"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kept", [0.3, 0.5, 0.7, 1.0])
def test_budget_is_met_exactly(method, group, kept):
    a = allocate(GEOM, kept, group, method, 8, _fisher())
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
