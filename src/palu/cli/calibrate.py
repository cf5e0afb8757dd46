"""Step `calibrate`: Gram matrices of the K/V inputs per layer (cached per model + setting)."""
from __future__ import annotations

import hydra
from safetensors.torch import save_file

from ..calib.gram import collect_grams
from ..config import validate
from ..data.corpora import load_corpus
from ..data.windows import calibration_windows, tokenize
from ..io import atomic_path
from ..models.loading import load_model
from ..pipeline import naming
from .common import CONF_DIR, log, model_path


def calibration_tag(cfg) -> str:
    c = cfg.calibration
    return naming.calibration_tag(c.corpus, c.samples, c.seqlen, c.seed)


def windows_for(cfg, tok, samples: int, seqlen: int, seed: int):
    text = load_corpus(cfg.calibration.corpus, path=cfg.calibration.path).calibration_text
    return calibration_windows(tokenize(tok, text), samples, seqlen, seed)


def run(cfg) -> str:
    c = cfg.calibration
    out = cfg.out or str(naming.gram_path(cfg.paths.work, cfg.model.name, calibration_tag(cfg)))
    model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
    windows = windows_for(cfg, tok, c.samples, c.seqlen, c.seed)
    stats = collect_grams(model, windows, progress=cfg.progress)
    with atomic_path(out) as tmp:
        save_file({"gram": stats["gram"]}, str(tmp),
                  metadata={"tokens": str(stats["tokens"]), "tag": calibration_tag(cfg)})
    log.info("Gram over %d tokens -> %s", stats["tokens"], out)
    return out


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    run(validate(cfg))


if __name__ == "__main__":
    main()
