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

from .cases import dense_case, palu_case
from .latency_tuning import tune, tune_params
from .timing import bench_rotated, measure_ceilings, rel_err, rotation_copies, speedups, timed_row

CONF = Path(__file__).resolve().parent / "conf" / "bench" / "latency.yaml"


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
            err = rel_err(lambda: call(q, k, v).float(), ref) if check else None
            t = bench_rotated([lambda c=c: call(*c) for c in cases], w, r)
        except Exception as e:   # a backend this GPU / shape does not serve: recorded, not fatal
            rows.append({"variant": f"sdpa-{name}", "shape": shape_name, "batch": B, "length": T,
                         "error": f"{type(e).__name__}: {e}"[:300]})
            log(f"sdpa {name} {shape_name} B={B} T={T}: FAILED {type(e).__name__}: {e}"[:300])
            continue
        if check:
            checks.append({"shape": shape_name, "variant": f"sdpa-{name}", "rel_err": err})
        times[name] = t
        rows.append(timed_row(f"sdpa-{name}", shape_name, B, T, t, counts, ceil, backend=name))
    if not times:
        raise RuntimeError(f"no torch SDPA backend ran at {shape_name} B={B} T={T}: {rows}")
    best = min(times, key=times.get)
    base = {"sdpa": times[best]}
    rows.append(timed_row("sdpa", shape_name, B, T, times[best], counts, ceil, backend=best))
    if T <= cfg.get("eager_max_length", 131072):
        base["eager"] = bench_rotated([lambda c=c: _eager(*c) for c in cases], w, r)
        rows.append(timed_row("eager", shape_name, B, T, base["eager"], counts, ceil))
    for row in rows:
        if "seconds" in row:
            row.update(speedups(row["seconds"], base))
    log(f"{shape_name} B={B} T={T}: " + ", ".join(f"{n} {t * 1e6:.1f} us" for n, t in times.items())
        + (f", eager {base['eager'] * 1e6:.1f} us" if "eager" in base else "")
        + f" ({counts['copies']} copies)")
    return rows, base


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
        err = rel_err(fns[0], ref)
        checks.append({"shape": shape_name, "group": s, "bits": bits, "rope": rope, "split": split,
                       "rel_err": err})
    c["copies"] = rotation_copies(c["bytes"], cfg)
    for seed in range(1, c["copies"]):   # other layers' caches: the same shapes, other values
        q2, hk2, hv2, kw2, _ = palu_case(shape, B, T, s, kk, kv, bits, rope, seed=seed)
        if not rope:
            kw2["bk"] = None
        fns.append(lambda q2=q2, hk2=hk2, hv2=hv2, kw2=kw2: palu_decode(q2, hk2, hv2, **kw2, **params))
    t = bench_rotated(fns, cfg["warmup_ms"], cfg["rep_ms"])
    return timed_row(name, shape_name, B, T, t, c, ceil, **speedups(t, base), group_size=s, bits=bits,
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
                err = rel_err(fns[0], ref) if check else None
                if check and i == 0:
                    checks.append({"shape": shape_name, "variant": name, "bits": bits, "rel_err": err})
                t = bench_rotated(fns, cfg["warmup_ms"], cfg["rep_ms"])
                rows.append(timed_row(name, shape_name, B, T, t, counts, ceil, **speedups(t, base), bits=bits,
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


def shape_points(shape: dict, cfg: dict) -> list[tuple[int, int]]:
    """(batch, length) points timed for one shape: the grid's, or the shape's own `lengths` (a
    model of 32K positions is not timed at 128K), batched points only within them."""
    lengths = shape.get("lengths", cfg["lengths"])
    if not lengths or any(not isinstance(T, int) or T <= 0 for T in lengths):
        raise ValueError(f"latency shape {shape}: lengths must be positive token counts, got {lengths!r}")
    limit = max(lengths)
    return [(1, T) for T in lengths] + [(b["batch"], b["length"]) for b in cfg["batches"] if b["length"] <= limit]


def shape_selection_lengths(shape: dict, cfg: dict) -> list[int]:
    """Lengths of the latent-selection rows: the shape's own `selection_lengths`, else the grid's
    `selection.lengths` (each within the shape's timed lengths)."""
    lengths = shape.get("selection_lengths", (cfg.get("selection") or {}).get("lengths", []))
    timed = {T for B, T in shape_points(shape, cfg) if B == 1}
    return [T for T in lengths if T in timed]


def run(cfg: dict, out: str | None = None, log=print) -> dict:
    from palu_kernels.palu_decode import palu_decode
    if not torch.cuda.is_available():
        raise RuntimeError("the latency benchmark needs a CUDA GPU (none visible here)")
    import triton
    ceil = measure_ceilings()
    log(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    rows, checks = tune(cfg, ceil, log), []
    w, r = cfg["warmup_ms"], cfg["rep_ms"]
    for shape_name, shape in cfg["shapes"].items():
        points = shape_points(shape, cfg)
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
            t = bench_rotated([lambda qi=qi, hk=hk, hv=hv, kw=kw: palu_decode(qi, hk, hv, **{**kw, "bk": None})
                                for qi, hk, hv, kw, _ in cases], w, r)
            rows.append(timed_row("int4_kv", shape_name, B, T, t, c, ceil, **speedups(t, base)))
            del cases
            rows += kivi_rows(shape_name, shape, B, T, base, cfg, ceil, checks, log)
            if B == 1 and T in shape_selection_lengths(shape, cfg):
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
