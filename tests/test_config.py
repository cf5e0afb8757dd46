"""Every config in conf/ composes and validates; bad values fail naming the key."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from palu.cli.common import CONF_DIR
from palu.config import ConfigError, validate

GROUPS = ["model", "data", "calibration", "fisher", "palu", "generate", "tracking", "paths"]


def _compose(overrides=()):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes_and_validates(group):
    for option in sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")):
        cfg = validate(_compose([f"{group}={option}"]))
        assert cfg[group] is not None


@pytest.mark.parametrize("override, key", [
    ("palu.kept_ratio=0", "palu.kept_ratio"),
    ("palu.kept_ratio=1.2", "palu.kept_ratio"),
    ("data.seqlen=0", "data.seqlen"),
    ("data.seqlen=-5", "data.seqlen"),
    ("palu.rank_method=fishr", "palu.rank_method"),
    ("tracking.mode=sometimes", "tracking.mode"),
    ("method=palu", "checkpoint"),
])
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(_compose([override]))


def test_misspelled_keys_fail():
    with pytest.raises(Exception, match="seqln"):
        _compose(["data.seqln=128"])
    cfg = _compose()
    from omegaconf import OmegaConf
    raw = OmegaConf.to_container(cfg)
    raw["palu"]["kept_ratoi"] = 0.5  # a typo inside a YAML file reaches validate() like this
    with pytest.raises(ConfigError, match="kept_ratoi"):
        validate(raw)


def test_grids_parse():
    from palu.pipeline.grid import Grid
    for path in (Path(CONF_DIR) / "grid").glob("*.yaml"):
        grid = Grid.load(path)
        assert grid.rank_search_specs() and grid.common_overrides()
    with pytest.raises(ValueError, match="unknown grid keys"):
        Grid({"model": "x", "calibration": {}, "fisher": {}, "typo": 1})
