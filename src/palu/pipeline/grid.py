"""The experiment grid (conf/grid/*.yaml): which runs each table needs, and their Hydra overrides.

The Snakefile only expands what this module returns, so a Python user can enumerate the same
runs without Snakemake.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from . import naming

CONF = Path(__file__).resolve().parents[3] / "conf"
_KEYS = {"model", "tracking", "work", "results", "eval", "calibration", "fisher", "rank_multiple",
         "granularity", "rank_search", "rank_figure", "memory"}


@dataclass(frozen=True)
class PaluSpec:
    decomposition: str
    rank_method: str
    kept_ratio: float
    group_size: int

    @property
    def tag(self) -> str:
        return naming.palu_tag(self.decomposition, self.rank_method, self.kept_ratio, self.group_size)

    def overrides(self) -> list[str]:
        return [f"palu.decomposition={self.decomposition}", f"palu.rank_method={self.rank_method}",
                f"palu.kept_ratio={self.kept_ratio}", f"palu.group_size={self.group_size}"]


class Grid:
    def __init__(self, config: dict):
        unknown = set(config) - _KEYS
        if unknown:
            raise ValueError(f"unknown grid keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
        self.c = config
        self.model = config["model"]
        self.work, self.results = config.get("work", "work"), config.get("results", "results")
        cal, fis = config["calibration"], config["fisher"]
        self.ctag = naming.calibration_tag(cal["corpus"], cal["samples"], cal["seqlen"], cal["seed"])
        self.ftag = naming.fisher_tag(fis["samples"], fis["seqlen"], fis["seed"])

    @classmethod
    def load(cls, path: str | Path) -> "Grid":
        return cls(yaml.safe_load(Path(path).read_text()))

    # ---- parameters --------------------------------------------------------------------------
    def kv_heads(self) -> int:
        from ..models.adapters import geometry_of
        from ..models.loading import load_config
        model_id = naming.model_source(self.work, self.model,
                                       OmegaConf.load(CONF / "model" / f"{self.model}.yaml").id)
        return geometry_of(load_config(model_id)).num_kv_heads

    def group_sizes(self, value) -> list[int]:
        if value == "all":
            n = self.kv_heads()
            return [s for s in range(1, n + 1) if n % s == 0]
        return [int(v) for v in (value if isinstance(value, list) else [value])]

    def common_overrides(self) -> list[str]:
        cal, fis = self.c["calibration"], self.c["fisher"]
        return [f"model={self.model}", f"tracking={self.c.get('tracking', 'offline')}",
                f"paths.work={self.work}", f"paths.results={self.results}",
                f"calibration.corpus={cal['corpus']}", f"calibration.samples={cal['samples']}",
                f"calibration.seqlen={cal['seqlen']}", f"calibration.seed={cal['seed']}",
                f"fisher.samples={fis['samples']}", f"fisher.seqlen={fis['seqlen']}",
                f"fisher.seed={fis['seed']}", f"palu.rank_multiple={self.c['rank_multiple']}"]

    # ---- runs per table ------------------------------------------------------------------------
    def granularity_specs(self) -> list[PaluSpec]:
        g = self.c["granularity"]
        return [PaluSpec(g["decomposition"], g["rank_method"], float(k), s)
                for s in self.group_sizes(g["group_sizes"]) for k in g["kept_ratios"]]

    def rank_search_specs(self) -> list[PaluSpec]:
        r = self.c["rank_search"]
        return [PaluSpec(r["decomposition"], m, float(k), int(r["group_size"]))
                for k in r["kept_ratios"] for m in r["methods"]]

    def figure_spec(self) -> PaluSpec:
        f = self.c["rank_figure"]
        return PaluSpec("whitened", f["rank_method"], float(f["kept_ratio"]), int(f["group_size"]))

    def memory_spec(self) -> PaluSpec:
        m = self.c["memory"]
        return PaluSpec("whitened", m["rank_method"], float(m["kept_ratio"]), int(m["group_size"]))

    def memory_wildcards(self):
        """The memory run's checkpoint in the Snakefile's wildcard vocabulary."""
        from types import SimpleNamespace
        s = self.memory_spec()
        return SimpleNamespace(decomp=s.decomposition, method=s.rank_method,
                               kept=naming.fmt_ratio(s.kept_ratio), group=str(s.group_size))

    def metrics(self, method_tag: str) -> list[str]:
        ev = self.c["eval"]
        return [str(naming.metrics_path(self.results, self.model, method_tag, corpus, ev["seqlen"],
                                        ev.get("max_tokens")))
                for corpus in ev["corpora"]]

    def table_inputs(self, table: str) -> list[str]:
        specs = {"baseline": [], "granularity": self.granularity_specs(),
                 "rank_search": self.rank_search_specs()}[table]
        paths = self.metrics("fp16")
        for spec in specs:
            paths += self.metrics(spec.tag)
        return paths

    def ranks_file(self, spec: PaluSpec) -> str:
        return str(naming.ranks_path(self.work, self.model, self.ctag, self.ftag, spec.rank_method,
                                     spec.kept_ratio, spec.group_size, self.c["rank_multiple"]))
