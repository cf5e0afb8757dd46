"""The experiment grid (conf/grid/*.yaml): which runs each table needs, and their Hydra overrides.

The Snakefile only expands what this module returns, so a Python user can enumerate the same
runs without Snakemake. A run is a KV-cache method (palu.methods) evaluated on the grid's
corpora; runs are keyed by their `naming.run_name` (the method's tag, then the calibration it
was made from), and their results live at `naming.metrics_path(..., run, ...)`.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import yaml
from omegaconf import OmegaConf

from palu.calib.fisher import FisherWindows
from palu.decompose.checkpoint import rotation_tag
from palu.decompose.lineage import palu_lineage
from palu.eval.suites import SUITES
from palu.pipeline import naming
from palu.pipeline.config import (CONF_DIR, CalibrationConfig, DataConfig, KVQuantConfig,
                                  RecoveryConfig, ZeroshotConfig)
from palu.pipeline.specs import KVQuantSpec, PaluSpec, hydra_overrides, settings_of

_KEYS = {"model", "tracking", "work", "results", "eval", "calibration", "fisher", "rank_multiple",
         "device", "methods", "granularity", "rank_allocation", "latent_bits", "hadamard", "rank_figure",
         "memory", "quantization", "zeroshot", "longcontext", "resources", "factors",
         "recovery", "byte_budget"}
TABLES = ("baseline", "granularity", "rank_allocation", "latent_bits", "hadamard", "quantization", "factors",
          "recovery", "byte_budget")


class Grid:
    def __init__(self, config: dict):
        if "job_threads" in config:
            raise ValueError("grid key job_threads is now resources.threads (the grid's `resources:` "
                             "block, src/palu/pipeline/jobs.py)")
        unknown = set(config) - _KEYS
        if unknown:
            raise ValueError(f"unknown grid keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
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
        self.dtype = self.model_conf().dtype
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

    def scheduler_resources(self, step: str) -> dict:
        """The Snakemake `resources:` of one model job, a GPU included where it needs one."""
        from palu.pipeline.jobs import scheduler_resources
        return scheduler_resources(self.config.get("resources"), self.device, step)

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
        return [int(v) for v in (value if isinstance(value, list) else [value])]

    def common_overrides(self) -> list[str]:
        """What every model step is given: the model, device, folders, the calibration, Fisher
        and evaluation-window settings, the rank multiple (each evaluation adds its corpus)."""
        data = {k: v for k, v in self.data.items() if k not in ("corpus", "path")}
        return ([f"model={self.model}", f"tracking={self.tracking.mode}", f"device={self.device}",
                 f"paths.work={self.work}", f"paths.results={self.results}"]
                + hydra_overrides("calibration", self.calibration) + hydra_overrides("fisher", self.fisher)
                + hydra_overrides("data", data) + [f"palu.rank_multiple={self.config['rank_multiple']}"])

    # ---- runs per table ------------------------------------------------------------------------
    def granularity_specs(self) -> list[PaluSpec]:
        g = self.config["granularity"]
        return [PaluSpec(g["decomposition"], g["rank_method"], float(k), s)
                for s in self.group_sizes(g["group_sizes"]) for k in g["kept_ratios"]]

    def rank_allocation_specs(self) -> list[PaluSpec]:
        r = self.config["rank_allocation"]
        # `group_sizes` (a list; kv_heads = J-LRD) or one `group_size`
        sizes = r.get("group_sizes", [r.get("group_size", 1)])
        groups = [self.kv_heads() if g == "kv_heads" else int(g) for g in sizes]
        return [PaluSpec(r["decomposition"], m, float(k), g)
                for g in groups for k in r["kept_ratios"] for m in r["methods"]]

    def factors_specs(self) -> list[PaluSpec]:
        """The factor-objective ablation: each decomposition (whitened vs attention) at each kept
        ratio and group size, the same ranks."""
        f = self.config.get("factors")
        if not f:
            return []
        from palu.decompose.factors import DECOMPOSITIONS
        stray = [d for d in f["decompositions"] if d not in DECOMPOSITIONS]
        if stray:
            raise ValueError(f"grid factors.decompositions {stray} are not among {list(DECOMPOSITIONS)}")
        groups = [self.kv_heads() if g == "kv_heads" else int(g) for g in f["group_sizes"]]
        return [PaluSpec(d, f["rank_method"], float(k), g)
                for g in groups for k in f["kept_ratios"] for d in f["decompositions"]]

    def recovery_settings(self) -> dict:
        """The grid's recovery settings over the step's defaults (config.RecoveryConfig)."""
        settings = settings_of(RecoveryConfig, self.config.get("recovery"), "recovery",
                               drop=("runs", "corpora"))
        settings.pop("checkpoint")          # the rule passes each run's own
        return settings

    def recovery_tag(self) -> str:
        return naming.recovery_tag(**self.recovery_settings())

    def recovery_overrides(self) -> str:
        return " ".join(hydra_overrides("recovery", self.recovery_settings()))

    def byte_budget_specs(self) -> list[PaluSpec]:
        """(rank, bits) under a byte budget: for each `budgets` entry (kept ratio, bits) the
        uniform checkpoint at that width (the reference) and an error_aware_bytes allocation of
        exactly its latent bytes (its kept ratio: the byte ratio to FP16, 5 decimals)."""
        b = self.config.get("byte_budget")
        if not b:
            return []
        from palu.decompose.bit_alloc import uniform_byte_budget
        group = self.kv_heads() if b["group_size"] == "kv_heads" else int(b["group_size"])
        geom, out = self.geometry, []
        for entry in b["budgets"]:
            kept, bits = float(entry["kept_ratio"]), int(entry["bits"])
            ratio = uniform_byte_budget(geom, kept, group, self.config["rank_multiple"], bits)
            out += [PaluSpec("whitened", "uniform", kept, group, bits),
                    PaluSpec("whitened", "error_aware_bytes", ratio, group, "alloc")]
        return out

    def recovery_specs(self) -> list[PaluSpec]:
        """Each `recovery.runs` entry (uniform ranks, whitened unless given) before and after LoRA
        recovery."""
        r = self.config.get("recovery")
        if not r:
            return []
        tag, out = self.recovery_tag(), []
        for p in r.get("runs", []):
            base = PaluSpec(p.get("decomposition", "whitened"), p.get("rank_method", "uniform"),
                            float(p["kept_ratio"]),
                            self.kv_heads() if p["group_size"] == "kv_heads" else int(p["group_size"]))
            out += [base, PaluSpec(base.decomposition, base.rank_method, base.kept_ratio, base.group_size,
                                   recovery=tag)]
        return out

    def latent_bits_specs(self) -> list[PaluSpec]:
        q = self.config.get("latent_bits")
        if not q:
            return []
        # `kv_heads`: one group of all KV heads (J-LRD), whatever the model's head count
        group = self.kv_heads() if q["group_size"] == "kv_heads" else int(q["group_size"])
        return [PaluSpec(q["decomposition"], q["rank_method"], float(q["kept_ratio"]), group, int(b))
                for b in q["bits"]]

    def hadamard_specs(self) -> list[PaluSpec]:
        """One checkpoint per rotation (J-LRD by default), its latents at each bit width."""
        h = self.config.get("hadamard")
        if not h:
            return []
        group = self.kv_heads() if h["group_size"] == "kv_heads" else int(h["group_size"])
        return [PaluSpec(h["decomposition"], h["rank_method"], float(h["kept_ratio"]), group, int(b), r)
                for r in h["rotations"] for b in h["bits"]]

    def quantization_palu_specs(self) -> list[PaluSpec]:
        """Palu rows of the quantization table: kept ratio x granularity x rotation x bits."""
        p = (self.config.get("quantization") or {}).get("palu")
        if not p:
            return []
        groups = [self.kv_heads() if g == "kv_heads" else int(g) for g in p["group_sizes"]]
        return [PaluSpec(p["decomposition"], p["rank_method"], float(k), g, int(b), r)
                for k in p["kept_ratios"] for g in groups for r in p["rotations"] for b in p["bits"]]

    def _suite_specs(self, key: str) -> list[PaluSpec]:
        """Palu rows of an evaluation suite (zeroshot, longcontext): each entry a kept ratio, group
        size and latent bits (uniform ranks, whitened SVD unless given)."""
        z = self.config.get(key) or {}
        return [PaluSpec(p.get("decomposition", "whitened"), p.get("rank_method", "uniform"),
                         float(p["kept_ratio"]),
                         self.kv_heads() if p["group_size"] == "kv_heads" else int(p["group_size"]),
                         int(p.get("bits", 16)))
                for p in z.get("palu", [])]

    def zeroshot_runs(self) -> dict[str, PaluSpec | KVQuantSpec | dict | None]:
        return self._suite_runs("zeroshot")

    def _suite_runs(self, key: str) -> dict[str, PaluSpec | KVQuantSpec | dict | None]:
        """FP16 (the reference of every paired difference), the entry's Palu runs, its baselines
        and KVQuant at `<key>.kvquant_bits` (fitted for the quantization table)."""
        z = self.config.get(key)
        if not z:
            return {}
        out: dict = {"fp16": None, **{self.run_name(s): s for s in self._suite_specs(key)}}
        out.update(self._configured_methods(z.get("baselines")))
        kv = [s for s in self.kvquant_specs() if s.bits == z.get("kvquant_bits")]
        out.update({self.run_name(s): s for s in kv[:1]})
        return out

    def longcontext_runs(self) -> dict[str, PaluSpec | KVQuantSpec | dict | None]:
        return self._suite_runs("longcontext")

    def longcontext_suites(self) -> dict[str, dict]:
        """Each suite of the grid's `longcontext.suites` with its settings over the suite's
        settings dataclass (registered in palu.eval.suites)."""
        suites = (self.config.get("longcontext") or {}).get("suites") or {}
        unknown = [s for s in suites if s not in SUITES]
        if unknown:
            raise ValueError(f"grid longcontext.suites {unknown} unknown; known: {list(SUITES)}")
        return {name: settings_of(SUITES[name].settings, given, f"longcontext.suites.{name}")
                for name, given in suites.items()}

    def longcontext_tags(self) -> dict[str, str]:
        """Result-file tag -> suite name, for every suite of the grid (each suite's own tag)."""
        return {SUITES[name].tag(SUITES[name].settings(**s), self.dtype): name
                for name, s in self.longcontext_suites().items()}

    def longcontext_pattern(self) -> str:
        """The longcontext rule's output, with {run} and {suite} (a suite's tag) wildcards."""
        return str(naming.longcontext_path(self.results, self.model, "{run}", "{suite}"))

    def longcontext_files(self, suite: str | None = None) -> list[str]:
        return [str(naming.longcontext_path(self.results, self.model, run, tag))
                for tag, name in self.longcontext_tags().items() if suite in (None, name)
                for run in self.longcontext_runs()]

    def longcontext_overrides(self, tag: str) -> str:
        """The Hydra overrides of the suite whose result tag is `tag`."""
        name = self.longcontext_tags()[tag]
        return " ".join([f"longcontext.suite={name}"]
                        + hydra_overrides(f"longcontext.{name}", self.longcontext_suites()[name]))

    def zeroshot_settings(self) -> dict:
        return settings_of(ZeroshotConfig, self.config["zeroshot"], "zeroshot",
                           drop=("palu", "baselines", "kvquant_bits"))

    def zeroshot_files(self) -> list[str]:
        s = self.zeroshot_settings()
        return [str(naming.zeroshot_path(self.results, self.model, run, s["source"], s["limit"],
                                         self.dtype)) for run in self.zeroshot_runs()]

    def zeroshot_pattern(self) -> str:
        s = self.zeroshot_settings()
        return str(naming.zeroshot_path(self.results, self.model, "{run}", s["source"], s["limit"],
                                        self.dtype))

    def zeroshot_overrides(self) -> str:
        return " ".join(hydra_overrides("zeroshot", self.zeroshot_settings()))

    def kvquant_specs(self) -> list[KVQuantSpec]:
        k = (self.config.get("quantization") or {}).get("kvquant")
        if not k:
            return []
        return [KVQuantSpec(int(f["bits"]), f.get("weighting", "fisher"),
                            float(f.get("outlier_fraction", k["outlier_fraction"])))
                for f in k["fits"]]

    def kvquant_ktag(self) -> str:
        """The calibration windows KVQuant's codebooks are fitted on (the state's lineage)."""
        cal, k = self.calibration, self.kvquant_settings(self.kvquant_specs()[0])
        return naming.kvquant_calibration_tag(cal["corpus"], k["samples"], k["seqlen"], k["seed"],
                                              self.dtype, cal["bos"])

    def kvquant_state(self, spec: KVQuantSpec) -> str:
        return str(naming.kvquant_dir(self.work, self.model, self.kvquant_ktag(), spec.tag))

    def kvquant_settings(self, spec: KVQuantSpec) -> dict:
        """The fitting settings of `spec`'s state: the grid's `quantization.kvquant` block (windows,
        tokens) over the schema, the spec's bits / weighting / outliers."""
        given = {**self.config["quantization"]["kvquant"], "bits": spec.bits,
                 "weighting": spec.weighting, "outlier_fraction": spec.outlier_fraction}
        settings = settings_of(KVQuantConfig, given, "quantization.kvquant", drop=("fits",))
        settings.pop("activations")         # the rule passes the capture it fits from
        return settings

    def kvquant_overrides(self, spec: KVQuantSpec) -> str:
        return " ".join(hydra_overrides("kvquant", self.kvquant_settings(spec)))

    def kvquant_states(self) -> dict[str, KVQuantSpec]:
        """Every fitted state the grid needs, by its tag (the fit_kvquant rule's wildcard)."""
        return {spec.tag: spec for spec in self.kvquant_specs()}

    def _configured_methods(self, confs) -> dict[str, dict]:
        from palu.methods import build_method
        out = {}
        for conf in confs or []:
            method = build_method(conf)
            if hasattr(method, "checkpoint") or hasattr(method, "state"):
                raise ValueError(f"grid methods: {conf} needs a checkpoint or fitted state; Palu "
                                 "runs come from the Palu entries, KVQuant from quantization.kvquant")
            out[method.tag] = dict(conf)
        return out

    def method_runs(self) -> dict[str, dict]:
        """The grid's `methods:` list (method configs: a name and its fields) by tag: cache
        methods evaluated beside the FP16 baseline in the baseline table. A method is added to
        the default tables by one line here, no code."""
        return self._configured_methods(self.config.get("methods"))

    def quantization_baselines(self) -> dict[str, dict]:
        """The quantization table's baselines that need no fitted state (Atom, KIVI, ...)."""
        return self._configured_methods((self.config.get("quantization") or {}).get("baselines"))

    def tables(self) -> list[str]:
        """The tables this grid makes: the baseline always, the others where it has their key."""
        return [t for t in TABLES if t == "baseline" or self.config.get(t)]

    def figure_specs(self) -> list[PaluSpec]:
        """rank_allocation.png: the allocations of `rank_figure.rank_methods` (or one
        `rank_method`) at one kept ratio and group size, one panel each."""
        f = self.config["rank_figure"]
        methods = f.get("rank_methods", [f["rank_method"]] if "rank_method" in f else [])
        if not methods:
            raise ValueError("grid rank_figure needs rank_methods (a list) or rank_method")
        group = self.kv_heads() if f["group_size"] == "kv_heads" else int(f["group_size"])
        return [PaluSpec("whitened", m, float(f["kept_ratio"]), group) for m in methods]

    def memory_spec(self) -> PaluSpec:
        m = self.config["memory"]
        return PaluSpec("whitened", m["rank_method"], float(m["kept_ratio"]), int(m["group_size"]))

    def memory_runs(self) -> dict[str, PaluSpec | KVQuantSpec | dict]:
        """Runs whose cache bytes and generated text the cache_memory table shows at a long
        prompt: FP16 (the reference), the memory checkpoint's latents at `memory.bits`,
        `memory.methods`, and KVQuant at `memory.kvquant_bits` (when the quantization table fits it)."""
        m, base = self.config["memory"], self.memory_spec()
        palu = [PaluSpec(base.decomposition, base.rank_method, base.kept_ratio, base.group_size, int(b))
                for b in m.get("bits", [16])]
        out: dict = {"fp16": None, **{self.run_name(s): s for s in palu}}
        out.update(self._configured_methods(m.get("methods")))
        kv = [s for s in self.kvquant_specs() if s.bits == m.get("kvquant_bits")]
        out.update({self.run_name(s): s for s in kv[:1]})
        return out

    def memory_files(self) -> list[str]:
        m = self.config["memory"]
        return [str(naming.memory_path(self.results, self.model, run, m["context"], m["corpus"]))
                for run in self.memory_runs()]

    def outlier_checkpoints(self) -> list[str]:
        """latent_outliers.png: the hadamard table's checkpoint under each of its rotations."""
        h = self.config.get("hadamard")
        if not h:
            return []
        group = self.kv_heads() if h["group_size"] == "kv_heads" else int(h["group_size"])
        return [self.checkpoint(PaluSpec(h["decomposition"], h["rank_method"], float(h["kept_ratio"]),
                                         group, 16, r)) for r in h["rotations"]]

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
            names += list(self.quantization_baselines()) + [self.run_name(s) for s in self.kvquant_specs()]
        return names

    def runs(self) -> dict[str, PaluSpec | KVQuantSpec | dict | None]:
        """Every method run of the grid by its run name (None: the FP16 baseline; a dict: a
        method configured in the grid; a KVQuantSpec: KVQuant with a state the DAG fits)."""
        return dict(self._runs)

    def run_name(self, spec: PaluSpec | KVQuantSpec) -> str:
        """A run's name: what the method's `lineage()` will give for the checkpoint or state it
        loads (`naming.lineage_of` for Palu; the fitting windows for KVQuant)."""
        if isinstance(spec, KVQuantSpec):
            return naming.run_name(spec.tag, (self.kvquant_ktag(),))
        return naming.run_name(spec.tag, palu_lineage(self.ctag, self.ftag, spec.rank_method,
                                                             self.config["rank_multiple"]))

    @cached_property
    def _runs(self) -> dict[str, PaluSpec | KVQuantSpec | dict | None]:
        out: dict[str, PaluSpec | KVQuantSpec | dict | None] = {
            "fp16": None, **self.method_runs(), **self.quantization_baselines()}
        out.update({self.run_name(s): s for s in self.kvquant_specs()})
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
        tag = naming.palu_tag(spec.decomposition, spec.rank_method, spec.kept_ratio, spec.group_size,
                              rotation=rotation_tag(spec.rotation), recovery=spec.recovery)
        return str(naming.checkpoint_dir(self.work, self.model, self.ctag, self.ftag, tag,
                                         self.config["rank_multiple"], spec.rank_method))

    def checkpoints(self) -> dict[str, PaluSpec]:
        """Every checkpoint the grid's runs read, by its folder: the one place a checkpoint's path
        leads back to its spec (the decompose and recover rules look their wildcard up here,
        nothing is parsed back from the path)."""
        out = {}
        for spec in self.runs().values():
            if isinstance(spec, PaluSpec):
                for ck in {spec.checkpoint_spec(), spec.base().checkpoint_spec()}:
                    out[self.checkpoint(ck)] = ck
        return out

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
        spec = self._run(run)
        if isinstance(spec, PaluSpec):
            return [self.prepared_model(), self.checkpoint(spec)]
        if isinstance(spec, KVQuantSpec):
            return [self.prepared_model(), self.kvquant_state(spec)]
        return [self.prepared_model()]

    def run_overrides(self, run: str) -> str:
        """The Hydra overrides that select `run`'s method."""
        spec = self._run(run)
        if spec is None:
            return "method=fp16"
        if isinstance(spec, KVQuantSpec):
            return f"method=kvquant method.state={self.kvquant_state(spec)}"
        if isinstance(spec, dict):
            return " ".join([f"method={spec['name']}"] +
                            [f"method.{k}={v}" for k, v in spec.items() if k != "name"])
        # the checkpoint's manifest says how it was made: no palu.* setting is restated
        return f"method=palu method.checkpoint={self.checkpoint(spec)} method.bits={spec.bits}"

    def _run(self, run: str) -> PaluSpec | dict | None:
        runs = self.runs()
        if run not in runs:
            raise ValueError(f"run {run!r} is not in the grid; its runs: {sorted(runs)}")
        return runs[run]

    def decompose_overrides(self, spec: PaluSpec) -> str:
        return " ".join(spec.overrides())
