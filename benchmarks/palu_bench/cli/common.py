"""What the benchmark entry points share: their Hydra config tree (palu_bench/conf) and logger."""
from __future__ import annotations

import logging
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
log = logging.getLogger("palu_bench")


def tracked(cfg, job_type: str, name: str | None = None, used: dict | None = None):
    """The W&B run of one benchmark step (named by its output file)."""
    from omegaconf import OmegaConf

    from palu.pipeline.tracking import tracked_step
    return tracked_step(cfg.tracking, OmegaConf.to_container(cfg, resolve=True), job_type=job_type,
                        name=name or f"{job_type}/{Path(cfg.out).stem}", group="gpu-benchmarks", used=used)
