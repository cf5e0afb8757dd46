"""Entry point `scale` (GPU host): the paper grid's library steps at 7B-8B shapes, results JSON
for results/scale/ (palu_bench/scale.py; conf/bench/scale.yaml).

    python -m palu_bench.cli.scale out=results/scale/h200-llama2-7b.json shape=llama2-7b
`shape=` keeps one shape (one call per shape fits a 10-minute GPU slot). A host without Hydra
runs the same thing as `python -m palu_bench.scale OUT shape=llama2-7b [key=value ...]`.
"""
from __future__ import annotations

import hydra
from omegaconf import OmegaConf

from ..scale import run
from .common import CONF_DIR, log, tracked


@hydra.main(config_path=CONF_DIR, config_name="scale", version_base="1.3")
def main(cfg) -> None:
    bench = OmegaConf.to_container(cfg.bench, resolve=True)
    with tracked(cfg, "scale") as wb:
        run(bench, out=cfg.out, log=log.info, shapes=None if cfg.shape is None else [cfg.shape])
        wb.make("benchmark", cfg.out)


if __name__ == "__main__":
    main()
