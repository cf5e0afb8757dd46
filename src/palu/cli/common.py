"""Helpers shared by the Hydra entry points (thin: they only glue config to library calls)."""
from __future__ import annotations

import logging
import platform
from pathlib import Path

import torch

from ..config import to_dict
from ..pipeline import naming

CONF_DIR = str(Path(__file__).resolve().parents[3] / "conf")
log = logging.getLogger("palu")


def model_path(cfg) -> str:
    """The prepared (fast-loading) copy of the model if the pipeline made one, else `model.id`."""
    return naming.model_source(cfg.paths.work, cfg.model.name, cfg.model.id)


def environment() -> dict:
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "host": platform.node(),
            "cpu_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def record(cfg, **extra) -> dict:
    """What every output file carries: the full resolved config and the environment."""
    return {"config": to_dict(cfg), "environment": environment(), **extra}
