"""Step `fisher`: squared-gradient importance of every K/V head (cached per model + setting)."""
from __future__ import annotations

import hydra
from safetensors.torch import save_file

from ..calib.fisher import collect_fisher
from ..config import validate
from ..io import atomic_path
from ..models.loading import load_model
from ..pipeline import naming
from .calibrate import calibration_tag, windows_for
from .common import CONF_DIR, log, model_path


def fisher_tag(cfg) -> str:
    f = cfg.fisher
    return naming.fisher_tag(f.samples, f.seqlen, f.seed)


def run(cfg) -> str:
    f = cfg.fisher
    out = cfg.out or str(naming.fisher_path(cfg.paths.work, cfg.model.name, calibration_tag(cfg),
                                            fisher_tag(cfg)))
    model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
    windows = windows_for(cfg, tok, f.samples, f.seqlen, f.seed)
    stats = collect_fisher(model, windows, progress=cfg.progress)
    with atomic_path(out) as tmp:
        save_file({"fisher": stats["fisher"]}, str(tmp), metadata={"windows": str(stats["windows"])})
    log.info("Fisher over %d windows -> %s", stats["windows"], out)
    return out


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    run(validate(cfg))


if __name__ == "__main__":
    main()
