"""Entry point `decode` (GPU host): end-to-end decode latency and memory vs context.

    python -m palu_bench.cli.decode_e2e out=results/decode/h200-llama2-7b.json
The grid is conf/bench/decode.yaml (Llama-2-7B shapes, random fp16 weights); override any key,
e.g. `bench.contexts=[4096,65536] bench.batch=8`. Its `hf` block times the same shapes through
transformers (`LlamaForCausalLM` + `palu.LatentCache`, eager): `bench.hf=null` skips it.
"""
from __future__ import annotations

import hydra
from omegaconf import OmegaConf

from ..decode_e2e import run
from .common import CONF_DIR, log, tracked


@hydra.main(config_path=CONF_DIR, config_name="decode", version_base="1.3")
def main(cfg) -> None:
    with tracked(cfg, "decode") as wb:
        run(OmegaConf.to_container(cfg.bench, resolve=True), out=cfg.out, log=log.info)
        wb.make("benchmark", cfg.out)


if __name__ == "__main__":
    main()
