"""Step `resources`: materialise the model as a fast-loading folder in the work folder."""
from __future__ import annotations

from palu.models.loading import prepare_model, resolve_source
from palu.pipeline import naming
from palu.pipeline.cli.common import entry_point, log, tracked


def run(cfg) -> str:
    resolve_source(cfg.model.id)  # fail before any work if the weights are not there
    out = cfg.out or str(naming.prepared_model_dir(cfg.paths.work, cfg.model.name))
    with tracked(cfg, "prepare", out) as wb:
        prepare_model(cfg.model.id, out)
        wb.make("model", out, model_id=cfg.model.id)
    log.info("model %s ready at %s", cfg.model.name, out)
    return out


main = entry_point(run)

if __name__ == "__main__":
    main()
