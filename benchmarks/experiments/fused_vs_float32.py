"""Which fp16 answers are closer to a float32 run of the same prompts: those through the fused norms,
MLPs and RoPE (`palu.models.fused_layers`) or those through torch's own layers? Neither is exact
(fp16 rounding); float32 is the nearer reference (session 50: a GPU's float64 is no better one).

  python benchmarks/experiments/fused_vs_float32.py MODEL.gguf TEXT OUT_DIR [prompts=32] [new=32]

`benchmarks/` on PYTHONPATH. Answers 4,032-token windows of TEXT (`make_prompts`) 16 at a time through
FP16, KIVI-2 and SnapKV 0.5, in float32 (torch's layers: `fused_layers` leaves float32 alone) and in
float16 with PALU_FUSED_OPS=0 and =1; prints, per method and fp16 variant, how many answers equal
the float32 run's and the share of characters before the first difference. Writes
OUT_DIR/fused-vs-float32.json (every answer). Session 51 on an H100:
results/checks/h100-fused-vs-float32-session51.json.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

import palu
from palu.eval.generation import answer_batches
from palu.methods import build_method

CONF = {"fp16": {"name": "fp16"}, "kivi": {"name": "kivi", "bits": 2},
        "snapkv": {"name": "snapkv", "compression_ratio": 0.5}}


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def answers(model_path, text, count, new) -> dict:
    from palu_bench.batch_throughput import make_prompts
    out, prompts = {}, None
    for dtype in ("float32", "float16"):
        model, tok = palu.load_model(model_path, dtype=dtype, device="cuda")
        model.generation_config.eos_token_id = None
        if prompts is None:
            with open(text, encoding="utf-8") as fh:
                ids = tok(fh.read(), add_special_tokens=False)["input_ids"]
            prompts = make_prompts(ids[16 * 1024:], count, 4032)
        for name, conf in CONF.items():
            method = build_method(dict(conf))
            m = copy.deepcopy(model)
            method.install(m)
            for fused in ("1",) if dtype == "float32" else ("0", "1"):
                os.environ["PALU_FUSED_OPS"] = fused
                out[f"{name}/{dtype}/fused{fused}"] = [a for a, _ in answer_batches(m, tok, method, prompts, new,
                                                                                      batch_size=16)]
            del m
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    os.environ.pop("PALU_FUSED_OPS", None)
    return out


def main(argv):
    kw = dict(a.split("=", 1) for a in argv[3:])
    count, new = int(kw.get("prompts", 32)), int(kw.get("new", 32))
    res = answers(argv[0], argv[1], count, new)
    summary = {}
    for name in CONF:
        ref = res[f"{name}/float32/fused1"]
        for fused in ("0", "1"):
            got = res[f"{name}/float16/fused{fused}"]
            same = sum(a == b for a, b in zip(got, ref))
            chars = sum(common_prefix(a, b) for a, b in zip(got, ref)) / sum(len(b) for b in ref)
            label = f"{name} fp16 {'fused' if fused == '1' else 'torch'}"
            summary[label] = {"same_as_float32": same, "of": count, "common_prefix_chars": round(chars, 3)}
            print(f"{label}: same as float32 {same}/{count}, common prefix {chars:.3f} of the characters", flush=True)
    os.makedirs(argv[2], exist_ok=True)
    with open(os.path.join(argv[2], "fused-vs-float32.json"), "w") as fh:
        json.dump({"summary": summary, "answers": res, "prompts": count, "new": new,
                   "gpu": torch.cuda.get_device_name(0)}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
