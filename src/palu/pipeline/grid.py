"""The experiment grid (conf/grid/*.yaml): which runs each table needs, and their Hydra overrides.

The Snakefile only expands what this module returns, so a Python user can enumerate the same
runs without Snakemake. A run is a KV-cache method (palu.methods) evaluated on the grid's
corpora; runs are `specs.RunSpec`s keyed by their name (`RunSpec.name`: the method's tag, then the
calibration it was made from), and their results live at `naming.metrics_path(..., run, ...)`.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import re
import shlex

import yaml
from omegaconf import OmegaConf

from palu.calib.fisher import FisherWindows
from palu.pipeline import naming
from palu.pipeline.config import CONF_DIR, DTYPES, CalibrationConfig, DataConfig
from palu.pipeline.grid_sections import GridSections
from palu.pipeline.specs import FP16, PaluSpec, RunSpec, hydra_overrides, settings_of, shell_join

_KEYS = {"model", "dtype", "tracking", "work", "results", "eval", "calibration", "fisher", "rank_multiple",
         "device", "methods", "granularity", "rank_allocation", "latent_bits", "hadamard", "rank_figure",
         "memory", "quantization", "zeroshot", "longcontext", "resources", "factors",
         "recovery", "byte_budget"}
# What a grid value may hold: it becomes a path component and a command-line argument of a
# Snakemake `shell:` step, so nothing a shell reads (spaces, quotes, $, `, ;, |, &, <, >, (, ),
# globs, backslashes) may pass.
SHELL_SAFE = re.compile(r"[A-Za-z0-9._+=/,:@%~-]*")
TABLES = ("baseline", "granularity", "rank_allocation", "latent_bits", "hadamard", "quantization", "factors",
          "recovery", "byte_budget")


def check_shell_safe(node, where: str = "grid") -> None:
    """Every key and string value of a grid is a plain token (`SHELL_SAFE`): a grid file is
    untrusted input that reaches shell commands (issue 51, item 7)."""
    if isinstance(node, dict):
        for key, value in node.items():
            check_shell_safe(str(key), f"{where} key")
            check_shell_safe(value, f"{where}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_shell_safe(value, f"{where}[{i}]")
    elif isinstance(node, str) and not SHELL_SAFE.fullmatch(node):
        raise ValueError(f"{where}={node!r}: a grid value may hold only letters, digits and "
                         "._+=/,:@%~- (it becomes a path and a command-line argument; no spaces, "
                         "quotes or shell characters)")


class Grid(GridSections):
    """A grid's runs by name, their paths and the overrides of every step (the sections' own
    specs and settings: grid_sections.py)."""

    def __init__(self, config: dict):
        if "job_threads" in config:
            raise ValueError("grid key job_threads is now resources.threads (the grid's `resources:` "
                             "block, src/palu/pipeline/jobs.py)")
        unknown = set(config) - _KEYS
        if unknown:
            raise ValueError(f"unknown grid keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
        check_shell_safe(config)
        self.config = config
        self.model = config["model"]
        self.work, self.results = config.get("work", "work"), config.get("results", "results")
        self.device = config.get("device", "cpu")
        from palu.pipeline.jobs import MODEL_STEPS
        for step in MODEL_STEPS:        # a bad device or `resources:` value stops the plan here
            self.job_resources(step)
        # each step's settings: the grid's section over the step's schema (its defaults)
        self.calibration = settings_of(CalibrationConfig, config["calibration"], "calibration")
        self.fisher = settings_of(FisherWindows, config["fisher"], "fisher")
        # evaluation windows; the corpus is each evaluation's own
        self.data = settings_of(DataConfig, config["eval"], "eval", drop=("corpora",))
        # the grid's `dtype:` (e.g. float16 on a GPU) over the model's; it is in every tag, so
        # results of another precision never share a path
        self.dtype = config.get("dtype") or self.model_conf().dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"grid dtype={self.dtype!r} is not one of {list(DTYPES)}")
        cal, fis = self.calibration, self.fisher
        self.ctag = naming.calibration_tag(cal["corpus"], cal["samples"], cal["seqlen"], cal["seed"],
                                           self.dtype, cal["bos"])
        self.ftag = naming.fisher_tag(fis["samples"], fis["seqlen"], fis["seed"])

    @classmethod
    def load(cls, path: str | Path) -> "Grid":
        return cls(yaml.safe_load(Path(path).read_text()))

    # ---- parameters --------------------------------------------------------------------------
    @property
    def tracking(self) -> SimpleNamespace:
        """The grid's W&B setting (`tracking: offline | online | disabled`) and its folder."""
        return SimpleNamespace(mode=self.config.get("tracking", "offline"), upload="small",
                               dir=str(Path(self.work) / "wandb"))

    def job_resources(self, step: str):
        """Threads, host memory and wall time of one model job (`jobs.job_resources`)."""
        from palu.pipeline.jobs import job_resources
        return job_resources(self.config.get("resources"), self.device, step)

    def scheduler_resources(self, step: str, shared_by: int | None = None) -> dict:
        """The Snakemake `resources:` of one model job, a GPU included where it needs one (its
        `gpu_shares` of a local run's `shared_by` GPU slots)."""
        from palu.pipeline.jobs import scheduler_resources
        return scheduler_resources(self.config.get("resources"), self.device, step, shared_by)

    def gpu_share(self, step: str, shared_by: int, memory: str | None) -> str | None:
        """A local job's memory cap on the shared GPU (`palu.pipeline.jobs.gpu_share`); None for a
        step that does not use the GPU, or one job with the whole GPU."""
        from palu.pipeline.jobs import gpu_share, uses_gpu
        if not uses_gpu(self.device, step):
            return None
        return gpu_share(shared_by, memory, self.job_resources(step).gpu_shares)

    def model_conf(self):
        path = Path(CONF_DIR) / "model" / f"{self.model}.yaml"
        if not path.is_file():
            raise ValueError(f"grid model {self.model!r}: no {path}")
        return OmegaConf.merge({"dtype": "float32"}, OmegaConf.load(path))

    def kv_heads(self) -> int:
        return self.geometry.num_kv_heads

    @cached_property
    def geometry(self):
        # once per grid: without a prepared model this parses the GGUF file (seconds), and
        # Snakemake asks for the runs in every input function
        from palu.models.loading import load_geometry
        return load_geometry(naming.model_source(self.work, self.model, self.model_conf().id))

    def group_sizes(self, value) -> list[int]:
        if value == "all":
            n = self.kv_heads()
            return [s for s in range(1, n + 1) if n % s == 0]
        return [self.group(v) for v in (value if isinstance(value, list) else [value])]

    def common_overrides(self) -> list[str]:
        """What every model step is given: the model, device, folders, the calibration, Fisher
        and evaluation-window settings, the rank multiple (each evaluation adds its corpus)."""
        data = {k: v for k, v in self.data.items() if k not in ("corpus", "path")}
        return [shlex.quote(x) for x in
                [f"model={self.model}", f"tracking={self.tracking.mode}", f"device={self.device}",
                 f"paths.work={self.work}", f"paths.results={self.results}",
                 *([f"model.dtype={self.dtype}"] if self.config.get("dtype") else []),
                 *hydra_overrides("calibration", self.calibration), *hydra_overrides("fisher", self.fisher),
                 *hydra_overrides("data", data), f"palu.rank_multiple={self.config['rank_multiple']}"]]

    def tables(self) -> list[str]:
        """The tables this grid makes: the baseline always, the others where it has their key."""
        return [t for t in TABLES if t == "baseline" or self.config.get(t)]

    def specs(self, table: str) -> list[PaluSpec]:
        """The Palu runs of a table."""
        if table == "baseline":
            return []
        return {"granularity": self.granularity_specs, "rank_allocation": self.rank_allocation_specs,
                "latent_bits": self.latent_bits_specs, "hadamard": self.hadamard_specs,
                "quantization": self.quantization_palu_specs, "factors": self.factors_specs,
                "recovery": self.recovery_specs, "byte_budget": self.byte_budget_specs}[table]()

    def table_runs(self, table: str) -> list[str]:
        """Every run of a table by name: FP16, its Palu runs, and its other methods."""
        names = ["fp16"] + [self.run_name(s) for s in self.specs(table)]
        if table == "baseline":
            names += list(self.method_runs())
        if table == "quantization":
            names += list(self.quantization_baselines())
        names += [self.run_name(s) for s in self.fitted_specs() if s.table == table]
        return names

    def runs(self) -> dict[str, RunSpec]:
        """Every method run of the grid by its run name (`specs.RunSpec`: a configured method,
        FP16 included; a Palu checkpoint's run; a fitted method's state, `fitted.FittedSpec`)."""
        return dict(self._runs)

    def run_name(self, spec: RunSpec) -> str:
        """A run's name: what the method's `lineage()` will give for what it loads."""
        return spec.name(self)

    @cached_property
    def _runs(self) -> dict[str, RunSpec]:
        out: dict[str, RunSpec] = {"fp16": FP16, **self.method_runs(), **self.quantization_baselines()}
        out.update({self.run_name(s): s for s in self.fitted_specs()})
        if self.config.get("memory"):
            out.update(self.memory_runs())
        out.update(self.zeroshot_runs())
        out.update(self.longcontext_runs())
        for table in self.tables():
            out.update({self.run_name(s): s for s in self.specs(table)})
        return out

    # ---- paths ---------------------------------------------------------------------------------
    def metrics(self, run: str, corpora: list[str] | None = None) -> list[str]:
        return [str(self.metrics_path(run, corpus)) for corpus in corpora or self.config["eval"]["corpora"]]

    def metrics_path(self, run: str, corpus: str):
        d = self.data
        return naming.metrics_path(self.results, self.model, run, corpus, d["seqlen"], d["max_tokens"],
                                   self.dtype, d["calibration_fraction"], d["bos"])

    def table_corpora(self, table: str) -> list[str]:
        """The corpora a table evaluates on: its own `corpora:` (a subset of eval.corpora), else all."""
        own = (self.config.get(table) or {}).get("corpora") if isinstance(self.config.get(table), dict) else None
        if own is None:
            return list(self.config["eval"]["corpora"])
        stray = [c for c in own if c not in self.config["eval"]["corpora"]]
        if stray:
            raise ValueError(f"grid {table}.corpora {stray} are not in eval.corpora {self.config['eval']['corpora']}")
        return list(own)

    def evaluation_pattern(self) -> str:
        """The evaluate rule's output, with {run} and {corpus} wildcards (the windows are the grid's)."""
        return str(self.metrics_path("{run}", "{corpus}"))

    def table_inputs(self, table: str) -> list[str]:
        corpora = self.table_corpora(table)
        return [path for run in self.table_runs(table) for path in self.metrics(run, corpora)]

    def ranks_file(self, spec: PaluSpec) -> str:
        return str(naming.ranks_path(self.work, self.model, self.ctag, self.ftag, spec.rank_method,
                                     spec.kept_ratio, spec.group_size, self.config["rank_multiple"]))

    def checkpoint(self, spec: PaluSpec) -> str:
        """The folder of the checkpoint `spec` reads (named by its checkpoint spec's tag)."""
        return str(naming.checkpoint_dir(self.work, self.model, self.ctag, self.ftag, spec.checkpoint_spec().tag,
                                         self.config["rank_multiple"], spec.rank_method))

    def checkpoints(self) -> dict[str, PaluSpec]:
        """Every checkpoint the grid's runs read, by its folder: the one place a checkpoint's path
        leads back to its spec (the decompose and recover rules look their wildcard up here,
        nothing is parsed back from the path)."""
        return {self.checkpoint(ck): ck for spec in self.runs().values() for ck in spec.checkpoints()}

    def ranks_files(self) -> dict[str, PaluSpec]:
        """Every ranks file the grid's checkpoints and the rank figure read, by its path (the
        ranks rules' lookup)."""
        # a ranks file depends on the allocator, kept ratio and group size only
        specs = [PaluSpec("whitened", s.rank_method, s.kept_ratio, s.group_size)
                 for s in (*self.checkpoints().values(), *self.figure_specs())]
        return {self.ranks_file(s): s for s in specs}

    def prepared_model(self) -> str:
        return str(naming.prepared_model_dir(self.work, self.model))

    # ---- what a run needs ----------------------------------------------------------------------
    def run_inputs(self, run: str) -> list[str]:
        return self._run(run).inputs(self)

    def run_overrides(self, run: str) -> str:
        """The Hydra overrides that select `run`'s method."""
        return shell_join(self._run(run).method_overrides(self))

    def _run(self, run: str) -> RunSpec:
        runs = self.runs()
        if run not in runs:
            raise ValueError(f"run {run!r} is not in the grid; its runs: {sorted(runs)}")
        return runs[run]

    def decompose_overrides(self, spec: PaluSpec) -> str:
        return shell_join(spec.overrides())
