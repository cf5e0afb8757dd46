"""Decode-attention latency on a GPU: torch SDPA / eager vs Palu latent kernels (and an int4 cache).

Every row carries bytes moved, FLOPs, achieved TB/s and TFLOP/s and the roofline floor
max(bytes / measured bandwidth, FLOPs / measured matmul rate). Run `python -m palu_bench.latency`
on a GPU host (it needs only torch, triton and PyYAML) or the Hydra entry point palu_bench.cli.latency.
"""
from __future__ import annotations

import math
import platform
import sys
import time
from pathlib import Path

import torch

CONF = Path(__file__).resolve().parent / "conf" / "bench" / "latency.yaml"


def rotation_copies(nbytes: int, cfg: dict) -> int:
    """How many input copies one timed call cycles through so that no step finds its inputs in L2.

    Replaying one set of buffers lets a step whose inputs fit in L2 (the H200's 60 MB: a 4-bit
    Palu step at 4K-16K, 18-38 MB) read them from L2, not HBM: the short rows looked 8-22 % too
    fast (issue 39). A decode step of a real model reads another layer's cache each time, so each
    call here cycles through copies totalling `rotate_l2_multiple` x L2 (at least one copy)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    want = math.ceil(cfg.get("rotate_l2_multiple", 4) * l2 / max(1, nbytes))
    return max(1, min(cfg.get("rotate_max_copies", 64), want))


def _bench_rotated(fns: list, warmup_ms: float, rep_ms: float) -> float:
    """Median seconds of one call, each replay calling every copy's `fn` once in turn."""
    if len(fns) == 1:
        return _bench(fns[0], warmup_ms, rep_ms)

    def every():
        for fn in fns:
            fn()
    return _bench(every, warmup_ms, rep_ms) / len(fns)


def _bench(fn, warmup_ms: float, rep_ms: float, graph: bool = True) -> float:
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
    t = _bench(lambda: dst.copy_(src), warmup_ms, rep_ms, graph=False)
    bw = 2 * n * 2 / t
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    t = _bench(lambda: a @ b, warmup_ms, rep_ms, graph=False)
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * 8192 ** 3 / t}


def _rope_inv_freq(head_dim, theta, device):
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))


def _latent_bytes(B, G, T, r, bits):
    if bits == 16:
        return B * G * T * r * 2
    return B * G * T * (r * bits // 8 + 4)  # packed data + fp16 scale + fp16 zero point


def palu_case(shape, B, T, s, kept_k, kept_v, bits, rope, device="cuda", seed=0):
    """Random latents / factors for one configuration, plus its byte and FLOP counts."""
    from palu.quant.packed import quantize_latent
    H, KVH, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    G, n_rep = KVH // s, H // KVH
    rk, rv = int(kept_k * s * D), int(kept_v * s * D)
    g = torch.Generator(device=device).manual_seed(seed)
    hk = torch.randn(B, G, T, rk, device=device, dtype=torch.float16, generator=g)
    hv = torch.randn(B, G, T, rv, device=device, dtype=torch.float16, generator=g)
    q = torch.randn(B, H, D if rope else rk, device=device, dtype=torch.float16, generator=g)
    bk = (torch.randn(G, s * D, rk, device=device, dtype=torch.float16, generator=g)
          / math.sqrt(rk)) if rope else None
    if bits != 16:
        hk, hv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=1 / math.sqrt(D), n_rep=n_rep, group_size=s, bk=bk,
              position_offset=torch.zeros(B, device=device, dtype=torch.int32),
              inv_freq=_rope_inv_freq(D, shape["rope_theta"], device))
    from palu_kernels.palu_decode import _fused_unfit
    one_pass = _fused_unfit(rope, rk, rv, bits, bits, max(16, s * n_rep)) is None
    nbytes = (_latent_bytes(B, G, T, rk, bits) + _latent_bytes(B, G, T, rv, bits)
              + (0 if one_pass else 2 * B * H * T * 4)        # scores written and read back
              + (bk.numel() * 2 if rope else 0))
    flops = 2 * B * T * H * rv + (2 * B * T * (KVH * D * rk + H * D) if rope else 2 * B * T * H * rk)
    return q, hk, hv, kw, {"rank_k": rk, "rank_v": rv, "groups": G, "bytes": nbytes, "flops": flops}


def dense_case(shape, B, T, device="cuda", seed=0):
    H, KVH, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, 1, D, device=device, dtype=torch.float16, generator=g)
    k = torch.randn(B, KVH, T, D, device=device, dtype=torch.float16, generator=g)
    v = torch.randn(B, KVH, T, D, device=device, dtype=torch.float16, generator=g)
    return q, k, v, {"bytes": 2 * B * KVH * T * D * 2, "flops": 4 * B * H * T * D}


def _eager(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    p = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).float().softmax(-1).half()
    return p @ v


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION"}


def baseline_rows(shape_name, shape, B, T, cfg, ceil, checks, log=print) -> tuple[list[dict], dict]:
    """Dense fp16 attention over the same L2-rotated copies: each torch SDPA backend, `sdpa` (the
    fastest of them: the baseline every speed-up is over) and `eager` (the paper's baseline).
    Every backend is checked against eager attention at `check_length`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    w, r = cfg["warmup_ms"], cfg["rep_ms"]
    q, k, v, counts = dense_case(shape, B, T)
    counts["copies"] = rotation_copies(counts["bytes"], cfg)
    cases = [(q, k, v)] + [dense_case(shape, B, T, seed=seed)[:3] for seed in range(1, counts["copies"])]
    check = T == cfg["check_length"] and B == 1
    ref = _eager(q, k, v).float() if check else None
    rows, times = [], {}
    for name in cfg.get("sdpa_backends", list(SDPA_BACKENDS)):
        backend = getattr(SDPBackend, SDPA_BACKENDS[name])

        def call(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            err = _rel_err(lambda: call(q, k, v).float(), ref) if check else None
            t = _bench_rotated([lambda c=c: call(*c) for c in cases], w, r)
        except Exception as e:   # a backend this GPU / shape does not serve: recorded, not fatal
            rows.append({"variant": f"sdpa-{name}", "shape": shape_name, "batch": B, "length": T,
                         "error": f"{type(e).__name__}: {e}"[:300]})
            log(f"sdpa {name} {shape_name} B={B} T={T}: FAILED {type(e).__name__}: {e}"[:300])
            continue
        if check:
            checks.append({"shape": shape_name, "variant": f"sdpa-{name}", "rel_err": err})
        times[name] = t
        rows.append(_row(f"sdpa-{name}", shape_name, B, T, t, counts, ceil, backend=name))
    if not times:
        raise RuntimeError(f"no torch SDPA backend ran at {shape_name} B={B} T={T}: {rows}")
    best = min(times, key=times.get)
    base = {"sdpa": times[best]}
    rows.append(_row("sdpa", shape_name, B, T, times[best], counts, ceil, backend=best))
    if T <= cfg.get("eager_max_length", 131072):
        base["eager"] = _bench_rotated([lambda c=c: _eager(*c) for c in cases], w, r)
        rows.append(_row("eager", shape_name, B, T, base["eager"], counts, ceil))
    for row in rows:
        if "seconds" in row:
            row.update(speedups(row["seconds"], base))
    log(f"{shape_name} B={B} T={T}: " + ", ".join(f"{n} {t * 1e6:.1f} us" for n, t in times.items())
        + (f", eager {base['eager'] * 1e6:.1f} us" if "eager" in base else "")
        + f" ({counts['copies']} copies)")
    return rows, base


def _rel_err(fn, ref) -> float:
    """Relative error of one kernel call against the float32 reference output."""
    return ((fn() - ref).norm() / ref.norm()).item()


def _row(name, shape_name, B, T, t, counts, ceil, **extra):
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


def _palu_row(name, shape_name, shape, B, T, s, kk, kv, bits, rope, cfg, ceil, base, checks, split):
    from palu_kernels.palu_decode import palu_decode
    from palu_kernels.reference import latent_decode_reference
    params = tune_params(cfg.get("kernel") or {})   # palu_decode keywords
    qi, hk, hv, kw, c = palu_case(shape, B, T, s, kk, kv, bits, rope)
    if not rope:
        kw["bk"] = None
    fns = [lambda: palu_decode(qi, hk, hv, **kw, **params)]  # noqa: E731
    if T == cfg["check_length"] and B == 1:
        ref = latent_decode_reference(qi, hk, hv, **kw)
        err = _rel_err(fns[0], ref)
        checks.append({"shape": shape_name, "group": s, "bits": bits, "rope": rope, "split": split,
                       "rel_err": err})
    c["copies"] = rotation_copies(c["bytes"], cfg)
    for seed in range(1, c["copies"]):   # other layers' caches: the same shapes, other values
        q2, hk2, hv2, kw2, _ = palu_case(shape, B, T, s, kk, kv, bits, rope, seed=seed)
        if not rope:
            kw2["bk"] = None
        fns.append(lambda q2=q2, hk2=hk2, hv2=hv2, kw2=kw2: palu_decode(q2, hk2, hv2, **kw2, **params))
    t = _bench_rotated(fns, cfg["warmup_ms"], cfg["rep_ms"])
    return _row(name, shape_name, B, T, t, c, ceil, **speedups(t, base), group_size=s, bits=bits,
                rope=rope, split=split, rank_k=c["rank_k"], rank_v=c["rank_v"])


def kivi_rows(shape_name, shape, B, T, base, cfg, ceil, checks, log=print) -> list[dict]:
    """KIVI-b (per-channel key groups, per-token value groups, an exact fp16 window) through the
    KIVI peer kernel (`palu_kernels/kivi.py`): one row per width, plus a `tune` row per extra
    launch variant of `kivi.variants` (each checked against the float32 reference too)."""
    from palu_kernels.kivi import kivi_decode, kivi_decode_reference, kivi_nbytes, kivi_pack
    kc = cfg.get("kivi") or {}
    rows = []
    H, KVH, D = shape["heads"], shape["kv_heads"], shape["head_dim"]

    def case(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.float16, generator=g)
        k = torch.randn(B, KVH, T, D, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(B, KVH, T, D, device="cuda", dtype=torch.float16, generator=g)
        return q, kivi_pack(k, v, bits, kc.get("group", 32), kc.get("group", 32), kc.get("residual", 128))

    for bits in kc.get("bits", []):
        cases = [case(0)]
        q, cache = cases[0]
        counts = {"bytes": kivi_nbytes(cache) + 2 * q.numel() * 2, "flops": 4 * B * H * T * D}
        counts["copies"] = rotation_copies(counts["bytes"], cfg)
        cases += [case(seed) for seed in range(1, counts["copies"])]
        check = T == cfg["check_length"] and B == 1
        ref = kivi_decode_reference(q, cache, 1 / math.sqrt(D)) if check else None
        for i, params in enumerate(kc.get("variants") or [{}]):
            fns = [lambda q=q, cache=cache: kivi_decode(q, cache, **params) for q, cache in cases]
            name = f"kivi-b{bits}" if i == 0 else "tune"
            try:
                err = _rel_err(fns[0], ref) if check else None
                if check and i == 0:
                    checks.append({"shape": shape_name, "variant": name, "bits": bits, "rel_err": err})
                t = _bench_rotated(fns, cfg["warmup_ms"], cfg["rep_ms"])
                rows.append(_row(name, shape_name, B, T, t, counts, ceil, **speedups(t, base), bits=bits,
                                 group_size=kc.get("group", 32), params=str(params),
                                 **({"rel_err": err} if check else {})))
                log(f"kivi-b{bits} {params} {shape_name} B={B} T={T}: {t * 1e6:.1f} us "
                    f"({base['sdpa'] / t:.2f}x SDPA, {rows[-1]['roofline_fraction']:.0%} of its floor)")
            except Exception as err:
                rows.append({"variant": name, "shape": shape_name, "batch": B, "length": T,
                             "params": str(params), "error": f"{type(err).__name__}: {err}"[:300]})
                log(f"kivi-b{bits} {params} {shape_name} T={T}: FAILED {err}")
        del cases, cache, ref
        torch.cuda.empty_cache()
    return rows


def best_palu_seconds(rows, shape_name, B, T) -> float:
    """The fastest timed grid row of a Palu configuration at one point (nan if none ran): tune rows,
    failed rows and the baselines are not candidates."""
    times = [x["seconds"] for x in rows if x["variant"].startswith("palu-") and "seconds" in x
             and (x["shape"], x.get("batch"), x["length"]) == (shape_name, B, T)]
    return min(times, default=float("nan"))


def tune_params(variant) -> dict:
    """palu_decode keyword arguments of one tune variant: the two-pass shorthand
    [block_t, [stages], [warps], block_r], or a mapping of palu_decode keywords (e.g. the one-pass
    kernel's {fused_int_keys: true, fused_maxnreg: 128, splits: 64})."""
    if isinstance(variant, dict):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in variant.items()}
    if len(variant) != 4:
        raise ValueError(f"tune variant {variant!r} is neither [block_t, stages, warps, block_r] "
                         "nor a mapping of palu_decode keywords")
    return dict(block_t=variant[0], stages=tuple(variant[1]), warps=tuple(variant[2]), block_r=variant[3])


def run(cfg: dict, out: str | None = None, log=print) -> dict:
    from palu_kernels.palu_decode import palu_decode
    if not torch.cuda.is_available():
        raise RuntimeError("the latency benchmark needs a CUDA GPU (none visible here)")
    import triton
    ceil = measure_ceilings()
    log(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    from .latency_tuning import tune
    rows, checks = tune(cfg, ceil, log), []
    w, r = cfg["warmup_ms"], cfg["rep_ms"]
    points = [(1, T) for T in cfg["lengths"]] + [(b["batch"], b["length"]) for b in cfg["batches"]]
    for shape_name, shape in cfg["shapes"].items():
        groups = [shape["kv_heads"] if s == "all" else s for s in cfg["group_sizes"]]
        groups = sorted({s for s in groups if shape["kv_heads"] % s == 0})
        for B, T in points:
            base_rows, base = baseline_rows(shape_name, shape, B, T, cfg, ceil, checks, log)
            rows += base_rows
            # int4 K/V through the non-RoPE latent kernel with identity factors (per-token groups).
            cases = [palu_case(shape, B, T, 1, 1.0, 1.0, 4, rope=False)]
            c = cases[0][4]
            c["copies"] = rotation_copies(c["bytes"], cfg)
            cases += [palu_case(shape, B, T, 1, 1.0, 1.0, 4, rope=False, seed=seed)
                      for seed in range(1, c["copies"])]
            t = _bench_rotated([lambda qi=qi, hk=hk, hv=hv, kw=kw: palu_decode(qi, hk, hv, **{**kw, "bk": None})
                                for qi, hk, hv, kw, _ in cases], w, r)
            rows.append(_row("int4_kv", shape_name, B, T, t, c, ceil, **speedups(t, base)))
            del cases
            rows += kivi_rows(shape_name, shape, B, T, base, cfg, ceil, checks, log)
            if B == 1 and T in (cfg.get("selection") or {}).get("lengths", []):
                from .selection_latency import selection_rows
                rows += selection_rows(shape_name, shape, B, T, base, cfg, ceil, checks, log)
            for split_name, (kk, kv) in cfg["splits"].items():
                for s in groups:
                    for bits in cfg["bits"]:
                        for rope in cfg["rope"]:
                            if B > 1 and (bits == 2 or split_name != "uniform"):
                                continue
                            name = (f"palu-{'rope' if rope else 'norope'}-{split_name}-g{s}-"
                                    f"{'fp16' if bits == 16 else f'int{bits}'}")
                            try:
                                rows.append(_palu_row(name, shape_name, shape, B, T, s, kk, kv, bits,
                                                      rope, cfg, ceil, base, checks, split_name))
                            except Exception as err:  # a config the kernel cannot run: record it
                                log(f"{name} {shape_name} T={T}: FAILED {type(err).__name__}: {err}")
                                rows.append({"variant": name, "shape": shape_name, "batch": B,
                                             "length": T, "error": f"{type(err).__name__}: {err}"[:300]})
            log(f"{shape_name} B={B} T={T}: sdpa {base['sdpa'] * 1e6:.1f} us, best palu "
                f"{best_palu_seconds(rows, shape_name, B, T) * 1e6:.1f} us")
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "l2_bytes": props.L2_cache_size,
              "l2_rotated": True, "checks": checks, "rows": rows,
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda},
              "config": cfg, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if out:   # atomically: an interrupted run leaves no half-written results file
        from palu.artifacts import write_json   # refuses NaN / inf: a failed timing is an error row
        write_json(out, result)
    return result


if __name__ == "__main__":
    import yaml
    cfg = yaml.safe_load(CONF.read_text())
    for arg in sys.argv[2:]:  # quick overrides: key=yaml-value
        key, _, value = arg.partition("=")
        cfg[key] = yaml.safe_load(value)
    res = run(cfg, out=sys.argv[1] if len(sys.argv) > 1 else None)
    bad = [c for c in res["checks"] if not c["rel_err"] < 5e-3]
    print(f"{len(res['checks'])} correctness checks, {len(bad)} above 5e-3: {bad[:5]}")
