"""The CUDA-graph decode path (`palu.eval.static_decode`) on a GPU with the real model: the graph's
replayed steps against the same static step run eagerly (logits), and against the eager
dynamic-cache loop every other method uses (tokens), in float32 and float16; then where the time
of one batch goes (prefill vs decode) on each path. Writes OUT/static-decode-check.json.

  python benchmarks/experiments/static_decode_check.py OUT_DIR MODEL TEXT [batch=128] [length=4032]
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

import palu
from palu.eval import generation, static_decode


def _prompts(ids, count, length):
    return [ids[i * 331:i * 331 + length - (i * 97) % (length // 8)] for i in range(count)]


def _batch(prompts, pad, device):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _eager(model, ids, mask, new):
    rows = generation._decode_dropping_ended_rows(model, generation.DynamicCache(), ids, mask, new, set())
    return [n for n, _ in rows]


def _timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main(out_dir, model_path, text_path, *opts):
    args = {"batch": 128, "length": 4032, "new": 64}
    args.update({k: int(v) for k, v in (o.split("=") for o in opts)})
    os.makedirs(out_dir, exist_ok=True)
    result = {"args": args, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": [],
              "timing": []}
    path = os.path.join(out_dir, "static-decode-check.json")

    def save():
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(path + ".tmp", path)
    for dtype in ("float32", "float16"):
        model, tok = palu.load_model(model_path, dtype=dtype, device="cuda")
        model.generation_config.eos_token_id = None
        ids_all = tok(open(text_path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
        ids, mask = _batch(_prompts(ids_all, 16, 1024), tok.pad_token_id or 0, "cuda")
        g_trace, e_trace = [], []
        g_new, _ = static_decode.greedy_static(model, ids, mask, 24, set(), graph=True, trace=g_trace)
        e_new, _ = static_decode.greedy_static(model, ids, mask, 24, set(), graph=False, trace=e_trace)
        d_new = _eager(model, ids, mask, 24)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g_trace, e_trace))
        result["checks"].append({
            "dtype": dtype, "rows": len(g_new), "new_tokens": 24,
            "graph_vs_eager_static_max_logit_diff": diff,
            "graph_vs_eager_static_rows_equal": sum(a == b for a, b in zip(g_new, e_new)),
            "graph_vs_dynamic_loop_rows_equal": sum(a == b for a, b in zip(g_new, d_new)),
            "first_differing_step_vs_dynamic": [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                                for a, b in zip(g_new, d_new)]})
        print(json.dumps(result["checks"][-1]), flush=True)
        save()
        if dtype == "float16":
            ids, mask = _batch(_prompts(ids_all, args["batch"], args["length"]), tok.pad_token_id or 0, "cuda")
            paths = {"graph": lambda n: static_decode.greedy_static(model, ids, mask, n, set(), graph=True),
                     "static-eager": lambda n: static_decode.greedy_static(model, ids, mask, n, set(), graph=False),
                     "dynamic-loop": lambda n: _eager(model, ids, mask, n)}
            for name, fn in paths.items():
                fn(2)   # warm-up: kernel selection, allocator growth
                pre, _ = _timed(lambda: fn(1))
                full, _ = _timed(lambda: fn(args["new"]))
                row = {"path": name, "batch": args["batch"], "prefill_s": pre, "total_s": full,
                       "decode_step_ms": 1000 * (full - pre) / (args["new"] - 1),
                       "prompts_per_s": args["batch"] / full,
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
                result["timing"].append(row)
                print(json.dumps(row), flush=True)
                save()
        del model
        torch.cuda.empty_cache()
    print(f"-> {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
