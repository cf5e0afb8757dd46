"""Caches used the ways transformers allows (issue 51, items 2, 4 and 5): assisted decoding with
latent-space selection, one method object on two models or two methods on one model, and beam
search through the eviction caches. Each test failed on the main of before."""
import copy

import pytest
import torch

import palu
from palu.methods import build_method
from palu.methods.base import MethodError
from tiny import tiny_llama


@pytest.fixture
def base(tiny_base):
    return tiny_base


@pytest.fixture
def ckpt(tiny_palu_checkpoint):
    return tiny_palu_checkpoint


def _ids(n, seed, rows=1):
    return torch.randint(1, 97, (rows, n), generator=torch.Generator().manual_seed(seed))


# ---- 2. selection and assisted decoding ------------------------------------------------------
@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_latent_selection_refuses_the_multi_token_steps_of_assisted_decoding(base, ckpt, how):
    model = copy.deepcopy(base)
    method = build_method({"name": "palu_select", "checkpoint": ckpt, "tokens": 4, "window": 2})
    method.install(model)
    extra = ({"prompt_lookup_num_tokens": 3} if how == "prompt_lookup"
             else {"assistant_model": copy.deepcopy(base)})
    with pytest.raises(ValueError, match="one-token decode steps.*assisted or prompt-lookup"):
        model.generate(_ids(20, 1), max_new_tokens=8, do_sample=False,
                       past_key_values=method.make_cache(model), **extra)
    # plain greedy decoding still runs (prefill in one forward, then one token a step)
    out = model.generate(_ids(20, 1), max_new_tokens=4, do_sample=False, past_key_values=method.make_cache(model))
    assert out.shape == (1, 24)


# ---- 4. a method object belongs to one model -------------------------------------------------
def test_one_method_object_is_not_installed_on_a_second_model(base):
    method = build_method({"name": "pyramidkv", "compression_ratio": 0.5, "window": 2, "kernel": 1})
    first, second = copy.deepcopy(base), tiny_llama(1, layers=4).double()
    method.install(first)
    budgets = [method.policy.budget(layer, 20) for layer in range(2)]
    with pytest.raises(MethodError, match="installed on another model"):
        method.install(second)
    assert [method.policy.budget(layer, 20) for layer in range(2)] == budgets   # first model's, unchanged
    with pytest.raises(MethodError, match="install\\(model\\) before"):
        method.make_cache(second)
    import dataclasses
    dataclasses.replace(method).install(second)                                # a fresh object: fine


@pytest.mark.parametrize("first,second", [("snapkv", "palu"), ("h2o", "palu_select"), ("kivi", "fp16"),
                                          ("palu", "snapkv"), ("atom", "kivi"), ("palu", "palu")])
def test_methods_do_not_stack_by_installing_one_over_another(base, ckpt, first, second):
    confs = {"snapkv": {"compression_ratio": 0.5, "window": 2, "kernel": 1}, "palu": {"checkpoint": ckpt},
             "h2o": {"budget": 6, "window": 2}, "palu_select": {"checkpoint": ckpt}, "kivi": {"bits": 2, "group": 4, "residual": 4},
             "fp16": {}, "atom": {"bits": 4}}
    model = copy.deepcopy(base)
    build_method({"name": first, **confs[first]}).install(model)
    with pytest.raises(MethodError, match="installed already|factorised attention"):
        build_method({"name": second, **confs[second]}).install(model)


def test_a_cache_is_made_for_the_model_its_method_is_installed_on(base, ckpt):
    model = copy.deepcopy(base)
    palu.load_compressed(model, ckpt)                       # the library's own install: no method
    with pytest.raises(MethodError, match="factorised attention"):
        build_method({"name": "snapkv"}).install(model)
    installed = copy.deepcopy(base)
    method = build_method({"name": "h2o", "budget": 6, "window": 2})
    method.install(installed)
    with pytest.raises(MethodError, match="has h2o-n6-w2 installed"):
        build_method({"name": "fp16"}).make_cache(installed)
    clone = copy.deepcopy(installed)                        # a copy carries its method's settings
    assert clone(_ids(5, 0), past_key_values=method.make_cache(clone)).logits.isfinite().all()


# ---- 5. beam search through the eviction caches ----------------------------------------------
@pytest.mark.parametrize("conf", [{"name": "h2o", "budget": 6, "window": 2},
                                  {"name": "snapkv", "compression_ratio": 0.5, "window": 2, "kernel": 1},
                                  {"name": "tova", "budget": 5}])
def test_reordering_rows_moves_positions_and_scores_with_keys(base, conf):
    """Beam search's reorder_cache on a cache of rows (a, b) equals the cache of rows (b, a):
    keys, values, positions and H2O's accumulated scores, and the next step's logits."""
    method = build_method(conf)
    model = copy.deepcopy(base)
    method.install(model)
    ids = torch.cat([_ids(12, 4), _ids(12, 5)])
    steps = _ids(3, 6, rows=2)

    def run(rows):
        cache = method.make_cache(model)
        with torch.no_grad():
            model(ids[rows], past_key_values=cache)
            for t in range(steps.shape[1]):
                model(steps[rows, t:t + 1], past_key_values=cache)
        return cache
    moved, swapped = run([0, 1]), run([1, 0])
    moved.reorder_cache(torch.tensor([1, 0]))
    for a, b in zip(moved.layers, swapped.layers):
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    for layer, scores in getattr(swapped.policy, "accumulated", {}).items():   # H2O's state
        assert torch.equal(moved.policy.accumulated[layer], scores)
    nxt = _ids(1, 7, rows=2)
    with torch.no_grad():
        assert torch.equal(model(nxt[[1, 0]], past_key_values=moved).logits,
                           model(nxt[[1, 0]], past_key_values=swapped).logits)


def test_beam_search_through_h2o_runs_and_repeats_rows_whole(base):
    method = build_method({"name": "h2o", "budget": 6, "window": 2})
    model = copy.deepcopy(base)
    method.install(model)
    cache = method.make_cache(model)
    with torch.no_grad():
        model(_ids(12, 4), past_key_values=cache)
    cache.batch_repeat_interleave(3)
    assert all(lay.positions.shape[0] == 3 for lay in cache.layers)
    assert all(s.shape[0] == 3 for s in cache.policy.accumulated.values())
    out = model.generate(_ids(12, 4), max_new_tokens=5, num_beams=3, do_sample=False,
                         past_key_values=method.make_cache(model))
    assert out.shape == (1, 17)


def test_reordering_a_padded_batch_moves_each_rows_own_state(base):
    """A left-padded batch keeps one policy per row (H2O's scores over the row's own tokens);
    reorder_cache moves them with the rows: row 0 after [1, 0] is row 1 before."""
    method = build_method({"name": "h2o", "budget": 6, "window": 2})
    model = copy.deepcopy(base)
    method.install(model)
    short, long_ = [5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70]
    ids = torch.tensor([[0] * 5 + short, long_])
    mask = torch.tensor([[0] * 5 + [1] * 7, [1] * 12])

    def run():
        cache = method.make_cache(model)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
            model(torch.tensor([[4], [6]]), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                  past_key_values=cache)
        return cache
    before, moved = run(), run()
    moved.reorder_cache(torch.tensor([1, 0]))
    a, b = moved.row(0), before.row(1)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.positions, lb.positions) and la.seen == lb.seen
    assert all(torch.equal(a.policy.accumulated[i], b.policy.accumulated[i]) for i in b.policy.accumulated)
    assert before.row(0).layers[0].seen == 8 and before.row(1).layers[0].seen == 13


@pytest.mark.parametrize("conf", [{"name": "kivi", "bits": 2, "group": 4, "residual": 4}])
def test_beam_search_through_a_padded_quantised_batch_is_each_prompt_alone(base, conf):
    """KIVI's cache keeps a left-padded batch's rows apart (a row layer each, its real tokens
    only); beam search reorders and repeats those row layers whole (a repeated row is a copy), so
    each row's beams are those of its prompt alone."""
    method = build_method(conf)
    model = copy.deepcopy(base)
    method.install(model)
    short, long_ = [5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70]
    ids = torch.tensor([[0] * 5 + short, long_])
    mask = torch.tensor([[0] * 5 + [1] * 7, [1] * 12])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False,
                             pad_token_id=0, past_key_values=method.make_cache(model))
        for row, prompt in enumerate((short, long_)):
            alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, num_beams=3, do_sample=False,
                                   pad_token_id=0, past_key_values=method.make_cache(model))
            assert out[row, 12:].tolist() == alone[0, len(prompt):].tolist(), row
