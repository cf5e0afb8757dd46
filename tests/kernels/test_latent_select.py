"""The latent-space selection decode step the GPU benchmark times (palu_kernels/latent_select.py)
against plain float64 references: every token chosen = dense latent attention; a subset = the
dense attention masked to the tokens a float64 sketch score ranks highest."""
import math

import pytest
import torch

from palu_kernels.latent_select import rotate_query, select_tokens, selection_decode
from palu_kernels.reference import latent_decode_reference, rope_keys


def _case(B=2, G=3, n_rep=2, T=96, R=8, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, G * n_rep, D, generator=g, dtype=torch.float64)
    hk = torch.randn(B, G, T, R, generator=g, dtype=torch.float64)
    hv = torch.randn(B, G, T, R, generator=g, dtype=torch.float64)
    bk = torch.randn(G, D, R, generator=g, dtype=torch.float64) / math.sqrt(R)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    return q, hk, hv, bk, inv_freq


def _masked_reference(q, hk, hv, bk, inv_freq, tokens, window, sketch, n_rep):
    """Float64: score = Σ_heads-of-group (B_kᵀ q)[:sketch]·h[:sketch]; attention over every
    token, logits of the unchosen set to -inf."""
    B, G, T, R = hk.shape
    D = q.shape[-1]
    qg = q.view(B, G, n_rep, D)
    q_lat = torch.einsum("bgid,gdr->bgr", qg, bk)
    score = torch.einsum("bgr,bgtr->bgt", q_lat[..., :sketch], hk[..., :sketch])
    keep = torch.zeros(B, G, T, dtype=torch.bool)
    keep[..., T - window:] = True
    keep.scatter_(-1, score[..., :T - window].topk(tokens, -1).indices, True)
    k = rope_keys(torch.einsum("bgtr,gdr->bgtd", hk, bk), torch.arange(T).expand(B, T), inv_freq).double()
    q_rot = rotate_query(q, T, inv_freq).double().view(B, G, n_rep, D)
    logits = torch.einsum("bgid,bgtd->bgit", q_rot, k) / math.sqrt(D)
    p = logits.masked_fill(~keep[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bgit,bgtr->bgir", p, hv).reshape(B, G * n_rep, R)


@pytest.mark.parametrize("sketch", [3, 8])
@pytest.mark.parametrize("topk", ["plain", "chunked"])
def test_selection_equals_masked_dense_attention(sketch, topk):
    q, hk, hv, bk, inv_freq = _case()
    T = hk.shape[2]
    q_rot = rotate_query(q, T, inv_freq)
    out = selection_decode(q, q_rot, hk, hv, bk, inv_freq, tokens=12, window=8, sketch=sketch,
                           scale=1 / math.sqrt(q.shape[-1]), n_rep=2, topk=topk)
    ref = _masked_reference(q, hk, hv, bk, inv_freq, 12, 8, sketch, 2)
    assert torch.allclose(out.double(), ref, atol=1e-6, rtol=1e-6)


def test_the_sdpa_attend_path_equals_the_float32_one():
    from palu_kernels.latent_select import rope_table
    q, hk, hv, bk, inv_freq = _case()
    T = hk.shape[2]
    q_rot = rotate_query(q, T, inv_freq)
    kw = dict(tokens=12, window=8, sketch=4, scale=1 / math.sqrt(q.shape[-1]), n_rep=2)
    a = selection_decode(q, q_rot, hk, hv, bk, inv_freq, **kw)
    b = selection_decode(q, q_rot, hk, hv, bk, inv_freq, table=rope_table(T, inv_freq, torch.float64), **kw)
    assert torch.allclose(a.double(), b.double(), atol=1e-6)


def test_every_token_chosen_is_the_dense_latent_attention():
    q, hk, hv, bk, inv_freq = _case()
    B, G, T, R = hk.shape
    q_rot = rotate_query(q, T, inv_freq)
    out = selection_decode(q, q_rot, hk, hv, bk, inv_freq, tokens=T - 4, window=4, sketch=2,
                           scale=1 / math.sqrt(q.shape[-1]), n_rep=2)
    ref = latent_decode_reference(q_rot, hk, hv, scale=1 / math.sqrt(q.shape[-1]), n_rep=2, group_size=1,
                                  bk=bk, position_offset=torch.zeros(B), inv_freq=inv_freq)
    assert torch.allclose(out.double(), ref.double(), atol=1e-5)


def test_chunked_topk_chooses_the_same_tokens_and_falls_back_when_it_cannot_chunk():
    scores = torch.randn(2, 3, 8192 * 2 + 32, generator=torch.Generator().manual_seed(1))
    for tokens in (1, 100, 8192):
        a = select_tokens(scores, tokens, 32, "plain").sort(-1).values
        b = select_tokens(scores, tokens, 32, "chunked").sort(-1).values
        assert torch.equal(a, b)
    odd = torch.randn(1, 1, 1000)          # 968 older tokens: no whole 8192-token chunks
    assert torch.equal(select_tokens(odd, 10, 32, "chunked").sort(-1).values,
                       select_tokens(odd, 10, 32, "plain").sort(-1).values)


def test_bad_settings_are_refused():
    scores = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="tokens=40 exceeds the 32 tokens"):
        select_tokens(scores, 40, 32)
    with pytest.raises(ValueError, match="topk='heap'"):
        select_tokens(scores, 4, 32, "heap")


@pytest.mark.parametrize("n_rep, n", [(1, 40), (4, 37)])
def test_the_fused_attend_kernel_equals_the_torch_attend(n_rep, n):
    """palu_kernels.select_attend (Triton; the interpreter on CPU, the compiled kernel on a GPU
    with TRITON_INTERPRET=0) against `attend_selected` on the same chosen tokens."""
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from palu_kernels.latent_select import attend_selected
    from palu_kernels.select_attend import select_attend
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
    B, G, T, R, D = 2, 2, 96, 16, 32
    g = torch.Generator().manual_seed(n)
    q_rot = torch.randn(B, G * n_rep, D, generator=g).half().to(dev)
    hk = torch.randn(B, G, T, R, generator=g).half().to(dev)
    hv = torch.randn(B, G, T, R, generator=g).half().to(dev)
    bk = (torch.randn(G, D, R, generator=g) / math.sqrt(R)).half().to(dev)
    idx = torch.stack([torch.randperm(T, generator=g)[:n].sort().values for _ in range(B * G)]).view(B, G, n).to(dev)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(dev)
    ref = attend_selected(q_rot, hk, hv, bk, idx, inv_freq, 1 / math.sqrt(D), n_rep)
    for splits, early_v, torch_merge in ((1, False, False), (3, False, False), (3, True, False), (3, False, True)):
        out = select_attend(q_rot, hk, hv, bk, idx, inv_freq, 1 / math.sqrt(D), n_rep, splits=splits, block_n=16,
                            early_v=early_v, torch_merge=torch_merge)
        assert out.shape == ref.shape
        assert ((out - ref).norm() / ref.norm()).item() < 2e-3, (splits, early_v, torch_merge)


def test_the_latency_grid_reads_fused_attend_settings_and_refuses_bad_ones():
    """selection_bench's `attend=[fused:16:32:2:ev]` entries reach `select_attend` as these options."""
    from palu_bench.selection_latency import parse_fused
    assert parse_fused("fused") == (None, {})
    assert parse_fused("sdpa") == (None, {})
    assert parse_fused("fused:16") == (16, {})
    assert parse_fused("fused:auto:32:2") == (None, {"block_n": 32, "num_warps": 2, "early_v": False})
    assert parse_fused("fused:8:64:4:ev") == (8, {"block_n": 64, "num_warps": 4, "early_v": True})
    for bad in ("fused:8:64", "fused:8:64:4:xx", "fused:8:64:4:ev:1"):
        with pytest.raises(ValueError, match="expected fused"):
            parse_fused(bad)
