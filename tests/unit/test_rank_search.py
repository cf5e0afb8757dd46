"""The searching allocator (issue 53, `decompose/search.py`) on a tiny float64 model: ranks moved by
measured loss never lose to the probe_select allocation they start from on the search windows,
keep the budget, the multiples and the caps, are deterministic and spend at most their
evaluations; its windows are text neither the Gram nor the Fisher windows read, and nothing falls
back to the Fisher windows."""
import copy

import pytest
import torch

import palu
from palu.calib.fisher import collect_fisher
from palu.calib.gram import collect_grams
from palu.data.windows import calibration_offsets
from palu.decompose.probe import probe_loss, probe_select, truncated
from palu.decompose.search import held_out_windows, search_ranks
from palu.decompose.spectra import whitened_svds
from tiny import tiny_llama


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(0).double()
    calib = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    grams = collect_grams(model, calib, progress=False)["gram"]
    stats = collect_fisher(model, calib, progress=False)
    search = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(7))
    return model, grams, stats, search


def test_search_never_loses_to_its_start_and_keeps_the_budget(setup):
    model, grams, stats, windows = setup
    svds = whitened_svds(model, grams, 1)
    before = [p.detach().clone() for p in model.parameters()]
    found = search_ranks(model, svds, stats, 0.5, 1, 2, windows, evaluations=60)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))     # weights restored
    start = probe_select(model, svds, stats, 0.5, 1, 2, windows)
    with truncated(model, svds, found):
        loss = probe_loss(model, windows)
    s = found["search"]
    assert s["start"] == start["selected"] and abs(loss - s["loss"]) < 1e-12
    assert loss <= s["start_loss"] and s["evaluations"] <= 60 and s["budget"] == 60
    assert [h["loss"] for h in s["rounds"]] == sorted((h["loss"] for h in s["rounds"]), reverse=True)
    ranks = [r["rank"] for r in found["ranks"]]
    assert sum(ranks) == sum(r["rank"] for r in start["ranks"]) == found["latent_size"]
    assert all(r % 2 == 0 and 2 <= r <= f["full"] for r, f in zip(ranks, found["ranks"]))
    assert found["method"] == "search" and found["kept_ratio_realised"] == start["kept_ratio_realised"]
    again = search_ranks(model, svds, stats, 0.5, 1, 2, windows, evaluations=60)
    assert again["ranks"] == found["ranks"] and again["search"]["loss"] == s["loss"]    # deterministic


def test_a_search_with_room_moves_ranks_and_lowers_the_loss(setup):
    """At a tight budget on this model the marginals find improving moves (the test would be
    vacuous if the search never moved anything)."""
    model, grams, stats, windows = setup
    svds = whitened_svds(model, grams, 1)
    found = search_ranks(model, svds, stats, 0.3, 1, 2, windows, evaluations=200)
    s = found["search"]
    assert sum(h["moves"] for h in s["rounds"]) >= 1 and s["loss"] < s["start_loss"]


def test_held_out_windows_avoid_every_drawn_window_and_are_recorded():
    tokens = torch.arange(5000)
    gram = calibration_offsets(5000, 6, 400, seed=0)
    fisher = calibration_offsets(5000, 3, 400, seed=1)
    windows, starts = held_out_windows(tokens, [(gram, 400), (fisher, 400)], seqlen=128, n=8, bos=1)
    assert windows.shape == (len(starts), 128) and (windows[:, 0] == 1).all()
    read = set()
    for s in gram + fisher:
        read |= set(range(s, s + 400))
    for w, s in zip(windows, starts):
        assert torch.equal(w[1:], tokens[s:s + 127])
        assert not read & set(range(s, s + 127)), s                          # disjoint from both draws
    assert len(set(starts)) == len(starts)
    with pytest.raises(ValueError, match="no 512-token search window fits"):
        held_out_windows(torch.arange(600), [([0], 500)], seqlen=512)


def test_compress_with_search_needs_held_out_windows(setup):
    model, grams, stats, windows = setup
    with pytest.raises(ValueError, match="held-out text: pass probe_windows="):
        palu.compress(copy.deepcopy(model), None, 0.5, 1, "search", multiple=2, progress=False,
                      grams=grams, fisher_stats=stats, fisher_windows=windows)
    picked = palu.compress(copy.deepcopy(model), None, 0.5, 1, "search", multiple=2, progress=False,
                           grams=grams, fisher_stats=stats, probe_windows=windows)
    assert picked.allocation["method"] == "search"


def test_a_search_budget_is_named_in_the_allocator():
    """`search-e<evaluations>-w<windows>`: the budget enters every tag made from the name; a
    default spelled out and a malformed name are refused, in the config check too."""
    from palu.decompose.ranks import get_allocator, is_rank_method
    from palu.decompose.search import EVALUATIONS, WINDOWS
    assert get_allocator("search").windows == WINDOWS
    assert get_allocator("search-w8").windows == 8 and get_allocator("search-e80-w2").windows == 2
    assert get_allocator("search-e80").held_out and get_allocator("search-e80").kind == "probed"
    for bad, why in ((f"search-e{EVALUATIONS}", "spells out a default"), ("search-e0", "is not one of"),
                     ("search-w8-e80", "is not one of"), ("search-e80x", "is not one of"),
                     ("fisher-e80", "is not one of")):
        with pytest.raises(ValueError, match=why):
            get_allocator(bad)
        assert not is_rank_method(bad)


def test_a_named_budget_is_spent_and_names_the_allocation(setup):
    from palu.decompose.ranks import get_allocator
    model, grams, stats, windows = setup
    svds = whitened_svds(model, grams, 1)
    found = get_allocator("search-e12").probe(model, svds, stats, 0.5, 1, 2, windows, None)
    assert found["method"] == "search-e12"
    assert found["search"]["budget"] == 12 and found["search"]["evaluations"] <= 12


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kept_layer_outputs_change_nothing_but_the_work(family):
    """An evaluation that changed blocks from layer l on runs layers l.. alone (`_KeptPrefix`):
    the search takes the same path (every round's loss, the ranks, the evaluations) as with a
    whole forward each, bit for bit in float64, and runs fewer attention layers."""
    from tiny import tiny_gemma3
    model = (tiny_llama(1, layers=4) if family == "llama" else tiny_gemma3(1)).double()
    calib = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    grams = collect_grams(model, calib, progress=False)["gram"]
    stats = collect_fisher(model, calib, progress=False)
    windows = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(7))
    svds = whitened_svds(model, grams, 1)
    runs, found = {}, {}
    for reuse in (False, True):
        calls = [0]
        attn = [layer.self_attn.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
                for layer in model.model.layers]
        found[reuse] = search_ranks(model, svds, stats, 0.3, 1, 2, windows, evaluations=60,
                                    reuse_layers=reuse)
        for h in attn:
            h.remove()
        runs[reuse] = calls[0]
    assert found[True] == found[False]
    assert sum(h["moves"] for h in found[True]["search"]["rounds"]) >= 1     # kept moves made outputs stale
    assert runs[True] < runs[False]
    assert not any("forward" in vars(layer) for layer in model.model.layers)  # the layers' own forward again


def test_a_layer_with_its_own_forward_gets_it_back(setup):
    """A layer whose forward was set on the instance (accelerate's dispatch does that) keeps it
    after an evaluation that handed back its kept output."""
    from palu.decompose.search import _KeptPrefix
    model, _, _, windows = setup
    layer = model.model.layers[0]
    own = layer.forward                     # the bound class forward, set on the instance
    layer.forward = own
    try:
        prefix = _KeptPrefix(model, windows)
        whole = prefix.loss(len(prefix.layers))
        assert prefix.loss(1) == whole and vars(layer)["forward"] is own
    finally:
        del layer.forward
