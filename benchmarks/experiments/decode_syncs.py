"""Why some methods crawl on a shared GPU (issue 49; the H200 long grid, 2026-12-04): the host-device
synchronisations and torch calls each method's cache makes per decode step of a batch.

A call like `nonzero`, `item`, `tolist` or a tensor used as a Python bool waits for the GPU to
finish everything queued before it, and every torch call is at least one kernel launch. For a
135M model a decode step is launch-bound, so these counts set a method's decode speed; on a GPU
time-sliced between a dozen processes (the long grid ran 5-16 jobs on one H200) each sync also
waits for the process's next slice. Counted on the CPU (the same calls run on the device), for a
left-padded batch of 4 prompts of 229-256 tokens, as (calls with 17 new tokens - calls with 1) / 16
= per decode step of the batch, all layers. KIVI's and Quest's per-row paths scale with the batch.

Measured 2026-12-04 (results/checks/decode-syncs.json): FP16 2,315 calls and 2 syncs a step; Palu
5,966 / 2 (4-bit 11,234 / 2); SnapKV / PyramidKV 2,677 / 3; StreamingLLM / TOVA ~3,900 / 63; Quest
10,147 / 363; KIVI 38,713 / 483 (17x FP16's calls). On the H200 at 13 jobs sharing, KIVI's
RULER-style jobs answered 16 prompts in 8 min against ~300 for Palu's; SnapKV's answered 48 while
hardly syncing, so its 8K prefill (attention scores over the whole prompt) is the other cost.

    python benchmarks/experiments/decode_syncs.py results/checks/decode-syncs.json
"""
from __future__ import annotations

import random
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from palu.artifacts import write_json
from palu.eval.generation import answer_batches
from palu.methods.base import build_method
from palu.models.loading import load_model

MODEL = "work/models/smollm2-135m"
PALU = "work/palu/smollm2-135m/wiki_standin-n24-L2048-s0-float32/no-fisher/palu-whitened-uniform-k0.5-g3-m8"
METHODS = {"fp16": None, "palu-50%": {"name": "palu", "checkpoint": PALU},
           "palu-50% 4-bit": {"name": "palu", "checkpoint": PALU, "bits": 4},
           "kivi-2": {"name": "kivi", "bits": 2}, "kivi-4": {"name": "kivi", "bits": 4},
           "streaming_llm": {"name": "streaming_llm", "sink": 4, "window": 128},
           "snapkv": {"name": "snapkv", "compression_ratio": 0.5},
           "pyramidkv": {"name": "pyramidkv", "compression_ratio": 0.5},
           "tova": {"name": "tova", "budget": 128}, "quest": {"name": "quest", "page": 16, "budget": 64}}
SYNCS = {"nonzero", "item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "unique"}


class Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def counted(model, tok, method, prompts, new):
    with Count() as c:
        answer_batches(model, tok, method, prompts, new, batch_size=len(prompts))
    return c.calls


def main(out: str) -> None:
    torch.set_num_threads(2)
    random.seed(0)
    prompts = [[random.randrange(100, 40000) for _ in range(256 - 9 * i)] for i in range(4)]
    rows = []
    for name, cfg in METHODS.items():
        model, tok = load_model(MODEL, dtype="float32")
        method = build_method(cfg) if cfg else None
        if method is not None:
            method.install(model)
        one, many = counted(model, tok, method, prompts, 1), counted(model, tok, method, prompts, 17)
        step = {k: (many[k] - one[k]) / 16 for k in many}
        syncs = {k: v for k, v in step.items() if k in SYNCS and v}
        rows.append({"method": name, "torch_calls_per_step": round(sum(step.values()), 1),
                     "syncs_per_step": round(sum(syncs.values()), 1), "syncs": syncs})
        print(f"{name:16s} torch calls / step {sum(step.values()):8.0f}   syncs / step {sum(syncs.values()):7.1f}  {syncs}",
              flush=True)
    write_json(out, {"model": MODEL, "batch": 4, "prompt_tokens": [len(p) for p in prompts],
                     "per": "decode step of the batch (all layers)", "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/checks/decode-syncs.json")
