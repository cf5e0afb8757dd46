"""benchmarks/experiments/probe_choice_held_out.py reads both choices from committed runs' manifests."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "experiments" / "probe_choice_held_out.py"


def _module():
    spec = importlib.util.spec_from_file_location("probe_choice_held_out", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(root, grid, tag, allocation):
    folder = root / grid / "runs" / "m" / tag / "wiki_standin-n24-L2048-s0-float32" / "fisher-n8-L2048-s1-m8"
    folder.mkdir(parents=True)
    for corpus in ("wiki_standin", "novels_standin"):   # two evaluations of one checkpoint: one row
        (folder / f"ppl-{corpus}-L2048-T4096-float32-cf0.3.json").write_text(
            json.dumps({"method": {"manifest": {"allocation": allocation}}}))


def _probe(losses):
    return {"windows": 1, "seqlen": 2048, "candidates": [{"candidate": c, "loss": v} for c, v in losses.items()]}


def test_both_choices_are_read_and_compared(tmp_path):
    mod = _module()
    leaky = {"selected": "fisher_rms", "probe": _probe({"uniform": 4.0, "fisher_rms": 3.0, "fisher": 3.5})}
    _run(tmp_path, "g", "palu-whitened-probe_select-k0.5-g1", leaky)
    held = {"selected": "fisher", "probe": {**_probe({"uniform": 4.1, "fisher_rms": 3.6, "fisher": 3.4}), "windows": 4,
                                            "seqlen": 512},
            "search": {"start": "fisher", "held_out": {"offsets": [0, 512, 1024, 4000]}}}
    _run(tmp_path, "g", "palu-whitened-search-k0.5-g1", held)
    _run(tmp_path, "g", "palu-whitened-probe_select-k0.5-g1-b4", leaky)   # a quantised row: not a cell
    out = mod.compare(tmp_path)
    assert out["cells"] == 1 and out["same_choice_cells"] == 0
    row, = out["rows"]
    assert (row["chosen_on_probe_window"], row["chosen_held_out"]) == ("fisher_rms", "fisher")
    assert row["held_out_loss_of_probe_choice"] == 3.6 and row["held_out_loss_of_held_out_choice"] == 3.4
    assert row["candidate_rank_agreement"] == pytest.approx(0.5)   # 3 candidates, one swap
    _run(tmp_path, "g", "palu-whitened-search-e800-k0.5-g1",
         {**held, "search": {"start": "uniform", "held_out": {"offsets": [0, 512, 1024, 4000]}}})
    with pytest.raises(SystemExit, match="same windows started from different choices"):
        mod.compare(tmp_path)
