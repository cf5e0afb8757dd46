"""Every conf/method/*.yaml maps to a registered class and back; bad method configs are named."""
from pathlib import Path

import pytest
import yaml

from palu.config import CONF_DIR
from palu.methods import REGISTRY, MethodError, build_method, method_names

YAMLS = {p.stem: yaml.safe_load(p.read_text()) for p in (Path(CONF_DIR) / "method").glob("*.yaml")}


def test_every_method_yaml_names_a_registered_class_and_every_class_has_a_yaml():
    assert set(YAMLS) == set(method_names())
    for stem, conf in YAMLS.items():
        assert conf["name"] == stem and REGISTRY[stem].name == stem


@pytest.mark.parametrize("stem", sorted(YAMLS))
def test_each_yaml_builds_its_method_with_only_declared_fields(stem, tmp_path):
    conf = dict(YAMLS[stem])
    if "checkpoint" in conf:
        conf["checkpoint"] = str(tmp_path)
    method = build_method(conf)
    assert type(method) is REGISTRY[stem]
    assert method.name == conf["name"]
    assert {k: getattr(method, k) for k in conf if k != "name"} == {k: v for k, v in conf.items() if k != "name"}


def test_unknown_method_and_unknown_field_are_named():
    with pytest.raises(MethodError, match=r"method.name='kivi2' is not one of \['fp16', 'palu'"):
        build_method({"name": "kivi2"})
    with pytest.raises(MethodError, match=r"no field\(s\) \['bitz'\]"):
        build_method({"name": "palu", "checkpoint": "x", "bitz": 4})
    with pytest.raises(MethodError, match="method.bits=3"):
        build_method({"name": "palu", "checkpoint": "x", "bits": 3})


def test_palu_tag_carries_the_bit_width(tmp_path):
    from palu.decompose.checkpoint import FORMAT_VERSION
    from palu.io import write_json
    write_json(tmp_path / "manifest.json", {"format_version": FORMAT_VERSION, "tag": "palu-x"})
    assert build_method({"name": "palu", "checkpoint": str(tmp_path)}).tag == "palu-x"
    assert build_method({"name": "palu", "checkpoint": str(tmp_path), "bits": 4}).tag == "palu-x-b4"
