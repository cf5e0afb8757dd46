"""KIVI's one-pass prefill attention, banded (`palu.attention.banded_prefill`, the default since
session 45) against the masked view it replaced, one layer at SmolLM2-135M's shapes (9 query
heads, 3 KV heads of 64): each path's error against float32 attention over the same coded forms
(fp16 on the GPU; float32 through the efficient kernel's log-sum-exp too), then its time and peak
memory at a serving batch, beside plain causal attention (FP16's prefill) over the same tokens.
The cache's own step (coding the blocks) is inside both timings, as a prefill runs it.

  python benchmarks/experiments/banded_prefill_check.py OUT_DIR [batch=64] [length=4032]
      [check_batch=4] [device=cuda] [rep_ms=200]

Writes OUT_DIR/banded-prefill-check.json. On a CPU (device=cpu) a smoke run at small sizes.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from palu.attention import banded_prefill
from palu.cache.quant_cache import QuantKVCache, Schedule
from palu.quant.codecs import UniformCodec

HEADS, KV_HEADS, DIM = 9, 3, 64
SCHEMES = {"kivi-b2": (2, 32, 128), "kivi-b4": (4, 32, 128)}   # bits, group, residual (the grids')


def _cache(bits, group, residual):
    return QuantKVCache(UniformCodec(bits, group, "token"), UniformCodec(bits, group, "channel"),
                        Schedule(window=residual), 1)


def masked(q, k, v, scheme, scale):
    """The path before: the view's columns under its (T, S') mask, heads repeated (kv_attention)."""
    view = _cache(*scheme).step(0, k, v, None, None)
    rep = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(rep, 1) for t in (view.keys, view.values))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=view.mask, scale=scale)


def banded(q, k, v, scheme, scale, kernel=None):
    band = _cache(*scheme).step(0, k, v, None, None, banded=True)
    assert isinstance(band, banded_prefill.QuantKVBand), "the band did not apply"
    return banded_prefill.attend(q, band, scale, kernel)


def reference(q, k, v, scheme, scale):
    """float32 attention over the view's coded forms, explicit scores."""
    view = _cache(*scheme).step(0, k, v, None, None)
    rep = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(rep, 1).float() for t in (view.keys, view.values))
    s = (q.float() @ keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~view.mask, float("-inf"))
    return s.softmax(-1) @ values


def _inputs(B, T, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda h: torch.randn(B, h, T, DIM, device=device, dtype=dtype, generator=g)  # noqa: E731
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def _time(fn, device, rep_ms):
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import triton.testing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median") * 1e-3


def _peak(fn, device):
    if device == "cpu":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def main(argv):
    out_dir = argv[0]
    args = {"batch": 64, "length": 4032, "check_batch": 4, "device": "cuda", "rep_ms": 200}
    for a in argv[1:]:
        key, value = a.split("=", 1)
        args[key] = value if key == "device" else int(value)
    device = args["device"]
    if device == "cpu":
        args.update(batch=min(args["batch"], 2), length=min(args["length"], 512), check_batch=1)
    dtype = torch.float16 if device == "cuda" else torch.float32
    scale = DIM ** -0.5
    rel = lambda x, r: ((x.float() - r).norm() / r.norm()).item()  # noqa: E731
    result = {"args": args, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "chunk": banded_prefill.CHUNK, "schemes": {}}
    for name, scheme in SCHEMES.items():
        row = {"reach": scheme[1] - 1 + scheme[2]}
        q, k, v = _inputs(args["check_batch"], args["length"], device, dtype, 0)
        ref = reference(q, k, v, scheme, scale)
        row["rel_err_masked"] = rel(masked(q, k, v, scheme, scale), ref)
        row["rel_err_banded"] = rel(banded(q, k, v, scheme, scale), ref)
        row["rel_err_banded_torch"] = rel(banded(q, k, v, scheme, scale, kernel=False), ref)
        q32, k32, v32 = (t.float() for t in (q, k, v))
        row["rel_err_banded_float32"] = rel(banded(q32, k32, v32, scheme, scale), reference(q32, k32, v32, scheme, scale))
        del q, k, v, ref, q32, k32, v32
        q, k, v = _inputs(args["batch"], args["length"], device, dtype, 1)
        calls = {"masked": lambda: masked(q, k, v, scheme, scale),
                 "banded": lambda: banded(q, k, v, scheme, scale),
                 "banded_torch": lambda: banded(q, k, v, scheme, scale, kernel=False),
                 "causal_fp16": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                       enable_gqa=True)}
        for label, fn in calls.items():
            try:
                row[f"{label}_ms"] = _time(fn, device, args["rep_ms"]) * 1e3
                row[f"{label}_peak_gib"] = _peak(fn, device)
            except torch.OutOfMemoryError:
                row[f"{label}_ms"] = "out of memory"
            if device == "cuda":
                torch.cuda.empty_cache()
        del q, k, v
        result["schemes"][name] = row
        print(name, json.dumps(row), flush=True)
    ok = all(max(r["rel_err_banded"], r["rel_err_banded_torch"]) <= 2 * r["rel_err_masked"] + 1e-3
             and r["rel_err_banded_float32"] < 1e-5
             for r in result["schemes"].values())
    result["verdict"] = "banded within the masked view's error" if ok else "banded off: larger error"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "banded-prefill-check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(result["verdict"])
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
