"""Uncertainty of accuracies: a 95% interval for one method, and for its paired difference to a
reference on the same samples. A difference whose interval contains zero is not a win."""
from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (well-behaved near 0 and 1)."""
    if n <= 0:
        raise ValueError(f"an interval needs at least one sample, got n={n}")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a, b, iters: int = 10_000, seed: int = 0) -> dict:
    """Mean of a - b over paired samples with a 95% percentile-bootstrap interval (samples drawn
    with replacement as pairs, so what both methods get right or wrong together cancels)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired samples must be two equal, non-empty vectors; got {a.shape} and {b.shape}")
    d = a - b
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(iters, len(d)))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    p = sign_test(d)
    # the bootstrap interval alone is overconfident on a handful of pairs (two discordant pairs
    # give a zero-width interval): a change also needs the exact sign test (McNemar for 0/1)
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "n": int(len(d)),
            "p_sign": p, "significant": bool((lo > 0 or hi < 0) and p < 0.05)}


def sign_test(differences) -> float:
    """Two-sided exact sign test on the non-zero paired differences (McNemar's exact test when
    the scores are 0/1): the probability of a split at least this uneven under no change."""
    d = np.asarray(differences, dtype=float)
    pos, m = int((d > 0).sum()), int((d != 0).sum())
    if m == 0:
        return 1.0
    k = min(pos, m - pos)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def stratified_mean(strata, iters: int = 10_000, seed: int = 0, reference=None) -> dict:
    """The mean over strata (tasks) of each stratum's mean, with a 95% bootstrap interval that
    resamples within every stratum; with `reference` (the same strata, paired sample by sample)
    the statistic is the difference of the two such means. Stratum sizes may differ; where one
    holds a single sample, the strata's means are resampled instead (a zero-width interval
    otherwise)."""
    strata = [np.asarray(s, dtype=float) for s in strata]
    if reference is not None:
        reference = [np.asarray(r, dtype=float) for r in reference]
        if [r.shape for r in reference] != [s.shape for s in strata]:
            raise ValueError("paired strata must have the same sizes")
        strata = [s - r for s, r in zip(strata, reference)]
    if not strata or any(len(s) == 0 for s in strata):
        raise ValueError("every stratum needs at least one sample")
    if len(strata) == 1 and len(strata[0]) == 1:
        raise ValueError("one sample has no interval: a bootstrap of it would claim zero width")
    rng = np.random.default_rng(seed)
    if min(len(s) for s in strata) < 2:
        # a stratum of one sample has no spread to resample: within-stratum resampling would give
        # a zero-width interval. Resample the strata's means instead (the tasks as the units)
        means = np.array([s.mean() for s in strata])
        boot = means[rng.integers(0, len(means), size=(iters, len(means)))].mean(axis=1)
    else:
        boot = np.mean([s[rng.integers(0, len(s), size=(iters, len(s)))].mean(axis=1) for s in strata],
                       axis=0)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    value = float(np.mean([s.mean() for s in strata]))
    out = {"value": value, "lo": float(lo), "hi": float(hi), "significant": bool(lo > 0 or hi < 0)}
    if reference is not None:          # as in paired_difference: the exact sign test as well
        out["p_sign"] = sign_test(np.concatenate(strata))
        out["significant"] = out["significant"] and out["p_sign"] < 0.05
    return out


def _ppl_draws(block_nll, block_tokens, idx) -> np.ndarray:
    return np.exp(block_nll[idx].sum(axis=1) / block_tokens[idx].sum(axis=1))


def ppl_interval(block_nll, block_tokens, iters: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of a perplexity, resampling its token blocks (the NLL
    sums per block of `perplexity.BLOCK` scored tokens). Blocks of one window are treated as
    independent, which understates the spread somewhat when they share a document's topic."""
    nll, tok = np.asarray(block_nll, dtype=float), np.asarray(block_tokens, dtype=float)
    if nll.shape != tok.shape or nll.ndim != 1 or len(nll) < 2:
        raise ValueError(f"a ppl interval needs >= 2 token blocks with counts; got {nll.shape}, {tok.shape}")
    idx = np.random.default_rng(seed).integers(0, len(nll), size=(iters, len(nll)))
    lo, hi = np.quantile(_ppl_draws(nll, tok, idx), [0.025, 0.975])
    return float(lo), float(hi)


def ppl_difference(nll_a, nll_b, block_tokens, iters: int = 10_000, seed: int = 0) -> dict:
    """ppl(a) - ppl(b) on the same token blocks (two methods, the same windows), with a 95%
    paired-bootstrap interval (one draw of blocks serves both, so what the text makes hard for
    both cancels) and the relative change; `significant` when the interval excludes 0."""
    a, b = np.asarray(nll_a, dtype=float), np.asarray(nll_b, dtype=float)
    tok = np.asarray(block_tokens, dtype=float)
    if a.shape != b.shape or a.shape != tok.shape or len(a) < 2:
        raise ValueError(f"paired ppl needs the same >= 2 blocks; got {a.shape}, {b.shape}, {tok.shape}")
    idx = np.random.default_rng(seed).integers(0, len(a), size=(iters, len(a)))
    draws = _ppl_draws(a, tok, idx) - _ppl_draws(b, tok, idx)
    lo, hi = np.quantile(draws, [0.025, 0.975])
    pa, pb = math.exp(a.sum() / tok.sum()), math.exp(b.sum() / tok.sum())
    return {"diff": pa - pb, "lo": float(lo), "hi": float(hi), "relative": pa / pb - 1,
            "significant": bool(lo > 0 or hi < 0)}
