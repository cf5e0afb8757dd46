"""The `attention` decomposition: whitened SVD weighed on the output side by what attention does
with each block (decompose/metrics.py). Checked against direct computations in float64."""
import copy
import math

import pytest
import torch

import palu
from palu.calib.gram import collect_grams
from palu.decompose.factors import decompose_model
from palu.decompose.metrics import block_metric, key_metrics, value_metrics
from palu.decompose.ranks import allocate
from palu.decompose.svd import factorize, whitening
from palu.models.adapters import adapter_for, geometry_of
from tiny import FAMILIES, tiny_llama

GEN = torch.Generator().manual_seed(0)


def _spd(n, gen=GEN):
    X = torch.randn(3 * n, n, dtype=torch.float64, generator=gen)
    return X.T @ X


def test_identity_metric_gives_the_whitened_factors_bit_for_bit():
    W = torch.randn(12, 20, dtype=torch.float64, generator=GEN)
    white = whitening(_spd(20))
    A0, B0 = factorize(W, 5, white)
    A1, B1 = factorize(W, 5, white, torch.eye(12, dtype=torch.float64))
    assert torch.equal(A0, A1) and torch.equal(B0, B1)


def test_weighted_factors_are_optimal_for_their_objective():
    W = torch.randn(12, 20, dtype=torch.float64, generator=GEN)
    G, M = _spd(20), _spd(12)
    white = whitening(G)
    L = torch.linalg.cholesky(M).T

    def cost(A, B, metric):   # ||L (W - BA) S||_F^2 through the Grams: tr(E G E^T M)
        E = W - B @ A
        return float(torch.trace(E @ G @ E.T @ metric))
    for r in (1, 4, 9):
        A, B = factorize(W, r, white, M)
        sigma = torch.linalg.svdvals(L @ W @ white.S)
        assert cost(A, B, M) == pytest.approx(float(sigma[r:].pow(2).sum()), rel=1e-9)   # Eckart-Young
        Aw, Bw = factorize(W, r, white)
        assert cost(A, B, M) <= cost(Aw, Bw, M) * (1 + 1e-12)
        assert cost(Aw, Bw, torch.eye(12, dtype=torch.float64)) <= cost(A, B, torch.eye(12, dtype=torch.float64)) * (1 + 1e-12)
    A, B = factorize(W, 12, white, M)
    assert torch.allclose(B @ A, W, atol=1e-9)                        # full rank: W itself


def test_value_metric_is_the_energy_the_output_projection_passes():
    d, kv, rep, hidden = 8, 2, 3, 24
    Wo = torch.randn(hidden, kv * rep * d, dtype=torch.float64, generator=GEN)
    M = value_metrics(Wo, kv, d, rep)
    e = torch.randn(d, dtype=torch.float64, generator=GEN)
    for j in range(kv):    # the error of KV head j reaches o through each of its query heads
        direct = sum(float((Wo[:, h * d:(h + 1) * d] @ e).pow(2).sum()) for h in range(j * rep, (j + 1) * rep))
        assert float(e @ M[j] @ e) == pytest.approx(direct, rel=1e-12)


def test_rope_key_metric_is_the_score_error_averaged_over_relative_rotations():
    d, hidden = 4, 10                      # two rotate-half pairs: (0, 2) and (1, 3)
    Wq = torch.randn(d, hidden, dtype=torch.float64, generator=GEN)
    X = torch.randn(50, hidden, dtype=torch.float64, generator=GEN)
    M = key_metrics(Wq, X.T @ X, 1, d, 1, rope=True)[0]
    e = torch.randn(d, dtype=torch.float64, generator=GEN)
    q = X @ Wq.T                           # (tokens, d)
    n = 16                                 # a uniform grid is exact for trig polynomials of degree 2
    total = 0.0
    for a in range(n):
        for b in range(n):
            t0, t1 = 2 * math.pi * a / n, 2 * math.pi * b / n
            c = torch.tensor([math.cos(t0), math.cos(t1)], dtype=torch.float64)
            s = torch.tensor([math.sin(t0), math.sin(t1)], dtype=torch.float64)
            x1, x2 = e[:2], e[2:]          # rotate_half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
            Re = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s]).double()
            total += float((q @ Re).pow(2).sum())
    assert float(e @ M @ e) == pytest.approx(total / n ** 2, rel=1e-10)
    plain = key_metrics(Wq, X.T @ X, 1, d, 1, rope=False)[0]
    assert float(e @ plain @ e) == pytest.approx(float((q @ e).pow(2).sum()), rel=1e-10)


def test_block_metric_is_block_diagonal_and_damped():
    per_head = [torch.eye(3, dtype=torch.float64) * (j + 1) for j in range(4)]
    M = block_metric(per_head, 1, 2)
    assert M.shape == (6, 6) and M[0, 3] == 0 and M[0, 0] > 3 and M[4, 4] > 4


def _calib():
    return torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_attention_decomposition_at_full_rank_is_the_model(family):
    base = FAMILIES[family](0).double()
    model = copy.deepcopy(base)
    palu.compress(model, _calib(), kept_ratio=1.0, group_size=1, decomposition="attention",
                  multiple=8, progress=False)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, base(ids).logits, atol=1e-8)


def test_attention_values_lose_less_of_the_attention_output_than_whitened():
    """At the same ranks, the value error seen through o_proj (tokens attending to themselves,
    the P = I case of the metric) is smaller with the attention objective, the plain V error larger."""
    model = tiny_llama(0, kv_heads=2).double()
    geom, adapter = geometry_of(model.config), adapter_for(model.config)
    grams = collect_grams(model, _calib(), progress=False)["gram"]
    alloc = allocate(geom, 0.5, 1, "uniform", 4)
    fw, _ = decompose_model(model, alloc, grams, "whitened", progress=False)
    fa, _ = decompose_model(model, alloc, grams, "attention", progress=False)
    d, rep = geom.head_dim, geom.n_rep
    for l, layer in enumerate(adapter.layers(model)):
        _, _, v, o = adapter.projections(adapter.attention(layer))
        G = grams[l]

        def errors(f):
            through_o, plain = 0.0, 0.0
            for j in range(geom.num_kv_heads):
                E = v.weight.detach().double()[j * d:(j + 1) * d] - f[l].B_v[j] @ f[l].A_v[j]
                plain += float(torch.trace(E @ G @ E.T))
                for h in range(j * rep, (j + 1) * rep):
                    OE = o.weight.detach().double()[:, h * d:(h + 1) * d] @ E
                    through_o += float(torch.trace(OE @ G @ OE.T))
            return through_o, plain
        (ow, pw), (oa, pa) = errors(fw), errors(fa)
        assert oa < ow and pa >= pw
