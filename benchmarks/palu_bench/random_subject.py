"""A model with a real model's shapes and random weights, a stand-in tokenizer and random token
ids: what the GPU benchmarks time on a host where nothing is staged (the real weights and the
wheelhouse take ~700 s of device time to stage; torch, triton and transformers are already there).

  model=random:smollm2-135m      the embedded SmolLM2-135M's shapes (untied head, see below)
  model=random:PATH              the shapes of PATH/config.json (any family palu supports)

What a random model measures honestly: time and memory, which depend on shapes alone, because
every benchmark switches EOS off and generates the same number of tokens; agreement between batch
sizes (the same fp16 reductions at another batch shape). What it does not: quality, and which
tokens an eviction or selection keeps (its scores are of random attention). A row says
`"weights": "random"` so no table mistakes it for the real model's.
"""
from __future__ import annotations

import torch

PREFIX = "random:"
# SmolLM2-135M-Instruct's config (the embedded GGUF's), with the head untied so random weights
# answer varied tokens (a tied random head repeats its input's most similar embedding)
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def is_random(model_id) -> bool:
    return isinstance(model_id, str) and model_id.startswith(PREFIX)


class IdTokenizer:
    """Enough of a tokenizer for `answer_batches`: a pad id, no EOS, answers written as ids."""
    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def random_config(model_id: str):
    from transformers import AutoConfig
    name = model_id[len(PREFIX):]
    if name in SHAPES:
        shapes = dict(SHAPES[name])
        return AutoConfig.for_model(shapes.pop("model_type"), **shapes)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise SystemExit(f"model={model_id!r}: {name!r} is neither a named shape ({sorted(SHAPES)}) "
                         f"nor a folder with a config.json ({err})") from err


def random_subject(model_id: str, tokens: int, dtype: str = "float16", device: str = "cuda",
                   seed: int = 0):
    """(model, tokenizer, `tokens` random ids) for `model=random:...`."""
    from transformers import AutoModelForCausalLM

    from palu.models.loading import check_supported
    config = random_config(model_id)
    check_supported(config, model_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")   # from_pretrained's choice
    model = model.to(device, getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, config.vocab_size, (tokens,), generator=g).tolist()
    return model, IdTokenizer(), ids
