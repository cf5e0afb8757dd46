"""What the Hydra entry points share (thin glue from config to library calls; steps never
import each other's modules)."""
from __future__ import annotations

import functools
import logging
import platform

import hydra
import torch

from ..config import CONF_DIR, to_dict, validate
from ..pipeline import naming

log = logging.getLogger("palu")


def entry_point(run, config_name: str = "config", checked: bool = True):
    """The `@hydra.main` function of a step whose work is `run(cfg)`: it composes conf/, validates
    it against the schema (`checked`) and calls `run`. Hydra names the job after `run`'s module."""
    @functools.wraps(run)
    def main(cfg) -> None:
        run(validate(cfg) if checked else cfg)
    return hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")(main)


def model_path(cfg) -> str:
    """The prepared (fast-loading) copy of the model if the pipeline made one, else `model.id`."""
    return naming.model_source(cfg.paths.work, cfg.model.name, cfg.model.id)


def calibration_windows_of(cfg, tok, samples: int, seqlen: int, seed: int):
    """Seeded windows from the calibration corpus (shared by the calibrate and fisher steps)."""
    from ..data.corpora import load_corpus
    from ..data.windows import bos_token_for, calibration_windows, tokenize
    text = load_corpus(cfg.calibration.corpus, path=cfg.calibration.path).calibration_text
    return calibration_windows(tokenize(tok, text), samples, seqlen, seed,
                               bos_token_for(tok, cfg.calibration.bos))


def environment() -> dict:
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "host": platform.node(),
            "cpu_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def record(cfg, **extra) -> dict:
    """What every output file carries: the full resolved config and the environment."""
    return {"config": to_dict(cfg), "environment": environment(), **extra}
