"""Step `ranks`: allocate ranks for a kept ratio, group size and method; writes a JSON."""
from __future__ import annotations

from safetensors.torch import load_file

from ..decompose.ranks import allocate
from ..io import write_json
from ..models.adapters import geometry_of
from ..models.loading import load_config
from ..pipeline import naming
from .common import entry_point, log, model_path, tracked


def run(cfg) -> dict:
    p = cfg.palu
    geom = geometry_of(load_config(model_path(cfg)))
    geom.check_group_size(p.group_size)
    fisher, used = None, {}
    if p.rank_method != "uniform":
        path = naming.fisher_path_of(cfg)
        if not path.is_file():
            raise FileNotFoundError(f"rank method {p.rank_method!r} needs Fisher scores at {path}; "
                                    "run `python -m palu.cli.fisher` first")
        used["fisher"] = str(path)
        fisher = load_file(str(path))["fisher"]
    out = cfg.out or str(naming.ranks_path_of(cfg))
    with tracked(cfg, "ranks", out, used=used) as wb:
        allocation = allocate(geom, p.kept_ratio, p.group_size, p.rank_method, p.rank_multiple, fisher)
        write_json(out, allocation)
        wb.metrics({"kept_ratio_realised": allocation["kept_ratio_realised"],
                    "kept_ratio_target": p.kept_ratio})
        wb.make("ranks", out)
    log.info("%s ranks: kept ratio %.4f (target %.4f) -> %s", p.rank_method,
             allocation["kept_ratio_realised"], p.kept_ratio, out)
    return allocation


main = entry_point(run)

if __name__ == "__main__":
    main()
