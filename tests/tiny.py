"""Tiny random models of every supported family, for fast unit tests."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_llama(seed: int = 0, kv_heads: int = 2, layers: int = 2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=256, rope_theta=10000.0)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0):
    """GQA with k/v bias (Qwen2 has q/k/v bias)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def tiny_opt(seed: int = 0):
    """The non-RoPE family: learned positions, biases everywhere, q scaled inside the projection."""
    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64)
    model = OPTForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.out_proj):
                proj.bias.normal_(0, 0.5)
    return model


FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "opt": tiny_opt}
