"""palu.models.fused_layers: a model's norms, MLPs and RoPE through the fused kernels (here the
Triton interpreter on CPU, `force=True`) answer as the model's own forwards, only where the family
computes those expressions, and leaving the context restores every module."""
import importlib
import inspect
import os
import re

import pytest
import torch

from palu.models import fused_layers as fl
from tests.tiny import FAMILIES


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("family,swaps", [("llama", 2 * 2 + 1 + 2 + 1), ("qwen2", 8), ("qwen3", 8 + 2 * 2),
                                          ("gemma3", 0), ("olmo2", 0), ("phi3", 0)])
def test_fused_layers_answer_as_the_models_own(monkeypatch, family, swaps):
    pytest.importorskip("palu_kernels.fused_ops")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = FAMILIES[family](seed=3).half()
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    forwards = {id(m): m.forward for m in model.modules()}
    with fl.fused_layers(model, force=True) as n:
        assert n == swaps    # norms (2 a layer + the last; Qwen3's q/k norms), MLPs, one RoPE function
        fused = _logits(model, ids)
    assert torch.allclose(fused, before, rtol=0, atol=2e-2 * before.abs().max().item())
    assert all(not hasattr(m, fl._MARK) and m.__dict__.get("forward") is None for m in model.modules())
    assert {id(m): m.forward for m in model.modules()}.keys() == forwards.keys()
    for name in fl.ROPE_MODULES:
        assert not getattr(importlib.import_module(name).apply_rotary_pos_emb, fl._MARK, False)
    assert torch.equal(_logits(model, ids), before)


def test_nothing_is_fused_off_the_gpu_or_when_switched_off(monkeypatch):
    model = FAMILIES["llama"](seed=0)
    assert fl.unsupported(model).startswith("dtype torch.float32")    # float32 keeps torch's layers
    model.to(torch.float16)
    assert fl.unsupported(model) == "not on a GPU"
    with fl.fused_layers(model) as n:
        assert n == 0
    assert fl.unsupported(None) == "no parameters (not a torch model)"     # a test's stand-in model
    with fl.fused_layers(None) as n:
        assert n == 0
    monkeypatch.setenv("PALU_FUSED_OPS", "0")
    assert fl.unsupported(model) == "PALU_FUSED_OPS=0"
    monkeypatch.setenv("PALU_FUSED_OPS", "yes")
    with pytest.raises(ValueError, match="PALU_FUSED_OPS='yes'"):
        fl.enabled()


def test_the_whitelisted_families_compute_llamas_expressions():
    # a transformers upgrade that changes one family's norm, MLP or rotation must drop it from the lists
    def src(obj):
        return re.sub(r'""".*?"""', "", inspect.getsource(obj), flags=re.S)
    ref = importlib.import_module("transformers.models.llama.modeling_llama")
    for name in fl.ROPE_MODULES:
        mod = importlib.import_module(name)
        prefix = next(c[:-len("RMSNorm")] for c in fl.NORMS if hasattr(mod, c))
        assert src(getattr(mod, prefix + "RMSNorm").forward) == src(ref.LlamaRMSNorm.forward)
        assert src(getattr(mod, prefix + "MLP").forward) == src(ref.LlamaMLP.forward)
        assert src(mod.apply_rotary_pos_emb) == src(ref.apply_rotary_pos_emb)
        assert src(mod.rotate_half) == src(ref.rotate_half)


def test_a_nested_context_swaps_nothing_twice(monkeypatch):
    pytest.importorskip("palu_kernels.fused_ops")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = FAMILIES["llama"](seed=0).half()
    with fl.fused_layers(model, force=True) as outer:
        with fl.fused_layers(model, force=True) as inner:
            assert outer > 0 and inner == 0
        assert all(getattr(m, fl._MARK, False) for m in model.modules() if type(m).__name__ in fl.NORMS)
    assert not any(hasattr(m, fl._MARK) for m in model.modules())
    assert os.environ.get("PALU_FUSED_OPS") is None


def test_answer_batches_runs_fused_and_answers_alike(monkeypatch):
    pytest.importorskip("palu_kernels.fused_ops")
    from palu.eval.generation import answer_batches
    from tests.tiny import PROMPTS, tiny_tokenizer
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = FAMILIES["llama"](seed=5).half()
    model.generation_config.eos_token_id = None
    tok = tiny_tokenizer()
    plain = answer_batches(model, tok, None, PROMPTS, 6, batch_size=3)
    seen = []
    real = fl.fused_layers

    def spy(m, force=False):
        seen.append(m)
        return real(m, force=True)
    monkeypatch.setattr("palu.eval.generation.fused_layers", spy)
    assert answer_batches(model, tok, None, PROMPTS, 6, batch_size=3) == plain
    assert seen == [model]


def test_palus_own_rotation_runs_fused_and_answers_alike(monkeypatch, tiny_base, tiny_palu_checkpoint):
    # Palu's attention rotates its queries and rebuilt keys itself (palu.attention.rope): inside the
    # context the fused kernel does it, bit for bit, and leaving the context hands it back to torch
    import copy

    pytest.importorskip("palu_kernels.fused_ops")
    from palu.attention import rope
    from palu.methods import build_method
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    method = build_method({"name": "palu", "checkpoint": tiny_palu_checkpoint})
    model = copy.deepcopy(tiny_base)
    method.install(model)
    model.half()
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids)
    calls = []
    with fl.fused_layers(model, force=True) as n:
        assert rope.kernel is not None and n == 5 + 2 + 2    # norms, MLPs, Llama's and Palu's rotations
        real = rope.kernel
        monkeypatch.setattr(rope, "kernel", lambda *a: calls.append(1) or real(*a))
        fused = _logits(model, ids)
        monkeypatch.setattr(rope, "kernel", real)
    assert calls and rope.kernel is None
    assert torch.allclose(fused, before, rtol=0, atol=2e-2 * before.abs().max().item())


def test_a_rotation_the_kernel_does_not_take_falls_back_to_torch(monkeypatch):
    pytest.importorskip("palu_kernels.fused_ops")
    from palu.attention import rope
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    model = FAMILIES["llama"](seed=0).half()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 5, 16, generator=g).half() for h in (4, 2))
    cos, sin = (torch.randn(2, 5, 16, generator=g).half() for _ in range(2))
    expect = llama.apply_rotary_pos_emb(q, k, cos, sin)
    partial = (cos[..., :8], sin[..., :8])          # partial rotary (Phi-3's kind): torch's path
    with fl.fused_layers(model, force=True):
        assert getattr(llama.apply_rotary_pos_emb, fl._MARK)
        got = llama.apply_rotary_pos_emb(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, expect))
        with pytest.raises(RuntimeError):            # a cos of another length: torch's own error, not the kernel's
            llama.apply_rotary_pos_emb(q, k, cos[:, :3], sin[:, :3])
        rope.kernel = fl._palu_rope(importlib.import_module("palu_kernels.fused_ops"))
        try:
            assert torch.equal(rope.apply_rope(q, *partial), torch.cat(
                [q[..., :8] * partial[0][:, None] + rope.rotate_half(q[..., :8]) * partial[1][:, None], q[..., 8:]], -1))
        finally:
            rope.kernel = None
