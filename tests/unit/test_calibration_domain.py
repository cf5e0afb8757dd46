"""benchmarks/experiments/calibration_domain.py pairs each calibration with the in-domain one on
the same blocks, and refuses grids that did not score the same blocks."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "experiments" / "calibration_domain.py"


def _module():
    spec = importlib.util.spec_from_file_location("calibration_domain", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(root, cal, method, corpus, nll, tokens=None):
    tokens = tokens or [128] * len(nll)
    import math
    m = {"method": method, "corpus": corpus, "block_nll": nll, "block_tokens": tokens,
         "ppl": math.exp(sum(nll) / sum(tokens)), "calibration_samples": 0 if method == "fp16" else 24,
         "group_size": 1, "num_kv_heads": 2, "kept_ratio_target": 0.5}
    path = root / cal / "runs" / "m" / method / f"ppl-{corpus}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metrics": m}))


def _grids(root, novels_blocks=None):
    base = [300.0, 310.0, 320.0, 330.0]
    for cal, shift in (("wiki", 0.0), ("novels", 20.0), ("mix", 5.0)):
        for corpus in ("wiki_standin", "novels_standin"):
            _write(root, cal, "fp16", corpus, base)
            worse = shift if corpus == "wiki_standin" else 20.0 - shift   # in-domain is best
            nll = [b + 40 + worse for b in base]
            _write(root, cal, "palu-k0.5", corpus, nll, novels_blocks if cal == "novels" else None)


def test_each_calibration_is_paired_with_the_in_domain_one(tmp_path):
    _grids(tmp_path)
    result = _module().table(tmp_path)
    rows = {(r["run"], r["corpus"]): r for r in result["rows"]}
    wiki = rows[("palu-k0.5", "wiki_standin")]
    assert wiki["in_domain"] == "wiki" and "vs_in_domain" not in wiki["wiki"]
    assert wiki["novels"]["vs_in_domain"]["diff"] > 0 and wiki["novels"]["vs_in_domain"]["significant"]
    novels = rows[("palu-k0.5", "novels_standin")]
    assert novels["wiki"]["vs_in_domain"]["diff"] > 0 and "vs_in_domain" not in novels["novels"]
    assert "vs_in_domain" not in rows[("fp16", "wiki_standin")]["novels"]


def test_grids_that_scored_other_blocks_are_refused(tmp_path):
    _grids(tmp_path, novels_blocks=[128, 128, 128, 127])
    with pytest.raises(ValueError, match="scored other blocks"):
        _module().table(tmp_path)


def test_a_missing_grid_is_named(tmp_path):
    _grids(tmp_path)
    import shutil
    shutil.rmtree(tmp_path / "mix")
    with pytest.raises(ValueError, match="mix: no run files"):
        _module().table(tmp_path)
