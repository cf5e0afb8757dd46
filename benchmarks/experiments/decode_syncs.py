"""Why some methods crawl on a shared GPU (issue 49; the H200 long grid, 2026-12-04): the host-device
synchronisations and torch calls each method's cache makes per decode step of a batch.

A call like `nonzero`, `item`, `tolist` or a tensor used as a Python bool waits for the GPU to
finish everything queued before it, and every torch call is at least one kernel launch. For a
135M model a decode step is launch-bound, so these counts set a method's decode speed; on a GPU
time-sliced between a dozen processes (the long grid ran 5-16 jobs on one H200) each sync also
waits for the process's next slice. Counted on the CPU (the same calls run on the device), for a
left-padded batch of 4 prompts of 229-256 tokens, as (calls with 17 new tokens - calls with 1) / 16
= per decode step of the batch, all layers. KIVI's and Quest's per-row paths scale with the batch.

Measured 2026-12-04, session 31 (after its fixes): FP16 2,315 calls and 2 syncs a step (generate's
own stopping checks); Palu 5,966 / 2 (4-bit 11,234 / 2); SnapKV / PyramidKV 2,677 / 3; StreamingLLM /
TOVA ~3,900 / 63 (`slots_of`: two per layer); Quest 8,887 / 3; KIVI 41,220 / 3. Before it: KIVI
38,713 / 483 (4 `nonzero` for each row of each layer, `quant_cache.QuantKVLayer.step`), Quest
10,147 / 483 (per row and layer a `nonzero`, a boolean-mask index, a pad read and a check,
`subset_attention._by_row`). On the H200 at 13 jobs sharing, KIVI's and Quest's RULER-style jobs
had answered 16 prompts in 8 min against ~300 for Palu's; SnapKV's answered 48 while hardly
syncing, so its 8K prefill (attention scores over the whole prompt) is the other cost.
Session 32 (results/checks/decode-syncs.json): every method 2 syncs a step, FP16's count (one the
row-dropping loop's read of the new tokens, one transformers' padding-mask check): StreamingLLM /
TOVA's kept width comes from host counts (`SubsetPolicy.padded_width`); KIVI's one-token steps read
each token once, in order (`_Stream.in_order`), instead of one column block per (key form, value
form) pair; the SnapKV compositions and Palu + TOVA serve the padded batch row by row.
On a CPU run every tensor is on the host, so `Count` tracks which side each tensor
would be on (its docstring).

    python benchmarks/experiments/decode_syncs.py results/checks/decode-syncs.json [methods=fp16,quest] [batches=4,8]

Session 35 (results/checks/decode-syncs-kivi-batch-path.json): past the prefill the quantised cache
holds every row in one buffer (`cache/quant_dense.py`): KIVI-2 5,172 / 5,854 calls a step at batch
4 / 8 against 23,329 / 44,569 on the row layers (PALU_QUANT_DENSE=0), KIVI-2 + SnapKV 4,703 / 4,778
against 14,515 / 20,395; FP16 2,273.
Session 34: Quest selects for every row of a padded batch at once (`QuestPolicy.select_padded`):
results/checks/decode-syncs-quest.json.
"""
from __future__ import annotations

import random
import sys
import weakref
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
           "palu-50% 4-bit": {"name": "palu", "checkpoint": PALU, "latent_bits": 4},
           "kivi-2": {"name": "kivi", "bits": 2}, "kivi-4": {"name": "kivi", "bits": 4},
           "streaming_llm": {"name": "streaming_llm", "sink": 4, "window": 128},
           "snapkv": {"name": "snapkv", "compression_ratio": 0.5},
           "pyramidkv": {"name": "pyramidkv", "compression_ratio": 0.5},
           "tova": {"name": "tova", "budget": 128}, "quest": {"name": "quest", "page": 16, "budget": 64},
           "kivi-2 + snapkv": {"name": "kivi_snapkv", "bits": 2, "evict_ratio": 0.5},
           "palu-50% 4-bit + snapkv": {"name": "palu_snapkv", "checkpoint": PALU, "latent_bits": 4, "evict_ratio": 0.5},
           "palu-50% 4-bit + tova": {"name": "palu_tova", "checkpoint": PALU, "latent_bits": 4, "budget": 128}}
SYNCS = {"nonzero", "item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "unique",
         "masked_select"}
MASKED = {"__getitem__", "index"}   # indexing with a boolean mask: its result's size is data


def _has_bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class Count(TorchFunctionMode):
    """Counts torch calls, and sync-like calls on tensors that would live on the GPU. On a CPU run
    every tensor is on the host, so each tensor's side is tracked: the model's weights, and
    anything made with an explicit device or from a device-side tensor, are device-side; index
    bookkeeping made on the host (no device named) is not, until it is moved with `.to(device)`."""

    def __init__(self, model):
        super().__init__()
        self.calls, self.syncs = Counter(), Counter()
        self.device_side: set[int] = set()     # ids of live device-side tensors
        for t in list(model.parameters()) + list(model.buffers()):
            self._mark(t)

    def _mark(self, t: torch.Tensor) -> None:
        if id(t) not in self.device_side:
            self.device_side.add(id(t))
            weakref.finalize(t, self.device_side.discard, id(t))

    def _on_device(self, x) -> bool:
        if isinstance(x, torch.Tensor):
            return id(x) in self.device_side
        if isinstance(x, (list, tuple)):
            return any(self._on_device(v) for v in x)
        return isinstance(x, torch.device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.calls[name] += 1
        device = (self._on_device(list(args)) or "device" in kwargs
                  or any(self._on_device(v) for v in kwargs.values()))
        if device and (name in SYNCS or (name in MASKED and _has_bool_index(args))):
            self.syncs[name if name in SYNCS else f"{name}[bool mask]"] += 1
        out = func(*args, **kwargs)
        if device:
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out


def counted(model, tok, method, prompts, new):
    with Count(model) as c:
        answer_batches(model, tok, method, prompts, new, batch_size=len(prompts))
    return c.calls, c.syncs


def main(out: str, *opts: str) -> None:
    """OUT [methods=a,b,...] [batches=4,8]: the methods of METHODS to count (default all) and the
    batch sizes (default 4: prompts of 256, 247, 238, ... tokens)."""
    args = dict(o.split("=", 1) for o in opts)
    names = args["methods"].split(",") if "methods" in args else list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"methods {unknown} unknown; known: {list(METHODS)}")
    batches = [int(b) for b in args.get("batches", "4").split(",")]
    torch.set_num_threads(2)
    rows = []
    for batch in batches:
        random.seed(0)
        prompts = [[random.randrange(100, 40000) for _ in range(256 - 9 * i)] for i in range(batch)]
        for name in names:
            cfg = METHODS[name]
            model, tok = load_model(MODEL, dtype="float32")
            method = build_method(cfg) if cfg else None
            if method is not None:
                method.install(model)
            (one, one_syncs), (many, many_syncs) = (counted(model, tok, method, prompts, 1),
                                                    counted(model, tok, method, prompts, 17))
            step = {k: (many[k] - one[k]) / 16 for k in many}
            syncs = {k: (many_syncs[k] - one_syncs[k]) / 16 for k in many_syncs if many_syncs[k] - one_syncs[k]}
            rows.append({"method": name, "batch": batch, "torch_calls_per_step": round(sum(step.values()), 1),
                         "syncs_per_step": round(sum(syncs.values()), 1), "syncs": syncs})
            print(f"{name:16s} batch {batch:3d} torch calls / step {sum(step.values()):8.0f}   "
                  f"syncs / step {sum(syncs.values()):7.1f}  {syncs}", flush=True)
    write_json(out, {"model": MODEL, "batches": batches, "per": "decode step of the batch (all layers)",
                     "prompt_tokens": "256 - 9 i for row i", "rows": rows})


if __name__ == "__main__":
    main(*(sys.argv[1:] or ["results/checks/decode-syncs.json"]))
