"""Where a batch's time goes, method by method (issue 49): its prefill and one decode step of
`answer_batches`, by CUDA kernel, at the throughput benchmark's shapes.

The throughput table says how fast a method is; this says why. Per method, the same batch is
answered with `new_tokens` 1 (the prefill alone), 2 and `2 + steps`. Every `answer_batches` call
builds its own cache, so its first decode step runs eagerly and is captured as a CUDA graph
(`static_decode`, `graph_decoding`): 2 minus 1 is that first step (`first_step_s`: eager run and
capture), and (2 + steps) minus 2, over `steps`, is one replayed step: wall time, and under
torch.profiler its CUDA time, kernels and host calls by name. (Until session 42 the short run was
1 token, so the capture's one-off work was spread over the steps: a "step" was slower and made
more host calls than a replay does, and with one repeat Palu's came out negative.) Nothing inside the library is hooked, so what is measured is the path the
suites take (slots, replayed graphs, kernels, the eager loop), chosen as in `batch_throughput`
(the same method names and their PALU_STATIC_DECODE switch).

Replayed CUDA graphs: CUPTI reports the kernels a graph launches; if a step shows `cudaGraphLaunch`
and no kernels, its kernels were not attributed (the row says `graph_kernels_seen: false`), and the
unprofiled wall times still hold. Bytes and FLOPs to compare with: the row's cache bytes per
prompt (as stored, from the answers) times the batch is what a step must read at least.

  python -m palu_bench.step_profile OUT_DIR model=PATH.gguf text=PATH.txt
      ['methods=[fp16,palu50-b4-graph,kivi-b2-graph]' batch=64 length=4032 steps=16 top=15]

`model=random:smollm2-135m` times the model's shapes with random weights (see batch_throughput).
On a CPU (device=cpu dtype=float32, small batch and length) it runs as a smoke test: host times
by op instead of kernels.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from .batch_throughput import METHODS, _env, _method, _sync, checkpoint_if_needed, load_subject, make_prompts, set_switches
from .batch_throughput import overrides as throughput_overrides

DEFAULTS = {"methods": ["fp16", "palu50-b4-graph", "kivi-b2-graph"], "batch": 64, "length": 4032,
            "steps": 16, "top": 15, "device": "cuda", "dtype": "float16", "model": None, "text": None,
            "calib_windows": 16, "repeats": 2}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _self_device_us(evt) -> float:
    return float(getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0))


def profile_table(prof) -> dict:
    """name -> (calls, self device us, self host us) over one profiled run."""
    out = {}
    for evt in prof.key_averages():
        out[evt.key] = (int(evt.count), _self_device_us(evt), float(evt.self_cpu_time_total))
    return out


def step_rows(short: dict, long: dict, steps: int, device: str, top: int) -> dict:
    """The per-step difference of two profiled runs: kernels (device time) and host calls."""
    names = set(short) | set(long)
    zero = (0, 0.0, 0.0)

    def per_step(name):
        (c0, d0, h0), (c1, d1, h1) = short.get(name, zero), long.get(name, zero)
        return {"name": name, "calls": (c1 - c0) / steps, "device_us": (d1 - d0) / steps,
                "host_us": (h1 - h0) / steps}

    rows = [per_step(n) for n in names]
    kernels = [r for r in rows if r["device_us"] > 0 and long.get(r["name"], zero)[2] == 0]
    host = [r for r in rows if r["name"].startswith("aten::")]
    launches = sum(r["calls"] for r in rows if r["name"] in LAUNCHES)
    graphs = sum(r["calls"] for r in rows if r["name"] == "cudaGraphLaunch")
    out = {"kernel_us": sum(r["device_us"] for r in kernels), "kernel_calls": sum(r["calls"] for r in kernels),
           "kernel_launches": launches, "graph_launches": graphs, "aten_calls": sum(r["calls"] for r in host),
           "top_kernels": sorted(kernels, key=lambda r: -r["device_us"])[:top],
           "top_host_ops": sorted(host, key=lambda r: -r["host_us"])[:top]}
    if device == "cuda":
        out["graph_kernels_seen"] = not (graphs > 0 and not kernels)
    return out


def prefill_rows(short: dict, top: int) -> dict:
    kernels = [{"name": n, "calls": c, "device_us": d} for n, (c, d, h) in short.items() if d > 0 and h == 0]
    return {"kernel_us": sum(r["device_us"] for r in kernels),
            "top_kernels": sorted(kernels, key=lambda r: -r["device_us"])[:top]}


def _answer(m, tok, method, prompts, new_tokens, device):
    from palu.eval.generation import answer_batches
    _sync(device)
    t = time.perf_counter()
    answers = answer_batches(m, tok, method, prompts, new_tokens, batch_size=len(prompts))
    _sync(device)
    return time.perf_counter() - t, answers


class NotAStepTime(RuntimeError):
    """Wall times whose difference cannot be a decode step."""


def step_times(walls: dict, steps: int) -> dict:
    """Prefill, first step (eager run and graph capture) and one replayed step from the fastest
    wall times of answers of 1, 2 and 2 + `steps` tokens. A step time at or below zero cannot be
    right (the runs were not alike: a capture in one and not the other, a busy GPU): an error,
    not a number."""
    one, two, long = (min(walls[n]) for n in (1, 2, 2 + steps))
    step_ms = (long - two) / steps * 1e3
    if step_ms <= 0:
        raise NotAStepTime(f"a decode step of {step_ms:.2f} ms (walls {walls}): the runs differ by "
                           "more than their steps; run again with more repeats")
    return {"prefill_s": one, "first_step_s": two - one, "step_ms": step_ms}


def measure(model, tok, name, ckpt, prompts, args) -> dict:
    from torch.profiler import ProfilerActivity, profile
    device, steps = args["device"], args["steps"]
    method, m = _method(model, name, ckpt)
    set_switches(name)
    _answer(m, tok, method, prompts, 2 + steps, device)               # warm-up: compile, tune
    walls = {1: [], 2: [], 2 + steps: []}
    for _ in range(args["repeats"]):
        for n in walls:
            walls[n].append(_answer(m, tok, method, prompts, n, device)[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    tables = {}
    for n in walls:
        with profile(activities=activities) as prof:
            _, answers = _answer(m, tok, method, prompts, n, device)
        tables[n] = profile_table(prof)
    kv = max(b["stored"] for _, b in answers) if answers and answers[0][1] else None
    row = {"method": name, "batch": len(prompts), "prompt_tokens": [len(prompts[-1]), len(prompts[0])],
           "switch": os.environ["PALU_STATIC_DECODE"], **step_times(walls, steps),
           "walls_s": {str(k): v for k, v in walls.items()}, "kv_bytes_per_prompt": kv,
           "step": step_rows(tables[2], tables[2 + steps], steps, device, args["top"]),
           "first_step": step_rows(tables[1], tables[2], 1, device, args["top"]),
           "prefill": prefill_rows(tables[1], args["top"])}
    if kv is not None:   # what one step must read at least: every row's cache as stored
        row["step_cache_bytes"] = kv * len(prompts)
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def report(row: dict) -> str:
    s = row["step"]
    lines = [f"== {row['method']} (batch {row['batch']}, PALU_STATIC_DECODE={row['switch']}): prefill "
             f"{row['prefill_s']:.3f} s, first step (eager + capture) {row['first_step_s']:.3f} s, "
             f"replayed step {row['step_ms']:.2f} ms wall; per step {s['kernel_us'] / 1e3:.2f} ms "
             f"in {s['kernel_calls']:.0f} kernels, {s['kernel_launches']:.0f} launches, "
             f"{s['graph_launches']:.0f} graph launches, {s['aten_calls']:.0f} aten calls"]
    for r in s["top_kernels"]:
        lines.append(f"   step  {r['device_us']:10.1f} us {r['calls']:8.1f} x  {r['name'][:110]}")
    for r in row["prefill"]["top_kernels"][:8]:
        lines.append(f"   prefill {r['device_us'] / 1e3:8.1f} ms {r['calls']:6d} x  {r['name'][:110]}")
    if not s["top_kernels"]:
        for r in s["top_host_ops"][:8]:
            lines.append(f"   host  {r['host_us']:10.1f} us {r['calls']:8.1f} x  {r['name'][:110]}")
    return "\n".join(lines)


def overrides(items: list[str]) -> dict:
    args = throughput_overrides(items, DEFAULTS)
    if int(args["steps"]) < 1 or int(args["batch"]) < 1:
        raise SystemExit(f"steps={args['steps']} and batch={args['batch']} must be at least 1")
    return args


def main(argv: list[str]) -> None:
    from .random_subject import is_random
    if not argv:
        raise SystemExit(__doc__)
    out_dir, args = argv[0], overrides(argv[1:])
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "step-profile.json")
    device = args["device"]
    model, tok, ids = load_subject(args, args["batch"])
    data = {"config": args, "env": _env(device), "rows": [], "failed": [],
            "weights": "random" if is_random(args["model"]) else "real"}
    with tempfile.TemporaryDirectory() as tmp:
        windows = torch.tensor([ids[i * 1024:(i + 1) * 1024] for i in range(args["calib_windows"])], device=device)
        ckpt = checkpoint_if_needed(model, windows, tmp, args["methods"])
        prompts = make_prompts(ids[args["calib_windows"] * 1024:], args["batch"], args["length"])
        for name in args["methods"]:
            try:
                row = measure(model, tok, name, ckpt, prompts, args)
            except torch.OutOfMemoryError as err:
                data["failed"].append({"method": name, "error": f"out of memory: {err}"[:300]})
                print(f"{name}: out of memory", flush=True)
                continue
            except NotAStepTime as err:   # recorded as a failure, never as a number
                data["failed"].append({"method": name, "error": str(err)[:300]})
                print(f"{name}: {err}", flush=True)
                continue
            data["rows"].append(row)
            print(report(row), flush=True)
            _save(path, data)
    _save(path, data)
    print(f"-> {path}", flush=True)


def _save(path: str, data: dict) -> None:
    """Rewritten after every method, so a run stopped at its time limit keeps what it measured."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main(sys.argv[1:])
