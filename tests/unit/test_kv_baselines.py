"""The KV-quantisation baselines (Atom, KIVI, TurboQuant, KVQuant; issue 16 items 1, 4-6): each
method's defining property, decode-equivalence of a one-pass window, bytes = the real cache's
nbytes, generate() through every cache, and bad settings refused."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from palu.cache.quant_cache import QuantKVCache, Schedule
from palu.eval.perplexity import perplexity
from palu.methods import MethodError, build_method
from palu.calib.kvquant import fit_kvquant
from palu.calib.value_scales import fit_kivi_vscale
from palu.methods.kvquant import KVQuantState
from palu.quant.codecs import TurboCodec, UniformCodec
from palu.quant.uniform import dequantize, quantize
from tiny import FAMILIES

# float64 models: the one-pass and token-by-token paths code every token from the same numbers,
# so their logits agree to float64 rounding; perplexity (loss in float32) to float32 rounding
LOGIT_TOL = 1e-9
PPL_REL_TOL = 1e-6
T = 40   # > KIVI's window + group in the tiny configs, so every form and boundary occurs


@pytest.fixture(scope="module")
def kvquant_states():
    """Fitted on a tiny llama and a tiny opt (fisher and plain k-means, 2 / 3 / 4 bits)."""
    calib = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(3))
    out = {}
    for family in ("llama", "opt"):
        base = FAMILIES[family](0).double()
        for bits in (2, 3, 4):
            for weighting in ("fisher", "uniform"):
                out[family, bits, weighting] = fit_kvquant(copy.deepcopy(base), calib, bits=bits,
                                                           weighting=weighting, tokens_per_window=24,
                                                           progress=False)
        # KIVI's calibrated value scales (the second fitted method)
        out[family, "vscale"] = fit_kivi_vscale(copy.deepcopy(base), calib, alpha=0.5, tokens_per_window=24,
                                                progress=False)
    return out


def _configs(family, states):
    # tiny models: head_dim 16, so KIVI's groups are 8 / 4 tokens and channels
    return ([{"name": "atom", "bits": b} for b in (2, 3, 4, 8)]
            + [{"name": "kivi", "bits": 2, "group": 8, "residual": 16},
               {"name": "kivi", "bits": 4, "group": 4, "residual": 8},
               {"name": "kivi", "bits": 2, "group": 8, "residual": 0}]
            + [{"name": "turboquant", "bits": b} for b in (2, 3, 4)]
            + [{"name": "kvquant", "state": states[family, b, w]} for b in (2, 3, 4)
               for w in ("fisher", "uniform")]
            + [{"name": "kvquant", "state": states[family, 3, "fisher"], "sink": 0}]
            + [{"name": "kivi_vscale", "bits": 2, "group": 8, "residual": 16, "state": states[family, "vscale"]},
               {"name": "kivi_vscale", "bits": 4, "group": 4, "residual": 0, "state": states[family, "vscale"]}])


def _installed(family, conf):
    method = build_method(dict(conf))
    model = copy.deepcopy(FAMILIES[family](0).double())
    method.install(model)
    return method, model


@torch.no_grad()
def _stepwise(model, method, window):
    cache = method.make_cache(model)
    return torch.cat([model(window[None, t:t + 1], past_key_values=cache, use_cache=True).logits
                      for t in range(window.numel())], 1)[0], cache


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_one_pass_equals_decoding_through_every_baselines_cache(family, kvquant_states):
    windows = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(11))
    for conf in _configs(family, kvquant_states):
        method, model = _installed(family, conf)
        one = perplexity(model, windows, progress=False, make_cache=lambda: method.make_cache(model))
        nll = 0.0
        for w in windows:
            logits, _ = _stepwise(model, method, w)
            with torch.no_grad():
                passed = model(w[None], past_key_values=method.make_cache(model), use_cache=True).logits[0]
            assert (passed - logits).abs().max().item() < LOGIT_TOL, method.tag
            nll += F.cross_entropy(logits[:-1].float(), w[1:], reduction="sum").item()
        assert one["ppl"] == pytest.approx(math.exp(nll / (2 * (T - 1))), rel=PPL_REL_TOL), method.tag


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_every_baseline_changes_the_model_and_fewer_bits_change_it_more(family, kvquant_states):
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        ref = FAMILIES[family](0).double()(ids).logits
    err = {}
    for conf in _configs(family, kvquant_states):
        method, model = _installed(family, conf)
        with torch.no_grad():
            out = model(ids, past_key_values=method.make_cache(model), use_cache=True).logits
        err[method.tag] = (out - ref).abs().max().item()
        assert err[method.tag] > 1e-9, method.tag
    assert err["atom-b2"] > err["atom-b4"] > err["atom-b8"]
    assert err["turboquant-b2"] > err["turboquant-b4"]


@pytest.mark.parametrize("tokens", [1, 5, 17, 24, 25, 40])
def test_bytes_by_formula_equal_the_nbytes_of_a_filled_cache(tokens, kvquant_states):
    ids = torch.randint(0, 97, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    for conf in _configs("llama", kvquant_states):
        method, model = _installed("llama", conf)
        cache = method.make_cache(model)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        real = method.cache_nbytes(cache)
        tensors = sum(t.numel() * t.element_size() for layer in cache.layers
                      for s in (layer.k, layer.v)
                      for t in [*s.enc.values(), s.head, s.tail] if t is not None)
        tensors += sum(layer.positions.numel() * 4 for layer in cache.layers if layer.positions is not None)
        per_layer = sum(c.layer_metadata_nbytes(i) for i in range(len(cache.layers))
                        for c in (cache.layers[0].k.codec, cache.layers[0].v.codec))
        assert real["total"] == tensors + per_layer, method.tag
        expected = method.expected_nbytes(tokens, batch=2, element_size=8)
        assert {k: real[k] for k in expected} == expected, method.tag


def test_kivi_keeps_the_newest_tokens_exact_and_quantises_keys_in_whole_groups():
    G, R = 8, 16
    codec_k, codec_v = UniformCodec(2, G, "token"), UniformCodec(2, G, "channel")
    for n in (3, 16, 17, 23, 24, 25, 40, 41):
        cache = QuantKVCache(codec_k, codec_v, Schedule(window=R), num_layers=1)
        k, v = torch.randn(2, 3, n, 16, dtype=torch.float64), torch.randn(2, 3, n, 16, dtype=torch.float64)
        # in several steps, as generation stores them
        for start in range(0, n, 7):
            cache.step(0, k[:, :, start:start + 7], v[:, :, start:start + 7], None, None)
        layer = cache.layers[0]
        n_v = max(0, n - R)                               # values: the newest R exact
        n_k = G * max(0, (n - R) // G)                    # keys: whole groups left the window
        assert layer.v.tail.shape[2] == n - n_v and torch.equal(layer.v.tail, v[:, :, n_v:])
        assert layer.k.tail.shape[2] == n - n_k and torch.equal(layer.k.tail, k[:, :, n_k:])
        assert n - n_k >= min(n, R)                       # the newest R keys exact too
        if n_k:
            assert layer.k.enc["scale"].shape == (2, 3, n_k // G, 16)   # per channel, per group
            back = codec_k.decode(layer.k.enc, 0, torch.float64)
            step = layer.k.enc["scale"].double().repeat_interleave(G, 2)
            assert ((back - k[:, :, :n_k]).abs() <= step / 2 + 1e-3).all()
        if n_v:
            assert layer.v.enc["scale"].shape == (2, 3, n_v, 16 // G)   # per token, channel groups


def test_kivi_one_step_view_shows_each_token_in_the_form_of_its_decode_step():
    """In a one-pass step, query t sees value j exact iff j is among the newest R at t."""
    G, R, n = 4, 8, 20
    cache = QuantKVCache(UniformCodec(2, G, "token"), UniformCodec(2, G, "channel"), Schedule(window=R), 1)
    k, v = torch.randn(1, 1, n, 8, dtype=torch.float64), torch.randn(1, 1, n, 8, dtype=torch.float64)
    view = cache.step(0, k, v, None, None)
    for t in range(n):
        seen = view.index[view.mask[0, 0, t]]
        assert sorted(seen.tolist()) == list(range(t + 1))          # each token once, causal
        for col in view.mask[0, 0, t].nonzero().flatten():
            j = int(view.index[col])
            exact_v = torch.equal(view.values[0, 0, col], v[0, 0, j])
            exact_k = torch.equal(view.keys[0, 0, col], k[0, 0, j])
            assert exact_v == (j > t - R), (t, j)
            # a key is quantised once its whole group of G tokens has left the window
            assert exact_k == (G * (j // G + 1) - 1 + R > t), (t, j)


def test_uniform_quantisation_error_is_within_half_a_step():
    x = torch.randn(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 3
    for bits in (2, 3, 4, 8):
        for group, axis in ((64, "channel"), (32, "channel"), (8, "token"), (32, "token")):
            enc = quantize(x, bits, group, axis)
            back = dequantize(enc, bits, group, axis, torch.float32)
            scale = enc["scale"].float()
            scale = (scale.repeat_interleave(group, -1) if axis == "channel"
                     else scale.repeat_interleave(group, 2))
            assert ((back - x).abs() <= scale / 2 + 2e-3 * x.abs().max()).all(), (bits, group, axis)


def test_turboquant_error_is_that_of_its_lloyd_max_codebook():
    """Relative MSE of unit vectors after the rotation: TurboQuant's D_mse (0.117 / 0.03 / 0.009
    at 2 / 3 / 4 bits), with a margin for d = 64."""
    x = torch.randn(1, 2, 512, 64, generator=torch.Generator().manual_seed(1)) * 5
    x[..., 3] += 40.0                                                # an outlier channel
    for bits, bound in ((2, 0.13), (3, 0.04), (4, 0.012)):
        codec = TurboCodec(bits, 64, num_layers=1)
        back = codec.decode(codec.encode(x, 0), 0, torch.float32)
        rel = ((back - x).norm(dim=-1) ** 2 / x.norm(dim=-1) ** 2).mean().item()
        assert rel < bound, (bits, rel)


def test_kvquant_keeps_the_first_token_and_its_outliers_exact(kvquant_states):
    state = kvquant_states["llama", 3, "fisher"]
    method, model = _installed("llama", {"name": "kvquant", "state": state})
    cache = method.make_cache(model)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        for stream in (layer.k, layer.v):
            assert stream.head.shape[2] == 1 and stream.tail.shape[2] == 0   # token 0 exact
            enc = stream.enc
            # one entry in 16 per vector (round(0.01 * 16) -> at least 1) kept with its index
            assert enc["outlier_value"].shape == (1, 2, 29, 1) and enc["outlier_index"].dtype == torch.uint8
            back = stream.codec.decode(enc, layer.layer_idx, torch.float32)
            got = back.gather(-1, enc["outlier_index"].long())
            assert torch.equal(got, enc["outlier_value"].float())
    assert state.key_codebooks.shape == (2, 8) and (state.key_codebooks.diff(dim=1) > 0).all()


def test_kvquant_keys_are_quantised_before_rope(kvquant_states):
    """The cache holds pre-RoPE keys: the same token at two positions is stored identically."""
    method, model = _installed("llama", {"name": "kvquant", "state": kvquant_states["llama", 3, "uniform"]})
    cache = method.make_cache(model)
    ids = torch.tensor([[5, 7, 7, 9, 7]])
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    codes = cache.layers[0].k.enc["codes"][0, :, :, :]              # tokens 1..4
    assert torch.equal(codes[:, 0], codes[:, 1]) and torch.equal(codes[:, 1], codes[:, 3])
    assert cache.layers[0].positions.tolist() == [[0, 1, 2, 3, 4]]


def test_kvquant_state_round_trips_and_a_damaged_file_is_refused(kvquant_states, tmp_path):
    state = kvquant_states["llama", 2, "fisher"]
    state.save(tmp_path / "s")
    back = KVQuantState.load(tmp_path / "s")
    assert torch.equal(back.key_codebooks, state.key_codebooks) and back.tag == state.tag
    data = (tmp_path / "s" / "state.safetensors").read_bytes()
    (tmp_path / "s" / "state.safetensors").write_bytes(data[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match="does not match its manifest"):
        KVQuantState.load(tmp_path / "s")


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_generate_runs_through_every_baselines_cache(family, kvquant_states):
    prompt = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    if family == "qwen2":   # k/v biases: its own KVQuant state
        configs = [c for c in _configs("llama", kvquant_states) if c["name"] not in ("kvquant", "kivi_vscale")]
        configs.append({"name": "kvquant", "state": fit_kvquant(
            FAMILIES["qwen2"](0).double(), prompt.repeat(2, 2), bits=3, tokens_per_window=8, progress=False)})
    else:
        configs = _configs(family, kvquant_states)
    for conf in configs:
        method, model = _installed(family, conf)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=6, do_sample=False,
                                 past_key_values=method.make_cache(model))
        logits, _ = _stepwise(model, method, out[0, :-1])
        assert torch.equal(logits[11:].argmax(-1), out[0, 12:]), method.tag   # greedy = stepwise


def test_the_attention_refuses_a_cache_that_is_not_its_methods(kvquant_states):
    method, model = _installed("llama", {"name": "atom", "bits": 4})
    other = build_method({"name": "atom", "bits": 2})
    other_model = copy.deepcopy(FAMILIES["llama"](0))
    other.install(other_model)
    ids = torch.randint(0, 97, (1, 5))
    from transformers import DynamicCache
    for cache in (DynamicCache(), other.make_cache(other_model)):
        with pytest.raises(TypeError, match="method.make_cache"):
            model(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(TypeError, match="method.make_cache"):
        model.generate(ids, max_new_tokens=2)          # transformers' own DynamicCache
    # without a cache the step still quantises (a fresh cache serves it)
    with torch.no_grad():
        a = model(ids, use_cache=False).logits
        b = model(ids, past_key_values=method.make_cache(model), use_cache=True).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("conf, message", [
    ({"name": "atom", "bits": 5}, "method.bits=5"),
    ({"name": "kivi", "bits": 1}, "method.bits=1"),
    ({"name": "turboquant", "bits": 8}, "method.bits=8"),
    ({"name": "kivi", "group": 0}, "method.group=0"),
    ({"name": "kivi", "group": 32, "residual": 100}, "method.residual=100"),
    ({"name": "atom", "group": -4}, "method.group=-4"),
    ({"name": "kvquant"}, "method.state"),
    ({"name": "quip", "bits": 2}, "method.name='quip'"),
    ({"name": "kivi", "window": 3}, "no field"),
])
def test_bad_settings_are_refused_naming_the_value(conf, message):
    with pytest.raises(MethodError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_method(conf)


@pytest.mark.parametrize("fraction", [-0.1, 0.5, 0.7])
def test_an_outlier_fraction_outside_its_range_is_refused(fraction):
    with pytest.raises(MethodError, match=f"outlier_fraction={fraction}"):
        fit_kvquant(FAMILIES["llama"](0), torch.zeros(1, 8, dtype=torch.long), outlier_fraction=fraction)


def test_a_group_that_does_not_divide_the_head_is_refused_at_install():
    for conf in ({"name": "kivi", "group": 32, "residual": 64}, {"name": "atom", "group": 6}):
        with pytest.raises(MethodError, match="does not divide head_dim"):
            build_method(conf).install(copy.deepcopy(FAMILIES["llama"](0)))


@pytest.mark.parametrize("make", ["tiny_mistral_sliding", "tiny_qwen2_sliding"])
def test_sliding_window_models_keep_their_window_through_a_quantised_cache(make):
    """The model's window mask reaches the quantised attention on both paths: at 8 bits the
    output stays within quantisation error of the model's own (a lost window moves it by O(1)),
    and one pass equals decoding. (Every token is kept; the bytes count them all.)"""
    import tiny
    base = getattr(tiny, make)(0).double()
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = base(ids).logits
    for conf in ({"name": "atom", "bits": 8}, {"name": "kivi", "bits": 8, "group": 4, "residual": 4}):
        method = build_method(conf)
        model = copy.deepcopy(base)
        method.install(model)
        with torch.no_grad():
            one = model(ids, past_key_values=method.make_cache(model), use_cache=True).logits
        step, _ = _stepwise(model, method, ids[0])
        assert (one - ref).abs().max().item() < 1e-2, method.tag
        assert (one[0] - step).abs().max().item() < LOGIT_TOL, method.tag


def test_one_capture_serves_every_fit_and_round_trips(tmp_path):
    """The pipeline captures calibration activations once (kvquant_capture) and fits each bit
    width and weighting from them: the same states as fitting from the model directly."""
    from palu.calib.kvquant import KVQuantActivations, capture_activations, fit_from_activations
    base = FAMILIES["llama"](0).double()
    calib = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(8))
    captured = capture_activations(copy.deepcopy(base), calib, fisher=True, tokens_per_window=16,
                                   progress=False)
    captured.save(tmp_path / "acts.safetensors")
    back = KVQuantActivations.load(tmp_path / "acts.safetensors")
    for bits, weighting in ((2, "fisher"), (3, "uniform")):
        direct = fit_kvquant(copy.deepcopy(base), calib, bits=bits, weighting=weighting,
                             tokens_per_window=16, progress=False)
        shared = fit_from_activations(back, bits, weighting, 0.01)
        for name in ("key_codebooks", "value_codebooks", "channel_offset", "channel_scale"):
            assert torch.equal(getattr(direct, name), getattr(shared, name)), (bits, weighting, name)
    plain = capture_activations(copy.deepcopy(base), calib, fisher=False, tokens_per_window=16, progress=False)
    with pytest.raises(ValueError, match="weighting=fisher needs activations captured with their gradients"):
        fit_from_activations(plain, 3, "fisher", 0.01)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bits, group, axis", [(2, 32, "token"), (4, 32, "token"), (2, 16, "channel"),
                                               (4, 64, "channel"), (3, 8, "channel")])
def test_roundtrip_is_decode_of_encode_bit_for_bit(dtype, bits, group, axis):
    # the slots' decode step codes a due block with `roundtrip` (no packing): it must store
    # exactly what the cache's codes decode to, constant groups and outliers included
    from palu.quant.codecs import UniformCodec
    g = torch.Generator().manual_seed(bits * 100 + group)
    x = (torch.randn(2, 3, 64, 64, generator=g) * torch.logspace(-3, 2, 64)).to(dtype)
    x[0, 0, :32] = 1.25          # a constant block
    codec = UniformCodec(bits, group, axis)
    want = codec.decode(codec.encode(x, 0), 0, x.dtype)
    got = codec.roundtrip(x, 0)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bits, d", [(2, 64), (3, 64), (4, 128), (3, 48)])
def test_turboquant_roundtrip_is_decode_of_encode_bit_for_bit(dtype, bits, d):
    from palu.quant.codecs import TurboCodec
    g = torch.Generator().manual_seed(bits * 10 + d)
    x = (torch.randn(2, 3, 16, d, generator=g) * torch.logspace(-3, 2, d)).to(dtype)
    x[0, 0, 0] = 0.0             # a zero vector: its norm clamped, its codes of zero
    codec = TurboCodec(bits, d, num_layers=2, seed=1)
    for layer in (0, 1):
        want = codec.decode(codec.encode(x, layer), layer, x.dtype)
        got = codec.roundtrip(x, layer)
        assert got.dtype == want.dtype and torch.equal(got, want), (layer, (got - want).abs().max())
