"""A fitted method is its library files and one spec class (issue 52 item 2): the grid plans its
states, runs, fit settings and paths through `fitted.FittedSpec` alone, and no pipeline module
but its spec names it (checked on KIVI's value scales, the method added this way)."""
from pathlib import Path

import pytest
import yaml

from palu.pipeline.fitted import FITTED
from palu.pipeline.grid import Grid

ROOT = Path(__file__).resolve().parents[2]


def _grid(**quantization):
    config = yaml.safe_load((ROOT / "conf/grid/default.yaml").read_text())
    config["quantization"].update(quantization)
    return Grid(config)


def test_the_grid_plans_every_fitted_method_through_its_spec():
    grid = _grid()
    assert set(grid.fitted_kinds()) == {"kvquant", "kivi_vscale"}
    runs = {name: spec for name, spec in grid.runs().items() if spec.__class__ in FITTED.values()}
    assert sorted(runs) == sorted([
        "kvquant-b4-fisher-o0.01/wiki_standin-n4-L2048-s2-float32", "kvquant-b3-fisher-o0.01/wiki_standin-n4-L2048-s2-float32",
        "kvquant-b2-fisher-o0.01/wiki_standin-n4-L2048-s2-float32", "kvquant-b3-uniform-o0.01/wiki_standin-n4-L2048-s2-float32",
        "kivi-b4-g32-r128-vscale-a0.5/wiki_standin-n4-L2048-s2-float32",
        "kivi-b2-g32-r128-vscale-a0.5/wiki_standin-n4-L2048-s2-float32"])
    vscale = runs["kivi-b2-g32-r128-vscale-a0.5/wiki_standin-n4-L2048-s2-float32"]
    state = "work/kivi_vscale/smollm2-135m/wiki_standin-n4-L2048-s2-float32/vscale-a0.5"
    assert vscale.inputs(grid) == [grid.prepared_model(), state]
    assert vscale.method_overrides(grid) == ["method=kivi_vscale", f"method.state={state}", "method.bits=2"]
    # the two runs of one alpha share one fitted state; its step settings come from the block
    assert list(grid.fitted_states("kivi_vscale")) == ["vscale-a0.5"]
    assert vscale.step_overrides(grid) == ("kivi_vscale.alpha=0.5 kivi_vscale.samples=4 kivi_vscale.seed=2 "
                                          "kivi_vscale.seqlen=2048 kivi_vscale.tokens_per_window=256")
    assert grid.fitted_capture(type(vscale)) == \
        "work/kivi_vscale/smollm2-135m/wiki_standin-n4-L2048-s2-float32/activations.safetensors"
    assert set(runs) <= set(grid.table_runs("quantization"))


def test_a_fit_entry_with_an_unknown_key_or_other_windows_is_refused():
    block = yaml.safe_load((ROOT / "conf/grid/default.yaml").read_text())["quantization"]["kivi_vscale"]
    with pytest.raises(ValueError, match=r"quantization.kivi_vscale.fits\[0\] has unknown keys \['bitz'\]"):
        _grid(kivi_vscale={**block, "fits": [{"alpha": 0.5, "bitz": 2}]}).runs()
    with pytest.raises(ValueError, match="quantization.kivi_vscale lists no fits"):
        _grid(kivi_vscale={**block, "fits": []}).runs()


def test_no_pipeline_module_but_its_spec_names_a_fitted_method():
    """Adding KIVI's value scales touched the library (its method, its fit), its spec and the spec's
    registration line, the grid YAML and the tests: no other module of the pipeline or rule file."""
    allowed = {ROOT / "src/palu/pipeline/fitted/kivi_vscale.py", ROOT / "src/palu/pipeline/fitted/__init__.py"}
    places = [*(ROOT / "src/palu/pipeline").rglob("*.py"), *(ROOT / "workflow").rglob("*.smk"), ROOT / "Snakefile"]
    naming_it = [str(p.relative_to(ROOT)) for p in places if p not in allowed and "vscale" in p.read_text()]
    assert naming_it == []
