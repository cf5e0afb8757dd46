"""Model families by description (issue 37): every method on tiny random models of Qwen3 (per-head
q/k norm), Gemma-3 (per-head norm with (1 + w) weights, MQA, head_dim > hidden / heads, a sliding
layer with its own RoPE), OLMo-2 (q/k norm over all heads) and Phi-3 (fused qkv, partial rotary),
beside the families we had. A supported cell runs the method and checks it against the model's
own computation; a refused cell checks the method's reason. `SUPPORT` is the README's table."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import palu
from palu.cache.latent_cache import LatentCache
from palu.calib.kvquant import fit_kvquant
from palu.eval.perplexity import perplexity
from palu.methods import build_method
from tiny import FAMILIES

NEW = ["qwen3", "gemma3", "olmo2", "phi3"]
LOGIT_TOL = 1e-9
T = 24      # > the tiny Gemma-3's sliding window (8): every sliding layer really slides

# family -> method -> "yes" or the reason it is refused (what the README's table prints)
KNORM = "refused: q/k norm makes the query moment other than W_q G W_qᵀ"
SUPPORT = {
    "llama / mistral / qwen2": {"palu": "yes", "palu 2-8 bit": "yes", "kernels": "yes",
                                "attention objective": "yes", "head order": "yes",
                                "kivi / atom / turboquant": "yes", "kvquant": "yes",
                                "eviction / selection": "yes (Mistral / Qwen2 sliding layers: refused)"},
    "opt": {"palu": "yes", "palu 2-8 bit": "yes", "kernels": "yes (no RoPE)", "attention objective": "yes",
            "head order": "yes", "kivi / atom / turboquant": "yes", "kvquant": "yes",
            "eviction / selection": "yes"},
    "qwen3": {"palu": "yes", "palu 2-8 bit": "yes", "kernels": "torch path (k-norm)",
              "attention objective": KNORM, "head order": "yes", "kivi / atom / turboquant": "yes",
              "kvquant": "yes (keys after the k-norm)", "eviction / selection": "yes; palu_select refused (k-norm)"},
    "gemma3_text": {"palu": "yes", "palu 2-8 bit": "yes", "kernels": "torch path (k-norm)",
                    "attention objective": KNORM, "head order": "n/a (one KV head: M-LRD = J-LRD)",
                    "kivi / atom / turboquant": "yes", "kvquant": "yes (keys after the k-norm)",
                    "eviction / selection": "refused (sliding-window layers)"},
    "olmo2": {"palu": "yes", "palu 2-8 bit": "yes", "kernels": "torch path (k-norm)",
              "attention objective": KNORM, "head order": "yes (norm weights move with their heads)",
              "kivi / atom / turboquant": "yes", "kvquant": "yes (keys after the k-norm)",
              "eviction / selection": "yes; palu_select refused (k-norm)"},
    "phi3": {"palu": "yes (qkv split exactly)", "palu 2-8 bit": "yes",
             "kernels": "yes; torch path under partial rotary",
             "attention objective": "yes; refused under partial rotary", "head order": "yes",
             "kivi / atom / turboquant": "yes", "kvquant": "yes", "eviction / selection": "yes"},
    "gemma2, any other": {k: "refused" for k in
                          ("palu", "palu 2-8 bit", "kernels", "attention objective", "head order",
                           "kivi / atom / turboquant", "kvquant", "eviction / selection")},
}


def support_table() -> str:
    """SUPPORT as the README prints it (a markdown table)."""
    methods = list(next(iter(SUPPORT.values())))
    rows = ["| family | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    rows += [f"| {fam} | " + " | ".join(cells[m] for m in methods) + " |" for fam, cells in SUPPORT.items()]
    return "\n".join(rows)


def test_the_readme_table_is_this_files_support_matrix():
    from conftest import ROOT
    assert support_table() in (ROOT / "README.md").read_text(), "README's family table: print support_table()"


def _windows(seed=11, n=2):
    return torch.randint(0, 97, (n, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _stepwise(model, make_cache, window):
    cache = make_cache()
    return torch.cat([model(window[None, t:t + 1], past_key_values=cache, use_cache=True).logits
                      for t in range(window.numel())], 1)[0]


def _decode_equals_one_pass(model, make_cache, what):
    """One pass over each window = its tokens fed one at a time through the real cache
    (float64 logits), and perplexity's number is that of the token-by-token logits."""
    windows, nll = _windows(), 0.0
    for w in windows:
        steps = _stepwise(model, make_cache, w)
        with torch.no_grad():
            one = model(w[None], past_key_values=make_cache(), use_cache=True).logits[0]
        assert (one - steps).abs().max().item() < LOGIT_TOL, what
        nll += F.cross_entropy(steps[:-1].float(), w[1:], reduction="sum").item()
    ppl = perplexity(model, windows, progress=False, make_cache=make_cache)["ppl"]
    assert ppl == pytest.approx(math.exp(nll / (len(windows) * (T - 1))), rel=1e-6), what


@pytest.fixture(scope="module", params=NEW)
def family(request):
    return request.param


def _baselines(name, base):
    calib = _windows(3, 3)
    state = fit_kvquant(copy.deepcopy(base), calib, bits=3, weighting="fisher", tokens_per_window=12,
                        progress=False)
    return [{"name": "atom", "bits": 4}, {"name": "kivi", "bits": 2, "group": 8, "residual": 8},
            {"name": "turboquant", "bits": 3}, {"name": "kvquant", "state": state}]


def test_every_kv_baseline_decodes_as_it_evaluates(family):
    base = FAMILIES[family](0).double()
    ref = base(_windows(12, 1), use_cache=False).logits
    for conf in _baselines(family, base):
        method = build_method(dict(conf))
        model = copy.deepcopy(base)
        method.install(model)
        _decode_equals_one_pass(model, lambda: method.make_cache(model), (family, method.tag))
        with torch.no_grad():
            out = model(_windows(12, 1), past_key_values=method.make_cache(model), use_cache=True).logits
        assert (out - ref).abs().max().item() > 1e-6, (family, method.tag)    # it really quantises
        prompt = _windows(2, 1)[:, :10]
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=5, do_sample=False, past_key_values=method.make_cache(model))
        steps = _stepwise(model, lambda: method.make_cache(model), gen[0, :-1])
        assert torch.equal(steps[9:].argmax(-1), gen[0, 10:]), (family, method.tag)


@pytest.mark.parametrize("bits", [16, 4])
def test_palu_checkpoints_decode_as_they_evaluate(family, bits, tmp_path):
    base = FAMILIES[family](0).double()
    model = copy.deepcopy(base)
    result = palu.compress(model, _windows(0, 4), kept_ratio=0.5, group_size=1, multiple=8, progress=False)
    result.save(tmp_path / "ckpt")
    method = build_method({"name": "palu", "checkpoint": str(tmp_path / "ckpt"), "latent_bits": bits})
    model = copy.deepcopy(base)
    method.install(model)
    _decode_equals_one_pass(model, lambda: method.make_cache(model), (family, bits))


def test_full_rank_palu_generates_the_original_tokens_through_latent_cache(family):
    """Through sliding layers too: the tiny Gemma-3 slides over 8 tokens and generates 24 past it,
    so a window not kept (or kept wrongly) changes the tokens."""
    base = FAMILIES[family](0).double()
    model = copy.deepcopy(base)
    palu.compress(model, _windows(0, 4), kept_ratio=1.0, group_size=1, progress=False)
    prompt = _windows(5, 2)[:, :6]
    with torch.no_grad():
        want = base.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        got = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0,
                             past_key_values=LatentCache(model))
    assert torch.equal(got, want), family
    with torch.no_grad():
        a = model(want, past_key_values=LatentCache(model), use_cache=True).logits
        b = base(want, use_cache=False).logits
    assert (a - b).abs().max().item() < LOGIT_TOL, family


def test_gemma3_layers_keep_their_own_window_and_rope():
    """Gemma-3: the sliding layer sees 8 tokens and rotates at base 10k, the global one sees all
    and rotates at 1M: a Palu layer given the other layer's RoPE, or no window, differs."""
    from palu.models.adapters import rotary_for
    model = FAMILIES["gemma3"](0).double()
    local, glob = rotary_for(model, 0), rotary_for(model, 1)
    assert (local.layer_type, glob.layer_type) == ("sliding_attention", "full_attention")
    assert not torch.equal(local.inv_freq, glob.inv_freq)
    x, pos = torch.zeros(1, 1, 64, dtype=torch.float64), torch.tensor([[5]])
    assert torch.equal(local(x, pos)[0], model.model.rotary_emb(x, pos, "sliding_attention")[0])


def test_the_fisher_and_probing_allocators_run_on_every_family(family):
    """Fisher gradients reach the k / v projections (Phi-3: the split ones), and probe_select
    scores truncated models of every family."""
    base = FAMILIES[family](0).double()
    calib, fisher = _windows(0, 3), _windows(1, 2)
    for method in ("fisher", "probe_select"):
        result = palu.compress(copy.deepcopy(base), calib, kept_ratio=0.5, group_size=1, rank_method=method,
                               fisher_windows=fisher, multiple=8, progress=False)
        kv = palu.geometry_of(base.config).num_kv_heads
        assert len(result.allocation["ranks"]) == base.config.num_hidden_layers * 2 * kv
        assert result.allocation["method"] == method


def test_phi3s_fused_projection_is_split_exactly():
    from palu.models.adapters import SplitQKV, adapter_for
    model = FAMILIES["phi3"](0).double()
    attn = model.model.layers[0].self_attn
    fused = attn.qkv_proj.weight.detach().clone()
    ids = _windows(4, 1)
    before = model(ids, use_cache=False).logits
    q, k, v, _ = adapter_for(model.config).projections(attn)
    assert isinstance(attn.qkv_proj, SplitQKV)
    assert torch.equal(torch.cat([q.weight, k.weight, v.weight]), fused)
    assert (model(ids, use_cache=False).logits - before).abs().max().item() < 1e-12
    assert adapter_for(model.config).projections(attn)[1] is k          # split once


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "olmo2", "phi3"])
def test_the_attention_objective_is_refused_where_its_query_model_does_not_hold(name):
    with pytest.raises(ValueError, match="decomposition='attention' is not supported"):
        palu.compress(FAMILIES[name](0).double(), _windows(0, 3), kept_ratio=0.5, group_size=1,
                      decomposition="attention", progress=False)


@pytest.mark.parametrize("name, reason", [("qwen3", "k-norm"), ("gemma3", "k-norm"), ("olmo2", "k-norm"),
                                          ("phi3", "partial rotary"), ("llama", None)])
def test_the_decode_kernels_say_why_they_do_not_serve_a_family(name, reason, monkeypatch):
    """The kernels rebuild and rotate keys without a norm, over the whole head: a family with a
    k-norm or partial rotary takes the torch path, with the reason (checked before the device)."""
    from palu.attention.kernel_backend import can_use_kernel
    model = FAMILIES[name](0).double()
    palu.compress(model, _windows(0, 3), kept_ratio=1.0, group_size=1, progress=False)
    attn = model.model.layers[0].self_attn
    why = can_use_kernel(attn, torch.zeros(1, 1, 64), None)
    if reason is None:
        assert "k-norm" not in (why or "") and "partial" not in (why or "")
    else:
        assert reason in why, why


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "phi3"])
def test_eviction_follows_the_family_and_refuses_sliding_layers(name):
    """StreamingLLM on a family with q/k norms or a fused qkv equals the model under its mask
    (keys normalised, then rotated, as the model does); Gemma-3's sliding layers are refused."""
    base = FAMILIES[name](0).double()
    method = build_method({"name": "streaming_llm", "sink": 2, "window": 5})
    model = copy.deepcopy(base)
    method.install(model)
    ids = _windows(13, 1)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None]
    band = (k <= q) & ((k < 2) | (q - k < 5))
    with torch.no_grad():
        ref = base(ids, attention_mask=band[None, None], use_cache=False).logits
        got = model(ids, past_key_values=method.make_cache(model), use_cache=True).logits
    assert (got - ref).abs().max().item() < LOGIT_TOL, name
    with pytest.raises(ValueError, match="sliding window"):
        build_method({"name": "snapkv"}).install(copy.deepcopy(FAMILIES["gemma3"](0)))


PROMPTS = [[5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70]]


def test_each_row_of_a_left_padded_batch_generates_what_its_prompt_does_alone(family, tmp_path):
    """The per-token methods on every new family (Gemma-3's sliding layers included): a row of a
    left-padded batch generates what its prompt generates alone."""
    base = FAMILIES[family](0).double()
    model = copy.deepcopy(base)
    palu.compress(model, _windows(3, 4), kept_ratio=0.5, group_size=1, progress=False).save(tmp_path / "c")
    n = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in PROMPTS])
    for conf in ({"name": "palu", "checkpoint": str(tmp_path / "c"), "latent_bits": 16},
                 {"name": "palu", "checkpoint": str(tmp_path / "c"), "latent_bits": 4},
                 {"name": "atom", "bits": 4}, {"name": "turboquant", "bits": 3}):
        method = build_method(dict(conf))
        model = copy.deepcopy(base)
        method.install(model)

        def generate(x, m=None):
            with torch.no_grad():
                return model.generate(x, attention_mask=m, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                      past_key_values=method.make_cache(model))
        batch = generate(ids, mask)[:, n:]
        for row, prompt in enumerate(PROMPTS):
            alone = generate(torch.tensor([prompt]))[0, len(prompt):]   # (stops early at EOS; the batch pads)
            assert torch.equal(batch[row, :len(alone)], alone), (family, method.tag, row)
            assert (batch[row, len(alone):] == 0).all(), (family, method.tag, row)


def test_kivi_keeps_a_left_padded_batchs_rows_apart_on_every_family(family):
    """KIVI counts a row's tokens (window, key blocks): its cache keeps a padded batch's rows
    apart, exact on every new family; on sliding-window layers (Gemma-3) it refuses by name."""
    base = FAMILIES[family](0).double()
    method = build_method({"name": "kivi", "bits": 2, "group": 4, "residual": 4})
    model = copy.deepcopy(base)
    method.install(model)
    n = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in PROMPTS])

    def generate(x, m=None):
        with torch.no_grad():
            return model.generate(x, attention_mask=m, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  past_key_values=method.make_cache(model))
    from palu.models.adapters import layer_window
    if any(layer_window(model.config, i) for i in range(model.config.num_hidden_layers)):
        with pytest.raises(ValueError, match="sliding-window layer"):
            generate(ids, mask)
        return
    batch = generate(ids, mask)[:, n:]
    for row, prompt in enumerate(PROMPTS):
        alone = generate(torch.tensor([prompt]))[0, len(prompt):]
        assert torch.equal(batch[row, :len(alone)], alone), (family, row)


ROPES = {
    "qwen3-linear": ("qwen3", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "qwen3-yarn": ("qwen3", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
                             "rope_theta": 10000.0}),
    "qwen3-dynamic": ("qwen3", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "phi3-longrope": ("phi3", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                               "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    "gemma3-linear-global": ("gemma3", {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}}),
}


@pytest.mark.parametrize("case", sorted(ROPES))
def test_full_rank_palu_generates_as_the_model_or_refuses_the_rope_type(case):
    """RoPE variants of the new families past their original 16 positions: static scalings
    (Gemma-3's per-layer-type scaling included) generate as the model; the length-dependent ones
    (dynamic, longrope) are refused by name."""
    import transformers as tf
    from palu.models.adapters import UnsupportedRopeError
    family, rope = ROPES[case]
    small = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, rope_parameters=rope)
    torch.manual_seed(0)
    base = {"qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**small, head_dim=16)),
            "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**small, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                             original_max_position_embeddings=16)),
            "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
                **{**small, "num_key_value_heads": 1}, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"]))}[family]().double().eval()
    model = copy.deepcopy(base)
    if rope.get("rope_type") in ("dynamic", "longrope"):
        with pytest.raises(UnsupportedRopeError, match=rope["rope_type"]):
            palu.compress(model, None, kept_ratio=1.0, group_size=1, decomposition="plain", progress=False)
        return
    palu.compress(model, None, kept_ratio=1.0, group_size=1, decomposition="plain", progress=False)
    ids = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        got = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0,
                             past_key_values=LatentCache(model))
    assert torch.equal(want, got), case
