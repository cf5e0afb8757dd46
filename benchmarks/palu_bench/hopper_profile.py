"""One launch of the Hopper RoPE scores kernel at Llama-2-7B (or -3-8B) shapes, for a profiler:
  ncu --kernel-name regex:rope_scores --launch-skip 3 --launch-count 1 python -m palu_bench.hopper_profile llama2-7b 65536 16 4
(the first launches build and warm up; arguments: shape, tokens, frequencies per warp, ring slots[,
reduction])."""
from __future__ import annotations

import sys

import torch
import yaml

from .hopper_bench import _hopper_scores
from .cases import palu_case
from .latency import CONF


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    shape_name, T, per_warp, stages = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    reduce = int(argv[4]) if len(argv) > 4 else 0
    shape = yaml.safe_load(CONF.read_text())["shapes"][shape_name]
    q, hk, hv, kw, _ = palu_case(shape, 1, T, 1, 0.5, 0.5, 16, True)
    for _ in range(5):
        _hopper_scores(q, hk, kw, per_warp, stages, reduce)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
