"""The KIVI peer kernel against its float32 reference; runs on CPU through the Triton interpreter."""
import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from palu_kernels.kivi import kivi_decode, kivi_decode_reference, kivi_dequantize, kivi_nbytes, kivi_pack  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"   # see test_palu_decode


def _case(B, KVH, n_rep, T, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, KVH * n_rep, D, generator=g).half().to(DEV)
    # keys with per-channel outliers (KIVI's reason for per-channel key groups)
    k = (torch.randn(B, KVH, T, D, generator=g) * (1 + 4 * (torch.arange(D) % 37 == 0))).half().to(DEV)
    v = torch.randn(B, KVH, T, D, generator=g).half().to(DEV)
    return q, k, v


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("B, KVH, n_rep, T, residual, splits", [(1, 2, 1, 200, 32, 3), (2, 1, 4, 96, 0, 2),
                                                                 (1, 1, 2, 40, 128, None)])
def test_kernel_matches_the_dequantised_reference(bits, B, KVH, n_rep, T, residual, splits):
    q, k, v = _case(B, KVH, n_rep, T)
    cache = kivi_pack(k, v, bits, group_k=32, group_v=32, residual=residual)
    ref = kivi_decode_reference(q, cache, scale=1 / math.sqrt(128))
    out = kivi_decode(q, cache, splits=splits)
    assert _rel(kivi_decode(q, cache, splits=splits, num_warps=4), ref) < 3e-3   # launch variants agree
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 3e-3, _rel(out, ref)   # fp16 dot operands, fp32 accumulation


def test_the_cache_is_kivi_quantised_and_counted_as_stored():
    q, k, v = _case(1, 2, 1, 200)
    cache = kivi_pack(k, v, 2, residual=32)
    assert cache["k_data"].shape[2] == 160 and cache["k_res"].shape[2] == 40   # whole key groups
    kd, vd = kivi_dequantize(cache)
    # the exact window is exact, the rest is really 2-bit (error well above fp16 rounding)
    assert torch.equal(kd[:, :, 160:].half(), k[:, :, 160:]) and torch.equal(vd[:, :, 160:].half(), v[:, :, 160:])
    assert 0.05 < _rel(kd[:, :, :160], k[:, :, :160]) < 0.6
    # per-channel key scales: an outlier channel does not widen the other channels' steps
    assert cache["k_scale"][0, 0, 0, 0] > 3 * cache["k_scale"][0, 0, 0, 1]
    T, D, H = 200, 128, 2
    packed = H * 160 * D * 2 / 8 * 2                       # keys + values, 2 bits
    meta = H * (160 // 32) * D * 2 * 2 + H * 160 * (D // 32) * 2 * 2
    assert kivi_nbytes(cache) == packed + meta + H * 40 * D * 2 * 2
    # the kernel reads that cache, not the fp16 K/V: poisoning them changes nothing
    out = kivi_decode(q, cache)
    k.fill_(float("nan"))
    assert torch.equal(kivi_decode(q, cache), out)


def test_bad_caches_are_refused():
    q, k, v = _case(1, 1, 1, 64)
    with pytest.raises(ValueError, match="bits=3"):
        kivi_pack(k, v, 3)
    cache = kivi_pack(k, v, 4, residual=0)
    with pytest.raises(ValueError, match="query shape"):
        kivi_decode(q[:, :, :32], cache)
    with pytest.raises(ValueError, match="value group 64"):   # 2-bit parts of 32 channels
        kivi_decode(q, kivi_pack(k, v, 2, group_v=64, residual=0))
