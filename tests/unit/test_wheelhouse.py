"""The offline install for a GPU host (workflow/wheelhouse.py, issue 50 item 1): what it ships
and what it leaves to the host, and what `install` refuses before pip runs. No network here: the
download itself is exercised by `make wheelhouse` (README: sizes and times measured)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))
import wheelhouse  # noqa: E402


def test_the_host_keeps_what_satisfies_every_requirement_and_torch_always():
    needs = {"torch": [">=2.11"], "triton": [], "numpy": [">=1.24", "<3"], "pandas": [">=3.1"],
             "snakemake": [""], "setuptools": [">=38"]}
    pins = {"numpy": "2.4.6", "pandas": "3.1.1", "snakemake": "9.27.1"}
    host = {"torch": "2.11.0", "numpy": "2.5.2", "pandas": "3.0.6", "setuptools": "81.0.0"}
    provided, ship = wheelhouse.plan(needs, pins, host)
    assert provided == {"torch": "2.11.0", "triton": "(the host's own)", "numpy": "2.5.2", "setuptools": "81.0.0"}
    assert ship == ["pandas", "snakemake"]          # pandas 3.0.6 fails >=3.1: ours is shipped
    with pytest.raises(SystemExit, match="setuptools is required .* not pinned"):
        wheelhouse.plan(needs, pins, {})


def test_the_closure_is_palu_and_its_pipeline_without_cuda_packages():
    needs = wheelhouse.closure("3.12")
    assert {"snakemake", "hydra-core", "lm-eval", "wandb", "datasets", "gguf", "transformers",
            "snakemake-executor-plugin-slurm", "torch"} <= set(needs)
    assert not any(n.startswith(("nvidia-", "cuda-")) for n in needs)
    assert ">=2.11" in needs["torch"]


def _house(tmp_path, python, packages=()):
    (tmp_path / "wheelhouse.json").write_text(json.dumps({
        "target": {"python": python}, "host_provides": {}, "requirements": {}, "packages": list(packages)}))
    return tmp_path


def test_install_refuses_another_python_and_a_damaged_wheel(tmp_path):
    with pytest.raises(SystemExit, match="for CPython 2.7 on linux x86_64"):
        wheelhouse.install(_house(tmp_path, "2.7"), tmp_path / "site")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"changed")
    house = _house(tmp_path, here, [{"name": "x", "version": "1.0", "file": "x-1.0-py3-none-any.whl",
                                     "sha256": "0" * 64, "bytes": 7}])
    with pytest.raises(SystemExit, match="sha256 differs .*damaged in transit"):
        wheelhouse.install(house, tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_a_rebuild_deletes_only_the_wheels_its_earlier_build_wrote(tmp_path):
    """A wheel of the user's in the folder stays; a wheel the last build listed and this one no
    longer ships goes (a listed name with a path in it is never followed)."""
    for name in ("old-1.0-py3-none-any.whl", "mine-2.0-py3-none-any.whl", "kept-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"packages": [
        {"file": "old-1.0-py3-none-any.whl"}, {"file": "kept-1.0-py3-none-any.whl"}, {"file": "../escape.whl"}]}))
    (tmp_path.parent / "escape.whl").write_bytes(b"x")
    assert wheelhouse.drop_stale(tmp_path, {"kept-1.0-py3-none-any.whl"}) == ["old-1.0-py3-none-any.whl"]
    assert sorted(p.name for p in tmp_path.glob("*.whl")) == ["kept-1.0-py3-none-any.whl", "mine-2.0-py3-none-any.whl"]
    assert (tmp_path.parent / "escape.whl").exists()
