"""The methods whose decode steps run in preallocated slots, replayed as CUDA graphs, on a padded
batch of real prompts: the token subsets (`palu.eval.static_subset.greedy_static_subset`: SnapKV
and PyramidKV, on by default since this check passed on the H200, session 36:
results/checks/h200-static-subset-check.json; StreamingLLM, TOVA, Quest) and the quantised caches
(`palu.eval.static_quant.greedy_static_quant`: KIVI, KIVI + SnapKV). The replayed graphs against
the same steps run eagerly (logits, tokens), both against the eager loop every answer of the
method takes without the path (tokens; the prefill is the same code, so only the decode attention
differs: the dense-decode kernel against SDPA's masked one), then one batch's time on each path.
What a GPU lease checks before a path is switched on by default; exits 3 when a verdict says it
may not be (with `alone=K` the prompts alone judge the tokens in place of the eager loop:
`_judge_alone`). Writes OUT/static-subset-check.json. Atom and TurboQuant fail that verdict with
the real weights (3 of 16 alone, session 50) and are on by default all the same: the path they
replaced is no closer (4 of 4 differed, session 46), and their batch answers part from alone for a
reason no path removes (`batch_invariance.py`).

  python benchmarks/experiments/static_subset_check.py OUT_DIR MODEL TEXT \
      [methods=snapkv,pyramidkv,tova,streaming_llm,quest,h2o,kivi,kivi-b4,kivi_snapkv] [batch=64] \
      [length=4032] [new=64] [device=cuda] [dtype=float16] [loop=all] [paths=graph,static-eager]
      [alone=0]

`loop`: the methods whose eager loop is timed too (at a batch of 64 x 4K Quest's and StreamingLLM's
eager loops take minutes; session 36's figures stand for them); `all` for every method.
`paths`: the slot paths timed on the large batch. `alone=K`: the first K prompts of the large batch
answered one at a time through the same slot path, against their rows of the timed batch ("graph"
must be timed): how many answers a batch changes (fp16 reductions of another shape can flip an
argmax; the share is reported, never hidden).

On a CPU (device=cpu) the graph runs are the eager static steps (a smoke run of the script).
MODEL `random:smollm2-135m` (TEXT then unused, say `-`; `benchmarks/` on PYTHONPATH): the model's
shapes with random weights and prompts (`palu_bench.random_subject`), for a GPU host with nothing
staged; the JSON says `"weights": "random"`.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

import palu
from palu.eval import generation, static_quant, static_subset
from palu.methods import build_method
from static_latent_check import _batch, _prompts, _timed   # the same prompts and timing (a sibling script)

CONF = {"snapkv": {"name": "snapkv", "compression_ratio": 0.5},
        "pyramidkv": {"name": "pyramidkv", "compression_ratio": 0.5},
        # evicting every step (cache/evicting_slots.py; budgets below the check's 1K prompts, so
        # they evict from the first decode step)
        "tova": {"name": "tova", "budget": 512}, "streaming_llm": {"name": "streaming_llm", "sink": 4, "window": 508},
        "quest": {"name": "quest", "page": 16, "budget": 256},
        "h2o": {"name": "h2o", "budget": 512, "window": 64},
        # quantised (cache/quant_slots.py): the long grid's settings; over 24 steps at 1K prompts
        # every row codes values each step and a key block every 32 tokens, rows at other steps
        "kivi": {"name": "kivi", "bits": 2}, "kivi-b4": {"name": "kivi", "bits": 4},
        "kivi_snapkv": {"name": "kivi_snapkv", "bits": 2, "evict_ratio": 0.5},
        "turboquant": {"name": "turboquant", "bits": 3}, "atom": {"name": "atom", "bits": 4}}
# replayed steps are the eager steps' kernels: equal tokens, logits within REPLAY_TOL; against the
# eager loop (another attention kernel in fp16) at least LOOP_SHARE of the rows equal
REPLAY_TOL, LOOP_SHARE = 1e-2, 0.75


def _no_grad(fn):
    # the eager loop is called here directly, not through `answer_batches` (which holds no
    # gradients): with them its 64 steps at 64 x 4K kept every step's activations (KIVI-2 ran out
    # of the H200's 139 GiB in session 38; the "unexplained" out-of-memory of session 36)
    return torch.no_grad()(fn)


def greedy_of(model, method):
    """The slot path that serves `method` (quantised or token subset); exits naming why if none."""
    if static_quant.quant_unsupported(model, method) is None:
        return static_quant.greedy_static_quant
    why = static_subset.subset_unsupported(model, method)
    if why is not None:
        raise SystemExit(f"{method.name}: {why}")
    return static_subset.greedy_static_subset


def check(model, method, ids, mask, graph: bool) -> dict:
    runs = {}
    greedy = greedy_of(model, method)
    for name, g in (("graph", graph), ("static-eager", False)):
        trace = []
        runs[name] = (greedy(model, method, ids, mask, 24, set(), graph=g, trace=trace)[0], trace)
    with torch.no_grad():
        loop = [n for n, _ in generation._decode_dropping_ended_rows(model, method.make_cache(model), ids, mask, 24, set())]
    (g_new, g_trace), (e_new, e_trace) = runs["graph"], runs["static-eager"]
    out = {"rows": len(g_new), "new_tokens": 24,
           "graph_vs_same_step_eager_max_logit_diff": max((a.float() - b.float()).abs().max().item()
                                                          for a, b in zip(g_trace, e_trace)),
           "graph_vs_same_step_eager_rows_equal": sum(a == b for a, b in zip(g_new, e_new)),
           "graph_vs_eager_loop_rows_equal": sum(a == b for a, b in zip(g_new, loop)),
           "first_differing_step_vs_loop": [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                            for a, b in zip(g_new, loop)]}
    why = []
    if out["graph_vs_same_step_eager_rows_equal"] != out["rows"]:
        why.append("rows differ from the same steps run eagerly")
    if out["graph_vs_same_step_eager_max_logit_diff"] > REPLAY_TOL:
        why.append(f"replayed logits more than {REPLAY_TOL} from eager")
    if out["graph_vs_eager_loop_rows_equal"] < LOOP_SHARE * out["rows"]:
        why.append(f"fewer than {LOOP_SHARE:.0%} of the rows equal the eager loop's")
    out["verdict"] = {"pass": not why, "why": why, "replay_tol": REPLAY_TOL, "loop_share": LOOP_SHARE}
    return out


def _judge_alone(check_: dict) -> None:
    """Each prompt alone is what a row must give (issue 49); the eager loop is only the path it
    replaces, with its own batch effects (session 50, real weights: KIVI + SnapKV's left-padded
    loop kept 2 of 16 of the slot path's answers, which were the prompts' own in 15). So where the
    prompts alone were answered, they judge the tokens in place of the loop: at least LOOP_SHARE of
    the rows equal alone. The replay checks stay as they are."""
    alone, verdict = check_["alone"], check_["verdict"]
    loop_why = f"fewer than {LOOP_SHARE:.0%} of the rows equal the eager loop's"
    why = [w for w in verdict["why"] if w != loop_why]
    if alone["equal"] < LOOP_SHARE * alone["rows"]:
        why.append(f"fewer than {LOOP_SHARE:.0%} of the rows equal their prompt alone "
                   f"({alone['equal']} of {alone['rows']})")
    verdict.update({"pass": not why, "why": why, "judged_by": "each prompt alone"})


def _alone(greedy, model, method, ids, mask, batch_answers, new, graph) -> dict:
    """Each of the first rows answered alone (its prompt without the pads, batch 1) against its row
    of the batch: equal answers, and where the first pair differs."""
    first = []
    for row, expected in enumerate(batch_answers):
        real = ids[row, mask[row].bool()][None]
        got = greedy(model, method, real, torch.ones_like(real), new, set(), graph=graph)[0][0]
        first.append(next((k for k, (x, y) in enumerate(zip(got, expected)) if x != y),
                          None if len(got) == len(expected) else min(len(got), len(expected))))
    return {"rows": len(first), "equal": sum(f is None for f in first), "first_differing_step": first,
            "batch": int(ids.shape[0]), "new_tokens": new}


def main(out_dir, model_path, text_path, *opts):
    args = {"methods": "snapkv,pyramidkv", "loop": "all", "batch": "64", "length": "4032", "new": "64", "device": "cuda",
            "dtype": "float16", "paths": "graph,static-eager", "alone": "0"}
    args.update(o.split("=", 1) for o in opts)
    batch, length, new, alone = (int(args[k]) for k in ("batch", "length", "new", "alone"))
    timed = set(filter(None, args["paths"].split(",")))   # paths= : the checks alone
    if timed - {"graph", "static-eager"} or (alone and "graph" not in timed) or alone > batch:
        raise SystemExit(f"paths={args['paths']!r}, alone={alone}: paths among graph, static-eager; "
                         f"alone needs graph and at most batch={batch}")
    device = args["device"]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "static-subset-check.json")
    result = {"args": args, "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
              "torch": torch.__version__, "checks": {}, "timing": []}

    def save():
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(path + ".tmp", path)
    if model_path.startswith("random:"):   # the model's shapes, random weights and ids: nothing staged
        from palu_bench.random_subject import random_subject
        base, tok, text = random_subject(model_path, 331 * max(batch, 16) + length, args["dtype"], device)
        result["weights"] = "random"
    else:
        base, tok = palu.load_model(model_path, dtype=args["dtype"], device=device)
        text = tok(open(text_path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    base.generation_config.eos_token_id = None
    pad = tok.pad_token_id or 0
    small = _batch(_prompts(text, 16, min(length, 1024)), pad, device)
    large = _batch(_prompts(text, batch, length), pad, device)
    graph = device == "cuda"
    for name in args["methods"].split(","):
        import copy
        method, model = build_method(CONF[name]), copy.deepcopy(base)
        method.install(model)
        greedy = greedy_of(model, method)
        result["checks"][name] = check(model, method, *small, graph)
        print(json.dumps({name: result["checks"][name]}), flush=True)
        save()
        ids, mask = large
        paths = {"graph": lambda n: greedy(model, method, ids, mask, n, set(), graph=graph),
                 "static-eager": lambda n: greedy(model, method, ids, mask, n, set(), graph=False),
                 "eager-loop": lambda n: _no_grad(generation._decode_dropping_ended_rows)(
                     model, method.make_cache(model), ids, mask, n, set())}
        if args["loop"] != "all" and name not in args["loop"].split(","):
            del paths["eager-loop"]
        for path_name in ("graph", "static-eager"):
            if path_name not in timed:
                del paths[path_name]
        answers = None
        for path_name, fn in paths.items():
            held_before = None
            if device == "cuda":
                # session 36 on the H200: the eager loop's timing ran out of memory after the two
                # slot paths (in batch_throughput the same loop peaked at 9.8 GiB): what the earlier
                # paths still hold is recorded, after a collection, to tell a leak from a peak
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                held_before = {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
                               "reserved_gib": torch.cuda.memory_reserved() / 2**30}
            try:
                fn(2)   # warm-up: kernel selection, graph capture, allocator growth
                pre, _ = _timed(lambda: fn(1), device)
                full, out = _timed(lambda: fn(new), device)
            except torch.OutOfMemoryError:
                result["timing"].append({"method": name, "path": path_name, "batch": batch, "oom": True,
                                         "held_before": held_before,
                                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None})
                save()
                continue
            row = {"method": name, "path": path_name, "batch": batch, "prefill_s": pre, "total_s": full,
                   "decode_step_ms": 1000 * (full - pre) / max(1, new - 1), "prompts_per_s": batch / full,
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
            result["timing"].append(row)
            print(json.dumps(row), flush=True)
            save()
            if path_name == "graph":
                answers = out[0]
        if alone and answers is not None:
            result["checks"][name]["alone"] = _alone(greedy, model, method, ids, mask, answers[:alone], new, graph)
            _judge_alone(result["checks"][name])
            print(json.dumps({name: {"alone": result["checks"][name]["alone"],
                                     "verdict": result["checks"][name]["verdict"]}}), flush=True)
            save()
        del model
    result["pass"] = all(c["verdict"]["pass"] for c in result["checks"].values())
    save()
    print(f"-> {path}")
    if not result["pass"]:
        raise SystemExit(3)


if __name__ == "__main__":
    main(*sys.argv[1:])
