"""Every registered method is a `method` option of the config (its fields and their defaults, as
`palu.pipeline.config.method_defaults` stores them) and builds from it; bad method configs are named."""
import re
from pathlib import Path

import pytest

from palu.methods import REGISTRY, MethodError, build_method, method_names
from palu.pipeline.config import method_defaults

YAMLS = {name: method_defaults(name) for name in method_names()}


def test_every_registered_method_is_an_option_named_after_it():
    assert set(YAMLS) == set(REGISTRY) and len(YAMLS) >= 6
    for stem, conf in YAMLS.items():
        assert conf["name"] == stem and REGISTRY[stem].name == stem


@pytest.mark.parametrize("stem", sorted(YAMLS))
def test_each_yaml_builds_its_method_with_only_declared_fields(stem, tmp_path):
    conf = dict(YAMLS[stem])
    if "checkpoint" in conf:
        conf["checkpoint"] = str(tmp_path)
    if "state" in conf:   # a fitted method (KVQuant, KIVI's value scales): its state folder
        from tiny import fitted_state, tiny_llama
        conf["state"] = fitted_state(stem, tiny_llama(0), tmp_path / "state")
    method = build_method(conf)
    assert type(method) is REGISTRY[stem]
    assert method.name == conf["name"]
    assert {k: getattr(method, k) for k in conf if k != "name"} == {k: v for k, v in conf.items() if k != "name"}


def test_unknown_method_and_unknown_field_are_named():
    with pytest.raises(MethodError, match=re.escape(f"method.name='kivi2' is not one of {method_names()}")):
        build_method({"name": "kivi2"})
    with pytest.raises(MethodError, match=r"no field\(s\) \['bitz'\]"):
        build_method({"name": "palu", "checkpoint": "x", "bitz": 4})
    with pytest.raises(MethodError, match="method.latent_bits=5"):
        build_method({"name": "palu", "checkpoint": "x", "latent_bits": 5})
    # Palu's latent width was `bits` (issue 52 item 4): the old key names the new one, for every
    # method on Palu's latents; a quantiser's `bits` keeps its word
    for name in ("palu", "palu_select", "palu_snapkv", "palu_tova"):
        with pytest.raises(MethodError, match=f"method '{name}': 'bits' is now 'latent_bits'"):
            build_method({"name": name, "checkpoint": "x", "bits": 4})
    assert build_method({"name": "kivi", "bits": 4}).bits == 4


def test_palu_tag_carries_the_bit_width(tmp_path):
    from palu.decompose.checkpoint import FORMAT_VERSION
    from palu.artifacts import seal, write_json
    write_json(tmp_path / "manifest.json", seal({"format_version": FORMAT_VERSION, "tag": "palu-x"}))
    assert build_method({"name": "palu", "checkpoint": str(tmp_path)}).tag == "palu-x"
    assert build_method({"name": "palu", "checkpoint": str(tmp_path), "latent_bits": 4}).tag == "palu-x-b4"


def test_a_grid_line_adds_a_method_to_the_baseline_table(monkeypatch):
    """A method class (here one defined by the test) plus one `methods:` line in a grid: the DAG
    then evaluates it with its overrides, beside FP16, and the baseline table reads its runs."""
    from dataclasses import dataclass

    from palu.methods import CacheMethod, base
    from palu.pipeline.grid import Grid
    monkeypatch.setattr(base, "REGISTRY", base.REGISTRY.copy())   # the test's class stays here

    @dataclass
    class Halved(CacheMethod):
        name = "test_halved"
        bits: int = 8

        @property
        def tag(self):
            return f"halved-b{self.bits}"

    grid = Grid({"model": "smollm2-135m", "calibration": {"corpus": "c", "samples": 1, "seqlen": 8,
                                                            "seed": 0},
                 "fisher": {"samples": 1, "seqlen": 8, "seed": 0}, "rank_multiple": 8,
                 "eval": {"corpora": ["wiki_standin"], "seqlen": 64, "max_tokens": 128},
                 "methods": [{"name": "test_halved", "bits": 4}]})
    assert "halved-b4" in grid.runs()
    assert grid.run_overrides("halved-b4") == "method=test_halved method.bits=4"
    assert grid.run_inputs("halved-b4") == [grid.prepared_model()]
    assert grid.metrics("halved-b4")[0] in grid.table_inputs("baseline")
    with pytest.raises(ValueError, match="needs a checkpoint"):
        Grid({**grid.config, "methods": [{"name": "palu", "checkpoint": "x"}]}).runs()


def test_every_run_of_a_grid_is_a_spec_named_as_it_is_keyed(monkeypatch):
    """Issue 52 item 1: the grid holds `RunSpec`s only (FP16 and configured methods included),
    each run's name computed by its spec, and a new kind of run (here a test's fitted method)
    is planned through the protocol alone: its inputs and overrides reach the evaluation rule's
    lookups with no branch in the grid."""
    from dataclasses import dataclass

    from palu.pipeline.grid import Grid
    from palu.pipeline.specs import RunSpec
    grid = Grid.load(Path(__file__).resolve().parents[2] / "conf" / "grid" / "default.yaml")
    runs = grid.runs()
    assert runs and all(isinstance(s, RunSpec) for s in runs.values())
    assert all(spec.name(grid) == name for name, spec in runs.items())
    assert grid.run_overrides("fp16") == "method=fp16"

    @dataclass(frozen=True)
    class Fitted(RunSpec):
        seed: int

        def name(self, grid):
            return f"fitted-s{self.seed}"

        def inputs(self, grid):
            return [grid.prepared_model(), f"{grid.work}/fitted/s{self.seed}"]

        def method_overrides(self, grid):
            return ["method=fitted", f"method.state={grid.work}/fitted/s{self.seed}"]
    spec = Fitted(3)
    monkeypatch.setitem(grid.__dict__, "_runs", {**grid._runs, spec.name(grid): spec})
    assert grid.run_inputs("fitted-s3") == [grid.prepared_model(), "work/fitted/s3"]
    assert grid.run_overrides("fitted-s3") == "method=fitted method.state=work/fitted/s3"
