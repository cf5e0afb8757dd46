"""Palu attention on tiny random models of every family: exactness, fusion, caching, bytes."""
import copy

import pytest
import torch

import palu
from palu.cache.latent_cache import LatentCache
from tiny import FAMILIES

TOL64 = 1e-9  # float64 end-to-end logits tolerance for exact (full-rank) factorisations


def _compressed(name, kept, group, fuse=True, method="uniform", decomposition="whitened", seed=0):
    base = FAMILIES[name](seed).double()
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(seed))
    model = copy.deepcopy(base)
    result = palu.compress(model, calib, kept_ratio=kept, group_size=group, rank_method=method,
                           decomposition=decomposition, multiple=8, fuse=fuse, progress=False)
    return base, model, result


def _groups(name):
    return palu.geometry_of(FAMILIES[name]().config).group_sizes()


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("fuse", [True, False])
def test_full_rank_reproduces_the_original_logits(name, fuse):
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    for group in _groups(name):
        base, model, _ = _compressed(name, 1.0, group, fuse=fuse)
        assert isinstance(model.get_decoder().layers[0].self_attn, palu.attention.palu_attention.PaluAttention)
        # use_cache=False: a sliding-window family's default DynamicCache would trim latents (refused)
        diff = (model(ids, use_cache=False).logits - base(ids, use_cache=False).logits).abs().max().item()
        assert diff < TOL64, (name, group, fuse, diff)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_and_unfused_paths_agree_when_compressed(name):
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    base, fused, _ = _compressed(name, 0.5, 1, fuse=True)
    _, unfused, _ = _compressed(name, 0.5, 1, fuse=False)
    a, b, ref = (m(ids, use_cache=False).logits for m in (fused, unfused, base))
    assert (a - b).abs().max().item() < TOL64
    assert (a - ref).abs().max().item() > 1e-4  # compression really changed something


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("fuse", [True, False])
def test_latent_cache_decoding_equals_full_recompute(name, fuse):
    _, model, _ = _compressed(name, 0.5, _groups(name)[-1], fuse=fuse)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    cache = LatentCache(model)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache,
                         pad_token_id=0)
    # Recompute: each step runs the whole prefix without any cache.
    seq = ids
    for _ in range(8):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    # Step-by-step logits through the cache match too.
    cache = LatentCache(model)
    step_logits = model(seq[:, :9], past_key_values=cache, use_cache=True).logits[:, -1]
    for t in range(9, seq.shape[1]):
        full = model(seq[:, : t + 1], use_cache=False).logits[:, -1]
        step_logits = model(seq[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
        assert (step_logits - full).abs().max().item() < TOL64


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cache_bytes_equal_what_the_ranks_predict(name):
    _, model, result = _compressed(name, 0.5, 1, fuse=True)
    model = model.float()
    B, T = 3, 17
    cache = LatentCache(model)
    model(torch.randint(0, 97, (B, T)), past_key_values=cache, use_cache=True)
    latent = result.allocation["latent_size"]            # Σ ranks over layers, K and V
    nbytes = cache.nbytes()
    assert nbytes["latents"] == B * T * latent * 4       # float32 latents
    assert nbytes["positions"] == B * T * 4 * len(cache.layers)  # int32 positions per layer
    geom = palu.geometry_of(model.config)
    dense = B * T * geom.num_layers * geom.kv_size() * 4
    assert nbytes["latents"] == pytest.approx(0.5 * dense, rel=0.02)


def test_default_dynamic_cache_also_stores_latents():
    _, model, _ = _compressed("llama", 0.5, 1)
    ids = torch.randint(0, 97, (1, 6))
    out = model(ids, use_cache=True)
    layer = out.past_key_values.layers[0]
    assert layer.keys.shape == (1, 1, 6, sum(model.model.layers[0].self_attn.ranks_k))


def test_plain_svd_is_worse_than_whitened_on_the_model():
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    base, white, _ = _compressed("llama", 0.5, 1, decomposition="whitened")
    _, plain, _ = _compressed("llama", 0.5, 1, decomposition="plain")
    ref = base(ids).logits
    err_w = (white(ids).logits - ref).norm()
    err_p = (plain(ids).logits - ref).norm()
    assert err_w < err_p


def test_unsupported_architecture_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        palu.compress(model, torch.randint(0, 50, (1, 8)), kept_ratio=0.5)
