"""Fused decoder elementwise kernels (Triton interpreter on CPU) against the torch expressions
they replace."""
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")

from palu_kernels.fused_ops import add_rms_norm, silu_mul  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [96, 100])          # a power of two and not: the tail is masked
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype, n, with_delta):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, n, generator=g) * 3).to(dtype).to(DEV)
    d = torch.randn(3, n, generator=g).to(dtype).to(DEV) if with_delta else None
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEV)
    xo, h = add_rms_norm(x, d, w, 1e-5)
    ref_x = x + d if with_delta else x
    if dtype == torch.float16:
        assert torch.equal(xo, ref_x)                                 # the residual sum, rounded alike
    else:   # the interpreter rounds float32 -> bf16 by truncation (a GPU to nearest): 1 ulp
        assert torch.allclose(xo.float(), ref_x.float(), rtol=2 ** -7, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert torch.allclose(h.float(), _rms_norm(ref_x, w, 1e-5).float(), rtol=tol, atol=tol)


def test_add_rms_norm_names_bad_shapes():
    x = torch.zeros(2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight \(7,\)"):
        add_rms_norm(x, None, torch.ones(7, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match=r"delta \(2, 4\)"):
        add_rms_norm(x, torch.zeros(2, 4, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-5)


@pytest.mark.parametrize("n", [64, 1500])          # one block, and several with a masked tail
def test_silu_mul_matches_torch(n):
    gu = (torch.randn(2, 2 * n, generator=torch.Generator().manual_seed(n)) * 4).half().to(DEV)
    gate, up = gu.chunk(2, -1)
    ref = F.silu(gate) * up
    out = silu_mul(gu)
    assert out.shape == ref.shape
    assert torch.allclose(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="7 is not"):
        silu_mul(torch.zeros(2, 7, dtype=torch.float16))


# ---- the library's fused layers (palu.models.fused_layers) ----------------------------------

def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


@pytest.mark.parametrize("n", [576, 100])           # SmolLM2's width, and a masked tail
def test_rms_norm_rows_matches_llama_rms_norm(n):
    from palu_kernels.fused_ops import rms_norm_rows
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 37, n, generator=g) * 3).half().to(DEV)     # 111 rows: a partial last program
    w = (1 + 0.1 * torch.randn(n, generator=g)).half().to(DEV)
    out = rms_norm_rows(x, w, 1e-5)
    ref = _rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype
    # the sum of squares is reduced in another order: at most one fp16 rounding step apart
    assert torch.allclose(out.float(), ref.float(), rtol=2 ** -10, atol=1e-4)
    assert (out != ref).float().mean() < 0.01
    with pytest.raises(ValueError, match="weight"):
        rms_norm_rows(x, w.float(), 1e-5)


def test_silu_times_matches_torch():
    from palu_kernels.fused_ops import silu_times
    g = torch.Generator().manual_seed(1)
    gate, up = ((torch.randn(2, 5, 1500, generator=g) * 4).half().to(DEV) for _ in range(2))
    out = silu_times(gate, up)
    assert torch.allclose(out.float(), (F.silu(gate) * up).float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="up"):
        silu_times(gate, up[..., :7])


@pytest.mark.parametrize("rows_of_cos", [1, 2])
def test_rope_is_transformers_rotation_bit_for_bit(rows_of_cos):
    from palu_kernels.fused_ops import rope
    g = torch.Generator().manual_seed(rows_of_cos)
    B, T, H, D = 2, 5, 3, 16
    # as LlamaAttention makes them: a projection's (B, T, H, D) viewed as (B, H, T, D)
    x = (torch.randn(B, T, H, D, generator=g) * 2).half().to(DEV).transpose(1, 2)
    angles = torch.randn(rows_of_cos, T, D // 2, generator=g) * 3
    cos, sin = (torch.cat([f(angles)] * 2, -1).half().to(DEV) for f in (torch.cos, torch.sin))
    out = rope(x, cos, sin)
    ref = x * cos[:, None] + _rotate_half(x) * sin[:, None]
    assert out.shape == ref.shape and out.stride() == x.stride()
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="cos"):
        rope(x, cos[:, :2], sin[:, :2])
