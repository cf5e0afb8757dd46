"""The typed runs a grid plans, and the one way settings become Hydra overrides.

Every run of a grid is a `RunSpec`: it names itself (the run name its result files carry), lists
the inputs its steps read and gives the overrides that select its method, so the grid asks a spec
and never its type. `MethodSpec` is a method configured in the grid (FP16 included), `PaluSpec` a
Palu checkpoint's run, a `fitted.FittedSpec` a method whose state the DAG fits (KVQuant).

A grid section that configures a step (calibration, fisher, eval, zeroshot, a long-context suite,
recovery, KVQuant fitting) is merged onto that step's schema dataclass (`settings_of`): an unknown
key fails naming it, what the grid leaves out takes the schema's default (palu.pipeline.config is
the one home of defaults), and `hydra_overrides` turns the merged settings into the command
line of the step. No key list or default is written twice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from palu.decompose.checkpoint import rotation_tag
from palu.decompose.lineage import palu_lineage
from palu.pipeline import naming

# A spec's methods take the `Grid` (palu.pipeline.grid) that plans it: its tags, folders and
# steps' settings. Annotated by name only: grid.py imports this module.


def defaults_of(schema) -> dict:
    """A dataclass's init fields with their defaults."""
    return {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(schema) if f.init}


# How a step runs, not what it computes (batch sizes: a batch gives each row what it gives alone):
# passed on only where a grid sets them, so adding one changes no existing job's parameters.
EXECUTION_KEYS = ("batch_size",)


def settings_of(schema, given: dict | None, where: str, drop: tuple[str, ...] = ()) -> dict:
    """`given` (a grid section) over `schema`'s defaults, execution settings (`EXECUTION_KEYS`)
    only where given; `drop`: keys of the section that are the grid's own (run lists, corpora),
    not settings of the step."""
    defaults = defaults_of(schema)
    given = {k: v for k, v in (given or {}).items() if k not in drop}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"grid {where} has unknown keys {unknown}; its settings: {sorted(defaults)}"
                         + (f" (and the grid's own {sorted(drop)})" if drop else ""))
    return {**{k: v for k, v in defaults.items() if k not in EXECUTION_KEYS}, **given}


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)        # a float's shortest round-trip text: Hydra reads back the same number


def hydra_overrides(group: str, settings: dict) -> list[str]:
    """`group.key=value` for every setting, in key order (the grid's key order is no setting),
    unquoted: `shell_join` quotes them for a `shell:` command."""
    return [f"{group}.{key}={_value(value)}" for key, value in sorted(settings.items())]


def shell_join(items: list[str]) -> str:
    """Command-line arguments for a Snakemake `shell:` step, each quoted for the shell (a grid
    value with a space or `$(...)` stays one literal argument)."""
    import shlex
    return " ".join(shlex.quote(x) for x in items)


class RunSpec:
    """One run of a grid: what its results are named, what its steps read, how its method is
    selected. A new kind of run (a method with fitted state) is a new subclass; the grid and the
    rules only call these."""

    def name(self, grid: "Grid") -> str:
        """The run name in its result paths: the method's tag, then what it was made from."""
        raise NotImplementedError

    def inputs(self, grid: "Grid") -> list[str]:
        """What an evaluation of this run reads besides its data: the prepared model, and the
        run's own artifact (a checkpoint, a fitted state)."""
        return [grid.prepared_model()]

    def method_overrides(self, grid: "Grid") -> list[str]:
        """The Hydra overrides that select this run's method (unquoted: `shell_join` quotes)."""
        raise NotImplementedError

    def checkpoints(self) -> tuple["PaluSpec", ...]:
        """The Palu checkpoints this run's artifacts are made from (none but for Palu runs)."""
        return ()


@dataclass(frozen=True)
class MethodSpec(RunSpec):
    """A method configured in the grid (`methods:`, a table's baselines; FP16): its name and its
    fields, nothing fitted by the DAG (a checkpoint or fitted state is refused: `Grid`)."""
    conf: dict = field(hash=False)

    def name(self, grid: "Grid") -> str:
        from palu.methods import build_method
        return build_method(self.conf).tag

    def method_overrides(self, grid: "Grid") -> list[str]:
        return [f"method={self.conf['name']}"] + [f"method.{k}={v}" for k, v in self.conf.items() if k != "name"]


FP16 = MethodSpec({"name": "fp16"})


@dataclass(frozen=True)
class PaluSpec(RunSpec):
    """One Palu run: how its checkpoint is made, and the width its cache stores latents at."""
    decomposition: str
    rank_method: str
    kept_ratio: float
    group_size: int
    latent_bits: int | str = 16   # or "alloc": the per-layer widths of an error_aware_bytes allocation
    rotation: str = "none"     # seed 0 (the grid's rotations are deterministic per block)
    recovery: str = ""         # a naming.recovery_tag: the checkpoint after LoRA recovery
    method: str = "palu"       # or a method on Palu's latents (palu_select, palu_snapkv) ...
    options: tuple = ()        # ... and its own fields, sorted (key, value) pairs

    @property
    def tag(self) -> str:
        return naming.palu_tag(self.decomposition, self.rank_method, self.kept_ratio,
                               self.group_size, self.latent_bits, rotation_tag(self.rotation),
                               self.recovery) + self.method_suffix()

    def method_suffix(self) -> str:
        """The method's own tag suffix (from its fields: no checkpoint needed to name the run)."""
        if self.method == "palu":
            return ""
        from palu.methods import build_method
        return build_method({"name": self.method, "checkpoint": "-", **dict(self.options)}).method_suffix

    def option_overrides(self) -> list[str]:
        """The fields of a method on Palu's latents (`options`)."""
        return [f"method.{k}={_value(v)}" for k, v in self.options]

    def name(self, grid: "Grid") -> str:
        """What the method's `lineage()` gives for the checkpoint it loads (`naming.lineage_of`)."""
        return naming.run_name(self.tag, palu_lineage(grid.ctag, grid.ftag, self.rank_method,
                                                      grid.config["rank_multiple"]))

    def inputs(self, grid: "Grid") -> list[str]:
        return [grid.prepared_model(), grid.checkpoint(self)]

    def method_overrides(self, grid: "Grid") -> list[str]:
        # the checkpoint's manifest says how it was made: no palu.* setting is restated
        return [f"method={self.method}", f"method.checkpoint={grid.checkpoint(self)}",
                f"method.latent_bits={self.latent_bits}"] + self.option_overrides()

    def checkpoints(self) -> tuple["PaluSpec", ...]:
        """The checkpoint it reads, and (after recovery) the one recovery starts from."""
        return tuple(dict.fromkeys((self.checkpoint_spec(), self.base().checkpoint_spec())))

    def base(self) -> "PaluSpec":
        """The same run without recovery (the checkpoint recovery starts from)."""
        return PaluSpec(self.decomposition, self.rank_method, self.kept_ratio, self.group_size,
                        self.latent_bits, self.rotation)

    def checkpoint_spec(self) -> "PaluSpec":
        """The checkpoint this run reads (its latents' bit width is the cache's, not the checkpoint's;
        a method on Palu's latents reads the plain Palu checkpoint)."""
        return dataclasses.replace(self, latent_bits=16, method="palu", options=())

    def overrides(self) -> list[str]:
        """The palu.* settings that make this run's checkpoint (steps ranks and decompose)."""
        return hydra_overrides("palu", {"decomposition": self.decomposition,
                                        "rank_method": self.rank_method,
                                        "kept_ratio": self.kept_ratio, "group_size": self.group_size,
                                        "rotation": self.rotation, "rotation_seed": 0})
