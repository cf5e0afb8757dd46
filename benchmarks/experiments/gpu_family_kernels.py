"""Which decode path serves each model family on the GPU (issue 37): tiny random models of Llama,
Qwen3, OLMo-2, Phi-3 (full and partial rotary) and Gemma-3 at kernel-friendly shapes (head_dim
64, ranks multiples of 16), compressed at kept 0.5, in fp16 on CUDA; one decode step through
`palu.LatentCache` with backend auto: the kernels' eligibility answer, and the step's logits
against the torch backend's (the reference). Writes one JSON under $OUT.

    python benchmarks/experiments/gpu_family_kernels.py $OUT/gpu-family-kernels.json
"""
from __future__ import annotations

import copy
import json
import sys

import torch
import transformers as tf

import palu
from palu.attention.install import set_backend
from palu.attention.kernel_backend import can_use_kernel

SMALL = dict(vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def models():
    yield "llama", tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, head_dim=64))
    yield "qwen3", tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=64))
    yield "olmo2", tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL))
    yield "phi3", tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    yield "phi3-partial", tf.Phi3ForCausalLM(tf.Phi3Config(
        **SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
    yield "gemma3", tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**SMALL, "num_key_value_heads": 1}, head_dim=64,
                                                             sliding_window=16))


def main(out: str) -> None:
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # (cpu: a dry run of the script)
    dtype = torch.float16 if dev == "cuda" else torch.float32
    rows = []
    for name, base in models():
        model = copy.deepcopy(base.eval())
        kv = palu.geometry_of(model.config).num_kv_heads
        palu.compress(model, torch.randint(1, 97, (4, 64)), kept_ratio=0.5, group_size=kv, multiple=16,
                      progress=False)
        model = model.to(device=dev, dtype=dtype)
        ids = torch.randint(1, 97, (1, 40), device=dev)
        logits = {}
        for backend in ("torch", "auto"):
            set_backend(model, backend)
            cache = palu.LatentCache(model)
            with torch.no_grad():
                model(ids[:, :-1], past_key_values=cache, use_cache=True)
                attn = model.model.layers[0].self_attn
                x = torch.zeros(1, 1, model.config.hidden_size, device=dev, dtype=dtype)
                reason = can_use_kernel(attn, x, None)
                logits[backend] = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits.float()
        diff = (logits["auto"] - logits["torch"]).abs().max().item()
        rows.append({"family": name, "kernel": reason is None, "reason": reason, "max_abs_diff_vs_torch": diff,
                     "max_abs_logit": logits["torch"].abs().max().item()})
        print(json.dumps(rows[-1]))
    record = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": tf.__version__, "rows": rows}
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    bad = [r for r in rows if not r["max_abs_diff_vs_torch"] <= 2e-2 * max(1.0, r["max_abs_logit"])]
    if bad:
        sys.exit(f"auto decode disagrees with torch: {bad}")


if __name__ == "__main__":
    main(sys.argv[1])
