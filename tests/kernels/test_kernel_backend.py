"""PaluAttention's decode fast path (Triton, here through the CPU interpreter) = the torch path."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from palu.quant.packed import QuantLatent

import palu
from palu.attention.install import set_backend
from palu.attention.palu_attention import PaluAttention
from tiny import tiny_opt

pytest.importorskip("triton")


def _decode_logits(model, ids, steps=3, gap=0):
    """Prefill then greedy steps; `gap` > 0 skips positions after the 4th token (a cache whose
    positions are not contiguous: the kernels take their arbitrary-positions path)."""
    cache = palu.LatentCache(model)
    pos = torch.arange(ids.shape[1])[None]
    pos = torch.where(pos >= 4, pos + gap, pos)
    out = [model(ids, past_key_values=cache, use_cache=True, position_ids=pos).logits[:, -1]]
    nxt = out[-1].argmax(-1, keepdim=True)
    for i in range(steps):
        step_pos = pos[:, -1:] + 1 + i
        out.append(model(nxt, past_key_values=cache, use_cache=True, position_ids=step_pos).logits[:, -1])
        nxt = out[-1].argmax(-1, keepdim=True)
    return torch.stack(out, 1)


@pytest.mark.parametrize("family, gap", [("llama", 0), ("llama", 5), ("opt", 0)])
def test_kernel_decode_matches_torch_decode(family, gap, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    if family == "llama":  # head_dim 32: the kernel needs head_dim/2 >= 16
        base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=32)).eval()
        kept = 0.5
    else:
        base, kept = tiny_opt(), 1.0   # rank 16 per head: the kernel needs >= 16 columns
    model = copy.deepcopy(base)
    palu.compress(model, torch.randint(0, 97, (2, 32)), kept_ratio=kept, group_size=1,
                  multiple=16, progress=False)
    ids = torch.randint(0, 97, (2, 7))
    set_backend(model, "torch")
    ref = _decode_logits(model, ids, gap=gap)
    set_backend(model, "triton")
    from palu.attention import kernel_backend
    import palu_kernels.palu_decode as kpd
    calls, paths = [], []
    real, real_kernel = kernel_backend.kernel_decode, kpd.palu_decode
    monkeypatch.setattr(kernel_backend, "kernel_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(kpd, "palu_decode", lambda *a, **k: paths.append(
        "positions" if "positions" in k else "offset") or real_kernel(*a, **k))
    out = _decode_logits(model, ids, gap=gap)
    assert len(calls) == 3 * 2  # every decode step of both layers went through the kernel
    if family == "llama":       # the cache's tracked contiguity picks the RoPE path
        assert set(paths) == {"positions" if gap else "offset"}
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 5e-3  # fp16 latents and fp16 tensor-core operands inside the kernel


def test_latent_cache_tracks_position_contiguity_as_tokens_arrive():
    cache = palu.LatentCache(num_layers=1)
    layer = cache.layers[0]
    hk, hv = torch.zeros(2, 4, 8), torch.zeros(2, 4, 6)
    cache.update_latent(hk, hv, torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]]), 0)
    assert layer.contiguous                       # each row runs p0, p0 + 1, ...
    cache.update_latent(hk[:, :1], hv[:, :1], torch.tensor([[7], [4]]), 0)
    assert layer.contiguous
    cache.update_latent(hk[:, :1], hv[:, :1], torch.tensor([[9], [5]]), 0)   # row 0 skips 8
    assert not layer.contiguous
    cache.update_latent(hk[:, :1], hv[:, :1], torch.tensor([[10], [6]]), 0)
    assert not layer.contiguous                   # once broken, stays broken
    fresh = palu.LatentCache(num_layers=1)
    fresh.update_latent(hk, hv, torch.tensor([[0, 1, 5, 6]]), 0)
    assert not fresh.layers[0].contiguous         # a gap inside the prefill


def test_contiguity_is_checked_once_per_step_for_all_layers():
    # transformers passes one position_ids tensor to every layer: one check (a host sync on a
    # GPU) serves all of them, unless a layer's positions or the tensor differ.
    cache = palu.LatentCache(num_layers=4)
    hk, hv = torch.zeros(1, 3, 8), torch.zeros(1, 3, 6)

    def step(positions, per_layer=False):
        for i in range(4):
            n = positions.shape[1]
            cache.update_latent(hk[:, :n], hv[:, :n], positions.clone() if per_layer else positions, i)
        return cache._contiguity_memo["checks"], [lay.contiguous for lay in cache.layers]

    assert step(torch.arange(3)[None]) == (1, [True] * 4)              # prefill
    assert step(torch.tensor([[3]])) == (2, [True] * 4)
    assert step(torch.tensor([[4]]), per_layer=True) == (6, [True] * 4)  # four tensors: four checks
    # the layers' histories now differ (four tensors): each checks for itself, and sees the gap
    assert step(torch.tensor([[9]])) == (10, [False] * 4)
    fresh = palu.LatentCache(num_layers=2)
    pos = torch.arange(3)[None]
    fresh.update_latent(hk, hv, pos, 0)
    pos[0, 2] = 7                                                      # written in place: a new version
    fresh.update_latent(hk, hv, pos, 1)
    assert fresh._contiguity_memo["checks"] == 2 and [lay.contiguous for lay in fresh.layers] == [True, False]
    fresh.layers[1].crop(1)                                            # positions changed outside
    assert fresh.layers[1]._history != fresh.layers[0]._history


@pytest.mark.parametrize("scaling, kernel", [
    ({"rope_type": "linear", "factor": 2.0}, True),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 4}, True),
    # (dynamic NTK and LongRoPE are refused: tests/unit/test_rope_types.py)
    # YaRN scales the attention logits as well (attention_scaling != 1): the torch path serves it
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
      "max_position_embeddings": 8192}, False)])
def test_rope_scaling_types_decode_like_the_torch_path(scaling, kernel, monkeypatch):
    # linear / llama3 fold their scaling into inv_freq, which the kernels read from the model's
    # rotary module; a short original context makes llama3's frequency bands all matter here.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    extra = {k: scaling.pop(k) for k in ("max_position_embeddings",) if k in scaling}
    base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, rope_scaling=scaling,
                                        **extra)).eval()
    model = copy.deepcopy(base)
    palu.compress(model, torch.randint(0, 97, (2, 32)), kept_ratio=0.5, group_size=1, multiple=16,
                  progress=False)
    ids = torch.randint(0, 97, (2, 7))
    set_backend(model, "torch")
    ref = _decode_logits(model, ids)
    set_backend(model, "triton")
    from palu.attention import kernel_backend
    calls = []
    real = kernel_backend.kernel_decode
    monkeypatch.setattr(kernel_backend, "kernel_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = _decode_logits(model, ids)
    assert len(calls) == (3 * 2 if kernel else 0)
    assert ((out - ref).norm() / ref.norm()).item() < 5e-3


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32)).eval()


def _decode_with(model, ids, bits, steps=3):
    """Prefill, then `steps` one-token steps fed fixed tokens (not argmax: two paths whose
    logits differ by rounding must not diverge on a near-tie)."""
    cache = palu.LatentCache(model, bits=bits)
    nxt = torch.randint(0, 97, (ids.shape[0], steps), generator=torch.Generator().manual_seed(7))
    out = [model(ids, past_key_values=cache, use_cache=True).logits[:, -1]]
    for i in range(steps):
        out.append(model(nxt[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1), cache


def test_quantised_latent_cache_degrades_in_order_and_holds_packed_bytes():
    model = _tiny_llama()
    palu.compress(model, torch.randint(0, 97, (2, 32)), kept_ratio=0.5, group_size=2, multiple=16,
                  progress=False)
    set_backend(model, "torch")
    ids = torch.randint(0, 97, (2, 9))
    ref, _ = _decode_with(model, ids, 16)
    errs = {}
    for bits in (8, 4, 2):
        out, cache = _decode_with(model, ids, bits)
        errs[bits] = ((out - ref).norm() / ref.norm()).item()
        n = cache.nbytes()
        B, T, G, rank = 2, 9 + 3, 1, 32          # one group of 2 KV heads, rank 64 * 0.5
        assert n["latents"] == 2 * 2 * B * T * rank * bits // 8        # 2 layers, K and V
        assert n["scales"] == 2 * 2 * B * T * G * 2 * 2                # fp16 scale + zero
    assert errs[8] < 0.02 and errs[8] < errs[4] < errs[2]


@pytest.mark.parametrize("bits, kept", [(8, 0.5), (4, 0.5), (2, 1.0)])
def test_kernel_path_reads_the_packed_cache_like_the_torch_path(bits, kept, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _tiny_llama(1)
    palu.compress(model, torch.randint(0, 97, (2, 32)), kept_ratio=kept, group_size=2,
                  multiple=16, progress=False)
    ids = torch.randint(0, 97, (2, 7))
    set_backend(model, "torch")
    ref, _ = _decode_with(model, ids, bits)
    set_backend(model, "triton")
    from palu.attention import kernel_backend
    calls = []
    real = kernel_backend.kernel_decode
    monkeypatch.setattr(kernel_backend, "kernel_decode",
                        lambda *a, **k: calls.append(isinstance(a[3], QuantLatent)) or real(*a, **k))
    out, _ = _decode_with(model, ids, bits)
    assert calls == [True] * (3 * 2)   # every decode step read the packed cache
    assert ((out - ref).norm() / ref.norm()).item() < 5e-3


def test_latent_cache_rejects_an_unsupported_width():
    with pytest.raises(ValueError, match="bits=5 is not one of"):
        palu.LatentCache(num_layers=1, bits=5)
    # one encoding of "unquantised" (16), as the methods and kernels write it: None is refused
    with pytest.raises(ValueError, match=r"bits=None is not one of .* \(or 16: unquantised\)"):
        palu.LatentCache(num_layers=1, bits=None)
    assert [layer.bits for layer in palu.LatentCache(num_layers=2).layers] == [16, 16]


def test_packed_cache_follows_beam_search_and_crop():
    model = _tiny_llama(2)
    palu.compress(model, torch.randint(0, 97, (2, 32)), kept_ratio=0.5, group_size=2, multiple=16,
                  progress=False)
    set_backend(model, "torch")
    ids = torch.randint(0, 97, (1, 6))
    cache = palu.LatentCache(model, bits=8)
    out = model.generate(ids, num_beams=2, max_new_tokens=3, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 9)
    layer = cache.layers[0]
    T = layer.get_seq_length()
    assert layer.key_sz.shape[:2] == layer.positions.shape == (layer.keys.shape[0], T)
    cache.crop(-2)
    assert layer.get_seq_length() == T - 2 == layer.key_sz.shape[1] == layer.positions.shape[1]


def test_head_dim_the_kernels_cannot_rotate_takes_the_torch_path(monkeypatch):
    # head_dim 96 (a multiple of 32, but halves of 48): the kernels would refuse it with an
    # error; the decode step must take the torch path instead, also when the kernels are forced
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=384, intermediate_size=96,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=4, head_dim=96)).eval()
    palu.compress(base, torch.randint(0, 97, (2, 16)), kept_ratio=0.5, group_size=1, multiple=16,
                  progress=False)
    ids = torch.randint(0, 97, (1, 5))
    set_backend(base, "torch")
    ref = _decode_logits(base, ids, steps=2)
    set_backend(base, "triton")
    from palu.attention.kernel_backend import can_use_kernel
    attn = next(m for m in base.modules() if isinstance(m, PaluAttention))
    assert "head_dim 96" in can_use_kernel(attn, torch.zeros(1, 1, 384), None)
    out = _decode_logits(base, ids, steps=2)
    assert torch.allclose(out, ref)


def test_stacked_bk_is_built_once_and_again_after_an_in_place_write():
    from types import SimpleNamespace

    from palu.attention.kernel_backend import _stacked_bk
    attn = SimpleNamespace(n_groups=2, B_k0=torch.randn(8, 4), B_k1=torch.randn(8, 4))
    first = _stacked_bk(attn)
    assert first.dtype == torch.float16 and first.shape == (2, 8, 4)
    assert _stacked_bk(attn) is first                       # reused while nothing changed
    attn.B_k1.mul_(2)                                       # e.g. load_state_dict copies in place
    again = _stacked_bk(attn)
    assert again is not first and torch.equal(again[1], attn.B_k1.half())
