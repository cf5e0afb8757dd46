import pytest
import torch

from palu.decompose.svd import factorize, whitening


def _data(seed=0, n=400, d_in=32, d_out=24):
    g = torch.Generator().manual_seed(seed)
    # Correlated, anisotropic inputs: the case whitening exists for.
    mix = torch.randn(d_in, d_in, generator=g, dtype=torch.float64) * torch.logspace(0, -2, d_in, dtype=torch.float64)
    X = torch.randn(n, d_in, generator=g, dtype=torch.float64) @ mix
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return W, X


def test_full_rank_is_exact():
    W, X = _data()
    for white in (None, whitening(X.T @ X)):
        A, B = factorize(W, min(W.shape), white)
        assert torch.allclose(B @ A, W, atol=1e-9, rtol=0)


def test_whitened_beats_plain_on_held_out_activations():
    W, X = _data(n=800)
    calib, held_out = X[:400], X[400:]
    white = whitening(calib.T @ calib)
    for rank in (4, 8, 12):
        errs = {}
        for name, wh in (("plain", None), ("whitened", white)):
            A, B = factorize(W, rank, wh)
            errs[name] = ((held_out @ (W - B @ A).T).norm() / (held_out @ W.T).norm()).item()
        assert errs["whitened"] < 0.9 * errs["plain"], (rank, errs)


def test_singular_gram_falls_back_and_stays_finite():
    W, X = _data(n=10)  # 10 samples for 32 inputs: a rank-10 Gram
    white = whitening(X.T @ X)
    assert white.method in ("cholesky_damped", "eigen")
    A, B = factorize(W, 8, white)
    assert torch.isfinite(A).all() and torch.isfinite(B).all()
    zero = whitening(torch.zeros(32, 32, dtype=torch.float64))
    assert torch.isfinite(zero.S_inv).all()


def test_bad_rank_is_rejected():
    W, _ = _data()
    for rank in (0, 25):
        try:
            factorize(W, rank)
        except ValueError as err:
            assert str(rank) in str(err)
        else:
            raise AssertionError("rank out of range accepted")


def test_whitened_spectra_are_the_exact_truncation_errors():
    """sum of sigma_i^2 beyond rank r = ||(W - B A) X||_F^2 on the calibration inputs."""
    from palu.calib.gram import collect_grams
    from palu.decompose.ranks import Slot
    from palu.decompose.spectra import whitened_spectra
    from palu.decompose.svd import factorize, whitening
    from tiny import tiny_llama
    model = tiny_llama(0).double()
    windows = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    grams = collect_grams(model, windows, progress=False)["gram"]
    spectra = whitened_spectra(model, grams, group_size=1)
    W = model.model.layers[1].self_attn.v_proj.weight.double()[16:32]      # layer 1, value group 1
    A, B = factorize(W, 5, whitening(grams[1]))
    E = W - B @ A
    error = torch.einsum("oi,ij,oj->", E, grams[1], E)
    assert torch.allclose(spectra[Slot(1, "v", 1)][5:].sum(), error, rtol=1e-8)


def test_compress_with_error_aware_ranks_meets_the_budget():
    import palu
    from tiny import tiny_llama
    model = tiny_llama(0).double()
    calib = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    result = palu.compress(model, calib, kept_ratio=0.5, group_size=1, rank_method="error_aware",
                           multiple=2, progress=False, fisher_windows=calib)
    assert result.allocation["method"] == "error_aware" and result.allocation["kept_ratio_realised"] == 0.5
    ranks = [r["rank"] for r in result.allocation["ranks"]]
    assert sum(ranks) == result.allocation["latent_size"] and len(set(ranks)) > 1


def test_compress_reuses_precomputed_statistics_bit_for_bit():
    import copy

    import palu
    from palu.calib.fisher import collect_fisher
    from palu.calib.gram import collect_grams
    from tiny import tiny_llama
    base = tiny_llama(0).double()
    calib = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    direct = palu.compress(copy.deepcopy(base), calib, 0.5, 1, "error_aware", multiple=2, progress=False,
                           fisher_windows=calib)
    grams = collect_grams(base, calib, progress=False)["gram"]
    stats = collect_fisher(base, calib, progress=False)
    reused = palu.compress(copy.deepcopy(base), None, 0.5, 1, "error_aware", multiple=2, progress=False,
                           grams=grams, fisher_stats=stats, probe_windows=calib[:1])
    assert reused.allocation["ranks"] == direct.allocation["ranks"]
    assert all(torch.equal(a, b) for fa, fb in zip(direct.factors, reused.factors) for a, b in zip(fa.A_k, fb.A_k))


def test_the_svd_signs_are_canonical_so_quantised_latents_do_not_depend_on_the_machine():
    """LAPACK may return (u, v) or (-u, -v); flipping a pair must give the same factors back."""
    from palu.decompose.svd import canonical_svd
    M = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    U, s, Vh = canonical_svd(M)
    assert torch.allclose((U * s) @ Vh, M, atol=1e-12)
    assert (U[U.abs().argmax(0), torch.arange(U.shape[1])] > 0).all()
    flip = torch.tensor([1.0 if i % 3 else -1.0 for i in range(U.shape[1])], dtype=torch.float64)
    U2, s2, Vh2 = canonical_svd((U * flip * s) @ (Vh * flip[:, None]))   # the same matrix
    assert torch.allclose(U2, U, atol=1e-10) and torch.allclose(Vh2, Vh, atol=1e-10)
    # what the sign decides: a flipped latent channel changes the per-token min-max quantisation
    from palu.quant.packed import dequantize_latent, quantize_latent
    h = torch.randn(1, 1, 64, 8, generator=torch.Generator().manual_seed(5))
    flipped = h.clone()
    flipped[..., 0] *= -1
    err = lambda x: (dequantize_latent(quantize_latent(x, 2), torch.float32) - x).pow(2).sum()
    assert err(h).item() != pytest.approx(err(flipped).item(), rel=1e-3)


def test_compress_takes_a_precomputed_allocation_and_refuses_one_that_cannot_be_this_models():
    """allocation= skips the rank search: the same ranks give the same factors (here under another
    factor objective too); a sealed ranks record that was edited, or one of another group size,
    is refused."""
    import copy

    import palu
    from palu.artifacts import seal
    from tiny import tiny_llama
    base = tiny_llama(0).double()
    calib = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    searched = palu.compress(copy.deepcopy(base), calib, 0.5, 1, "error_aware", multiple=2, progress=False,
                             fisher_windows=calib)
    again = palu.compress(copy.deepcopy(base), calib, group_size=1, progress=False,
                          allocation=seal(dict(searched.allocation)))
    assert again.allocation["ranks"] == searched.allocation["ranks"]
    assert again.allocation["method"] == "error_aware"
    assert all(torch.equal(a, b) for fa, fb in zip(searched.factors, again.factors) for a, b in zip(fa.A_k, fb.A_k))
    other = palu.compress(copy.deepcopy(base), calib, group_size=1, progress=False, decomposition="plain",
                          allocation=searched.allocation)
    assert other.allocation["ranks"] == searched.allocation["ranks"]
    edited = seal(dict(searched.allocation))
    edited["ranks"] = [{**r, "rank": r["rank"] + 2} if i == 0 else r for i, r in enumerate(edited["ranks"])]
    with pytest.raises(Exception, match="edited"):
        palu.compress(copy.deepcopy(base), calib, group_size=1, progress=False, allocation=edited)
    with pytest.raises(ValueError, match="group_size"):
        palu.compress(copy.deepcopy(base), calib, group_size=2, progress=False, allocation=searched.allocation)
