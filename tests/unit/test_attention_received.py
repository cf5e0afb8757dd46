"""The attention each key receives (`palu.attention.received`, H2O's score for a padded batch):
the torch path against an explicit per-row softmax in float64, and the Triton kernel through the
interpreter against the torch path (float32), over left-padded rows, grouped query heads, a
step whose queries follow held tokens with fillers among them, and sizes off the block grid."""
import pytest
import torch

from palu.attention import received as rec


def _case(B=3, H=2, rep=3, T=10, S=10, D=16, dtype=torch.float64, seed=0):
    """Left-padded rows of lengths 10, 6, 1 (T = S: a prefill), or, with S > T, earlier held
    slots first (some fillers, position -1) and the step's T queries last."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * rep, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, S, D, generator=g, dtype=dtype)
    lengths = torch.tensor([T, 6, 1][:B]) if S == T else torch.tensor([T] * B)
    q_pos = (torch.arange(T)[None] - (T - lengths)[:, None]).masked_fill(torch.arange(T)[None] < (T - lengths)[:, None], -1)
    old = S - T
    k_pos = torch.cat([torch.arange(old).expand(B, H, old), q_pos[:, None].expand(B, H, T) + old], 2).clone()
    if old:
        q_pos = q_pos + old
        k_pos[1, 0, 1] = k_pos[2, 1, 0] = -1      # fillers: dropped earlier
    return q, k, q_pos, k_pos


def _explicit(q, k, q_pos, k_pos, scale):
    B, Hq, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, S, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // H)
            for t in range(T):
                if q_pos[b, t] < 0:
                    continue
                seen = (k_pos[b, h] >= 0) & (k_pos[b, h] <= q_pos[b, t])
                s = (k[b, h] @ q[b, hq, t]) * scale
                out[b, h] += torch.where(seen, s, float("-inf")).softmax(0)
    return out


@pytest.mark.parametrize("shape", [dict(), dict(rep=1), dict(T=1, S=9), dict(T=4, S=13)])
@pytest.mark.parametrize("chunk", [None, 1])
def test_torch_path_is_each_rows_own_softmax_summed(monkeypatch, shape, chunk):
    if chunk:
        monkeypatch.setattr(rec, "SCORES_AT_ONCE", chunk)
    q, k, q_pos, k_pos = _case(**shape)
    got = rec.received_torch(q, k, q_pos, k_pos, 0.3)
    assert got.dtype == torch.float64
    assert (got - _explicit(q, k, q_pos, k_pos, 0.3)).abs().max().item() < 1e-12
    assert got[k_pos < 0].abs().max().item() == 0.0           # pads and fillers receive nothing


@pytest.mark.parametrize("shape", [dict(T=70, S=70), dict(T=70, S=70, rep=1), dict(T=5, S=83), dict(T=1, S=64)])
def test_kernel_through_the_interpreter_equals_the_torch_path(monkeypatch, shape):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from palu_kernels.received import attention_received
    q, k, q_pos, k_pos = _case(dtype=torch.float32, **shape)
    want = rec.received_torch(q, k, q_pos, k_pos, 0.25)
    got = rec.received(q, k, q_pos, k_pos, 0.25, kernel=lambda *a: attention_received(*a, block_m=16, block_n=16))
    assert (got - want).abs().max().item() < 1e-5


def test_the_kernel_is_chosen_only_on_a_gpu():
    assert rec.received_kernel(torch.zeros(1, 1, 1, 64)) is None
