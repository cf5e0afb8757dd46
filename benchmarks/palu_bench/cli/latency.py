"""Entry point `latency` (GPU host): decode-attention benchmark, results JSON for results/latency/.

    python -m palu_bench.cli.latency out=results/latency/h200-llama2-7b.json shape=llama2-7b
The grid is conf/bench/latency.yaml; `shape=` keeps one of its shapes (one call per shape fits
a 10-minute GPU slot).
"""
from __future__ import annotations

import hydra
from omegaconf import OmegaConf

from ..latency import run
from .common import CONF_DIR, log, tracked


@hydra.main(config_path=CONF_DIR, config_name="latency", version_base="1.3")
def main(cfg) -> None:
    bench = OmegaConf.to_container(cfg.bench, resolve=True)
    if cfg.shape is not None:
        if cfg.shape not in bench["shapes"]:
            raise ValueError(f"shape={cfg.shape!r} is not one of {sorted(bench['shapes'])}")
        bench["shapes"] = {cfg.shape: bench["shapes"][cfg.shape]}   # tune rows follow (tune_plan)
    with tracked(cfg, "latency") as wb:
        run(bench, out=cfg.out, log=log.info)
        wb.make("benchmark", cfg.out)


if __name__ == "__main__":
    main()
