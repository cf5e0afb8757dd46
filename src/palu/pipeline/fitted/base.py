"""A method whose state the DAG fits is one `FittedSpec` subclass (issue 52, item 2).

The subclass says everything the pipeline needs of such a method, so the grid, the rules
(workflow/rules/fitted.smk), the two entry points (cli/capture.py, cli/fit.py), the config schema,
the job resources and the W&B artifact kinds ask the registry and name no fitted method:
- `kind`: the method's registered name; also its settings group (`<kind>.*`), its steps
  (`<kind>_capture`, `fit_<kind>`) and its work folder (`work/<kind>/<model>/<windows>/<state>`);
- `settings`: the fit step's settings dataclass (the one home of their defaults);
- `block`: where a grid lists the states to fit (`fits:`, each entry a few of `varied`; the
  block's other keys are the shared settings);
- `captures`: whether one capture of calibration activations (`<kind>_capture`) feeds every
  state of the same windows, or each fit reads the model itself;
- the step bodies (`capture`, `fit`, `load_capture`) and `check` (settings refused by name).
An instance is one state to fit and one run of the grid: a frozen dataclass of the `varied`
settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from palu.pipeline import naming
from palu.registry import Registry
from palu.pipeline.specs import RunSpec, defaults_of, hydra_overrides, settings_of, shell_join

FITTED: Registry = Registry("fitted method")


@dataclass
class CaptureSettings:
    """The settings every fit step on captured calibration activations shares (a spec's
    `settings` extends it with its own, first)."""
    samples: int = 8                    # calibration windows
    seqlen: int = 2048
    seed: int = 2
    tokens_per_window: int = 256        # tokens per window whose activations are kept
    activations: Optional[str] = None   # fit from this capture (step <kind>_capture); null: capture here


def register_fitted(cls: type["FittedSpec"]) -> type["FittedSpec"]:
    """Register a fitted method's spec class (used as a decorator in its module)."""
    return FITTED.register(cls.kind, cls)


def fitted_kind(kind: str | None) -> type["FittedSpec"]:
    """The spec class of `fitted=<kind>` (the fit and capture steps' one choice)."""
    if kind is None:
        raise ValueError(f"this step fits a method's state: give fitted=<one of {sorted(FITTED)}>")
    if kind not in FITTED:
        raise ValueError(f"fitted={kind!r} is not a fitted method; known: {sorted(FITTED)}")
    return FITTED[kind]


def fitted_steps() -> dict[str, str]:
    """Every fitted method's step names -> its kind (`<kind>_capture` where it captures)."""
    out = {}
    for kind, cls in FITTED.items():
        if cls.captures:
            out[f"{kind}_capture"] = kind
        out[f"fit_{kind}"] = kind
    return out


class FittedSpec(RunSpec):
    kind: ClassVar[str]
    settings: ClassVar[type]
    block: ClassVar[tuple[str, ...]]
    varied: ClassVar[tuple[str, ...]]
    captures: ClassVar[bool] = False
    capture_setting: ClassVar[str] = "activations"   # the settings key the fit step reads a capture from
    method_fields: ClassVar[tuple[str, ...]] = ()    # fields of the method a fit entry may set too (not fit settings)
    select_key: ClassVar[str | None] = None          # a table section's key that picks one state
    table: ClassVar[str | None] = None               # the table whose runs are every state
    positive: ClassVar[tuple[str, ...]] = ()         # settings that must be positive integers

    # ---- what the subclass writes -------------------------------------------------------------
    @property
    def tag(self) -> str:
        """The state's name (its folder)."""
        raise NotImplementedError

    def run_tag(self) -> str:
        """The method's tag for this run (what `build_method(...).tag` gives once the state
        exists): the state's tag unless the method's own fields add to it."""
        return self.tag

    def selected_by(self, value) -> bool:
        """Whether a table section's `select_key: value` picks this state."""
        return False

    @classmethod
    def check(cls, settings) -> None:
        """Refuse bad settings by name (ValueError); `settings` has the group's keys."""

    @classmethod
    def capture_gradients(cls, settings, for_state: bool) -> bool:
        """Whether the capture keeps the activations' squared gradients (a backward pass a window);
        `for_state`: the fit captures for its own state alone, not for every state."""
        return False

    @classmethod
    def capture(cls, model, windows, settings, info: dict, progress: bool, for_state: bool = False):
        """What the fit reads of the model on the calibration windows (an object with `save`,
        `info`): by default sampled tokens' keys and values per layer (palu.calib.kvquant)."""
        from palu.calib.kvquant import capture_activations
        return capture_activations(model, windows, fisher=cls.capture_gradients(settings, for_state),
                                   tokens_per_window=settings["tokens_per_window"], seed=settings["seed"],
                                   progress=progress, info=info)

    @classmethod
    def load_capture(cls, path: str):
        from palu.calib.kvquant import KVQuantActivations
        return KVQuantActivations.load(path)

    @classmethod
    def fit(cls, captured, settings, device: str):
        """The fitted state (an object with `save(folder)`, `tag` and `info`) from a capture."""
        raise NotImplementedError

    @classmethod
    def metrics(cls, made, settings) -> dict:
        """What a capture or a fitted state reports to W&B."""
        return {"tokens": made.info["tokens"]}

    # ---- what the pipeline asks -----------------------------------------------------------------
    @classmethod
    def from_block(cls, block: dict, where: str) -> list["FittedSpec"]:
        """The states a grid block lists (`fits:`): each fit entry's `varied` values, else the
        block's, else the settings' defaults."""
        defaults = defaults_of(cls.settings)
        out = []
        for i, fit in enumerate(block.get("fits") or []):
            stray = sorted(set(fit) - set(cls.varied) - set(cls.method_fields))
            if stray:
                raise ValueError(f"grid {where}.fits[{i}] has unknown keys {stray}; a fit sets some of "
                                 f"{list(cls.varied + cls.method_fields)}")
            values = {k: fit.get(k, block.get(k, defaults[k])) for k in cls.varied}
            options = tuple(sorted((k, fit[k]) for k in cls.method_fields if k in fit))
            out.append(cls(**{k: type(defaults[k])(v) for k, v in values.items()},
                           **({"options": options} if cls.method_fields else {})))
        if not out:
            raise ValueError(f"grid {where} lists no fits")
        return out

    def fields(self) -> dict:
        """The fit settings this state varies."""
        return {k: getattr(self, k) for k in self.varied}

    @classmethod
    def windows_tag(cls, corpus: str, bos: str, settings, dtype: str) -> str:
        """The calibration windows a state is fitted on: its lineage (the run name's suffix and
        the folder every state of the same windows shares)."""
        return naming.calibration_tag(corpus, settings["samples"], settings["seqlen"], settings["seed"],
                                      dtype, bos)

    @classmethod
    def windows_tag_of(cls, cfg) -> str:
        """`windows_tag` of an entry point's config."""
        c = cfg.calibration
        return cls.windows_tag(c.corpus, c.bos, cfg[cls.kind], cfg.model.dtype)

    def state_settings(self, grid: "Grid") -> dict:
        """The fit step's settings for this state: the grid's block over the schema, this
        state's values (the capture the fit reads is the rule's input, not a setting)."""
        block = grid.fitted_block(type(self))
        settings = settings_of(self.settings, {**block, **self.fields()}, ".".join(self.block), drop=("fits",))
        settings.pop(self.capture_setting, None)
        return settings

    def step_overrides(self, grid: "Grid") -> str:
        return shell_join(hydra_overrides(self.kind, self.state_settings(grid)))

    # ---- RunSpec ------------------------------------------------------------------------------
    def name(self, grid: "Grid") -> str:
        """The method's tag, then the calibration windows its state is fitted on."""
        return naming.run_name(self.run_tag(), (grid.fitted_windows(type(self)),))

    def inputs(self, grid: "Grid") -> list[str]:
        return [grid.prepared_model(), grid.fitted_state(self)]

    def method_overrides(self, grid: "Grid") -> list[str]:
        options = [f"method.{k}={v}" for k, v in getattr(self, "options", ())]
        return [f"method={self.kind}", f"method.state={grid.fitted_state(self)}"] + options
