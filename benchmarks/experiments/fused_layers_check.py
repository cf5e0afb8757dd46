"""The fused norms, MLPs and RoPE (`palu.models.fused_layers`, session 51) on a GPU: do they answer
as torch's own layers, and what do they save?

  python benchmarks/experiments/fused_layers_check.py OUT_DIR MODEL [TEXT] [batch=64] [length=4032]
      [new=64] [methods=fp16,kivi,snapkv]

MODEL: a .gguf (then TEXT) or `random:smollm2-135m` (random weights and ids). Writes
OUT_DIR/fused-layers-check.json and prints a line per check:
- kernels: each fused op against its torch expression at the prefill's shapes (max |diff|,
  share of elements that differ; RoPE and SiLU * up are meant bit for bit);
- prefill: the batch's last logits through the model's forward, fused against unfused (max |diff|
  relative to the largest logit, argmax agreement), and the forward's time each way (CUDA events,
  median of 5 after a warm-up);
- answers: `answer_batches` through each method, fused against unfused: how many of the batch's
  answers are the same tokens (fp16 rounding may flip an argmax, as between batch sizes).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from palu.eval.generation import answer_batches  # noqa: E402
from palu.methods import build_method  # noqa: E402
from palu.models import fused_layers as fl  # noqa: E402

DEVICE = "cuda"   # device=cpu (with TRITON_INTERPRET=1): a smoke run of the script itself
CONF = {"fp16": {"name": "fp16"}, "kivi": {"name": "kivi", "bits": 2},
        "snapkv": {"name": "snapkv", "compression_ratio": 0.5}}


def _args(argv):
    pos = [a for a in argv if "=" not in a]
    kw = dict(a.split("=", 1) for a in argv if "=" in a)
    out, model = pos[0], pos[1]
    return out, model, (pos[2] if len(pos) > 2 else None), int(kw.get("batch", 64)), \
        int(kw.get("length", 4032)), int(kw.get("new", 64)), kw.get("methods", "fp16,kivi,snapkv").split(","), \
        kw.get("device", "cuda")


def _subject(model_arg, text, length, batch):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from palu_bench.batch_throughput import load_subject, make_prompts
    args = {"model": model_arg, "text": text, "dtype": "float16", "device": DEVICE, "length": length,
            "calib_windows": 1}
    model, tok, ids = load_subject(args, batch)
    return model, tok, make_prompts(ids, batch, length)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def kernel_rows(model, prompts):
    from palu_kernels import fused_ops as ops
    cfg = model.config
    B, T = min(len(prompts), 16), max(map(len, prompts))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(B, T, cfg.hidden_size, device=DEVICE, generator=g).half() * 2
    norm = model.model.layers[0].input_layernorm
    ref = type(norm).forward(norm, x)
    rows = []

    def add(name, out, ref):
        diff = (out.float() - ref.float()).abs()
        rows.append({"op": name, "max_abs": diff.max().item(), "differ": (out != ref).float().mean().item()})
    add("rms_norm", ops.rms_norm_rows(x, norm.weight, norm.variance_epsilon), ref)
    gate = torch.randn(B, T, cfg.intermediate_size, device=DEVICE, generator=g).half() * 3
    up = torch.randn_like(gate)
    add("silu_times", ops.silu_times(gate, up), torch.nn.functional.silu(gate) * up)
    D = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(B, T, cfg.num_attention_heads, D, device=DEVICE, generator=g).half().transpose(1, 2)
    pos = torch.arange(T, device=DEVICE).expand(B, -1)
    cos, sin = model.model.rotary_emb(x, pos)
    rot = torch.cat((-q[..., D // 2:], q[..., :D // 2]), -1)
    add("rope", ops.rope(q, cos, sin), q * cos[:, None] + rot * sin[:, None])
    return rows


@torch.no_grad()
def prefill_row(model, prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], device=DEVICE)   # right-padded
    last = torch.tensor([len(p) - 1 for p in prompts], device=DEVICE)
    rows = torch.arange(len(prompts), device=DEVICE)

    def forward():
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return model.lm_head(h[rows, last]).float()
    plain = forward()
    t_plain = _timed(forward)
    with fl.fused_layers(model, force=DEVICE != "cuda") as n:
        fused = forward()
        t_fused = _timed(forward)
    return {"swapped": n, "batch": len(prompts), "width": width,
            "max_abs_rel": ((fused - plain).abs().max() / plain.abs().max()).item(),
            "argmax_equal": int((fused.argmax(-1) == plain.argmax(-1)).sum()),
            "seconds_unfused": t_plain, "seconds_fused": t_fused, "speedup": t_plain / t_fused}


def answer_rows(model, tok, prompts, new, methods):
    import copy
    out = []
    for name in methods:
        method = build_method(dict(CONF[name]))
        m = copy.deepcopy(model)
        method.install(m)
        got = {}
        for fused in ("0", "1"):
            os.environ["PALU_FUSED_OPS"] = fused
            answer_batches(m, tok, method, prompts, new, batch_size=len(prompts))   # warm-up
            _sync()
            t = time.perf_counter()
            got[fused] = [x for x, _ in answer_batches(m, tok, method, prompts, new, batch_size=len(prompts))]
            _sync()
            got[fused + "_s"] = time.perf_counter() - t
        os.environ.pop("PALU_FUSED_OPS")
        same = sum(x == y for x, y in zip(got["0"], got["1"]))
        out.append({"method": name, "prompts": len(prompts), "same_answers": same,
                    "seconds_unfused": got["0_s"], "seconds_fused": got["1_s"],
                    "prompts_per_s_unfused": len(prompts) / got["0_s"],
                    "prompts_per_s_fused": len(prompts) / got["1_s"]})
        del m
        torch.cuda.empty_cache()
    return out


def main(argv):
    global DEVICE
    out_dir, model_arg, text, batch, length, new, methods, DEVICE = _args(argv)
    os.makedirs(out_dir, exist_ok=True)
    model, tok, prompts = _subject(model_arg, text, length, batch)
    result = {"config": {"model": model_arg, "batch": batch, "length": length, "new": new, "methods": methods},
              "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    result["kernels"] = kernel_rows(model, prompts)
    for r in result["kernels"]:
        print(f"kernel {r['op']:10s} max|diff| {r['max_abs']:.3g}  differ {r['differ']:.2e}", flush=True)
    result["prefill"] = prefill_row(model, prompts)
    p = result["prefill"]
    print(f"prefill {batch} x {p['width']}: {p['swapped']} swapped, logits {p['max_abs_rel']:.2e} apart (rel), "
          f"argmax equal {p['argmax_equal']}/{batch}; {p['seconds_unfused']:.3f} s -> {p['seconds_fused']:.3f} s "
          f"({p['speedup']:.2f}x)", flush=True)
    _save(out_dir, result)
    result["answers"] = answer_rows(model, tok, prompts, new, methods)
    for r in result["answers"]:
        print(f"answers {r['method']:8s} same {r['same_answers']}/{r['prompts']}; prompts/s "
              f"{r['prompts_per_s_unfused']:.1f} -> {r['prompts_per_s_fused']:.1f}", flush=True)
    _save(out_dir, result)


def _save(out_dir, result):
    path = os.path.join(out_dir, "fused-layers-check.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1:])
