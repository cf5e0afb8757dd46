"""How concentrated a model's keys are in a few channels (why a quantiser that shares one scale
across a token's channels can fail where a per-channel one does not): per layer, the largest key
magnitude, the largest channel's RMS over the median channel's, the share of the keys' energy in
the 4 strongest channels, the largest k_proj bias, and TurboQuant-4's error on each head vector
(palu.quant.codecs.TurboCodec, the method's own codec) relative to the keys and to their variation
across tokens (the keys less their mean: what a softmax over the tokens can tell apart). Keys as
k_proj gives them (bias included, before RoPE), over the first `tokens` tokens of the Wikipedia
stand-in's evaluation text.

    python benchmarks/experiments/key_outliers.py work/qwen25/models/qwen25-coder-1.5b [tokens]

(a prepared model folder, or any model id palu.load_model takes). Prints a markdown table.
"""
from __future__ import annotations

import sys

import torch

from palu.data.corpora import load_corpus
from palu.models.loading import load_model
from palu.quant.codecs import TurboCodec


def main(model_id: str, tokens: str = "256") -> None:
    model, tok = load_model(model_id, dtype="float32")
    ids = tok(load_corpus("wiki_standin").evaluation_text[:20 * int(tokens)], return_tensors="pt").input_ids
    ids = ids[:, :int(tokens)]
    layers = model.model.layers
    keys = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda _m, _a, out, i=i: keys.__setitem__(i, out[0].detach())) for i, layer in enumerate(layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    codec = TurboCodec(4, d, len(layers))
    print("| layer | max abs key | largest / median channel RMS | energy in top 4 channels | max abs bias "
          "| TQ-4 error / keys | TQ-4 error / their variation |")
    print("|---|---|---|---|---|---|---|")
    for i, layer in enumerate(layers):
        k = keys[i]
        heads = k.view(k.shape[0], -1, d)
        err = (codec.roundtrip(heads, i) - heads).norm()
        rms = k.pow(2).mean(0).sqrt()
        energy = k.pow(2).sum(0).sort(descending=True).values
        bias = layer.self_attn.k_proj.bias
        print(f"| {i} | {k.abs().max().item():.1f} | {(rms.max() / rms.median()).item():.1f} | "
              f"{(energy[:4].sum() / energy.sum()).item():.3f} | "
              f"{'-' if bias is None else f'{bias.abs().max().item():.1f}'} | "
              f"{(err / heads.norm()).item():.3f} | {(err / (heads - heads.mean(0)).norm()).item():.3f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
