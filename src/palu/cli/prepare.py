"""Step `resources`: materialise the model as a fast-loading folder in the work folder."""
from __future__ import annotations

import hydra

from ..config import validate
from ..models.loading import prepare_model, resolve_source
from ..pipeline import naming
from .common import CONF_DIR, log


def run(cfg) -> str:
    resolve_source(cfg.model.id)  # fail before any work if the weights are not there
    out = cfg.out or str(naming.prepared_model_dir(cfg.paths.work, cfg.model.name))
    prepare_model(cfg.model.id, out)
    log.info("model %s ready at %s", cfg.model.name, out)
    return out


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    run(validate(cfg))


if __name__ == "__main__":
    main()
