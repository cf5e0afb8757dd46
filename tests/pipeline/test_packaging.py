"""The wheel carries the three packages and the Hydra config tree, so entry points work after a
non-editable `pip install .` (the tree is read from the package, not from a checkout)."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_wheel_ships_packages_and_the_config_tree(tmp_path):
    # built from a copy: pip builds a local folder in place, and its build/ would land in the checkout
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "README.md", "src", "kernels", "benchmarks", "conf"):
        if (ROOT / part).is_dir():   # src/palu/pipeline/conf stays a link to conf/, as in the checkout
            shutil.copytree(ROOT / part, src / part, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / part, src / part)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("palu-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert conf and {f"palu/pipeline/conf/{c}" for c in conf} <= names          # every YAML of conf/
    for module in ("palu/methods/palu.py", "palu/quant/packed.py", "palu/pipeline/cli/evaluate.py", "palu_kernels/palu_decode.py", "palu_kernels/launch_defaults.py",
                   "palu_bench/cli/table.py", "palu_bench/conf/bench/decode.yaml",
                   "palu/eval/lmeval_tasks/piqa.yaml", "palu/eval/lmeval_tasks/embedded.py"):
        assert module in names
    assert not any(n.startswith(("tests/", "kernels/", "benchmarks/")) for n in names)
