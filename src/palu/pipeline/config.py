"""Config schema shared by every entry point: typed, validated, with errors that name the key.

These dataclasses are the one home of every setting's default: `register()` stores each group's
dataclass as that group's `default` option in Hydra's ConfigStore (and every KV-cache method's
fields, from its own dataclass, as the `method` group's options), so `conf/` holds only choices
(models, corpora, tracking modes, grids) and no copy of a default. `validate(cfg)` merges the
composed config onto the schema (a misspelled key or a wrong type fails at start) and checks
value ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from palu.calib.fisher import FisherWindows
from palu.data.windows import BOS_SETTINGS
from palu.decompose.factors import DECOMPOSITIONS
from palu.decompose.ranks import get_allocator, is_rank_method
from palu.decompose.heads import HEAD_ORDERS
from palu.decompose.rotation import ROTATIONS


CONF_DIR = str(Path(__file__).resolve().parent / "conf")   # src/palu/pipeline/conf links to the top-level conf/


class ConfigError(ValueError):
    """A config value is out of range or inconsistent; the message names the key."""


@dataclass
class ModelConfig:
    name: str = "???"          # short name used in paths and tables
    id: str = "???"            # HF id, local folder, .gguf file or pkg://package/file.gguf
    dtype: str = "float32"
    family: str = "auto"       # informational; the adapter is chosen from the loaded config


@dataclass
class DataConfig:
    corpus: str = "wiki_standin"
    path: Optional[str] = None          # folder with the original files for real corpora
    seqlen: int = 2048
    max_tokens: Optional[int] = None    # evaluate only the first windows covering this many tokens
    calibration_fraction: float = 0.3
    bos: str = "auto"                   # windows start with BOS: auto (as the tokenizer) | always | never
    batch_size: int = 1                 # perplexity windows a forward scores (a GPU takes many)


@dataclass
class CalibrationConfig:
    corpus: str = "wiki_standin"
    path: Optional[str] = None
    samples: int = 24
    seqlen: int = 2048
    seed: int = 0
    bos: str = "auto"                   # as data.bos, for the calibration (and Fisher) windows


@dataclass
class PaluConfig:
    kept_ratio: float = 0.5             # latent size / original K+V size ("Palu-50%" = 0.5)
    group_size: int = 1                 # KV heads per factorisation: 1 = M-LRD, all = J-LRD
    rank_method: str = "uniform"        # uniform | fisher | fisher_uniform | fisher_sqrt | fisher_rms |
                                        # error_aware | probe_select | error_aware_bytes
    decomposition: str = "whitened"     # whitened | plain | attention (output-weighted)
    rank_multiple: int = 8
    fuse: bool = True                   # fold B_v into o_proj (and B_k into q_proj without RoPE)
    rotation: str = "none"              # latent rotation fused into the factors: none | hadamard | random_orthogonal
    rotation_seed: int = 0              # random_orthogonal (and ranks without a known Hadamard order)
    head_order: str = "none"            # G-LRD: none | similarity (KV heads grouped by output CKA)


@dataclass
class RecoveryConfig:
    """LoRA recovery of a Palu checkpoint (step recover, palu.recover.lora) on calibration text."""
    rank: int = 8                       # inner rank of each latent projection's delta
    steps: int = 16                     # optimiser steps, one window each
    lr: float = 0.001
    init_scale: float = 0.01
    samples: int = 16                   # windows drawn from calibration.corpus (cycled)
    seqlen: int = 256
    seed: int = 3                       # other windows than the Gram's (0) and the Fisher's (1)
    checkpoint: Optional[str] = None    # the Palu checkpoint to recover


@dataclass
class ZeroshotConfig:
    # the paper's six tasks (palu.eval.zeroshot.TASKS); validation splits
    tasks: List[str] = field(default_factory=lambda: ["piqa", "arc_easy", "arc_challenge",
                                                      "hellaswag", "winogrande", "openbookqa"])
    limit: Optional[int] = 20           # first N documents of each task, the same for every method (null: all)
    source: str = "embedded"            # embedded (the wheel's data) | hub (lm-eval's own tasks)
    seed: int = 0
    batch_size: Any = 1                 # requests a forward scores (int | auto); methods that cannot batch exactly use 1


def _longcontext_schema() -> type:
    """`longcontext`: the suite a run picks, how many prompts a batch answers (an int or "auto":
    the largest that fits the GPU, halved on out-of-memory; answers equal batch 1's, exactly in
    float64 and up to fp16 reductions on a GPU), and one settings group per registered suite
    (its dataclass in palu.eval.<suite>, the one home of its defaults)."""
    from dataclasses import make_dataclass

    from palu.eval.suites import SUITES
    # prompts_only: build (or read) the suite's prompts into the work folder's cache and stop, no
    # answer, no result (suites that cache them): once on a CPU before a GPU lease, say
    return make_dataclass("LongContextConfig", [("suite", str, "needles"), ("batch_size", Any, 1),
                                                ("prompts_only", bool, False)] + [
        (name, suite.settings, field(default_factory=suite.settings)) for name, suite in SUITES.items()])


LongContextConfig = _longcontext_schema()


@dataclass
class GenerateConfig:
    context: int = 4096                 # prefill length whose cache memory is measured
    prompt: str = "The history of the university began in"
    new_tokens: int = 40


@dataclass
class TrackingConfig:
    mode: str = "offline"               # offline | online | disabled
    project: str = "palu"
    entity: Optional[str] = None
    dir: str = "${paths.work}/wandb"
    upload: str = "small"               # artifact bytes to W&B: none | small (files <= 1 MiB) | all


@dataclass
class PathsConfig:
    work: str = "work"
    results: str = "results"


@dataclass
class CoreConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    fisher: FisherWindows = field(default_factory=FisherWindows)
    palu: PaluConfig = field(default_factory=PaluConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    zeroshot: ZeroshotConfig = field(default_factory=ZeroshotConfig)
    longcontext: LongContextConfig = field(default_factory=LongContextConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    # the KV-cache method (`method=<name>`: its dataclass fields, checked by palu.methods)
    method: Dict[str, Any] = field(default_factory=lambda: {"name": "fp16"})
    out: Optional[str] = None           # output file; default derived from the parameters
    device: str = "cpu"
    seed: int = 0
    progress: bool = True


def _config_schema() -> type:
    """The whole schema: the core groups, then one settings group per fitted method (its spec's
    `settings` dataclass, palu.pipeline.fitted) and `fitted`, the kind the fit steps make."""
    from dataclasses import make_dataclass

    from palu.pipeline.fitted import FITTED
    return make_dataclass("Config", [(kind, spec.settings, field(default_factory=spec.settings))
                                     for kind, spec in FITTED.items()]
                          + [("fitted", Optional[str], None)], bases=(CoreConfig,))


Config = _config_schema()


DTYPES = ("float32", "float16", "bfloat16", "float64")
_CHOICES = {
    "palu.decomposition": DECOMPOSITIONS,
    "palu.rotation": ROTATIONS,
    "palu.head_order": HEAD_ORDERS,
    "tracking.mode": ("offline", "online", "disabled"),
    "tracking.upload": ("none", "small", "all"),
    "model.dtype": DTYPES,
    "data.bos": BOS_SETTINGS,
    "calibration.bos": BOS_SETTINGS,
}
_POSITIVE = ("data.seqlen", "data.batch_size", "calibration.samples", "calibration.seqlen", "fisher.samples",
             "fisher.seqlen", "palu.group_size", "palu.rank_multiple",
             "generate.context", "generate.new_tokens", "recovery.rank", "recovery.steps", "recovery.samples",
             "recovery.seqlen")


# The groups whose one option is their dataclass (conf/config.yaml picks `<group>: default`).
_GROUPS = {"calibration": CalibrationConfig, "fisher": FisherWindows, "palu": PaluConfig,
           "generate": GenerateConfig, "recovery": RecoveryConfig,
           "zeroshot": ZeroshotConfig, "longcontext": LongContextConfig, "paths": PathsConfig}


def method_defaults(name: str) -> dict:
    """A KV-cache method's fields with their dataclass defaults: the `method` group's option
    `name` (what `conf/method/<name>.yaml` used to restate)."""
    from palu.methods import REGISTRY, method_names
    from palu.pipeline.specs import defaults_of
    method_names()                       # imports every method module, so each registers itself
    return {"name": name, **defaults_of(REGISTRY[name])}


def register() -> None:
    """Store the schema in Hydra's ConfigStore (idempotent): the whole schema as `palu_schema`,
    each settings group's dataclass as
    `<group>/default`, the tracking and data base options that conf/tracking/*.yaml and
    conf/data/*.yaml extend, and one `method/<name>` option per registered method."""
    from hydra.core.config_store import ConfigStore

    from palu.methods import method_names
    cs = ConfigStore.instance()
    # the whole schema first (conf/config.yaml's defaults begin with it), so settings that are
    # no group one picks (a fitted method's, `<kind>.*`) take overrides without a defaults line
    cs.store(name="palu_schema", node=Config)
    for group, node in _GROUPS.items():
        cs.store(group=group, name="default", node=node)
    cs.store(group="tracking", name="base", node=TrackingConfig)
    cs.store(group="data", name="base", node=DataConfig)
    for name in method_names():
        cs.store(group="method", name=name, node=method_defaults(name))


def validate(cfg: DictConfig | dict) -> DictConfig:
    """Merge `cfg` onto the schema and check ranges; returns a typed, read-only config."""
    schema = OmegaConf.structured(Config)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except Exception as err:  # omegaconf's messages already name the full key
        raise ConfigError(f"invalid config: {err}") from None
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(merged, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    rank_method = merged.palu.rank_method
    if not isinstance(rank_method, str) or not is_rank_method(rank_method):
        try:
            get_allocator(str(rank_method))
        except ValueError as err:   # names the registered ones, or what is wrong with a variant
            raise ConfigError(f"palu.rank_method: {err}") from None
    for key in _POSITIVE:
        value = OmegaConf.select(merged, key)
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value!r} must be a positive integer")
    kept = merged.palu.kept_ratio
    if not (0.0 < kept <= 1.0):
        raise ConfigError(f"palu.kept_ratio={kept!r} must lie in (0, 1]")
    if merged.data.max_tokens is not None and merged.data.max_tokens < merged.data.seqlen:
        raise ConfigError(f"data.max_tokens={merged.data.max_tokens} is smaller than "
                          f"data.seqlen={merged.data.seqlen}: no window would be evaluated")
    if not (0.0 < merged.data.calibration_fraction < 1.0):
        raise ConfigError(f"data.calibration_fraction={merged.data.calibration_fraction!r} "
                          "must lie in (0, 1)")
    from palu.data.corpora import STANDINS, real_corpora
    for part in ("data", "calibration"):
        section = merged[part]
        if section.path and section.corpus in STANDINS:
            raise ConfigError(f"{part}.path={section.path!r} cannot be used with the embedded corpus "
                              f"{part}.corpus={section.corpus!r} (it reads no files); choose a real "
                              f"corpus ({real_corpora()}) for files of your own")
    if merged.device != "cpu" and not merged.device.startswith("cuda"):
        raise ConfigError(f"device={merged.device!r} must be 'cpu' or 'cuda[:N]'")
    check_fitted(merged)
    from palu.eval.zeroshot import check_request
    z = merged.zeroshot
    try:
        check_request(list(z.tasks), z.limit, z.source)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    from palu.eval.generation import check_batch_size
    from palu.eval.suites import SUITES, get_suite, settings_of
    try:
        check_batch_size(merged.longcontext.batch_size, "longcontext.batch_size")
        check_batch_size(merged.zeroshot.batch_size, "zeroshot.batch_size")
        for name, suite in SUITES.items():
            suite.check(settings_of(name, OmegaConf.to_container(merged.longcontext[name], resolve=True)))
        get_suite(merged.longcontext.suite).check_data(suite_settings(merged))
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    method_of(merged)
    OmegaConf.set_readonly(merged, True)
    return merged


def check_fitted(merged: DictConfig) -> None:
    """Every fitted method's settings group, by its spec (palu.pipeline.fitted), and `fitted`."""
    from palu.methods import MethodError
    from palu.pipeline.fitted import FITTED
    if merged.fitted is not None and merged.fitted not in FITTED:
        raise ConfigError(f"fitted={merged.fitted!r} is not one of {sorted(FITTED)}")
    for kind, spec in FITTED.items():
        settings = merged[kind]
        for key in spec.positive:
            if settings[key] is None or settings[key] <= 0:
                raise ConfigError(f"{kind}.{key}={settings[key]!r} must be a positive integer")
        try:
            spec.check(settings)
        except (MethodError, ValueError) as err:
            raise ConfigError(str(err)) from None


def suite_settings(cfg: DictConfig):
    """The settings dataclass of the long-context suite the config picks (`longcontext.suite`)."""
    from palu.eval.suites import settings_of
    lc = cfg.longcontext
    try:
        return settings_of(lc.suite, OmegaConf.to_container(lc[lc.suite], resolve=True))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def method_of(cfg: DictConfig):
    """The config's KV-cache method object (errors name the bad `method.*` value)."""
    from palu.methods import MethodError, build_method
    try:
        return build_method(OmegaConf.to_container(cfg.method, resolve=True))
    except MethodError as err:
        raise ConfigError(str(err)) from None


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
