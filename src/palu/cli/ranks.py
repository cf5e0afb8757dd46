"""Step `ranks`: allocate ranks for a kept ratio, group size and method; writes a JSON."""
from __future__ import annotations

import hydra
from safetensors.torch import load_file

from ..config import validate
from ..decompose.ranks import allocate
from ..io import write_json
from ..models.adapters import geometry_of
from ..models.loading import load_config
from ..pipeline import naming
from .calibrate import calibration_tag
from .common import CONF_DIR, log, model_path
from .fisher import fisher_tag


def ranks_file(cfg) -> str:
    p = cfg.palu
    return str(naming.ranks_path(cfg.paths.work, cfg.model.name, calibration_tag(cfg),
                                            fisher_tag(cfg), p.rank_method, p.kept_ratio,
                                            p.group_size, p.rank_multiple))


def model_geometry(cfg):
    return geometry_of(load_config(model_path(cfg)))


def run(cfg) -> dict:
    p = cfg.palu
    geom = model_geometry(cfg)
    geom.check_group_size(p.group_size)
    fisher = None
    if p.rank_method != "uniform":
        path = naming.fisher_path(cfg.paths.work, cfg.model.name, calibration_tag(cfg), fisher_tag(cfg))
        if not path.is_file():
            raise FileNotFoundError(f"rank method {p.rank_method!r} needs Fisher scores at {path}; "
                                    "run `python -m palu.cli.fisher` first")
        fisher = load_file(str(path))["fisher"]
    allocation = allocate(geom, p.kept_ratio, p.group_size, p.rank_method, p.rank_multiple, fisher)
    out = cfg.out or ranks_file(cfg)
    write_json(out, allocation)
    log.info("%s ranks: kept ratio %.4f (target %.4f) -> %s", p.rank_method,
             allocation["kept_ratio_realised"], p.kept_ratio, out)
    return allocation


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    run(validate(cfg))


if __name__ == "__main__":
    main()
