"""The experiment grid (conf/grid/*.yaml): which runs each table needs, and their Hydra overrides.

The Snakefile only expands what this module returns, so a Python user can enumerate the same
runs without Snakemake. A run is a KV-cache method (conf/method/) evaluated on the grid's
corpora; runs are keyed by their `naming.run_name` (the method's tag, then the calibration it
was made from), and their results live at `naming.metrics_path(..., run, ...)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from ..config import CONF_DIR
from ..decompose.checkpoint import rotation_tag
from . import naming

_KEYS = {"model", "tracking", "work", "results", "eval", "calibration", "fisher", "rank_multiple",
         "device", "methods", "granularity", "rank_search", "latent_bits", "hadamard", "rank_figure",
         "memory"}
TABLES = ("baseline", "granularity", "rank_search", "latent_bits", "hadamard")


@dataclass(frozen=True)
class PaluSpec:
    """One Palu run: how its checkpoint is made, and the bit width its cache stores latents at."""
    decomposition: str
    rank_method: str
    kept_ratio: float
    group_size: int
    bits: int = 16
    rotation: str = "none"     # seed 0 (the grid's rotations are deterministic per block)

    @property
    def tag(self) -> str:
        return naming.palu_tag(self.decomposition, self.rank_method, self.kept_ratio,
                               self.group_size, self.bits, rotation_tag(self.rotation))

    def overrides(self) -> list[str]:
        return [f"palu.decomposition={self.decomposition}", f"palu.rank_method={self.rank_method}",
                f"palu.kept_ratio={self.kept_ratio}", f"palu.group_size={self.group_size}"] + (
            [] if self.rotation == "none" else [f"palu.rotation={self.rotation}", "palu.rotation_seed=0"])


class Grid:
    def __init__(self, config: dict):
        unknown = set(config) - _KEYS
        if unknown:
            raise ValueError(f"unknown grid keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
        self.c = config
        self.model = config["model"]
        self.work, self.results = config.get("work", "work"), config.get("results", "results")
        self.device = config.get("device", "cpu")
        cal, fis = config["calibration"], config["fisher"]
        self.dtype = self.model_conf().dtype
        self.ctag = naming.calibration_tag(cal["corpus"], cal["samples"], cal["seqlen"], cal["seed"],
                                           self.dtype, cal.get("bos", "auto"))
        self.ftag = naming.fisher_tag(fis["samples"], fis["seqlen"], fis["seed"])

    @classmethod
    def load(cls, path: str | Path) -> "Grid":
        return cls(yaml.safe_load(Path(path).read_text()))

    # ---- parameters --------------------------------------------------------------------------
    def model_conf(self):
        path = Path(CONF_DIR) / "model" / f"{self.model}.yaml"
        if not path.is_file():
            raise ValueError(f"grid model {self.model!r}: no {path}")
        return OmegaConf.merge({"dtype": "float32"}, OmegaConf.load(path))

    def kv_heads(self) -> int:
        return self._kv_heads

    @cached_property
    def _kv_heads(self) -> int:
        # once per grid: without a prepared model this parses the GGUF file (seconds), and
        # Snakemake asks for the runs in every input function
        from ..models.adapters import geometry_of
        from ..models.loading import load_config
        model_id = naming.model_source(self.work, self.model, self.model_conf().id)
        return geometry_of(load_config(model_id)).num_kv_heads

    def group_sizes(self, value) -> list[int]:
        if value == "all":
            n = self.kv_heads()
            return [s for s in range(1, n + 1) if n % s == 0]
        return [int(v) for v in (value if isinstance(value, list) else [value])]

    def common_overrides(self) -> list[str]:
        cal, fis = self.c["calibration"], self.c["fisher"]
        return [f"model={self.model}", f"tracking={self.c.get('tracking', 'offline')}",
                f"device={self.device}",
                f"paths.work={self.work}", f"paths.results={self.results}",
                f"calibration.corpus={cal['corpus']}", f"calibration.samples={cal['samples']}",
                f"calibration.seqlen={cal['seqlen']}", f"calibration.seed={cal['seed']}",
                f"calibration.bos={cal.get('bos', 'auto')}", f"data.bos={self.c['eval'].get('bos', 'auto')}",
                f"data.calibration_fraction={self.c['eval'].get('calibration_fraction', 0.3)}",
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

    def latent_bits_specs(self) -> list[PaluSpec]:
        q = self.c.get("latent_bits")
        if not q:
            return []
        # `kv_heads`: one group of all KV heads (J-LRD), whatever the model's head count
        group = self.kv_heads() if q["group_size"] == "kv_heads" else int(q["group_size"])
        return [PaluSpec(q["decomposition"], q["rank_method"], float(q["kept_ratio"]), group, int(b))
                for b in q["bits"]]

    def hadamard_specs(self) -> list[PaluSpec]:
        """One checkpoint per rotation (J-LRD by default), its latents at each bit width."""
        h = self.c.get("hadamard")
        if not h:
            return []
        group = self.kv_heads() if h["group_size"] == "kv_heads" else int(h["group_size"])
        return [PaluSpec(h["decomposition"], h["rank_method"], float(h["kept_ratio"]), group, int(b), r)
                for r in h["rotations"] for b in h["bits"]]

    def method_runs(self) -> dict[str, dict]:
        """The grid's `methods:` list (method configs, as conf/method/ takes them) by tag: cache
        methods evaluated beside the FP16 baseline in the baseline table. A method is added to
        the default tables by one line here, no code."""
        from ..methods import build_method
        out = {}
        for conf in self.c.get("methods") or []:
            method = build_method(conf)
            if hasattr(method, "checkpoint"):
                raise ValueError(f"grid methods: {conf} needs a checkpoint; Palu runs come from the "
                                 "granularity / rank_search / latent_bits entries")
            out[method.tag] = dict(conf)
        return out

    def tables(self) -> list[str]:
        """The tables this grid makes: the baseline always, the others where it has their key."""
        return [t for t in TABLES if t == "baseline" or self.c.get(t)]

    def figure_spec(self) -> PaluSpec:
        f = self.c["rank_figure"]
        return PaluSpec("whitened", f["rank_method"], float(f["kept_ratio"]), int(f["group_size"]))

    def memory_spec(self) -> PaluSpec:
        m = self.c["memory"]
        return PaluSpec("whitened", m["rank_method"], float(m["kept_ratio"]), int(m["group_size"]))

    def specs(self, table: str) -> list[PaluSpec]:
        if table == "baseline":
            return []
        return {"granularity": self.granularity_specs, "rank_search": self.rank_search_specs,
                "latent_bits": self.latent_bits_specs, "hadamard": self.hadamard_specs}[table]()

    def runs(self) -> dict[str, PaluSpec | dict | None]:
        """Every method run of the grid by its run name (None: the FP16 baseline; a dict: a
        method of the grid's `methods:` list)."""
        return dict(self._runs)

    def run_name(self, spec: PaluSpec) -> str:
        """A Palu run's name: what `naming.lineage_of` gives for the checkpoint it will load."""
        return naming.run_name(spec.tag, naming.palu_lineage(self.ctag, self.ftag, spec.rank_method,
                                                             self.c["rank_multiple"]))

    @cached_property
    def _runs(self) -> dict[str, PaluSpec | dict | None]:
        out: dict[str, PaluSpec | dict | None] = {"fp16": None, **self.method_runs()}
        for table in self.tables():
            out.update({self.run_name(s): s for s in self.specs(table)})
        return out

    # ---- paths ---------------------------------------------------------------------------------
    def metrics(self, run: str) -> list[str]:
        ev = self.c["eval"]
        return [str(naming.metrics_path(self.results, self.model, run, corpus, ev["seqlen"],
                                        ev.get("max_tokens"), self.dtype,
                                        ev.get("calibration_fraction", 0.3), ev.get("bos", "auto")))
                for corpus in ev["corpora"]]

    def evaluation_pattern(self) -> str:
        """The evaluate rule's output, with {run} {corpus} {seqlen} {tokens} wildcards."""
        ev = self.c["eval"]
        return str(naming.metrics_path(self.results, self.model, "{run}", "{corpus}", "{seqlen}",
                                       "{tokens}", self.dtype, ev.get("calibration_fraction", 0.3),
                                       ev.get("bos", "auto")))

    def table_inputs(self, table: str) -> list[str]:
        paths = self.metrics("fp16")
        if table == "baseline":
            for run in self.method_runs():
                paths += self.metrics(run)
        for spec in self.specs(table):
            paths += self.metrics(self.run_name(spec))
        return paths

    def ranks_file(self, spec: PaluSpec) -> str:
        return str(naming.ranks_path(self.work, self.model, self.ctag, self.ftag, spec.rank_method,
                                     spec.kept_ratio, spec.group_size, self.c["rank_multiple"]))

    def checkpoint(self, spec: PaluSpec) -> str:
        tag = naming.palu_tag(spec.decomposition, spec.rank_method, spec.kept_ratio, spec.group_size,
                              rotation=rotation_tag(spec.rotation))
        return str(naming.checkpoint_dir(self.work, self.model, self.ctag, self.ftag, tag,
                                         self.c["rank_multiple"], spec.rank_method))

    def prepared_model(self) -> str:
        return str(naming.prepared_model_dir(self.work, self.model))

    # ---- what a run needs ----------------------------------------------------------------------
    def run_inputs(self, run: str) -> list[str]:
        spec = self._run(run)
        return [self.prepared_model()] + ([self.checkpoint(spec)] if isinstance(spec, PaluSpec) else [])

    def run_overrides(self, run: str) -> str:
        """The Hydra overrides that select `run`'s method (and its palu.* settings)."""
        spec = self._run(run)
        if spec is None:
            return "method=fp16"
        if isinstance(spec, dict):
            return " ".join([f"method={spec['name']}"] +
                            [f"method.{k}={v}" for k, v in spec.items() if k != "name"])
        return " ".join(spec.overrides() + ["method=palu", f"method.checkpoint={self.checkpoint(spec)}",
                                            f"method.bits={spec.bits}"])

    def _run(self, run: str) -> PaluSpec | dict | None:
        runs = self.runs()
        if run not in runs:
            raise ValueError(f"run {run!r} is not in the grid; its runs: {sorted(runs)}")
        return runs[run]

    def decompose_overrides(self, spec: PaluSpec) -> str:
        return " ".join(spec.overrides())
