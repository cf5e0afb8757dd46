"""The latency grid's latent-selection rows alone (issue 39 item 3), without Hydra (the GPU host has
none): conf/bench/latency.yaml with the Palu, KIVI, tune and batch rows left out, so one call
times the SDPA / eager baselines and `selection_rows` at the given lengths.

  python -m palu_bench.selection_bench OUT.json ['shapes=[llama2-7b,llama3-8b]' 'lengths=[65536]'
      'topk=[plain,radix]' 'attend=[fused,fused:16]' 'tokens=[1024]' 'sketch=[16]']
`attend` entries `fused[:SPLITS[:BLOCK_N:WARPS[:ev]]]` run the fused attend kernel with SPLITS programs
per KV head (`auto`: the default, ~3 waves), tiles of BLOCK_N tokens, WARPS warps, `ev`: early value gathers.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from .latency import run

CONF = Path(__file__).parent / "conf" / "bench" / "latency.yaml"
SELECTION_KEYS = ("topk", "attend", "tokens", "sketch", "stored_sketch", "window", "kept")


def config(overrides: dict) -> dict:
    cfg = yaml.safe_load(CONF.read_text())
    shapes = overrides.pop("shapes", list(cfg["shapes"]))
    unknown = [s for s in shapes if s not in cfg["shapes"]]
    if unknown:
        raise ValueError(f"shapes {unknown} are not in {CONF.name}: {sorted(cfg['shapes'])}")
    lengths = overrides.pop("lengths", [65536])
    sel = dict(cfg["selection"], lengths=lengths, stored_sketch=[True])
    for k in SELECTION_KEYS:
        if k in overrides:
            sel[k] = overrides.pop(k)
    if overrides:
        raise ValueError(f"unknown settings {sorted(overrides)}: shapes, lengths or {SELECTION_KEYS}")
    cfg.update(shapes={s: cfg["shapes"][s] for s in shapes}, lengths=lengths, batches=[], splits={},
               tune=[], kivi={"bits": []}, selection=sel)
    return cfg


def main(argv: list[str]) -> None:
    if not argv or "=" in argv[0]:
        raise SystemExit(__doc__)
    overrides = {}
    for a in argv[1:]:
        k, _, v = a.partition("=")
        overrides[k] = yaml.safe_load(v)
    res = run(config(overrides), out=argv[0])
    bad = [c for c in res["checks"] if not c["rel_err"] < 5e-3]
    print(f"{len(res['checks'])} correctness checks, {len(bad)} above 5e-3: {bad[:5]}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
