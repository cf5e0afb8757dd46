"""Plain Palu through `GraphLatentCache` with replayed decode steps
(`palu.eval.static_decode.greedy_static_latent`, on by default since this check passed) on a padded
batch of real prompts: the replayed graphs against the same steps run eagerly (logits, tokens),
both against the eager `LatentCache` loop every Palu answer takes today (tokens), each path's
first token against the prompt alone (logits), then one batch's time on each path. What a GPU
lease checks before the path is switched on by default; exits 3 when `_verdict` says it may not be.
Writes OUT/static-latent-check.json.

  python benchmarks/experiments/static_latent_check.py OUT_DIR MODEL CHECKPOINT TEXT \
      [bits=4] [batch=128] [length=4032] [new=64] [device=cuda] [dtype=float16]

On a CPU (device=cpu) the graph runs are the eager static steps (a smoke run of the script). Seen
there (float32, 4-bit, 16 prompts of 915-1,024 tokens, session 34): the right-padded prefill within
2e-5 of each prompt alone, the eager loop's left-padded one 0.67-0.85 apart (a masked attention's
last-bit differences, turned into other 4-bit codes; FP16 1e-4), and 12 of 16 rows with the loop's tokens.
With a checkpoint calibrated on two 128-token windows and prompts of 264-300 tokens (session 35) the
graph prefill was 0.42 from each prompt alone (median of 16 rows; 4 rows within 3e-5), the loop's 0.71.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

import palu
from palu.eval import generation, static_decode
from palu.methods import build_method


def _prompts(ids, count, length):
    return [ids[i * 331:i * 331 + length - (i * 97) % max(1, length // 8)] for i in range(count)]


def _batch(prompts, pad, device):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _timed(fn, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def main(out_dir, model_path, checkpoint, text_path, *opts):
    args = {"bits": "4", "batch": "128", "length": "4032", "new": "64", "device": "cuda", "dtype": "float16"}
    args.update(o.split("=", 1) for o in opts)
    bits, batch, length, new = (int(args[k]) for k in ("bits", "batch", "length", "new"))
    device = args["device"]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "static-latent-check.json")
    result = {"args": args, "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
              "torch": torch.__version__, "checks": [], "timing": []}

    def save():
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(path + ".tmp", path)
    model, tok = palu.load_model(model_path, dtype=args["dtype"], device=device)
    model.generation_config.eos_token_id = None
    method = build_method({"name": "palu", "checkpoint": checkpoint, "latent_bits": bits})
    method.install(model)
    why = static_decode.latent_unsupported(model, method)
    if why is not None:
        raise SystemExit(f"the latent graph path cannot serve this checkpoint: {why}")
    text = tok(open(text_path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    pad = tok.pad_token_id or 0
    ids, mask = _batch(_prompts(text, 16, min(length, 1024)), pad, device)
    graph = device == "cuda"
    runs = {}
    for name, g in (("graph", graph), ("static-eager", False)):
        trace = []
        runs[name] = (static_decode.greedy_static_latent(model, method, ids, mask, 24, set(), graph=g,
                                                         trace=trace)[0], trace)
    loop = [n for n, _ in generation._decode_dropping_ended_rows(model, method.make_cache(model), ids, mask, 24, set())]
    (g_new, g_trace), (e_new, e_trace) = runs["graph"], runs["static-eager"]
    result["checks"].append({
        "rows": len(g_new), "new_tokens": 24, "bits": bits, "dtype": args["dtype"],
        "graph_vs_same_step_eager_max_logit_diff": max((a.float() - b.float()).abs().max().item()
                                                       for a, b in zip(g_trace, e_trace)),
        "graph_vs_same_step_eager_rows_equal": sum(a == b for a, b in zip(g_new, e_new)),
        "graph_vs_latent_cache_loop_rows_equal": sum(a == b for a, b in zip(g_new, loop)),
        "first_differing_step_vs_loop": [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                         for a, b in zip(g_new, loop)]})
    # each path's first token against the prompt alone through the method's cache (batch 1): a
    # quantised cache turns last-bit differences of the batch's other shapes into other codes
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, past_key_values=method.make_cache(model)).logits[:, -1]
        for r in range(len(g_new)):
            prompt = ids[r][mask[r].bool()][None]
            alone = model(prompt, past_key_values=method.make_cache(model)).logits[0, -1]
            result["checks"].append({"row": r, "tokens": int(prompt.shape[1]),
                                     "graph_prefill_vs_alone_max_logit_diff": (g_trace[0][r] - alone).abs().max().item(),
                                     "left_padded_prefill_vs_alone_max_logit_diff": (padded[r] - alone).abs().max().item()})
            print(json.dumps(result["checks"][-1]), flush=True)
    result["verdict"] = _verdict(result["checks"])
    print(json.dumps({"verdict": result["verdict"]}), flush=True)
    save()
    ids, mask = _batch(_prompts(text, batch, length), pad, device)
    paths = {"graph": lambda n: static_decode.greedy_static_latent(model, method, ids, mask, n, set(), graph=graph),
             "static-eager": lambda n: static_decode.greedy_static_latent(model, method, ids, mask, n, set(), graph=False),
             "latent-cache-loop": lambda n: generation._decode_dropping_ended_rows(
                 model, method.make_cache(model), ids, mask, n, set())}
    for name, fn in paths.items():
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            fn(2)   # warm-up: kernel compilation, graph capture of the first buckets, allocator growth
            pre, _ = _timed(lambda: fn(1), device)
            full, _ = _timed(lambda: fn(new), device)
        except torch.OutOfMemoryError:   # seen on the H200: the loop's eager left-padded prefill at 128 x 4K
            result["timing"].append({"path": name, "batch": batch, "oom": True})
            print(json.dumps(result["timing"][-1]), flush=True)
            save()
            continue
        row = {"path": name, "batch": batch, "prefill_s": pre, "total_s": full,
               "decode_step_ms": 1000 * (full - pre) / max(1, new - 1), "prompts_per_s": batch / full,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
        result["timing"].append(row)
        print(json.dumps(row), flush=True)
        save()
    print(f"-> {path}")
    if not result["verdict"]["pass"]:
        raise SystemExit(3)   # a lease switches the path on only when this exits 0


# What switching the graph path on needs: its replayed steps are the same steps run eagerly (the
# same kernels: equal tokens, logits within REPLAY_TOL), and its right-padded prefill is, over the
# rows, as close to each prompt alone as the loop's left-padded one (medians; ALONE_SLACK allows
# for noise: with quantised latents a last-bit difference of a batch's shapes turns into another
# code, and a row's logits move by tenths either way, as seen on the CPU).
REPLAY_TOL, ALONE_SLACK = 1e-2, 0.1


def _verdict(checks) -> dict:
    first, rows = checks[0], checks[1:]
    why = []
    if first["graph_vs_same_step_eager_rows_equal"] != first["rows"]:
        why.append(f"{first['rows'] - first['graph_vs_same_step_eager_rows_equal']} rows differ from the same steps run eagerly")
    if first["graph_vs_same_step_eager_max_logit_diff"] > REPLAY_TOL:
        why.append(f"replayed logits {first['graph_vs_same_step_eager_max_logit_diff']:.3g} from eager (> {REPLAY_TOL})")
    graph = statistics.median([r["graph_prefill_vs_alone_max_logit_diff"] for r in rows])
    loop = statistics.median([r["left_padded_prefill_vs_alone_max_logit_diff"] for r in rows])
    if graph > loop + ALONE_SLACK:
        why.append(f"the graph prefill's rows are {graph:.3g} from each prompt alone (median), the loop's {loop:.3g}")
    return {"pass": not why, "why": why, "replay_tol": REPLAY_TOL, "alone_slack": ALONE_SLACK,
            "median_vs_alone": {"graph_prefill": graph, "left_padded_prefill": loop}}


if __name__ == "__main__":
    main(*sys.argv[1:])
