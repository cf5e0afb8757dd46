"""End-to-end decode benchmark (GPU): time per generated token and peak GPU memory vs context.

For each variant (dense fp16 vs Palu with fp16 / 4-bit / 2-bit latents) and context length T,
a Llama-shaped decoder with random weights holds T cached tokens (random contents: decode time
does not depend on the values) and generates token T+1: the whole step (embedding, 32 layers,
cache write with on-the-fly quantisation, attention, MLP, LM head, argmax fed back as the next
input) is captured once as a CUDA graph and replayed. Peak memory is torch's
max_memory_allocated over building the cache, capturing and replaying (weights included).
Each row carries the bytes a step must read (weights + cache), its FLOPs (`step_flops`) and the
roofline floor max(bytes / copy bandwidth, FLOPs / matmul rate).
"""
from __future__ import annotations

import gc
import platform
import time
from pathlib import Path

import torch

from .bench_decoder import Decoder, DecoderShape, PaluSpec, step_flops


def _check_small(cfg, log) -> list[dict]:
    """Full-rank Palu vs dense on a small shape on this GPU: the two paths are one model."""
    out = []
    for rope, bits in ((True, 16), (True, 8), (True, 4), (False, 16), (False, 4)):
        small = DecoderShape(**cfg["check_shape"], rope=rope)
        dense = Decoder(small, device="cuda", seed=1, weight_std=0.1, kernel_params=cfg.get("kernel"),
                        fused_ops=cfg.get("fused_ops"))
        tokens = torch.randint(0, small.vocab, (2, 40), device="cuda",
                               generator=torch.Generator("cuda").manual_seed(0))
        full = small.head_dim * cfg["check_group_size"]
        palu = Decoder.palu_from_dense(dense, PaluSpec(cfg["check_group_size"], full, full, bits))
        logits = {}
        for name, model in (("dense", dense), ("palu", palu)):
            cache = model.new_cache(2, tokens.shape[1])
            logits[name] = torch.stack([model.step(tokens[:, t], t, cache).float()
                                        for t in range(tokens.shape[1])], 1)
        err = ((logits["palu"] - logits["dense"]).norm() / logits["dense"].norm()).item()
        log(f"check full-rank palu ({bits}-bit latents, rope={rope}) vs dense: rel err {err:.2e}")
        out.append({"rope": rope, "bits": bits, "rel_err": err})
    return out


def _measure(model: Decoder, context: int, batch: int, iters: int, resident: int) -> dict:
    """`resident`: bytes still allocated by earlier variants, subtracted from the peak."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache = model.new_cache(batch, context + 1)
    cache.fill_random()
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")

    def step():   # one generated token: its argmax is the next step's input
        tokens.copy_(model.step(tokens, context, cache).argmax(-1))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # compile kernels and warm the allocator outside the graph
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    peak = torch.cuda.max_memory_allocated() - resident
    cache_bytes = cache.nbytes()
    del graph, cache
    times.sort()
    return {"seconds_per_token": times[len(times) // 2], "seconds_min": times[0],
            "peak_bytes": peak, "cache_bytes": cache_bytes}


def variant_spec(shape: DecoderShape, v: dict) -> PaluSpec | None:
    if v.get("palu") is None:
        return None
    p = v["palu"]
    return PaluSpec.from_kept(shape, p["group_size"], p["kept_k"], p["kept_v"], p.get("bits", 16))


def run(cfg: dict, out: str | None = None, log=print) -> dict:
    names = [v["name"] for v in cfg["variants"]]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique: {names}")
    shapes = {v["name"]: DecoderShape(**cfg["shape"], rope=v.get("rope", True)) for v in cfg["variants"]}
    baselines = {v["name"]: v.get("baseline", cfg["baseline"]) for v in cfg["variants"]}
    for name, base in baselines.items():
        if base not in names:
            raise ValueError(f"variant {name!r}: baseline {base!r} is not one of the variants {names}")
    # validates every variant before any GPU work
    specs = {v["name"]: variant_spec(shapes[v["name"]], v) for v in cfg["variants"]}
    if cfg.get("hf"):
        from .decode_transformers import hf_plan
        hf_plan(cfg)
    if not torch.cuda.is_available():
        raise RuntimeError("the decode benchmark needs a CUDA GPU (none visible here)")
    import triton

    from .timing import measure_ceilings
    ceil = measure_ceilings()
    checks = _check_small(cfg, log) if cfg.get("check_shape") else []
    rows = []
    for name, spec in specs.items():
        shape = shapes[name]
        gc.collect()
        torch.cuda.empty_cache()
        # Anything still allocated here belongs to earlier variants (the first end-to-end run
        # showed peaks of later variants 0.5-1 GiB above weights + cache); it is recorded and
        # subtracted, so each variant's peak is its own.
        resident = torch.cuda.memory_allocated()
        model = Decoder(shape, spec, device="cuda", seed=0, kernel_params=cfg.get("kernel"),
                        fused_ops=cfg.get("fused_ops"))
        weights = model.weight_bytes()
        for context in cfg["contexts"]:
            row = {"variant": name, "context": context, "batch": cfg["batch"], "weight_bytes": weights,
                   "resident_before_bytes": resident, "fused_ops": model.fused_ops,
                   "rope": shape.rope, "baseline": baselines[name],
                   "group_size": spec.group_size if spec else None, "rank_k": spec.rank_k if spec else None,
                   "rank_v": spec.rank_v if spec else None, "bits": spec.bits if spec else 16}
            try:
                row.update(_measure(model, context, cfg["batch"], cfg["iters"], resident))
            except torch.OutOfMemoryError as err:
                row["error"] = f"out of memory: {str(err)[:160]}"
                torch.cuda.empty_cache()
            except Exception as err:   # a point the kernels cannot serve: recorded, the run goes on
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                torch.cuda.empty_cache()
            if "error" not in row:
                row["bytes_per_token"] = weights + row["cache_bytes"]
                row["flops_per_token"] = step_flops(shape, spec, context, cfg["batch"])
                row["roofline_floor_s"] = max(row["bytes_per_token"] / ceil["copy_bytes_per_s"],
                                              row["flops_per_token"] / ceil["matmul_flops_per_s"])
                row["roofline_fraction"] = row["roofline_floor_s"] / row["seconds_per_token"]
                log(f"{name} T={context}: {row['seconds_per_token'] * 1e3:.2f} ms/token, "
                    f"peak {row['peak_bytes'] / 2**30:.1f} GiB, roofline {row['roofline_fraction']:.0%}")
            else:
                log(f"{name} T={context}: {row['error']}")
            rows.append(row)
        del model
        torch.cuda.empty_cache()
    times = {(r["variant"], r["context"]): r["seconds_per_token"] for r in rows if "error" not in r}
    for r in rows:
        base = times.get((r["baseline"], r["context"]))
        if "error" not in r and base:
            r["speedup"] = base / r["seconds_per_token"]
    if cfg.get("hf"):   # the transformers path (eager), after the graph-replayed decoder
        from .decode_transformers import run_hf
        hf = run_hf(cfg, log)
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "checks": checks, "rows": rows,
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda},
              "weights": "random fp16 (decode time does not depend on the weight values)",
              "config": cfg, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if cfg.get("hf"):
        result["hf"] = hf
    if out:
        from palu.artifacts import write_json   # refuses NaN / inf: a failed timing is an error row
        write_json(out, result)
    return result


if __name__ == "__main__":
    import sys

    import yaml
    conf = Path(__file__).resolve().parent / "conf" / "bench" / "decode.yaml"
    cfg = yaml.safe_load(conf.read_text())
    for arg in sys.argv[2:]:  # quick overrides: key=yaml-value
        key, _, value = arg.partition("=")
        cfg[key] = yaml.safe_load(value)
    run(cfg, out=sys.argv[1] if len(sys.argv) > 1 else None)
