"""The warp-specialised Hopper RoPE scores kernel (palu_kernels/hopper_scores.py, hopper/rope_scores.cu).

CPU: the folded-query layout the kernel reads and the sum it must compute equal q . RoPE_t(B_k h_t)
with keys rebuilt and rotated in float64; every configuration it cannot serve is named. GPU (a Hopper
only; run on the H200 with TRITON_INTERPRET=0): the kernel against that reference, against the Triton
scores kernel, and the whole decode step against `latent_decode_reference`."""
import math

import pytest
import torch

from palu_kernels import hopper_scores
from palu_kernels.hopper_scores import fold_query, folded_scores_reference, unfit
from palu_kernels.reference import latent_decode_reference, rope_keys

LOG2E = 1.4426950408889634


def _case(B=2, G=2, n_rep=1, T=200, device="cpu", seed=0, dtype=torch.float16):
    g = torch.Generator(device=device).manual_seed(seed)
    H, D, R = G * n_rep, 128, 64
    q = torch.randn(B, H, D, generator=g, device=device).to(dtype)
    hk = torch.randn(B, G, T, R, generator=g, device=device).to(dtype)
    hv = torch.randn(B, G, T, R, generator=g, device=device).to(dtype)
    bk = (torch.randn(G, D, R, generator=g, device=device) / math.sqrt(R)).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    pos0 = torch.tensor([5, 1000][:B], device=device, dtype=torch.int32)
    return q, hk, hv, bk, inv_freq, pos0


def _rebuilt_scores(q, hk, bk, inv_freq, pos0, n_rep):
    """Float64: keys = RoPE(B_k h) at positions pos0 + t, scores q . k (unscaled) [B, H, T]."""
    B, G, T, _ = hk.shape
    k = torch.einsum("bgtr,gdr->bgtd", hk.double(), bk.double())
    pos = pos0.long()[:, None] + torch.arange(T, device=hk.device)[None]
    k = rope_keys(k, pos, inv_freq.double()).double().repeat_interleave(n_rep, 1)
    return torch.einsum("bhd,bhtd->bht", q.double(), k)


@pytest.mark.parametrize("n_rep,per_warp", [(1, 16), (1, 32), (4, 16)])
def test_fold_layout_gives_rotated_key_scores(n_rep, per_warp):
    q, hk, _, bk, inv_freq, pos0 = _case(n_rep=n_rep)
    fold = fold_query(q, bk, n_rep, per_warp)
    assert fold.shape == (2, 2 * n_rep, 64 // per_warp, 2 * per_warp, 64) and fold.dtype == torch.float16
    got = folded_scores_reference(fold, hk, pos0, inv_freq)
    want = _rebuilt_scores(q, hk, bk, inv_freq, pos0, n_rep)
    # the only difference is the fold's one fp16 rounding (~2.4e-4 relative per element)
    assert ((got - want).norm() / want.norm()).item() < 2e-3


def test_fold_permutation_matters():
    """A swapped half or a and c exchanged is caught by the comparison above."""
    q, hk, _, bk, inv_freq, pos0 = _case()
    want = _rebuilt_scores(q, hk, bk, inv_freq, pos0, 1)
    fold = fold_query(q, bk, 1)
    w = fold.shape[3] // 2
    for bad in (fold.flip(2), torch.cat([fold[:, :, :, w:], fold[:, :, :, :w]], 3)):
        got = folded_scores_reference(bad.contiguous(), hk, pos0, inv_freq)
        assert ((got - want).norm() / want.norm()).item() > 0.5


def test_unfit_names_each_reason():
    q, hk, _, bk, _, _ = _case()
    kw = dict(n_rep=1, group_size=1, contiguous_positions=True)
    assert "not a RoPE layer" in unfit(q, hk, None, **kw)
    assert "not fp16" in unfit(q, hk.float(), bk, **kw)
    assert "M-LRD rank 64" in unfit(q, hk[..., :32], bk, **kw)
    assert "M-LRD rank 64" in unfit(q, hk, bk, **{**kw, "group_size": 2})
    assert "3 query heads" in unfit(q, hk, bk, **{**kw, "n_rep": 3})
    assert "5 stages" in unfit(q, hk, bk, **kw, stages=5)
    assert "not contiguous" in unfit(q, hk, bk, **{**kw, "contiguous_positions": False})
    assert "16-byte aligned" in unfit(q, hk.transpose(2, 3).contiguous().transpose(2, 3), bk, **kw)
    if not torch.cuda.is_available():
        assert unfit(q, hk, bk, **kw) == "no CUDA device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is present")
def test_decode_refuses_without_hopper():
    from palu_kernels.palu_decode import palu_decode
    q, hk, hv, bk, inv_freq, pos0 = _case()
    with pytest.raises(ValueError, match="Hopper RoPE scores kernel cannot serve this step: no CUDA device"):
        palu_decode(q, hk, hv, scale=0.1, n_rep=1, group_size=1, bk=bk, inv_freq=inv_freq,
                    position_offset=pos0, hopper=True)
    with pytest.raises(ValueError, match="not a RoPE layer"):
        palu_decode(q[..., :64], hk, hv, scale=0.1, n_rep=1, group_size=1, hopper=True)


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the kernel runs on Hopper GPUs only")


@needs_hopper
@pytest.mark.parametrize("n_rep,per_warp,stages,reduce,T,strided", [
    (1, 16, 4, 0, 4096 + 37, False), (1, 16, 2, 0, 1000, True), (1, 16, 6, 0, 64, False),
    (1, 32, 4, 0, 3000, False), (4, 16, 4, 0, 3000, False), (4, 16, 4, 0, 129, True), (4, 32, 4, 0, 777, False),
    (1, 16, 4, 1, 4096 + 37, True), (4, 16, 4, 1, 3000, False)])
def test_kernel_matches_references(n_rep, per_warp, stages, reduce, T, strided):
    from palu_kernels.palu_decode import palu_decode
    q, hk, hv, bk, inv_freq, pos0 = _case(B=2, G=3, n_rep=n_rep, T=T, device="cuda")
    if strided:   # a slice of a larger cache buffer: rows 16-byte aligned, token stride > rank
        big = torch.zeros(2, 3, T + 100, 64, device="cuda", dtype=torch.float16)
        big[:, :, :T] = hk
        hk = big[:, :, :T]
    lengths = torch.tensor([T, max(1, T - 77)], device="cuda", dtype=torch.int32)
    scale = 1 / math.sqrt(128)
    assert hopper_scores.unfit(q, hk, bk, n_rep=n_rep, group_size=1, contiguous_positions=True) is None
    S = hopper_scores.rope_scores(q, hk, bk, pos0, inv_freq, lengths, scale * LOG2E, n_rep, stages=stages,
                                  per_warp=per_warp, reduce=reduce)
    assert {tuple(v) for v in hopper_scores._module().variants()} == hopper_scores.VARIANTS
    want = _rebuilt_scores(q, hk, bk, inv_freq, pos0, n_rep) * scale * LOG2E
    fold_ref = folded_scores_reference(fold_query(q, bk, n_rep), hk, pos0, inv_freq) * scale * LOG2E
    for b in range(2):
        n = int(lengths[b])
        got = S[b, :, :n].double()
        assert ((got - fold_ref[b, :, :n]).norm() / fold_ref[b, :, :n].norm()).item() < 1e-4
        assert ((got - want[b, :, :n]).norm() / want[b, :, :n].norm()).item() < 2e-3
    kw = dict(scale=scale, n_rep=n_rep, group_size=1, bk=bk, inv_freq=inv_freq, position_offset=pos0,
              lengths=lengths)
    z = palu_decode(q, hk, hv, **kw, hopper=True)
    z_triton = palu_decode(q, hk, hv, **kw)
    ref = latent_decode_reference(q, hk, hv, **kw)
    assert ((z - ref).norm() / ref.norm()).item() < 5e-3
    assert ((z - z_triton).norm() / ref.norm()).item() < 5e-3


def test_rank_order_view_is_the_documented_permutation():
    from palu_kernels.hopper_scores import RANK_ORDER, _kernel_rank_order
    assert sorted(RANK_ORDER) == list(range(64))
    x = torch.randn(3, 2, 64)
    assert torch.equal(_kernel_rank_order(x), x[..., RANK_ORDER])
