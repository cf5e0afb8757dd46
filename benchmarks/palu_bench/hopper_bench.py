"""RoPE M-LRD decode with the warp-specialised Hopper scores kernel (issue 39 item 2) against the Triton
path and the best torch SDPA backend of the same run, L2-rotated like the latency grid.

Per shape and length: `sdpa` (fastest backend) and `eager`; the whole Palu step with the Triton scores
kernel (`palu_decode` defaults) and with the Hopper kernel (`hopper=True`, each ring depth); the values
half alone (the one-pass kernel reading given scores, the call `palu_decode` makes) and the Hopper scores
alone, so the Triton scores time is the whole step minus the values half. Every step is checked against
the float32 reference at the shortest length. Run on the GPU host:
  python -m palu_bench.hopper_bench OUT.json ['shapes=[llama2-7b]' 'lengths=[65536]' ...]
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch
import triton
import yaml

from .cases import palu_case
from .latency import CONF, baseline_rows
from .timing import bench_rotated, measure_ceilings, rel_err, rotation_copies, speedups, timed_row

DEFAULTS = {"shapes": ["llama2-7b", "llama3-8b"], "lengths": [16384, 65536, 131072], "variants": [[16, 4, 0], [16, 4, 1], [32, 4, 0]],   # [frequencies per warp, ring slots, reduction]
            "check_length": 4096}


def _values_only(q, hk, hv, kw, S):
    """The values half of a RoPE step as `palu_decode` launches it (one-pass kernel reading scores)."""
    from palu_kernels.decode_policy import _sm_count
    from palu_kernels.launch_defaults import one_pass_tiles
    from palu_kernels.palu_decode import _run_fused
    B, G, T, rv = hv.shape
    H, n_rep = q.shape[1], kw["n_rep"]
    bt, warps = one_pass_tiles(16, 16, 0, rv, B * G * triton.cdiv(T, 256), _sm_count(hv.device), None, None)
    lengths = torch.full((B,), T, dtype=torch.int32, device=hv.device)
    return _run_fused(q, q, q, q, 16, hv, hv, hv, 16, lengths, kw["scale"], B, G, T, H, 16, rv, n_rep,
                      max(16, triton.next_power_of_2(n_rep)), bt, 2, warps, None, scores=S)


def _hopper_scores(q, hk, kw, per_warp, stages, reduce=0):
    from palu_kernels.hopper_scores import rope_scores
    B, T = hk.shape[0], hk.shape[2]
    lengths = torch.full((B,), T, dtype=torch.int32, device=hk.device)
    return rope_scores(q, hk, kw["bk"], kw["position_offset"], kw["inv_freq"], lengths,
                       kw["scale"] * 1.4426950408889634, kw["n_rep"], stages=stages, per_warp=per_warp, reduce=reduce)


def run(cfg: dict, log=print) -> dict:
    from palu_kernels.hopper_scores import _module, unfit
    from palu_kernels.palu_decode import palu_decode
    from palu_kernels.reference import latent_decode_reference
    t_build = time.time()
    mod = _module()
    if isinstance(mod, str):
        raise RuntimeError(f"the Hopper kernel did not build: {mod}")
    log(f"extension ready in {time.time() - t_build:.1f} s")
    ceil = measure_ceilings()
    log(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    rows, checks = [], []
    w, r = cfg["warmup_ms"], cfg["rep_ms"]
    for shape_name in cfg["shapes"]:
        shape = cfg["all_shapes"][shape_name]
        n_rep = shape["heads"] // shape["kv_heads"]
        log(f"{shape_name}: resident CTAs per SM by [frequencies per warp, slots]: "
            + ", ".join(f"{v}: {mod.resident_ctas(n_rep, *v)}" for v in cfg["variants"]))
        for T in [cfg["check_length"]] + cfg["lengths"]:
            q, hk, hv, kw, c = palu_case(shape, 1, T, 1, 0.5, 0.5, 16, True)
            why = unfit(q, hk, kw["bk"], n_rep=n_rep, group_size=1, contiguous_positions=True)
            if why:
                raise RuntimeError(f"{shape_name}: {why}")
            if T == cfg["check_length"]:
                ref = latent_decode_reference(q, hk, hv, **kw)
                for name, params in [("triton", {}), ("hopper", {"hopper": True})]:
                    err = rel_err(lambda p=params: palu_decode(q, hk, hv, **kw, **p), ref)
                    checks.append({"shape": shape_name, "variant": name, "length": T, "rel_err": err})
                    log(f"check {shape_name} {name} T={T}: rel. error {err:.2e}")
                    if not err < 5e-3:
                        raise RuntimeError(f"{shape_name} {name}: rel. error {err:.2e} against the float32 reference")
                continue
            base_rows, base = baseline_rows(shape_name, shape, 1, T, cfg, ceil, checks, log)
            rows += base_rows
            c["copies"] = rotation_copies(c["bytes"], cfg)
            cases = [(q, hk, hv, kw)] + [palu_case(shape, 1, T, 1, 0.5, 0.5, 16, True, seed=s)[:4]
                                         for s in range(1, c["copies"])]
            scores_bytes = hk.numel() * 2 + 2 * q.shape[1] * T * 4      # latents read, scores written
            scores_counts = {"bytes": scores_bytes, "flops": 2 * T * q.shape[1] * 128 * 64, "copies": c["copies"]}
            S = [torch.empty(1, q.shape[1], T, device="cuda") for _ in cases]
            values_counts = {"bytes": hv.numel() * 2 + q.shape[1] * T * 4, "flops": 2 * T * q.shape[1] * 64,
                             "copies": c["copies"]}
            t = bench_rotated([lambda a=a, s=s: _values_only(a[0], a[1], a[2], a[3], s) for a, s in zip(cases, S)], w, r)
            rows.append(timed_row("values-only", shape_name, 1, T, t, values_counts, ceil))
            variants = [("triton", None)] + [("hopper-" + "-".join(f"{k}{x}" for k, x in zip("wsr", v)), v)
                                             for v in cfg["variants"]]
            for i, (name, v) in enumerate(variants):
                if v:
                    t = bench_rotated([lambda a=a, v=v: _hopper_scores(a[0], a[1], a[3], *v) for a in cases], w, r)
                    rows.append(timed_row(f"scores-{name}", shape_name, 1, T, t, scores_counts, ceil, per_warp=v[0],
                                     stages=v[1], reduce=v[2] if len(v) > 2 else 0))
                    log(f"{shape_name} T={T} scores {name}: {t * 1e6:.1f} us "
                        f"({scores_bytes / t / 1e12:.2f} TB/s, {scores_counts['flops'] / t / 1e12:.0f} TFLOP/s)")
                    step = {"hopper": True}
                    if i != 1:
                        continue   # the whole step only with the first variant (palu_decode's default)
                else:
                    step = {}
                t = bench_rotated([lambda a=a, p=step: palu_decode(a[0], a[1], a[2], **a[3], **p) for a in cases], w, r)
                rows.append(timed_row(f"step-{name}", shape_name, 1, T, t, c, ceil, **speedups(t, base)))
                log(f"{shape_name} T={T} step {name}: {t * 1e6:.1f} us ({base['sdpa'] / t:.2f}x SDPA "
                    f"{base['sdpa'] * 1e6:.1f} us, {base.get('eager', float('nan')) / t:.2f}x eager)")
            del cases, S
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "ceilings": ceil, "config": {k: v for k, v in cfg.items() if k != "all_shapes"},
            "rows": rows, "checks": checks}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    base = yaml.safe_load(CONF.read_text())
    cfg = {**DEFAULTS, "warmup_ms": base["warmup_ms"], "rep_ms": base["rep_ms"],
           "rotate_l2_multiple": base["rotate_l2_multiple"], "rotate_max_copies": base["rotate_max_copies"],
           "sdpa_backends": base["sdpa_backends"], "eager_max_length": base["eager_max_length"],
           "all_shapes": base["shapes"]}
    for item in argv[1:]:
        key, _, value = item.partition("=")
        if key not in cfg:
            raise SystemExit(f"unknown setting {key!r}; known: {sorted(cfg)}")
        cfg[key] = yaml.safe_load(value)
    result = run(cfg)
    tmp = argv[0] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(tmp, argv[0])


if __name__ == "__main__":
    main()
