"""The layering rule: the library (every subpackage of `palu` but `palu.pipeline`, and the GPU
kernels) imports nothing from the pipeline layer, Hydra / OmegaConf, W&B or Snakemake, so that
`import palu` is all a library user pays for. Checked twice: statically (every import statement,
also those inside functions) and at run time (what importing every library module loads)."""
import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

FORBIDDEN = ("palu.pipeline", "palu_bench", "hydra", "omegaconf", "wandb", "snakemake")
LIBRARY = ROOT / "src" / "palu"
KERNELS = ROOT / "kernels" / "palu_kernels"


def _library_files():
    pipeline = LIBRARY / "pipeline"
    files = [p for p in LIBRARY.rglob("*.py") if pipeline not in p.parents]
    return files + sorted(KERNELS.rglob("*.py"))


def _module_of(path: Path) -> list[str]:
    root = LIBRARY.parent if LIBRARY in path.parents else KERNELS.parent
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _package_of(path: Path) -> list[str]:
    module = _module_of(path)
    return module if path.name == "__init__.py" else module[:-1]


def imports_in(text: str, package: list[str]) -> set[str]:
    """Every module an import statement of `text` names, relative ones resolved in `package`."""
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}   # `from palu import pipeline`
    return out


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def test_the_rule_sees_relative_and_function_level_imports():
    # the checker itself: a module of palu.methods importing the pipeline three ways is caught
    text = ("from ..pipeline import naming\nimport omegaconf\n"
            "def f():\n    from ..pipeline.grid import Grid\n")
    found = {m for m in imports_in(text, ["palu", "methods"]) if _forbidden(m)}
    assert {"palu.pipeline", "palu.pipeline.naming", "omegaconf", "palu.pipeline.grid"} <= found
    assert not any(_forbidden(m) for m in imports_in("from ..decompose import lineage\n",
                                                     ["palu", "methods"]))


def test_library_imports_nothing_from_the_pipeline_layer():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imports_in(p.read_text(), _package_of(p))
                                            if _forbidden(m))
           for p in _library_files()}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"library modules import the pipeline layer / Hydra / W&B / Snakemake: {bad}"


def test_importing_the_library_loads_no_pipeline_module():
    modules = sorted(".".join(_module_of(p)) for p in _library_files())
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r}))\n"
            "print(','.join(bad))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"importing the library loaded {proc.stdout.strip()}"
