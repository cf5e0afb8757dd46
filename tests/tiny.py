"""Tiny random models of every supported family (and of some unsupported ones, to test that they
are refused), and a tiny word-level tokenizer, for fast unit tests."""
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


def tiny_mistral_sliding(seed: int = 0, window: int = 8):
    """Mistral with a sliding window far shorter than the test sequences."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256, sliding_window=window)
    return MistralForCausalLM(cfg).eval()


def tiny_qwen2_sliding(seed: int = 0, window: int = 8):
    """Qwen2 whose second layer attends through a sliding window (`layer_types`)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      use_sliding_window=True, sliding_window=window, max_window_layers=1)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_gemma3(seed: int = 0):
    """Gemma-3 (`gemma3_text`): an unsupported family (q/k norms, MQA, sliding windows)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                           max_position_embeddings=256, sliding_window=8)
    return Gemma3ForCausalLM(cfg).eval()


WORDS = ("the of and to in a is was for on as by with he it at from his an were are which this be "
         "or has had first one their its new after who they have her she two been other when there "
         "all during into school time may years more most only over city some world would where "
         "later up such used many can state about national out known university united then made "
         "film between through american being these both under team").split()


def tiny_tokenizer(add_bos: bool = False):
    """A word-level fast tokenizer of 97 ids (the tiny models' vocabulary): <unk>, <s>, </s>, then
    frequent English words. `add_bos`: it puts <s> before every text, as Llama / Gemma do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *dict.fromkeys(WORDS)][:97])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    return tok


def save_tiny(model, tok, folder):
    """A local HF folder (config, weights, tokenizer) that `palu.load_model` reads."""
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
