"""Perplexity runs through the method's cache: a one-pass window equals feeding its tokens one at
a time through the real cache, and the latent bit width changes the number."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import palu
from palu.eval.perplexity import perplexity
from palu.methods import build_method
from tiny import FAMILIES

# float64 models; quantised latents are dequantised to float64 too, so the one-pass and the
# token-by-token paths see the same cache contents: their logits agree to float64 rounding, and
# perplexity (whose loss is taken in float32, as in `perplexity`) to float32 rounding.
LOGIT_TOL = 1e-9
PPL_REL_TOL = 1e-6


@pytest.fixture(scope="module", params=["llama", "opt"])
def checkpoint(request, tmp_path_factory):
    """A J-LRD kept-0.5 checkpoint of a tiny model (RoPE: llama; no RoPE: opt) and its base."""
    name = request.param
    base = FAMILIES[name](0).double()
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(base)
    kv = palu.geometry_of(base.config).num_kv_heads
    result = palu.compress(model, calib, kept_ratio=0.5, group_size=kv, multiple=8, progress=False)
    path = tmp_path_factory.mktemp(name) / "ckpt"
    result.save(path)
    return base, str(path)


@torch.no_grad()
def _token_by_token(model, method, windows):
    """Perplexity and logits (n, T, V) of each window fed one token at a time through a cache."""
    nll, count, logits = 0.0, 0, []
    for window in windows:
        cache = method.make_cache(model)
        steps = [model(window[None, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                 for t in range(window.numel())]
        logits.append(torch.stack(steps))
        nll += F.cross_entropy(logits[-1][:-1].float(), window[1:], reduction="sum").item()
        count += window.numel() - 1
    return math.exp(nll / count), torch.stack(logits)


def _installed(base, conf):
    method = build_method({"name": "palu", **conf})
    model = copy.deepcopy(base)
    method.install(model)
    return method, model


def _one_pass(model, method, windows):
    return perplexity(model, windows, progress=False, make_cache=lambda: method.make_cache(model))


@pytest.mark.parametrize("bits", [16, 8, 4, 3, 2])
def test_one_pass_perplexity_equals_decoding_through_the_cache(checkpoint, bits):
    base, path = checkpoint
    method, model = _installed(base, {"checkpoint": path, "latent_bits": bits})
    windows = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    one_pass = _one_pass(model, method, windows)
    stepwise, step_logits = _token_by_token(model, method, windows)
    assert one_pass["ppl"] == pytest.approx(stepwise, rel=PPL_REL_TOL)
    with torch.no_grad():
        pass_logits = torch.stack([model(w[None], past_key_values=method.make_cache(model),
                                         use_cache=True).logits[0] for w in windows])
    assert (pass_logits - step_logits).abs().max().item() < LOGIT_TOL


def test_latent_bits_change_the_perplexity(checkpoint):
    base, path = checkpoint
    windows = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(6))
    ppl = {}
    for bits in (16, 8, 4, 3, 2):
        method = build_method({"name": "palu", "checkpoint": path, "latent_bits": bits})
        model = copy.deepcopy(base)
        method.install(model)
        ppl[bits] = perplexity(model, windows, progress=False,
                               make_cache=lambda: method.make_cache(model))["ppl"]
    # every quantised width moves the number, and 2 bits moves it more than 8 bits
    for bits in (8, 4, 3, 2):
        assert abs(ppl[bits] - ppl[16]) > 1e-7 * ppl[16], ppl
    assert abs(ppl[2] - ppl[16]) > abs(ppl[8] - ppl[16]), ppl


def test_full_cache_perplexity_equals_no_cache():
    model = FAMILIES["llama"](0).double()
    windows = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(7))
    method = build_method({"name": "fp16"})
    with_cache = perplexity(model, windows, progress=False, make_cache=lambda: method.make_cache(model))
    assert with_cache["ppl"] == pytest.approx(perplexity(model, windows, progress=False)["ppl"], rel=1e-12)


def test_a_nan_loss_is_an_error_not_a_number():
    model = FAMILIES["llama"](0)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        perplexity(model, torch.randint(0, 97, (1, 16)), progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_on_a_gpu_one_pass_equals_decoding_through_the_kernels(bits, tmp_path, monkeypatch):
    """fp16 on CUDA: the one-pass window (torch path) against token-by-token decoding whose steps
    run the Triton kernels over the real (packed) cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from palu.attention import kernel_backend
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=256)
    base = LlamaForCausalLM(cfg).eval()
    model = copy.deepcopy(base)
    calib = torch.randint(0, 97, (4, 64), generator=torch.Generator().manual_seed(0))
    palu.compress(model, calib, kept_ratio=0.5, group_size=2, multiple=32, progress=False).save(tmp_path / "c")
    method = build_method({"name": "palu", "checkpoint": str(tmp_path / "c"), "latent_bits": bits})
    model = base
    method.install(model)      # the checkpoint's hash is of the float32 base
    model.half().cuda()
    calls = []
    real = kernel_backend.kernel_decode
    monkeypatch.setattr(kernel_backend, "kernel_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    windows = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(5)).cuda()
    one_pass = perplexity(model, windows, progress=False, make_cache=lambda: method.make_cache(model))
    stepwise, _ = _token_by_token(model, method, windows)
    assert len(calls) == 2 * 48 * 2        # every decode step of every layer through the kernels
    assert one_pass["ppl"] == pytest.approx(stepwise, rel=2e-3)


@pytest.mark.parametrize("bits, channel_group", [(4, 8), (2, 8), (3, 5)])
def test_channel_grouped_latents_are_decode_equivalent_and_cost_their_scales(checkpoint, bits, channel_group):
    """Latents quantised with one scale per `channel_group` channels (the last group of a rank
    shorter): one pass equals decoding, the number moves, and each extra group costs its fp16
    scale and zero point per token."""
    base, path = checkpoint
    plain, plain_model = _installed(base, {"checkpoint": path, "latent_bits": bits})
    grouped, model = _installed(base, {"checkpoint": path, "latent_bits": bits, "channel_group": channel_group})
    assert grouped.tag == plain.tag + f"-cg{channel_group}"
    windows = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(7))
    one_pass = _one_pass(model, grouped, windows)
    stepwise, _ = _token_by_token(model, grouped, windows)
    assert one_pass["ppl"] == pytest.approx(stepwise, rel=PPL_REL_TOL)
    plain_ppl = _one_pass(plain_model, plain, windows)
    assert abs(plain_ppl["ppl"] - one_pass["ppl"]) > 1e-9 * plain_ppl["ppl"]
    caches = {}
    for name, m, mdl in (("plain", plain, plain_model), ("grouped", grouped, model)):
        caches[name] = m.make_cache(mdl)
        with torch.no_grad():
            mdl(windows[:1], past_key_values=caches[name], use_cache=True)
    attn = next(mm for mm in model.modules() if getattr(mm, "stores_latents", False))
    groups = sum(-(-r // channel_group) for r in (*attn.ranks_k, *attn.ranks_v))
    layers = base.config.num_hidden_layers
    assert caches["grouped"].nbytes()["scales"] == 40 * groups * 2 * 2 * layers
    assert caches["grouped"].nbytes()["scales"] > caches["plain"].nbytes()["scales"]


def test_a_bad_channel_group_is_refused():
    from palu.methods import MethodError
    for conf in ({"latent_bits": 16, "channel_group": 8}, {"latent_bits": 4, "channel_group": 0}):
        with pytest.raises(MethodError, match="method.channel_group"):
            build_method({"name": "palu", "checkpoint": "x", **conf})


def test_row_by_row_loss_equals_the_whole_batch_loss_bit_for_bit():
    """`token_nll` upcasts one window's logits at a time (the whole batch's float32 copy ran a
    152K-vocabulary model out of its GPU share); each token's NLL is the flattened batch's."""
    from palu.eval.perplexity import token_nll
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 17, 50, generator=g) * 4).half()
    batch = torch.randint(0, 50, (3, 17), generator=g)
    whole = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(),
                            reduction="none").view(3, -1).double()
    rows = token_nll(logits, batch)
    assert rows.shape == (3, 16) and rows.dtype == torch.float64
    assert torch.equal(rows, whole)
