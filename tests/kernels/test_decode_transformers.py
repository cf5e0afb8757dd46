"""The transformers-path benchmark's pieces on CPU (tiny Llama): config validation, cache filling,
and its kernels-vs-torch check (kernels through the Triton interpreter)."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from palu.attention.install import install_palu  # noqa: E402
from palu_bench.bench_decoder import DecoderShape, PaluSpec  # noqa: E402
from palu_bench.decode_transformers import check, fill_cache, hf_llama, hf_plan, new_cache, random_factors  # noqa: E402

SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, intermediate=96, vocab=50)


def _cfg(**hf):
    base = {"contexts": [64], "steps": 2, "baseline": "dense",
            "variants": [{"name": "dense", "cache": "static"},
                         {"name": "palu", "palu": {"group_size": 2, "kept_k": 0.5, "kept_v": 0.5, "bits": 4}}]}
    return {"shape": SHAPE, "batch": 1, "hf": {**base, **hf}}


def test_plan_names_bad_values():
    shape, specs, kinds = hf_plan(_cfg())
    assert specs["dense"] is None and specs["palu"] == PaluSpec(2, 32, 32, 4) and kinds["dense"] == "static"
    with pytest.raises(ValueError, match="'nope' is not one of the variants"):
        hf_plan(_cfg(baseline="nope"))
    with pytest.raises(ValueError, match="cache 'paged'"):
        hf_plan(_cfg(variants=[{"name": "dense", "cache": "paged"}]))
    with pytest.raises(ValueError, match="unique"):
        hf_plan(_cfg(variants=[{"name": "dense"}, {"name": "dense"}]))
    with pytest.raises(ValueError, match="group_size"):
        hf_plan(_cfg(variants=[{"name": "dense"}, {"name": "p", "palu": {"group_size": 3, "kept_k": 0.5,
                                                                         "kept_v": 0.5}}]))


def test_plan_checks_graph_rows_and_their_baselines():
    graph_rows = [{"name": "dense", "cache": "static"},
                  {"name": "dense-graph", "cache": "static", "graph": True, "baseline": "dense-graph"},
                  {"name": "palu-graph", "graph": True, "baseline": "dense-graph",
                   "palu": {"group_size": 2, "kept_k": 0.5, "kept_v": 0.5, "bits": 4}}]
    hf_plan(_cfg(variants=graph_rows))
    with pytest.raises(ValueError, match="'palu-graph': baseline 'nope' is not one of the variants"):
        hf_plan(_cfg(variants=graph_rows[:2] + [{**graph_rows[2], "baseline": "nope"}]))
    with pytest.raises(ValueError, match="a CUDA graph needs the static dense cache, not 'dynamic'"):
        hf_plan(_cfg(variants=[{"name": "dense", "cache": "dynamic", "graph": True}]))
    with pytest.raises(ValueError, match="graph='yes' must be true or false"):
        hf_plan(_cfg(variants=[{"name": "dense", "graph": "yes"}]))


def test_filled_graph_cache_and_latent_cache_give_the_same_step():
    from palu.attention.install import set_backend
    shape = DecoderShape(**SHAPE)
    model = hf_llama(shape, "cpu").float()
    spec = PaluSpec(2, 32, 32, 4)
    install_palu(model, random_factors(shape, spec, "cpu"), spec.group_size)
    set_backend(model, "torch")
    logits = []
    for graph in (False, True):
        cache = new_cache(model, 4, palu=True, max_tokens=40, graph=graph, batch=2)
        fill_cache(model, cache, 37, batch=2)
        assert cache.get_seq_length() == 37
        with torch.no_grad():
            logits.append(model(input_ids=torch.tensor([[3], [5]]), past_key_values=cache,
                                use_cache=True).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


@torch.no_grad()
def test_static_and_dynamic_caches_hold_the_same_filled_tokens():
    model = hf_llama(DecoderShape(**SHAPE), "cpu")
    logits = []
    for kind in ("static", "dynamic"):
        cache = new_cache(model, None, palu=False, kind=kind, max_tokens=40)
        fill_cache(model, cache, 37, batch=2)
        assert cache.get_seq_length() == 37
        out = model(input_ids=torch.tensor([[3], [5]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits.float())
    assert torch.allclose(logits[0], logits[1], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("bits", [16, 4])
def test_kernel_check_runs_every_layer_through_the_kernels(bits):
    shape = DecoderShape(**SHAPE)
    model = hf_llama(shape, "cpu")
    spec = PaluSpec(2, 32, 32, bits)
    install_palu(model, random_factors(shape, spec, "cpu"), spec.group_size)
    result = check(model, bits, context=48, batch=2)
    assert result["kernel_layers"] == shape.layers       # every layer took the kernel path
    assert 0 < result["rel_err"] < 2e-2                  # fp16 kernels vs the torch path


def test_set_backend_names_a_bad_backend():
    from palu.attention.install import set_backend
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        set_backend(torch.nn.Linear(2, 2), "cuda")
