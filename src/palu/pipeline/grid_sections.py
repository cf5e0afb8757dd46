"""What each section of a grid asks for: the Palu runs (specs) of every table and suite, and the
settings of the steps it configures (recovery, zero-shot, long-context suites, fitted methods).
`Grid` (grid.py) combines them into the grid's runs, paths and overrides."""
from __future__ import annotations

from functools import cached_property

from palu.eval.suites import SUITES
from palu.pipeline import naming
from palu.pipeline.config import RecoveryConfig, ZeroshotConfig
from palu.pipeline.fitted import FITTED, FittedSpec
from palu.pipeline.specs import FP16, MethodSpec, PaluSpec, RunSpec, hydra_overrides, settings_of, shell_join


_REQUIRED = object()


def latent_bits(entry: dict, where: str, default=_REQUIRED):
    """A Palu section's or entry's latent width(s): `latent_bits` (16 unquantised, 8 / 4 / 3 / 2, or
    alloc); `bits` there, the old key, is refused by the new name (a quantiser's `bits` is its code
    width; README, "One word per meaning of bits")."""
    if "bits" in entry:
        raise ValueError(f"grid {where}.bits={entry['bits']!r}: Palu's latent width is now `latent_bits` "
                         "(`bits` is a quantiser's code width: KIVI, Atom, TurboQuant, KVQuant)")
    if "latent_bits" not in entry and default is _REQUIRED:
        raise ValueError(f"grid {where} needs latent_bits (Palu's latent width(s): 16, 8, 4, 3, 2)")
    return entry.get("latent_bits", default)


class GridSections:
    """Mixed into `Grid`: reads `self.config` and the grid's model, tags and run names."""

    def group(self, value) -> int:
        """A section's group size: a number, or `kv_heads` (one group of all KV heads, J-LRD)."""
        if value == "kv_heads":
            return self.kv_heads()
        if isinstance(value, bool) or not (isinstance(value, int) or str(value).isdigit()) or int(value) < 1:
            raise ValueError(f"grid group size {value!r}: a positive integer or kv_heads")
        return int(value)

    def granularity_specs(self) -> list[PaluSpec]:
        g = self.config.get("granularity")
        if not g:
            return []
        return [PaluSpec(g["decomposition"], g["rank_method"], float(k), s)
                for s in self.group_sizes(g["group_sizes"]) for k in g["kept_ratios"]]

    def rank_allocation_specs(self) -> list[PaluSpec]:
        r = self.config.get("rank_allocation")
        if not r:           # a grid without the table (the long-context grid)
            return []
        # `group_sizes` (a list; kv_heads = J-LRD) or one `group_size`; the composition rows
        # (issue 53 item 4): `decompositions` beside `decomposition`, `latent_bits` beside 16
        sizes = r.get("group_sizes", [r.get("group_size", 1)])
        groups = [self.group(g) for g in sizes]
        decompositions = r.get("decompositions", [r.get("decomposition", "whitened")])
        widths = latent_bits(r, "rank_allocation", [16])
        return [PaluSpec(d, m, float(k), g, int(b)) for d in decompositions for b in widths
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
        groups = [self.group(g) for g in f["group_sizes"]]
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
        return shell_join(hydra_overrides("recovery", self.recovery_settings()))

    def byte_budget_specs(self) -> list[PaluSpec]:
        """(rank, bits) under a byte budget: for each `budgets` entry (kept ratio, latent_bits) the
        uniform checkpoint at that width (the reference) and an error_aware_bytes allocation of
        exactly its latent bytes (its kept ratio: the byte ratio to FP16, 5 decimals)."""
        b = self.config.get("byte_budget")
        if not b:
            return []
        from palu.decompose.bit_alloc import uniform_byte_budget
        group = self.group(b["group_size"])
        geom, out = self.geometry, []
        for entry in b["budgets"]:
            kept, bits = float(entry["kept_ratio"]), int(latent_bits(entry, "byte_budget.budgets[]"))
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
                            self.group(p["group_size"]))
            out += [base, PaluSpec(base.decomposition, base.rank_method, base.kept_ratio, base.group_size,
                                   recovery=tag)]
        return out

    def latent_bits_specs(self) -> list[PaluSpec]:
        q = self.config.get("latent_bits")
        if not q:
            return []
        # `kv_heads`: one group of all KV heads (J-LRD), whatever the model's head count
        group = self.group(q["group_size"])
        return [PaluSpec(q["decomposition"], q["rank_method"], float(q["kept_ratio"]), group, int(b))
                for b in latent_bits(q, "latent_bits")]

    def hadamard_specs(self) -> list[PaluSpec]:
        """One checkpoint per rotation (J-LRD by default), its latents at each bit width."""
        h = self.config.get("hadamard")
        if not h:
            return []
        group = self.group(h["group_size"])
        return [PaluSpec(h["decomposition"], h["rank_method"], float(h["kept_ratio"]), group, int(b), r)
                for r in h["rotations"] for b in latent_bits(h, "hadamard")]

    def quantization_palu_specs(self) -> list[PaluSpec]:
        """Palu rows of the quantization table: kept ratio x granularity x rotation x latent_bits."""
        p = (self.config.get("quantization") or {}).get("palu")
        if not p:
            return []
        groups = [self.group(g) for g in p["group_sizes"]]
        return [PaluSpec(p["decomposition"], p["rank_method"], float(k), g, int(b), r)
                for k in p["kept_ratios"] for g in groups for r in p["rotations"]
                for b in latent_bits(p, "quantization.palu")]

    def _suite_specs(self, key: str) -> list[PaluSpec]:
        """Palu rows of an evaluation suite (zeroshot, longcontext): each entry a kept ratio, group
        size and latent bits (uniform ranks, whitened SVD unless given)."""
        z = self.config.get(key) or {}
        known = {"decomposition", "rank_method", "kept_ratio", "group_size", "latent_bits", "method"}
        return [PaluSpec(p.get("decomposition", "whitened"), p.get("rank_method", "uniform"),
                         float(p["kept_ratio"]),
                         self.group(p["group_size"]),
                         int(latent_bits(p, f"{key}.palu[]", 16)), method=p.get("method", "palu"),
                         options=tuple(sorted((k, v) for k, v in p.items() if k not in known)))
                for p in z.get("palu", [])]

    def zeroshot_runs(self) -> dict[str, RunSpec]:
        return self._suite_runs("zeroshot")

    def _suite_runs(self, key: str) -> dict[str, RunSpec]:
        """FP16 (the reference of every paired difference), the entry's Palu runs, its baselines
        and the fitted states it picks (`<key>.kvquant_bits`: `_selected_states`)."""
        z = self.config.get(key)
        if not z:
            return {}
        out: dict = {"fp16": FP16, **{self.run_name(s): s for s in self._suite_specs(key)}}
        out.update(self._configured_methods(z.get("baselines")))
        out.update({self.run_name(s): s for s in self._selected_states(z)})
        return out

    def longcontext_runs(self) -> dict[str, RunSpec]:
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
        batch = (self.config.get("longcontext") or {}).get("batch_size")   # how, not what: only if set
        return shell_join([f"longcontext.suite={name}"]
                          + ([] if batch is None else [f"longcontext.batch_size={batch}"])
                          + hydra_overrides(f"longcontext.{name}", self.longcontext_suites()[name]))

    def zeroshot_settings(self) -> dict:
        return settings_of(ZeroshotConfig, self.config["zeroshot"], "zeroshot",
                           drop=("palu", "baselines", *(c.select_key for c in FITTED.values() if c.select_key)))

    def zeroshot_files(self) -> list[str]:
        s = self.zeroshot_settings()
        return [str(naming.zeroshot_path(self.results, self.model, run, s["source"], s["limit"],
                                         self.dtype)) for run in self.zeroshot_runs()]

    def zeroshot_pattern(self) -> str:
        s = self.zeroshot_settings()
        return str(naming.zeroshot_path(self.results, self.model, "{run}", s["source"], s["limit"],
                                        self.dtype))

    def zeroshot_overrides(self) -> str:
        return shell_join(hydra_overrides("zeroshot", self.zeroshot_settings()))

    def fitted_block(self, spec_class) -> dict:
        """The grid block a fitted method's states are listed in (empty: none)."""
        node = self.config
        for key in spec_class.block:
            node = (node or {}).get(key) if isinstance(node, dict) else None
        return node or {}

    @cached_property
    def _fitted(self) -> dict[str, list[FittedSpec]]:
        """Each fitted method the grid lists, its states (read from its block once)."""
        return {kind: cls.from_block(self.fitted_block(cls), ".".join(cls.block))
                for kind, cls in FITTED.items() if self.fitted_block(cls)}

    def fitted_specs(self, kind: str | None = None) -> list[FittedSpec]:
        """Every state the grid fits (of one `kind`), in the order its blocks list them."""
        return [spec for k, specs in self._fitted.items() if kind in (None, k) for spec in specs]

    def fitted_kinds(self) -> dict[str, type[FittedSpec]]:
        """The fitted methods whose states the grid fits, by kind."""
        return {kind: FITTED[kind] for kind in self._fitted}

    def fitted_windows(self, spec_class) -> str:
        """The calibration windows a fitted method's states are fitted on (their lineage; one
        per kind: its capture is shared)."""
        return self._fitted_windows[spec_class.kind]

    @cached_property
    def _fitted_windows(self) -> dict[str, str]:
        out = {}
        for kind, specs in self._fitted.items():
            cls = FITTED[kind]
            tags = {cls.windows_tag(self.calibration["corpus"], self.calibration["bos"], s.state_settings(self),
                                    self.dtype) for s in specs}
            if len(tags) != 1:
                raise ValueError(f"grid {'.'.join(cls.block)}: its fits must share one set of "
                                 f"calibration windows, got {sorted(tags)}")
            out[kind] = tags.pop()
        return out

    def fitted_state(self, spec: FittedSpec) -> str:
        return str(naming.fitted_dir(self.work, self.model, spec.kind, self.fitted_windows(type(spec)), spec.tag))

    def fitted_capture(self, spec_class) -> str:
        return str(naming.fitted_capture_path(self.work, self.model, spec_class.kind,
                                              self.fitted_windows(spec_class)))

    def fitted_states(self, kind: str) -> dict[str, FittedSpec]:
        """Every state of `kind` the grid needs, by its tag (the fit rule's wildcard)."""
        return {spec.tag: spec for spec in self.fitted_specs(kind)}

    def _selected_states(self, section: dict) -> list[FittedSpec]:
        """The one state per fitted method a table section picks (`kvquant_bits: 3`: the first
        state the grid fits with those bits)."""
        out = []
        for kind, cls in FITTED.items():
            if cls.select_key and section.get(cls.select_key) is not None:
                out += [s for s in self.fitted_specs(kind) if s.selected_by(section[cls.select_key])][:1]
        return out

    def _configured_methods(self, confs) -> dict[str, MethodSpec]:
        from palu.methods import build_method
        out = {}
        for conf in confs or []:
            method = build_method(conf)
            if hasattr(method, "checkpoint") or hasattr(method, "state"):
                fitted = ", ".join(f"{k} from {'.'.join(c.block)}" for k, c in FITTED.items())
                raise ValueError(f"grid methods: {conf} needs a checkpoint or fitted state; Palu "
                                 f"runs come from the Palu entries, fitted methods from their blocks ({fitted})")
            out[method.tag] = MethodSpec(dict(conf))
        return out

    def method_runs(self) -> dict[str, MethodSpec]:
        """The grid's `methods:` list (method configs: a name and its fields) by tag: cache
        methods evaluated beside the FP16 baseline in the baseline table. A method is added to
        the default tables by one line here, no code."""
        return self._configured_methods(self.config.get("methods"))

    def quantization_baselines(self) -> dict[str, MethodSpec]:
        """The quantization table's baselines that need no fitted state (Atom, KIVI, ...)."""
        return self._configured_methods((self.config.get("quantization") or {}).get("baselines"))

    def figure_specs(self) -> list[PaluSpec]:
        """rank_allocation.png: the allocations of `rank_figure.rank_methods` (or one
        `rank_method`) at one kept ratio and group size, one panel each."""
        f = self.config.get("rank_figure")
        if not f:                 # a grid without the figure (the long-context grid)
            return []
        methods = f.get("rank_methods", [f["rank_method"]] if "rank_method" in f else [])
        if not methods:
            raise ValueError("grid rank_figure needs rank_methods (a list) or rank_method")
        group = self.group(f["group_size"])
        return [PaluSpec("whitened", m, float(f["kept_ratio"]), group) for m in methods]

    def memory_spec(self) -> PaluSpec:
        m = self.config["memory"]
        return PaluSpec("whitened", m["rank_method"], float(m["kept_ratio"]), int(m["group_size"]))

    def memory_runs(self) -> dict[str, RunSpec]:
        """Runs whose cache bytes and generated text the cache_memory table shows at a long
        prompt: FP16 (the reference), the memory checkpoint's latents at `memory.latent_bits`,
        `memory.methods`, and the fitted states it picks (`memory.kvquant_bits`: `_selected_states`)."""
        m, base = self.config["memory"], self.memory_spec()
        palu = [PaluSpec(base.decomposition, base.rank_method, base.kept_ratio, base.group_size, int(b))
                for b in latent_bits(m, "memory", [16])]
        out: dict = {"fp16": FP16, **{self.run_name(s): s for s in palu}}
        out.update(self._configured_methods(m.get("methods")))
        out.update({self.run_name(s): s for s in self._selected_states(m)})
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
        group = self.group(h["group_size"])
        return [self.checkpoint(PaluSpec(h["decomposition"], h["rank_method"], float(h["kept_ratio"]),
                                         group, 16, r)) for r in h["rotations"]]
