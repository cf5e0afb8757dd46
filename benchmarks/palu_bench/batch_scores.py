"""Palu's decode-attention kernels at a serving batch (issue 49): SmolLM2-135M's attention shapes
(9 query heads, 3 KV heads of 64 dimensions, RoPE) at batch 64 and 128 x 4K tokens, every launch
variant checked against the float32 reference and timed beside torch SDPA's backends over the same
dense K/V. The step profile of session 42 found Palu 4-bit's `_scores` at 180 us a layer there,
more than FP16's whole attention; its J-LRD keys (rank 96, 48 stored 4-bit columns) ran as three
16-column chunks of tiny dots. This run says which variant (`pad_r`: one masked 64-column chunk;
tiles, warps) wins and by how much, per layer and projected to a 30-layer step.

It also times the prefill's attention at SmolLM2's shapes, three ways: causal with the KV heads
shared (`enable_gqa`, what transformers passes when no mask is given: KIVI's right-padded prefill),
causal over repeated KV heads, and an explicit padding mask over repeated heads (FP16's
left-padded prefill) -- per SDPA backend. The same step profile found KIVI-2's prefill attention
(cuDNN) at 0.80 s against FP16's 0.08 s for the same shapes; this says whether the GQA call is why.

  python -m palu_bench.batch_scores OUT.json [batches=64,128] [length=4096] [rep_ms=20]

Only torch and triton are needed (a GPU host as shipped).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

from .cases import palu_case
from .latency import baseline_rows
from .latency_tuning import tune_params
from .timing import bench_rotated, measure_ceilings, rel_err, rotation_copies, timed_row

# SmolLM2-135M-Instruct's attention (its GGUF header: 9 heads, 3 KV heads, head_dim 64, 30 layers,
# rope_theta 100000)
SHAPE = {"heads": 9, "kv_heads": 3, "head_dim": 64, "rope_theta": 100000.0}
LAYERS = 30
# (label, group size, kept K / V, bits): the throughput benchmark's palu50 checkpoints are J-LRD
# over all three KV heads (rank 96); M-LRD (rank 32 a head) for contrast
CONFIGS = [("jlrd50-b4", 3, 0.5, 4), ("jlrd50-b16", 3, 0.5, 16), ("mlrd50-b4", 1, 0.5, 4)]
# `python -m palu_bench.sass --smollm2` predicts (sm_90, triton 3.x, no GPU): 64-token tiles issue
# ~0.56x the instructions a token of 32-token ones (10.9 against 19.3 at 4 bits), the padded block
# ~0.93x again; 128-token tiles need 255 registers at 4 warps (8 warps: as 64 / 4)
# {} = the library's defaults (since session 44: `rebuild_options`); the others pin a choice. The
# session-43 default (32-token tiles, 2 stages, the divisor rank block) stays for comparison.
VARIANTS = [{}, {"block_t": 32, "stages": [2, 3], "pad_r": False}, {"block_t": 32, "stages": [2, 3], "pad_r": True},
            {"stages": [2, 3]}, {"pad_r": False}, {"pad_r": False, "stages": [2, 3]},
            {"block_t": 128, "warps": [8, 4]}, {"warps": [8, 4]}, {"fused": False}]
CFG = {"warmup_ms": 10, "rep_ms": 20, "rotate_l2_multiple": 4, "rotate_max_copies": 16,
       "check_length": -1, "sdpa_backends": ["flash", "efficient", "cudnn"], "eager_max_length": 0}


def prefill_variants(B: int, T: int, device, backends=("flash", "efficient", "cudnn"), seed: int = 0):
    """{name: call} of one layer's prefill attention at SmolLM2's shapes (B rows of T tokens, the
    first row's first T // 8 tokens padding), and the inputs' byte / FLOP counts."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .latency import SDPA_BACKENDS
    H, KVH, D = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
    q = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, KVH, T, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, KVH, T, D, device=device, dtype=dtype, generator=g)
    kr, vr = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    real = torch.ones(B, T, dtype=torch.bool, device=device)
    real[0, :T // 8] = False
    mask = causal[None, None] & real[:, None, None, :]
    mask |= ~real[:, None, :, None]   # a pad query attends to everything (no all-masked row)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {}
    for name in backends:
        backend = [SDPBackend.MATH] if name == "math" else getattr(SDPBackend, SDPA_BACKENDS[name])

        def gqa(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=True, enable_gqa=True)

        def repeated(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, kr, vr, is_causal=True)

        def masked(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, kr, vr, attn_mask=mask)
        calls.update({f"{name}-causal-gqa": gqa, f"{name}-causal-repeated": repeated,
                      f"{name}-mask-repeated": masked})
    flops = 4 * B * H * T * T * D // 2   # causal: half the score and value products
    return calls, {"bytes": (q.numel() + 2 * k.numel()) * q.element_size() * 2, "flops": flops}, real


def prefill_rows(B: int, T: int, ceil, log=print) -> list[dict]:
    """Each prefill variant timed (median, eager launches), checked on the rows without padding
    against the first backend's causal GQA call."""
    import triton.testing
    calls, counts, real = prefill_variants(B, T, "cuda")
    rows, ref = [], None
    for name, call in calls.items():
        try:
            out = call()
            if ref is None:
                ref = out
            err = ((out[1:] - ref[1:]).float().norm() / ref[1:].float().norm()).item()
            if not err < 5e-3:
                raise ArithmeticError(f"relative error {err:.2e} against {next(iter(calls))}")
            t = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median") * 1e-3
            row = timed_row(f"prefill-{name}", "smollm2-135m", B, T, t, counts, ceil, rel_err=err,
                            step_s=LAYERS * t)
            log(f"prefill B={B} T={T} {name}: {t * 1e3:.2f} ms a layer ({LAYERS * t:.3f} s for "
                f"{LAYERS}), {row['tflop_per_s']:.0f} TFLOP/s")
        except Exception as e:   # a backend that does not serve this call: a row saying so
            row = {"variant": f"prefill-{name}", "batch": B, "length": T, "error": f"{type(e).__name__}: {e}"[:300]}
            log(f"prefill B={B} T={T} {name}: FAILED {row['error']}")
        rows.append(row)
    return rows


def _args(argv):
    kw = dict(a.split("=", 1) for a in argv)
    unknown = set(kw) - {"batches", "length", "rep_ms"}
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; known: batches, length, rep_ms")
    batches = [int(b) for b in kw.get("batches", "64,128").split(",")]
    length = int(kw.get("length", 4096))
    if min(batches) < 1 or length < 64:
        raise SystemExit(f"batches {batches} must be >= 1 and length {length} >= 64")
    return batches, length, float(kw.get("rep_ms", CFG["rep_ms"]))


def run(out: str, batches, T: int, rep_ms: float, log=print) -> dict:
    from palu_kernels.palu_decode import palu_decode
    from palu_kernels.reference import latent_decode_reference
    cfg = dict(CFG, rep_ms=rep_ms)
    ceil = measure_ceilings()
    result = {"host": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": SHAPE, "layers": LAYERS, "length": T, "ceilings": ceil, "rows": [],
              "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result["rows"] += prefill_rows(min(batches), T, ceil, log)
    torch.cuda.empty_cache()
    _write(out, result)
    for B in batches:
        rows, base = baseline_rows("smollm2-135m", SHAPE, B, T, cfg, ceil, [], log)
        result["rows"] += rows
        for label, s, kept, bits in CONFIGS:
            qi, hk, hv, kw, c = palu_case(SHAPE, B, T, s, kept, kept, bits, True)
            c["copies"] = rotation_copies(c["bytes"], cfg)
            others = [palu_case(SHAPE, B, T, s, kept, kept, bits, True, seed=i)[:4] for i in range(1, c["copies"])]
            ref = latent_decode_reference(qi, hk, hv, **kw)
            for v in VARIANTS:
                params = tune_params(v)
                fns = [lambda q=q, a=a, b=b, k=k: palu_decode(q, a, b, **k, **params)
                       for q, a, b, k in [(qi, hk, hv, kw), *others]]
                try:
                    err = rel_err(fns[0], ref)
                    if not err < 5e-3:   # a fast variant that computes something else is no win
                        raise ArithmeticError(f"relative error {err:.2e} against the float32 reference")
                    t = bench_rotated(fns, cfg["warmup_ms"], cfg["rep_ms"])
                    row = timed_row(label, "smollm2-135m", B, T, t, c, ceil, params=str(v), rel_err=err,
                                    group_size=s, bits=bits, rank_k=c["rank_k"], vs_sdpa=base["sdpa"] / t,
                                    step_ms=LAYERS * t * 1e3, sdpa_step_ms=LAYERS * base["sdpa"] * 1e3)
                    log(f"B={B} {label} {v}: {t * 1e6:.1f} us ({base['sdpa'] / t:.2f}x SDPA "
                        f"{base['sdpa'] * 1e6:.1f} us), {row['tflop_per_s']:.1f} TFLOP/s, "
                        f"{row['tb_per_s']:.2f} TB/s, rel. error {err:.1e}")
                except Exception as e:   # a variant that cannot run or is wrong: a row saying so
                    row = {"variant": label, "batch": B, "length": T, "params": str(v),
                           "error": f"{type(e).__name__}: {e}"[:300]}
                    log(f"B={B} {label} {v}: FAILED {row['error']}")
                result["rows"].append(row)
            del qi, hk, hv, ref, others
            torch.cuda.empty_cache()
        _write(out, result)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    _write(out, result)
    return result


def _write(out: str, result: dict) -> None:
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or "=" in argv[0]:
        raise SystemExit(__doc__)
    if not torch.cuda.is_available():
        raise SystemExit("batch_scores times GPU kernels: no CUDA device here")
    batches, T, rep_ms = _args(argv[1:])
    run(argv[0], batches, T, rep_ms)


if __name__ == "__main__":
    main()
