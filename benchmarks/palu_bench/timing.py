"""How the latency benchmarks time a decode step and report it (latency.py, latency_tuning.py,
hopper_bench.py, selection_latency.py, select_sweep.py share these): CUDA-graph replays cycling
through input copies beyond L2, the measured copy and matmul ceilings, the error against a float32
reference, and a row with its bytes, FLOPs and roofline floor."""
from __future__ import annotations

import math

import torch


def rotation_copies(nbytes: int, cfg: dict) -> int:
    """How many input copies one timed call cycles through so that no step finds its inputs in L2.

    Replaying one set of buffers lets a step whose inputs fit in L2 (the H200's 60 MB: a 4-bit
    Palu step at 4K-16K, 18-38 MB) read them from L2, not HBM: the short rows looked 8-22 % too
    fast (issue 39). A decode step of a real model reads another layer's cache each time, so each
    call here cycles through copies totalling `rotate_l2_multiple` x L2 (at least one copy)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    want = math.ceil(cfg.get("rotate_l2_multiple", 4) * l2 / max(1, nbytes))
    return max(1, min(cfg.get("rotate_max_copies", 64), want))


def bench_rotated(fns: list, warmup_ms: float, rep_ms: float) -> float:
    """Median seconds of one call, each replay calling every copy's `fn` once in turn."""
    if len(fns) == 1:
        return bench(fns[0], warmup_ms, rep_ms)

    def every():
        for fn in fns:
            fn()
    return bench(every, warmup_ms, rep_ms) / len(fns)


def bench(fn, warmup_ms: float, rep_ms: float, graph: bool = True) -> float:
    """Median seconds per call. Decode steps are CUDA-graph replays (as a serving stack runs
    them), so Python launch overhead is not what is measured."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e-3
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3


def measure_ceilings(warmup_ms=10, rep_ms=50) -> dict:
    """Device-to-device copy bandwidth (read + write bytes) and fp16 matmul rate, measured."""
    n = 2 ** 30  # 2 GiB of fp16 read, 2 GiB written
    src = torch.randn(n, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), warmup_ms, rep_ms, graph=False)
    bw = 2 * n * 2 / t
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    t = bench(lambda: a @ b, warmup_ms, rep_ms, graph=False)
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * 8192 ** 3 / t}


def rel_err(fn, ref) -> float:
    """Relative error of one kernel call against the float32 reference output."""
    return ((fn() - ref).norm() / ref.norm()).item()


def timed_row(name, shape_name, B, T, t, counts, ceil, **extra):
    floor = max(counts["bytes"] / ceil["copy_bytes_per_s"], counts["flops"] / ceil["matmul_flops_per_s"])
    return {"variant": name, "shape": shape_name, "batch": B, "length": T, "seconds": t,
            "copies": counts.get("copies", 1),
            "bytes": counts["bytes"], "flops": counts["flops"], "tb_per_s": counts["bytes"] / t / 1e12,
            "tflop_per_s": counts["flops"] / t / 1e12, "roofline_floor_s": floor,
            "roofline_fraction": floor / t, **extra}


def speedups(t: float, base: dict) -> dict:
    """Speed-up over the best torch SDPA backend of the same run, and over eager attention (the
    paper's baseline: its latency script times transformers' `LlamaAttention`), where timed."""
    out = {"speedup": base["sdpa"] / t}
    if base.get("eager"):
        out["speedup_eager"] = base["eager"] / t
    return out
