"""What the long-context grid (conf/grid/long.yaml, issue 36) would cost on a GPU: seconds per
RULER-style prompt generated through each family's cache, at SmolLM2-135M's shapes with random
weights (the time does not depend on the weights; the embedded GGUF does not travel to the GPU
host), and the throughput of several such processes sharing one GPU, as the grid's jobs would.

  python -m palu_bench.long_throughput OUT.json ['lengths=[4096,8192]' 'new_tokens=53' 'prompts=2'
                                                 'processes=[1,8,16]']

`new_tokens` defaults to the mean answer budget of the eight ruler_style tasks; generation runs
to that budget (no EOS stop: random weights), so the numbers are an upper bound per prompt.
"""
from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

import torch
import yaml

# SmolLM2-135M (the embedded model's architecture)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
# the long grid's methods (conf/grid/long.yaml), palu ones built on a random-calibration checkpoint
METHODS = {
    "fp16": None,
    "palu50-4bit": {"name": "palu", "latent_bits": 4},
    "palu_select": {"name": "palu_select", "latent_bits": 4, "tokens": 256, "window": 32},
    "palu_snapkv": {"name": "palu_snapkv", "latent_bits": 4, "evict_ratio": 0.5},
    "kivi-2": {"name": "kivi", "bits": 2},
    "streaming_llm": {"name": "streaming_llm", "sink": 4, "window": 2044},
    "snapkv": {"name": "snapkv", "compression_ratio": 0.5},
    "tova": {"name": "tova", "budget": 2048},
    "quest": {"name": "quest", "page": 16, "budget": 1024},
}
DEFAULTS = {"lengths": [4096, 8192], "new_tokens": 53, "prompts": 2, "processes": [1, 8, 16],
            "methods": list(METHODS), "dtype": "float32"}


class _Tok:
    """What `answer_and_bytes` asks of a tokenizer."""
    pad_token_id = 0
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _model(dtype: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2)
    return LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype)).eval()


def _checkpoint(model, folder: str) -> str:
    import palu
    windows = torch.randint(0, SMOLLM2["vocab_size"], (8, 1024), generator=torch.Generator().manual_seed(1))
    m = copy.deepcopy(model)
    result = palu.compress(m, windows.to(model.device), kept_ratio=0.5, group_size=3, progress=False)
    path = os.path.join(folder, "palu50")
    result.save(path)
    return path


def _time_method(model, spec, ckpt, lengths, new_tokens, prompts):
    from palu.eval.generation import answer_and_bytes
    from palu.methods import build_method
    m = model
    method = None
    if spec is not None:
        spec = dict(spec)
        if spec["name"].startswith("palu"):
            spec["checkpoint"] = ckpt
        method = build_method(spec)
        m = copy.deepcopy(model)
        method.install(m)
    tok, out = _Tok(), {}
    g = torch.Generator().manual_seed(2)
    for T in lengths:
        ids = [torch.randint(1, SMOLLM2["vocab_size"], (T - new_tokens,), generator=g).tolist()
               for _ in range(prompts + 1)]
        answer_and_bytes(m, tok, method, ids[0], new_tokens)            # warm-up
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        for p in ids[1:]:
            _, nbytes = answer_and_bytes(m, tok, method, p, new_tokens)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        out[T] = {"s_per_prompt": (time.perf_counter() - t0) / prompts, "bytes": nbytes}
    return out


def _worker(args):
    spec, T, new_tokens, prompts, dtype, device = args
    torch.set_num_threads(1)
    model = _model(dtype, device)
    return _time_method(model, spec, None, [T], new_tokens, prompts)[T]["s_per_prompt"]


def main(argv: list[str]) -> None:
    out_path, cfg = argv[0], dict(DEFAULTS)
    for a in argv[1:]:
        k, v = a.split("=", 1)
        cfg[k] = yaml.safe_load(v)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _model(cfg["dtype"], device)
    rows, scaling, t_start = [], [], time.perf_counter()

    def save():   # after every stage, atomically: a run stopped at its time limit keeps what it timed
        info = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                "python": platform.python_version(), "config": cfg, "model": SMOLLM2,
                "rows": rows, "scaling": scaling, "wall_s": time.perf_counter() - t_start}
        with open(out_path + ".tmp", "w") as f:
            json.dump(info, f, indent=1)
        os.replace(out_path + ".tmp", out_path)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _checkpoint(model, tmp) if any(METHODS[n] and METHODS[n]["name"].startswith("palu")
                                               for n in cfg["methods"]) else None
        for name in cfg["methods"]:
            r = _time_method(model, METHODS[name], ckpt, cfg["lengths"], cfg["new_tokens"], cfg["prompts"])
            for T, v in r.items():
                rows.append({"method": name, "length": T, **v})
                print(f"{name:14s} {T:6d}  {v['s_per_prompt']:.2f} s/prompt", flush=True)
            save()
    # several processes on one GPU, as Snakemake's parallel jobs would share it (FP16, shortest length)
    ctx = mp.get_context("spawn")
    for P in cfg["processes"]:
        t0 = time.perf_counter()
        with ctx.Pool(P) as pool:
            per = pool.map(_worker, [(None, cfg["lengths"][0], cfg["new_tokens"], cfg["prompts"],
                                      cfg["dtype"], device)] * P)
        wall = time.perf_counter() - t0
        # together: P prompts each `max(per)` seconds apart, counted until the slowest finishes
        # (at their mean pace it would be P / mean(per))
        scaling.append({"processes": P, "s_per_prompt_each": per,
                        "prompts_per_s": P / max(per) if per else None, "wall_s": wall})
        print(f"{P:2d} processes: {sum(per) / len(per):.2f} s/prompt each (mean), "
              f"{P / max(per):.2f} prompts/s together (until the slowest finishes)", flush=True)
        save()


if __name__ == "__main__":
    main(sys.argv[1:])
