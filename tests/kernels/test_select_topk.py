"""The fused scoring and radix top-k kernels of latent selection (palu_kernels/select_topk.py)
against torch: the sketch scores of `fold_query` + `sketch_scores`, and the k largest scores of
`torch.topk` (the same multiset of values; ties broken by position). On CPU through the Triton
interpreter; on a GPU with TRITON_INTERPRET=0 the compiled kernels."""
import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from palu_kernels.latent_select import fold_query, rotate_query, selection_decode, sketch_scores  # noqa: E402
from palu_kernels.select_topk import radix_topk, sketch_scores_fused  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _order(b: int) -> int:
    """An fp16's int16 bits -> its rank among fp16 values (as the kernel's order key)."""
    u = b & 0xFFFF
    return 0xFFFF - u if u >= 0x8000 else u + 0x8000


def _check_topk(scores, tokens, window, block):
    B, G, T = scores.shape
    older = T - window
    idx = radix_topk(scores.to(DEV), tokens, window, min_block=block, max_chunks=4).cpu()
    assert torch.equal(idx, radix_topk(scores.to(DEV), tokens, window, min_block=block, max_chunks=4,
                                       atomic=True).cpu())      # the same positions, either histogram
    assert idx.shape == (B, G, tokens + window) and idx.dtype == torch.int64
    chosen, recent = idx[..., :tokens], idx[..., tokens:]
    assert torch.equal(recent, torch.arange(older, T).expand(B, G, window))
    assert (chosen >= 0).all() and (chosen < older).all()
    assert all(len(set(r.tolist())) == tokens for r in chosen.reshape(-1, tokens))
    s = scores[..., :older].float()
    got = s.gather(-1, chosen).sort(-1).values
    want = s.topk(tokens, -1).values.sort(-1).values
    assert torch.equal(got, want)                      # the k largest values, ties included
    # ties at the threshold: the lowest positions among the equal scores (equal bits: the kernel
    # orders -0 below +0, which the float comparison calls equal)
    bits = scores[..., :older].view(torch.int16).reshape(-1, older)
    for r in range(B * G):
        row, pick = bits[r], chosen.reshape(-1, tokens)[r]
        t = min(row[pick].tolist(), key=_order)                           # the smallest chosen
        eq_chosen = sorted(p for p in pick.tolist() if row[p] == t)
        eq_all = (row == t).nonzero().flatten().tolist()
        assert eq_chosen == eq_all[:len(eq_chosen)]


@pytest.mark.parametrize("tokens, window, block", [(1, 0, 64), (17, 8, 64), (100, 32, 128), (261, 3, 4096)])
def test_radix_topk_chooses_the_largest_scores(tokens, window, block):
    g = torch.Generator().manual_seed(tokens)
    scores = (torch.randn(2, 3, 300, generator=g) * 3).half()
    _check_topk(scores, tokens, window, block)


def test_radix_topk_with_many_ties_signed_zeros_and_infinities():
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(-3, 4, (1, 2, 257), generator=g).half()       # 7 distinct values
    scores[0, 0, 10], scores[0, 0, 11] = float("inf"), float("-inf")
    scores[0, 1, :50] = -0.0
    for tokens in (1, 40, 120, 250):
        _check_topk(scores, tokens, 5, 64)
    _check_topk(scores, 257, 0, 64)                                      # every token


def test_fused_sketch_scores_equal_the_torch_fold_and_matmul():
    g = torch.Generator().manual_seed(0)
    for n_rep, s, T in ((1, 16, 300), (4, 32, 129)):
        B, G, D, R = 2, 2, 32, 64
        q = torch.randn(B, G * n_rep, D, generator=g).half()
        bk = (torch.randn(G, D, R, generator=g) / math.sqrt(R)).half()
        hk = torch.randn(B, G, T, R, generator=g).half()
        ref = sketch_scores(fold_query(q.float(), bk.float(), n_rep).half().float(), hk[..., :s].float())
        for sk in (hk[..., :s], hk[..., :s].contiguous()):                # read in place, or stored
            out = sketch_scores_fused(q.to(DEV), bk.to(DEV), sk.to(DEV), n_rep, block_t=64).cpu()
            assert out.dtype == torch.float16 and out.shape == (B, G, T)
            # the same fp16 numbers up to the order of the 16-32-term fp32 sum (one rounding step)
            assert torch.allclose(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_the_scoring_kernels_histogram_is_the_radix_selects_first_pass():
    g = torch.Generator().manual_seed(7)
    B, G, n_rep, T, D, R, window = 1, 3, 1, 700, 32, 32, 20
    q = torch.randn(B, G * n_rep, D, generator=g).half()
    bk = (torch.randn(G, D, R, generator=g) / math.sqrt(R)).half()
    hk = torch.randn(B, G, T, R, generator=g).half()
    scores, hist = sketch_scores_fused(q.to(DEV), bk.to(DEV), hk[..., :16].to(DEV), n_rep, block_t=128,
                                       window=window)
    bits = scores[..., :T - window].cpu().view(torch.int16).long() & 0xFFFF
    keys = torch.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)
    want = torch.stack([torch.bincount(r >> 8, minlength=256) for r in keys.reshape(-1, T - window)])
    assert torch.equal(hist.cpu().reshape(-1, 256).long(), want)
    for tokens in (1, 50, T - window):
        a = radix_topk(scores, tokens, window, hist=hist, min_block=64).cpu()
        b = radix_topk(scores, tokens, window, min_block=256).cpu()
        assert torch.equal(a, b)


def test_the_radix_step_equals_the_plain_step():
    g = torch.Generator().manual_seed(3)
    B, G, n_rep, T, R, D = 1, 2, 2, 200, 16, 32
    q = torch.randn(B, G * n_rep, D, generator=g).half()
    hk = torch.randn(B, G, T, R, generator=g).half()
    hv = torch.randn(B, G, T, R, generator=g).half()
    bk = (torch.randn(G, D, R, generator=g) / math.sqrt(R)).half()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    q_rot = rotate_query(q.float(), T, inv_freq).half()
    kw = dict(tokens=24, window=8, sketch=16, scale=1 / math.sqrt(D), n_rep=n_rep)
    args = [t.to(DEV) for t in (q, q_rot, hk, hv, bk, inv_freq)]
    plain = selection_decode(*args, **kw).cpu()
    radix = selection_decode(*args, topk="radix", **kw).cpu()
    fused = selection_decode(*args, topk="radix", fused=True, **kw).cpu()
    assert ((radix - plain).norm() / plain.norm()).item() < 2e-3
    assert ((fused - plain).norm() / plain.norm()).item() < 5e-3


def test_bad_inputs_are_refused():
    s = torch.randn(1, 1, 64).half()
    with pytest.raises(ValueError, match="orders fp16 scores, not torch.float32"):
        radix_topk(s.float(), 4, 8)
    with pytest.raises(ValueError, match="tokens=57, window=8"):
        radix_topk(s, 57, 8)
    with pytest.raises(ValueError, match="tokens=4, window=-1"):
        radix_topk(s, 4, -1)
    with pytest.raises(ValueError, match=r"hist must be \[B, G, 256\] int32 counts, not \(1, 1, 128\)"):
        radix_topk(s, 4, 8, hist=torch.zeros(1, 1, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="scores fp16 latents, not torch.float32"):
        sketch_scores_fused(torch.randn(1, 2, 32), torch.randn(2, 32, 16), torch.randn(1, 2, 10, 16), 1)
    with pytest.raises(ValueError, match="sketch channels 12 must be a power of two"):
        sketch_scores_fused(torch.randn(1, 2, 32).half(), torch.randn(2, 32, 16).half(),
                            torch.randn(1, 2, 10, 12).half(), 1)
    with pytest.raises(ValueError, match="last dimension contiguous"):
        sketch_scores_fused(torch.randn(1, 2, 32).half(), torch.randn(2, 32, 16).half(),
                            torch.randn(1, 2, 16, 10).half().transpose(-1, -2), 1)


def test_radix_topk_over_chunks_too_long_for_the_packed_scan():
    """Chunks of more than 32768 tokens rank their chosen keys with two scans (the packed one would
    carry between its 16-bit fields): the same k largest, ties lowest position first."""
    g = torch.Generator().manual_seed(11)
    scores = torch.randint(-20, 20, (1, 1, 70000), generator=g).half()   # many ties at the threshold
    _check_topk(scores, 3000, 10, 65536)
