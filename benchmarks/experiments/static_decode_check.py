"""The CUDA-graph decode path (`palu.eval.static_decode`) on a GPU with the real model: the graph's
replayed steps against the same static step run eagerly (logits), its dense decode kernel against
SDPA's masked kernel (logits, tokens), and against the eager dynamic-cache loop every other method
uses (tokens), in float32 and float16; then where the time of one batch goes (prefill vs decode)
on each path. Writes OUT/static-decode-check.json.

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
        runs = {}
        for name, graph, kernel in (("graph", True, "1"), ("static-eager", False, "1"), ("graph-sdpa", True, "0")):
            os.environ["PALU_DENSE_DECODE"] = kernel
            trace = []
            new, _ = static_decode.greedy_static(model, ids, mask, 24, set(), graph=graph, trace=trace)
            runs[name] = (new, trace)
        os.environ["PALU_DENSE_DECODE"] = "1"
        d_new = _eager(model, ids, mask, 24)
        g_new, g_trace = runs["graph"]

        def diff(name):
            return max((a.float() - b.float()).abs().max().item() for a, b in zip(g_trace, runs[name][1]))
        result["checks"].append({
            "dtype": dtype, "rows": len(g_new), "new_tokens": 24,
            "graph_vs_same_step_eager_max_logit_diff": diff("static-eager"),
            "graph_vs_same_step_eager_rows_equal": sum(a == b for a, b in zip(g_new, runs["static-eager"][0])),
            "kernel_vs_sdpa_decode_max_logit_diff": diff("graph-sdpa"),
            "kernel_vs_sdpa_decode_rows_equal": sum(a == b for a, b in zip(g_new, runs["graph-sdpa"][0])),
            "graph_vs_dynamic_loop_rows_equal": sum(a == b for a, b in zip(g_new, d_new)),
            "first_differing_step_vs_dynamic": [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                                for a, b in zip(g_new, d_new)]})
        print(json.dumps(result["checks"][-1]), flush=True)
        save()
        if dtype == "float16":
            ids, mask = _batch(_prompts(ids_all, args["batch"], args["length"]), tok.pad_token_id or 0, "cuda")
            paths = {"graph": (True, "1"), "graph-sdpa": (True, "0"), "static-eager": (False, "1")}
            for name, (graph, kernel) in paths.items():
                os.environ["PALU_DENSE_DECODE"] = kernel

                def fn(n):
                    return static_decode.greedy_static(model, ids, mask, n, set(), graph=graph)[0]
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                fn(2)   # warm-up: kernel selection and compilation, allocator growth
                pre, _ = _timed(lambda: fn(1))
                full, _ = _timed(lambda: fn(args["new"]))
                row = {"path": name, "batch": args["batch"], "prefill_s": pre, "total_s": full,
                       "decode_step_ms": 1000 * (full - pre) / (args["new"] - 1),
                       "prompts_per_s": args["batch"] / full,
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
                result["timing"].append(row)
                print(json.dumps(row), flush=True)
                save()
            os.environ["PALU_DENSE_DECODE"] = "1"
        del model
        torch.cuda.empty_cache()
    print(f"-> {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
