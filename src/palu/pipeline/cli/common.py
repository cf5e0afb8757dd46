"""What the Hydra entry points share (thin glue from config to library calls; steps never
import each other's modules)."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import hydra
import torch

from palu.pipeline.config import CONF_DIR, register, to_dict, validate
from palu.pipeline import naming
from palu.pipeline.fitted import fitted_steps
from palu.pipeline.tracking.wandb_run import check_tracking, tracked_step

log = logging.getLogger("palu")


def entry_point(run, config_name: str = "config", checked: bool = True):
    """The `@hydra.main` function of a step whose work is `run(cfg)`: it composes conf/, validates
    it against the schema (`checked`) and calls `run`. Hydra names the job after `run`'s module."""
    @functools.wraps(run)
    def main(cfg) -> None:
        cfg = validate(cfg) if checked else cfg
        check_tracking(cfg.tracking)    # an unusable W&B setting fails before any work
        limit_gpu_share(str(cfg.get("device", "cpu")))
        run(cfg)
    register()
    hydra_main = hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")(main)

    @functools.wraps(hydra_main)
    def checked_main(*args, **kwargs):
        refuse_renamed(sys.argv[1:])
        return hydra_main(*args, **kwargs)
    return checked_main


def refuse_renamed(argv: list[str]) -> None:
    """`method.<old>=...` for a field the chosen method renamed (Palu's `bits`, now `latent_bits`)
    is refused by the new name: Hydra's own refusal ("could not override") names no replacement."""
    from palu.methods import REGISTRY, method_names
    chosen = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "method"]
    if not chosen or chosen[-1] not in method_names():
        return
    renamed = REGISTRY[chosen[-1]].renamed
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key.startswith("method.") and key[len("method."):] in renamed:
            new = renamed[key[len("method."):]]
            print(f"{key}: method={chosen[-1]} calls this field {new!r} now (method.{new}=...; README, "
                  "'One word per meaning of bits')", file=sys.stderr)
            raise SystemExit(2)


GPU_SHARE_ENV = "PALU_GPU_SHARE"


def limit_gpu_share(device: str, share: str | None = None) -> float | None:
    """Hold this job to its share of the GPU's memory when several jobs share one GPU (the
    workflow sets `PALU_GPU_SHARE` = 0.95 / its `gpu` resource). Without a cap, one job's cached
    memory starves the others until a batch of one fails; with it, each job's `batch_size: auto`
    halves inside its own share. Returns the share applied (None: none)."""
    share = os.environ.get(GPU_SHARE_ENV) if share is None else share
    if not share or not device.startswith("cuda"):
        return None
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(f"{GPU_SHARE_ENV}={share!r} must be a fraction in (0, 1]")
    if torch.cuda.is_available():
        index = torch.device(device).index
        torch.cuda.set_per_process_memory_fraction(value, index if index is not None else torch.cuda.current_device())
        log.info("GPU memory held to %.3f of the device (%s=%s)", value, GPU_SHARE_ENV, share)
    return value


def model_path(cfg) -> str:
    """The prepared (fast-loading) copy of the model if the pipeline made one, else `model.id`."""
    return naming.model_source(cfg.paths.work, cfg.model.name, cfg.model.id)


def model_input(cfg) -> dict:
    """The prepared model folder as a tracked input, when the pipeline made one (a hub id or an
    embedded package is recorded in the config only)."""
    path = model_path(cfg)
    return {"model": path} if Path(path).is_dir() else {}


def run_name_of(cfg, out: str | os.PathLike) -> str:
    """A step's W&B run name: its output's path inside the results folder, or `work/` + its path
    inside the work folder (so a result run by hand, under work/results/, never reads like a
    committed one), without the extension (the same parameter tags as the file names); an output
    elsewhere: its file name."""
    full = Path(out).resolve()
    for root, prefix in ((cfg.paths.results, ""), (cfg.paths.work, "work/")):
        try:
            rel = full.relative_to(Path(root).resolve())
        except ValueError:
            continue
        name = rel.with_suffix("") if rel.suffix in {".json", ".safetensors", ".png", ".csv"} else rel
        return prefix + name.as_posix()
    return full.name


# The settings groups each step reads (beside model, paths, tracking and the top-level keys): its
# output file and W&B run record these and no other group, so a record says what made the result
# and nothing else (a decompose run does not carry zeroshot.*). An evaluating step does not carry
# palu.*, calibration.* or fisher.*: a checkpoint's own manifest (in the method's record) says how
# it was made, so a checkpoint is evaluated by hand with method.checkpoint alone.
STEP_GROUPS = {
    "prepare": (),
    "calibrate": ("calibration",),
    "fisher": ("calibration", "fisher"),
    "ranks": ("calibration", "fisher", "palu"),
    "decompose": ("calibration", "fisher", "palu"),
    "recover": ("calibration", "recovery"),
    "evaluate": ("data", "method"),
    "zeroshot": ("method", "zeroshot"),
    "longcontext": ("method", "longcontext"),
    "generate": ("data", "method", "generate"),
    # a fitted method's steps read the calibration corpus and the method's settings group
    **{step: ("calibration", kind) for step, kind in fitted_steps().items()},
}
_ALWAYS = ("model", "paths", "tracking")
_FIT_STEPS = set(fitted_steps())


def config_of(cfg, step: str) -> dict:
    """The resolved config a step's outputs and W&B run record: the groups it reads
    (`STEP_GROUPS`) and the top-level settings. A step not listed records everything."""
    full = to_dict(cfg)
    if step not in STEP_GROUPS:
        return full
    keep = set(_ALWAYS) | set(STEP_GROUPS[step]) | ({"fitted"} if step in _FIT_STEPS else set())
    # `fitted` (the kind a fit step makes) is a top-level key only the fit steps read
    return {k: v for k, v in full.items() if k in keep or not (isinstance(v, dict) or k == "fitted")}


def tracked(cfg, step: str, out: str | os.PathLike, used: dict | None = None, config: dict | None = None):
    """The W&B run of one step making `out` from `used` (kind -> path or paths)."""
    return tracked_step(cfg.tracking, config if config is not None else config_of(cfg, step), job_type=step,
                        name=run_name_of(cfg, out), group=cfg.model.name if "model" in cfg else "tables",
                        used=used, args=job_args())


def job_args() -> list[str] | None:
    """This job's own command-line overrides when Hydra runs it as one job of a multirun (the
    process's argv then holds the whole sweep); None otherwise (the argv is the job's)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return list(HydraConfig.get().overrides.task)


def check_window_length(cfg, seqlen: int, what: str) -> None:
    """A window longer than the model's positions fails before the model is loaded."""
    from palu.eval.runner import check_seqlen
    from palu.models.loading import load_config
    check_seqlen(load_config(model_path(cfg)), seqlen, what)


def calibration_windows_of(cfg, tok, samples: int, seqlen: int, seed: int):
    """Seeded windows from the calibration corpus (shared by the calibrate and fisher steps)."""
    from palu.data.corpora import load_corpus
    from palu.data.windows import bos_token_for, calibration_windows, tokenize
    text = load_corpus(cfg.calibration.corpus, path=cfg.calibration.path).calibration_text
    return calibration_windows(tokenize(tok, text), samples, seqlen, seed,
                               bos_token_for(tok, cfg.calibration.bos))


def environment() -> dict:
    import transformers

    from palu.eval.generation import decode_switches
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "host": platform.node(),
            "cpu_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "switches": decode_switches()}


def record(cfg, step: str, **extra) -> dict:
    """What every output file carries: the step's resolved config (`config_of`) and the environment."""
    return {"config": config_of(cfg, step), "environment": environment(), **extra}


# Journals of the steps that resume (longcontext, zeroshot): where they live and what they are
# fingerprinted with
def journal_path(cfg, out: str) -> Path:
    """Where this step journals its answers (so a stopped job resumes): the work folder, named by
    the output it is for (a hash: no name read from a config becomes a path)."""
    return Path(cfg.paths.work) / "journal" / f"{hashlib.sha256(str(out).encode()).hexdigest()[:24]}.jsonl"


def prompt_cache_dir(cfg) -> Path:
    """Where a grid's long-context jobs keep the prompts they build, for each other (the work
    folder; files named by a hash of what built them: palu.eval.prompt_cache)."""
    return Path(cfg.paths.work) / "prompts"


def weights_signature(path: str) -> dict:
    """Which weights the model was read from, as a journal must know them: a GGUF by its sha256; a
    folder `prepare` made, by the source it was made from (prepared again on another machine, it
    is the same model); any other folder by its weight files' sizes and modification times."""
    from palu.artifacts import sha256_file
    from palu.models.loading import ModelNotFoundError, prepared_from, resolve_source
    src = resolve_source(path)
    if src.kind == "hub":
        return {"hub": path}
    if src.gguf_file:
        return {"gguf_sha256": sha256_file(Path(src.path) / src.gguf_file)}
    source = prepared_from(src.path)
    if source is not None:
        try:
            return {"prepared_from": source, **weights_signature(source)}
        except (ModelNotFoundError, OSError):
            pass
    files = sorted(p for p in Path(src.path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def without_timings(record):
    """A record without its measured durations (`*_seconds`): what made the answers, so a
    checkpoint decomposed again on a fresh GPU host (the same factors, by their sha256; another
    `decompose_seconds`) resumes the journal of the first."""
    if isinstance(record, dict):
        return {k: without_timings(v) for k, v in record.items() if not str(k).endswith("_seconds")}
    if isinstance(record, list):
        return [without_timings(v) for v in record]
    return record
