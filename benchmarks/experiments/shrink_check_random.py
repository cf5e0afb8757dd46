"""Ended rows leaving replayed graphs (`palu.eval.static_decode.shrink_rows`) on a GPU host with
nothing staged (torch, triton and transformers only; `shrink_check.py` is the same check on the
real model, which needs the wheelhouse): SmolLM2-135M's shapes with random fp16 weights (an untied
random head gives varied answers, so stop tokens end rows at many steps). For each method: free
answers (graph), stop tokens chosen from them, then the graph path shrinking, the graph path
keeping every row (SHRINK_LIVE = 0), the same steps eagerly (shrinking): rows equal to the free
answers cut at their first stop token, and times.

  [L=1024] [B=64] [METHODS=fp16,kivi,snapkv,h2o,quest,palu] python benchmarks/experiments/shrink_check_random.py OUT.json
  SMALL=1 ...: a CPU smoke run (2 layers, 6 prompts)

Results: results/checks/h100-shrink-check-random-session48.json."""
import copy
import json
import os
import sys
import time

for n in ("omegaconf", "hydra", "gguf", "datasets", "wandb", "lm_eval", "snakemake"):
    sys.modules.setdefault(n, None)   # the host lacks them; palu's library needs none
os.environ["PALU_STATIC_DECODE"] = "all"
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import palu
from palu.eval import static_decode, static_quant, static_subset
from palu.methods import build_method

SMALL = os.environ.get("SMALL") == "1"
dev = "cpu" if SMALL else "cuda"
dtype = torch.float32 if SMALL else torch.float16
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2 if SMALL else 30,
                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                  max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa")
torch.manual_seed(0)
base = LlamaForCausalLM(cfg).to(dev, dtype).eval()
base.generation_config.eos_token_id = None
B, L, NEW = (6, 64, 12) if SMALL else (int(os.environ.get("B", 64)), int(os.environ.get("L", 1024)), 64)
g = torch.Generator().manual_seed(1)
lens = [L - (i * 97) % (L // 3) for i in range(B)]
prompts = [torch.randint(1, 49152, (n,), generator=g).tolist() for n in lens]
W = max(lens)
ids = torch.tensor([[0] * (W - len(p)) + p for p in prompts], device=dev)
mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in prompts], device=dev)
CONF = {"kivi": {"name": "kivi", "bits": 2}, "snapkv": {"name": "snapkv", "compression_ratio": 0.5},
        "h2o": {"name": "h2o", "budget": 512, "window": 64}, "quest": {"name": "quest", "page": 16, "budget": 256},
        "tova": {"name": "tova", "budget": 512}}
out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
       "batch": B, "new": NEW, "methods": {}}


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def answerer(name):
    if name == "fp16":
        return lambda stop, graph: static_decode.greedy_static(base, ids, mask, NEW, stop, graph=graph)[0]
    if name == "palu":
        ck = "/tmp/palu-rand-ckpt"
        if not os.path.exists(ck):
            calib = torch.randint(1, 49152, (4, 256), generator=torch.Generator().manual_seed(2))
            palu.compress(copy.deepcopy(base).float(), calib.to(dev), kept_ratio=0.5, group_size=3,
                          progress=False).save(ck)
        method = build_method({"name": "palu", "checkpoint": ck, "latent_bits": 4})
        model = copy.deepcopy(base)
        method.install(model)
        model.to(dtype)
        return lambda stop, graph: static_decode.greedy_static_latent(model, method, ids, mask, NEW, stop, graph=graph)[0]
    method = build_method(CONF[name])
    model = copy.deepcopy(base)
    method.install(model)
    greedy = static_quant.greedy_static_quant if static_quant.quant_unsupported(model, method) is None \
        else static_subset.greedy_static_subset
    return lambda stop, graph: greedy(model, method, ids, mask, NEW, stop, graph=graph)[0]


for name in os.environ.get("METHODS", "fp16,kivi,snapkv,h2o,quest,palu").split(","):
    try:
        with torch.no_grad():
            answer = answerer(name)
            free = answer(set(), not SMALL)
            keep = len(free) - len(free) // 4
            never = {t for n in free[keep:] for t in n}
            stop = {next((t for t in n[1 + r % (NEW // 4):] if t not in never), None)
                    for r, n in enumerate(free[:keep])} - {None}   # ends spread over the first quarter
            ends = [next((k for k, t in enumerate(n) if t in stop), NEW - 1) for n in free]
            want = [n[:e + 1] for n, e in zip(free, ends)]
            res = {"end_steps": ends}
            for label, graph, live in (("graph-shrinking", True, 0.5), ("graph-kept", True, 0.0),
                                       ("eager-shrinking", False, 0.5)):
                if SMALL and graph:
                    graph = False
                static_decode.SHRINK_LIVE = live
                sync(); t = time.perf_counter()
                got = answer(stop, graph)
                sync(); res[label] = {"s": time.perf_counter() - t, "equal": sum(a == b for a, b in zip(got, want)),
                                      "first_diff": [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                                     for a, b in zip(got, want) if a != b][:8]}
                static_decode.SHRINK_LIVE = 0.5
    except Exception as e:   # noqa: BLE001
        res = {"error": repr(e)[:400]}
    out["methods"][name] = res
    print(name, json.dumps(res), flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
