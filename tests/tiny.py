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


def _randomise_norms(model):
    """Random init leaves q/k norm weights at one (zero for Gemma's 1 + w): make them matter."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_norm", "k_norm"):
                norm = getattr(layer.self_attn, name, None)
                if norm is not None:
                    norm.weight.normal_(0.5, 0.3)
    return model


def tiny_qwen3(seed: int = 0):
    """Qwen3: per-head RMSNorm on q and k before RoPE; q/k/v bias switched on here."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, attention_bias=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return _randomise_norms(model)


def tiny_gemma3(seed: int = 0, window: int = 8):
    """Gemma-3 (`gemma3_text`): per-head q/k norms ((1 + w) weights), MQA, head_dim larger than
    hidden / heads, a sliding-window layer (its own RoPE base) and a global one, scaled
    embeddings, query_pre_attn_scalar."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                           max_position_embeddings=256, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)
    return _randomise_norms(Gemma3ForCausalLM(cfg).eval())


def tiny_olmo2(seed: int = 0):
    """OLMo-2: RMSNorm over all heads' q (and all KV heads' k) at once, before RoPE."""
    from transformers import Olmo2Config, Olmo2ForCausalLM
    torch.manual_seed(seed)
    cfg = Olmo2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return _randomise_norms(Olmo2ForCausalLM(cfg).eval())


def tiny_phi3(seed: int = 0):
    """Phi-3: one fused qkv projection; RoPE on half of each head (partial_rotary_factor 0.5)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(seed)
    cfg = Phi3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     original_max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return Phi3ForCausalLM(cfg).eval()


FAMILIES.update(qwen3=tiny_qwen3, gemma3=tiny_gemma3, olmo2=tiny_olmo2, phi3=tiny_phi3)


def tiny_gpt2(seed: int = 0):
    """GPT-2: a family palu has no adapter for (Conv1D c_attn), to test that it is refused."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=2)).eval()


def tiny_gemma2(seed: int = 0):
    """Gemma-2 with attention logit soft-capping, which palu's attention does not do: refused."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=256, sliding_window=8, attn_logit_softcapping=50.0)
    return Gemma2ForCausalLM(cfg).eval()


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


# Prompts of three lengths for padded-batch tests, and their left-padded batch (ids, mask).
PAD = 0
PROMPTS = [[5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70], [4, 88, 19]]


# six prompts of 3 to 12 tokens, for batches whose ended rows leave (static_decode.shrink_rows)
SIX_PROMPTS = PROMPTS + [p[::-1] for p in PROMPTS]


def stop_that_shrinks(free: list[list[int]], steps: int):
    """Stop tokens under which two rows of a batch's free answers `free` never stop in `steps`
    tokens and at least half the rest stop by their third (so a replayed batch drops them), and
    each row's step of its first stop token (steps - 1: none)."""
    import itertools
    for a, b in itertools.combinations(range(len(free)), 2):
        stop = {n[1] for r, n in enumerate(free) if r not in (a, b)} - set(free[a] + free[b])
        ends = [next((k for k, t in enumerate(n) if t in stop), steps - 1) for n in free]
        if 2 * sum(e <= 2 for e in ends) >= len(free):
            return stop, ends
    raise AssertionError(f"no stop tokens end half of these answers early: {free}")


class WordTok:
    """A tokenizer stand-in for `generation`: ids decoded as numbers separated by spaces."""
    pad_token_id, eos_token_id = PAD, None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def decode_as_rows_leave(greedy, label, steps: int = 12):
    """`greedy(ids, mask, steps, stop, trace)` -> (answers, extra) on SIX_PROMPTS, once without stop
    tokens and once under `stop_that_shrinks`' (half the rows end early and leave): each row's answer
    its free one cut at its first stop token, its logits within 1e-9 of the free run's up to there.
    Returns ids, mask, the stop tokens, the stopped run's extra and trace (NaN at rows gone)."""
    ids, mask = left_padded(SIX_PROMPTS)
    full, trace = [], []
    free, _ = greedy(ids, mask, steps, set(), full)
    stop, ends = stop_that_shrinks(free, steps)
    new, extra = greedy(ids, mask, steps, stop, trace)
    assert new == [n[:e + 1] for n, e in zip(free, ends)]
    for k, (ours, ref) in enumerate(zip(trace, full)):
        for row, end in enumerate(ends):
            if k <= end:
                assert (ours[row] - ref[row]).abs().max().item() < 1e-9, (label, row, k)
    return ids, mask, stop, extra, trace


def left_padded(prompts, pad: int = PAD):
    import torch
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def fitted_state(name: str, model, path, calib=None):
    """A fitted method's state (`method.state`) for `model`, saved at `path`: KVQuant's uniform
    3-bit codebooks or KIVI's value scales, on a few random windows. Returns the folder."""
    import copy

    import torch
    calib = torch.randint(1, 97, (2, 16), generator=torch.Generator().manual_seed(3)) if calib is None else calib
    if name == "kvquant":
        from palu.calib.kvquant import fit_kvquant
        state = fit_kvquant(copy.deepcopy(model), calib, bits=3, weighting="uniform", tokens_per_window=8,
                            progress=False)
    elif name == "kivi_vscale":
        from palu.calib.value_scales import fit_kivi_vscale
        state = fit_kivi_vscale(copy.deepcopy(model), calib, alpha=0.5, tokens_per_window=8, progress=False)
    else:
        raise ValueError(f"no tiny fitted state for method {name!r}: add one to tests/tiny.py")
    state.save(path)
    return str(path)


def greedy_alone(model, method, prompt, n):
    """One prompt alone through `method`'s own cache, greedy, token by token: its `n` tokens and
    every step's logits (what each row of a batched path must equal)."""
    import torch
    with torch.no_grad():
        return _greedy_alone(model, method, prompt, n)


def _greedy_alone(model, method, prompt, n):
    import torch
    cache = method.make_cache(model)
    logits = [model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        logits.append(model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def check_slots_refuse_misuse(model, method, slots_type):
    """Preallocated slots (`slots_type(cache, new_tokens)`) refuse a cache not yet prefilled, and a
    cache in slots refuses a step of more than one token a row."""
    import pytest
    import torch
    ids, mask = left_padded(PROMPTS)
    cache = method.make_cache(model)
    with pytest.raises(ValueError, match="prefill the batch through the cache first"):
        slots_type(cache, 4)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    cache.slots = slots_type(cache, 4)
    with pytest.raises(ValueError, match="one token a row a step"):
        with torch.no_grad():
            model(torch.tensor([[1, 2]] * 3), past_key_values=cache)
