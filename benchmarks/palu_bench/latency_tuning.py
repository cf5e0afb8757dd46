"""Kernel launch-parameter tuning, run before the latency grid: each `tune` row of the latency
config timed under every variant (tiles, stages, warps, the one-pass kernel's options), each
variant checked against the float32 reference (a faster variant that computes something else
must not look like a win). The kernel notes (benchmarks/NOTES.md) record what each tuning found;
the defaults it justified live in palu_kernels/launch_defaults.py."""
from __future__ import annotations

import torch

from .cases import palu_case
from .timing import bench_rotated, rel_err, rotation_copies, timed_row


def tune_plan(cfg) -> list[tuple[dict, list]]:
    """(configuration, variants) per `tune` row: the row's own `variants`, else `tune_variants`.
    Rows of shapes that this run does not time (one run per shape) are left to that shape's run."""
    plan = []
    for row in cfg.get("tune", []):
        if row["shape"] not in cfg["shapes"]:
            continue
        case = {k: v for k, v in row.items() if k != "variants"}
        plan.append((case, row.get("variants") or cfg.get("tune_variants") or [{}]))
    return plan


def tune(cfg, ceil, log) -> list[dict]:
    """Time kernel launch parameters on a few representative configurations (kernel notes): each
    `tune` row under every `tune_variants` entry, or under the row's own `variants`."""
    from palu_kernels.palu_decode import palu_decode
    from palu_kernels.reference import latent_decode_reference
    out = []
    for case, variants in tune_plan(cfg):
        shape = cfg["shapes"][case["shape"]]
        qi, hk, hv, kw, c = palu_case(shape, 1, case["length"], case["group"], case["kept"][0],
                                      case["kept"][1], case["bits"], case["rope"])
        if not case["rope"]:
            kw["bk"] = None
        c["copies"] = rotation_copies(c["bytes"], cfg)   # inputs beyond L2, as the grid's rows
        others = [palu_case(shape, 1, case["length"], case["group"], case["kept"][0], case["kept"][1],
                            case["bits"], case["rope"], seed=seed)[:4] for seed in range(1, c["copies"])]
        if not case["rope"]:
            for other in others:
                other[3]["bk"] = None
        # Every variant is checked against the float32 reference as well as timed: a faster
        # variant that computes something else must not look like a win.
        ref = latent_decode_reference(qi, hk, hv, **kw)
        for v in variants:
            params = tune_params(v)
            fns = [lambda q=q, a=a, b=b, k=k: palu_decode(q, a, b, **k, **params)
                   for q, a, b, k in [(qi, hk, hv, kw), *others]]
            try:
                err = rel_err(fns[0], ref)
                t = bench_rotated(fns, cfg["warmup_ms"], cfg["rep_ms"])
                row = timed_row("tune", case["shape"], 1, case["length"], t, c, ceil, **case, params=str(v),
                           rel_err=err)
            except Exception as err:
                row = {"variant": "tune", "batch": 1, **case, "params": str(v), "error": str(err)[:200]}
            log(f"tune {case} {v}: {row.get('seconds', float('nan')) * 1e6:.1f} us, "
                f"rel. error {row.get('rel_err', float('nan')):.1e}")
            out.append(row)
        del qi, hk, hv, ref, others
        torch.cuda.empty_cache()
    return out


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
