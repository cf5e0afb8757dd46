"""The dense decode kernel (`palu_kernels.dense_decode`, the CUDA-graph FP16 path's attention) vs
attention in float64 on the same mask: each row's prompt slots, its pad slots closed, the answer
slots written so far open. Runs on CPU through the Triton interpreter."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from palu_kernels.dense_decode import dense_decode  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _case(B=3, Hkv=2, G=3, L=300, D=32, width=200, written=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv, G, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    lengths = torch.tensor([width, width - 61, 5][:B])
    slots = torch.arange(L)
    mask = (slots < lengths[:, None]) | ((slots >= width) & (slots < width + written))
    return [t.to(dtype).to(DEV) for t in (q, k, v)] + [mask[:, None, None].to(DEV)]


def _reference(q, k, v, mask, scale):
    q, k, v = (t.double().cpu() for t in (q, k, v))
    s = torch.einsum("bhgd,bhnd->bhgn", q, k) * scale
    s = s.masked_fill(~mask.cpu()[:, :, 0][:, :, None, :].expand_as(s), float("-inf"))
    return torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("chunk", [64, 256])
def test_equals_masked_attention(dtype, tol, chunk):
    q, k, v, mask = _case(dtype=dtype)
    out = dense_decode(q, k, v, mask, scale=0.25, chunk=chunk)
    ref = _reference(q, k, v, mask, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.double().cpu() - ref).abs().max().item() < tol


def test_closed_slots_are_never_read():
    q, k, v, mask = _case()
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, 0, 0][:, None, :].expand(-1, k.shape[1], -1)] = float("nan")   # poison every closed slot
    v2[~mask[:, 0, 0][:, None, :].expand(-1, v.shape[1], -1)] = float("nan")
    out = dense_decode(q, k2, v2, mask, scale=0.25, chunk=64)
    assert torch.isfinite(out).all()
    assert (out - dense_decode(q, k, v, mask, scale=0.25, chunk=64)).abs().max().item() == 0


def test_refuses_a_mask_of_another_shape():
    q, k, v, mask = _case()
    with pytest.raises(ValueError, match="mask must be bool"):
        dense_decode(q, k, v, mask.float(), scale=0.25)
