"""KV heads reordered by similarity before G-LRD groups them (decompose/heads.py): the reorder
is the same function, the grouping follows the similarity, the checkpoint round-trips, and
"none" (or M-LRD / J-LRD) reduces to today's factors."""
import copy

import pytest
import torch

import palu
from palu.calib.gram import collect_grams
from palu.decompose.heads import group_order, head_similarity, reorder_heads, similarity_orders
from tiny import FAMILIES, tiny_llama, tiny_qwen2


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(0, kv_heads=4, layers=2).double()
    with torch.no_grad():   # make heads 0 and 2 alike (and 1 and 3), so grouping by index is wrong
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(4, 16, -1)
                w[2] = w[0] + 0.2 * w[0].std() * torch.randn_like(w[0])
                w[3] = w[1] + 0.2 * w[1].std() * torch.randn_like(w[1])
    calib = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(0))
    return model, calib, collect_grams(model, calib, progress=False)["gram"]


@pytest.mark.parametrize("make", [lambda: tiny_llama(1, kv_heads=4).double(), lambda: tiny_qwen2(1).double(),
                                  lambda: FAMILIES["qwen3"](1).double(), lambda: FAMILIES["olmo2"](1).double(),
                                  lambda: FAMILIES["phi3"](1).double()])
def test_reordering_heads_is_the_same_function(make):
    """OLMo-2's q/k norms hold a weight per dim of every head: they move with their heads."""
    model = make()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
    heads = model.config.num_key_value_heads
    orders = [list(reversed(range(heads))), list(range(1, heads)) + [0]]
    reorder_heads(model, orders)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, before, atol=1e-10)
    with pytest.raises(ValueError, match="permutation"):
        reorder_heads(model, [[0, 0] + list(range(2, heads)), list(range(heads))])


def test_similar_heads_are_grouped_together(setup):
    model, _, grams = setup
    sim = head_similarity(model.model.layers[0].self_attn.k_proj.weight, grams[0], 4)
    assert torch.allclose(sim.diagonal(), torch.ones(4, dtype=sim.dtype))
    assert torch.allclose(sim, sim.T) and sim[0, 2] > sim[0, 1] and sim[1, 3] > sim[1, 2]
    assert similarity_orders(model, grams, 2) == [[0, 2, 1, 3], [0, 2, 1, 3]]
    assert similarity_orders(model, grams, 1) == [[0, 1, 2, 3]] * 2      # M-LRD: nothing to group
    assert similarity_orders(model, grams, 4) == [[0, 1, 2, 3]] * 2      # J-LRD: one group
    assert group_order(torch.eye(4), 2) == [0, 1, 2, 3]                  # ties: the lower index


def test_similarity_grouping_lowers_the_g_lrd_error_and_round_trips(setup, tmp_path):
    model, calib, grams = setup
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids).logits
    errors, results = {}, {}
    for order in ("none", "similarity"):
        m = copy.deepcopy(model)
        results[order] = palu.compress(m, None, 0.25, 2, multiple=4, grams=grams, progress=False,
                                       head_order=order)
        with torch.no_grad():
            errors[order] = (m(ids).logits - reference).pow(2).mean().item()
        path = tmp_path / order
        results[order].save(path)
        base = copy.deepcopy(model)
        palu.load_compressed(base, path)
        with torch.no_grad():   # the checkpoint reinstalls the same reordered model
            assert torch.allclose(base(ids).logits, m(ids).logits, atol=1e-10)
    assert results["none"].manifest["head_order"] is None
    assert results["similarity"].manifest["head_order"] == [[0, 2, 1, 3], [0, 2, 1, 3]]
    assert results["similarity"].manifest["tag"].endswith("-heads_similarity")
    report = lambda r: sum(e["rel_error"] for e in r.report["output_error"])
    assert report(results["similarity"]) < report(results["none"])
    assert errors["similarity"] < errors["none"]


def test_head_order_none_and_m_lrd_are_todays_factors(setup):
    model, _, grams = setup
    plain = palu.compress(copy.deepcopy(model), None, 0.5, 1, multiple=4, grams=grams, progress=False)
    for order in ("none", "similarity"):       # M-LRD groups one head each: the order is moot
        other = palu.compress(copy.deepcopy(model), None, 0.5, 1, multiple=4, grams=grams,
                              progress=False, head_order=order)
        assert other.manifest["head_order"] is None and other.manifest["tag"] == plain.manifest["tag"]
        for a, b in zip(plain.factors, other.factors):
            assert all(torch.equal(x, y) for x, y in zip(a.A_k + a.A_v, b.A_k + b.A_v))
    with pytest.raises(ValueError, match="head_order"):
        palu.compress(copy.deepcopy(model), None, 0.5, 2, multiple=4, grams=grams, progress=False,
                      head_order="cka")


def test_the_pipeline_names_and_refuses_head_orders():
    from palu.decompose.heads import check_head_order
    from palu.models.adapters import geometry_of
    from palu.pipeline import naming
    geom = geometry_of(tiny_llama(0, kv_heads=4).config)
    check_head_order("similarity", geom, 2)
    for group in (1, 4):                    # M-LRD / J-LRD: the order is moot, so refused
        with pytest.raises(ValueError, match="head_order=none"):
            check_head_order("similarity", geom, group)
    a = naming.ranks_path("w", "m", "c", "f", "fisher", 0.5, 2, 8, "similarity")
    b = naming.ranks_path("w", "m", "c", "f", "fisher", 0.5, 2, 8)
    assert a != b and "heads_similarity" in a.name
    assert naming.ranks_path("w", "m", "c", "f", "uniform", 0.5, 2, 8, "similarity") == \
        naming.ranks_path("w", "m", "c", "f", "uniform", 0.5, 2, 8)
