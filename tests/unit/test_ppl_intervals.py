"""Perplexity intervals: the block bootstrap covers the true perplexity at about its stated rate,
paired differences cancel what the text makes hard for both methods, and tables show both."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from palu.eval.stats import ppl_difference, ppl_interval


def test_the_block_interval_covers_the_true_ppl_at_its_rate():
    rng = np.random.default_rng(0)
    true_mean, blocks, hits, reps = 3.0, 32, 0, 300
    for rep in range(reps):
        # 128-token blocks of iid token NLLs (gamma, mean 3): the true ppl is exp(3)
        nll = rng.gamma(2.0, true_mean / 2.0, size=(blocks, 128)).sum(axis=1)
        lo, hi = ppl_interval(nll, np.full(blocks, 128), iters=2000, seed=rep)
        hits += lo <= math.exp(true_mean) <= hi
    assert 0.90 <= hits / reps <= 0.99, hits / reps


def test_paired_differences_cancel_shared_difficulty():
    rng = np.random.default_rng(1)
    hard = rng.gamma(2.0, 1.5, size=32) * 128          # the text's difficulty per block, shared
    tokens = np.full(32, 128)
    a, b = hard + 0.02 * 128, hard.copy()              # a: +0.02 nats per token everywhere
    d = ppl_difference(a, b, tokens)
    lo_a, hi_a = ppl_interval(a, tokens)
    assert d["significant"] and d["lo"] > 0 and (d["hi"] - d["lo"]) < 0.1 * (hi_a - lo_a)
    assert d["relative"] == pytest.approx(math.exp(0.02) - 1)
    assert not ppl_difference(b, b, tokens)["significant"]
    with pytest.raises(ValueError, match="same >= 2 blocks"):
        ppl_difference(a, b[:5], tokens)


def _run(tmp_path, method, nll, corpus="wiki_standin"):
    m = {"model": "m", "method": method, "corpus": corpus, "corpus_label": corpus, "seqlen": 256,
         "tokens": 512, "ppl": math.exp(sum(nll) / (128 * len(nll))), "dtype": "float32",
         "block_nll": list(nll), "block_tokens": [128] * len(nll)}
    path = tmp_path / f"{method}-{corpus}.json"
    path.write_text(json.dumps({"metrics": m}))
    return str(path)


def test_tables_show_intervals_and_paired_differences(tmp_path):
    from palu.pipeline.reporting.tables import build_table, to_markdown
    rng = np.random.default_rng(2)
    hard = list(rng.gamma(2.0, 1.5, size=8) * 128)
    paths = [_run(tmp_path, "fp16", hard), _run(tmp_path, "worse", [h + 0.1 * 128 for h in hard]),
             _run(tmp_path, "same", [h + rng.normal(0, 0.5) for h in hard])]
    frame = build_table(paths).set_index("method")
    assert frame.loc["fp16", "ppl_lo"] < frame.loc["fp16", "ppl"] < frame.loc["fp16", "ppl_hi"]
    assert frame.loc["worse", "significant"] and frame.loc["worse", "diff_lo"] > 0
    assert not frame.loc["same", "significant"] and math.isnan(frame.loc["fp16", "diff_vs_fp16"])
    text = to_markdown(build_table(paths), "t")
    assert "Δ" in text and "~" in text and "95% interval" in text


def test_comparison_tables_pair_each_variant_with_its_reference(tmp_path):
    """rank_allocation rows against uniform at the same kept ratio and granularity (issue 21)."""
    from palu.pipeline.reporting.tables import build_table, to_markdown
    rng = np.random.default_rng(3)
    hard = list(rng.gamma(2.0, 1.5, size=8) * 128)

    def palu_run(method, rank_method, kept, nll):
        path = _run(tmp_path, method, nll)
        data = json.loads(Path(path).read_text())
        data["metrics"].update(kept_ratio_target=kept, group_size=1, rank_method=rank_method,
                               decomposition="whitened")
        Path(path).write_text(json.dumps(data))
        return path
    paths = [_run(tmp_path, "fp16", hard),
             palu_run("u5", "uniform", 0.5, [h + 0.3 * 128 for h in hard]),
             palu_run("f5", "fisher", 0.5, [h + 0.1 * 128 for h in hard]),       # better than u5
             palu_run("u3", "uniform", 0.3, [h + 0.5 * 128 for h in hard]),
             palu_run("f3", "fisher", 0.3, [h + 0.5 * 128 + rng.normal(0, 0.5) for h in hard])]
    frame = build_table(paths, table="rank_allocation").set_index("method")
    assert frame.loc["f5", "reference"] == "u5" and frame.loc["f3", "reference"] == "u3"
    assert frame.loc["f5", "ref_significant"] and frame.loc["f5", "ref_hi"] < 0
    assert not frame.loc["f3", "ref_significant"]
    assert frame.loc[["fp16", "u5", "u3"], "reference"].isna().all()
    text = to_markdown(build_table(paths, table="rank_allocation"), "t")
    assert "| f5 " in text.split("## Paired")[1] and "better" in text and "~ (tie)" in text
    assert "## Paired" not in to_markdown(build_table(paths), "t")    # other tables: no section
    # a second reference: another allocator against fisher (the paper's), uniform not against it
    paths.append(palu_run("p5", "probe_select", 0.5, [h + 0.2 * 128 for h in hard]))   # worse than f5
    frame = build_table(paths, table="rank_allocation").set_index("method")
    assert frame.loc["p5", "reference"] == "u5" and frame.loc["p5", "reference2"] == "f5"
    assert frame.loc["p5", "ref2_significant"] and frame.loc["p5", "diff_vs_ref2"] > 0
    assert frame.loc[["fp16", "u5", "f5", "u3", "f3"], "reference2"].isna().all()
    text = to_markdown(build_table(paths, table="rank_allocation"), "t")
    assert "| p5 " in text.split("## Paired against the second reference")[1] and "worse" in text
    assert "start" not in frame.columns and "search's start" not in text   # no search rows: as before
    # the search against the probe_select choice it starts from (issue 53), and only the search
    paths.append(palu_run("s5", "search", 0.5, [h + 0.15 * 128 for h in hard]))   # better than p5
    frame = build_table(paths, table="rank_allocation").set_index("method")
    assert frame.loc["s5", "start"] == "p5" and frame.loc["s5", "start_hi"] < 0
    assert frame.loc[["fp16", "u5", "f5", "p5", "u3", "f3"], "start"].isna().all()
    text = to_markdown(build_table(paths, table="rank_allocation"), "t")
    assert "| s5 " in text.split("## Paired against the search's start")[1].split("## All")[0]


def test_composition_rows_pair_with_the_same_factors_and_latent_width(tmp_path):
    """The rank-allocation table with the composition rows (issue 53 item 4): an allocation at 4
    bits or with attention-aware factors pairs with uniform / fisher / its start at the same
    factors and width, never across them, and the pairing text says so."""
    from palu.pipeline.reporting.tables import build_table, to_markdown
    rng = np.random.default_rng(4)
    hard = list(rng.gamma(2.0, 1.5, size=8) * 128)

    def palu_run(method, rank_method, decomposition, bits, extra):
        path = _run(tmp_path, method, [h + extra * 128 for h in hard])
        data = json.loads(Path(path).read_text())
        data["metrics"].update(kept_ratio_target=0.3, group_size=1, rank_method=rank_method,
                               decomposition=decomposition, kv_bits=bits)
        Path(path).write_text(json.dumps(data))
        return path
    paths = [_run(tmp_path, "fp16", hard)]
    for d in ("whitened", "attention"):
        for b in (16, 4):
            for m, extra in (("uniform", 0.5), ("fisher", 0.4), ("probe_select", 0.3), ("search", 0.2)):
                paths.append(palu_run(f"{d}-{m}-b{b}", m, d, b, extra + (b == 4) * 0.05 + (d == "attention") * 0.01))
    frame = build_table(paths, table="rank_allocation").set_index("method")
    for d in ("whitened", "attention"):
        for b in (16, 4):
            assert frame.loc[f"{d}-search-b{b}", "reference"] == f"{d}-uniform-b{b}"
            assert frame.loc[f"{d}-search-b{b}", "reference2"] == f"{d}-fisher-b{b}"
            assert frame.loc[f"{d}-search-b{b}", "start"] == f"{d}-probe_select-b{b}"
    assert "same corpus, kept ratio, granularity, factor objective and latent width" in \
        to_markdown(build_table(paths, table="rank_allocation"), "t")
    plain = [p for p in paths if "attention" not in p and "b4" not in p]
    assert "same corpus, kept ratio and granularity)" in to_markdown(build_table(plain, table="rank_allocation"), "t")


def test_bits_and_rotations_are_paired_and_the_main_view_shows_each_interval(tmp_path):
    """latent_bits: every width against the same checkpoint unquantised; hadamard: a rotation
    against no rotation at the same width (unpaired intervals overlap where the pair does not)."""
    from palu.pipeline.reporting.tables import build_table, to_markdown
    rng = np.random.default_rng(4)
    hard = list(rng.gamma(2.0, 1.5, size=16) * 128)

    def palu_run(method, bits, rotation, shift):
        path = _run(tmp_path, method, [h + shift * 128 + rng.normal(0, 0.02 * 128) for h in hard])
        data = json.loads(Path(path).read_text())
        data["metrics"].update(kept_ratio_target=0.5, group_size=3, rank_method="uniform",
                               decomposition="whitened", kv_bits=bits, rotation=rotation)
        Path(path).write_text(json.dumps(data))
        return path
    paths = [_run(tmp_path, "fp16", hard), palu_run("p16", 16, "none", 0.3),
             palu_run("p3", 3, "none", 0.4), palu_run("p3-rot", 3, "hadamard", 0.35)]
    bits = build_table(paths, table="latent_bits").set_index("method")
    assert bits.loc["p3", "reference"] == "p16" and bits.loc["p3", "ref_significant"]
    assert bits.loc["p3", "diff_vs_ref"] > 0 and bits.loc[["fp16", "p16"], "reference"].isna().all()
    rot = build_table(paths, table="hadamard").set_index("method")
    assert rot.loc["p3-rot", "reference"] == "p3" and rot.loc["p3-rot", "ref_hi"] < 0
    assert rot.loc[["p16", "p3"], "reference"].isna().all()
    text = to_markdown(build_table(paths, table="hadamard"), "t")
    r = rot.loc["p3-rot"]
    assert f"Δ{r.diff_vs_fp16:+.2f} [{r.diff_lo:+.2f}, {r.diff_hi:+.2f}]" in text.split("## Paired")[0]
    main = text.split("## Paired")[0]
    assert main.index("| fp16") < main.index("| p16") < main.index("| p3 ") < main.index("| p3-rot")


def test_a_stratum_of_one_sample_gives_an_interval_over_the_strata_not_zero_width():
    """One prompt per task: within-task resampling has nothing to resample (a zero-width interval
    claimed certainty); the tasks' means are resampled instead."""
    from palu.eval.stats import stratified_mean
    ci = stratified_mean([[1.0], [0.0], [1.0], [0.0]])
    assert ci["value"] == 0.5 and ci["lo"] < 0.3 and ci["hi"] > 0.7
    d = stratified_mean([[1.0], [0.0], [1.0]], reference=[[1.0], [1.0], [1.0]])
    assert d["value"] == pytest.approx(-1 / 3) and d["lo"] < d["value"] < d["hi"] and not d["significant"]
    wide = stratified_mean([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])     # unchanged where strata have spread
    assert wide["lo"] < wide["value"] < wide["hi"]
    with pytest.raises(ValueError, match="one sample has no interval"):
        stratified_mean([[0.5]])
