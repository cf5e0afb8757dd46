"""Architecture adapters: where a family keeps its attention projections, and whether it uses RoPE.

Supported: Llama, Mistral, Qwen2 (RoPE; MHA or GQA; Qwen2 has k/v bias) and OPT (no RoPE,
learned positions, biases everywhere) as the non-RoPE family.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no adapter."""


class UnsupportedRopeError(ValueError):
    """The model's RoPE scaling changes with the sequence length, which a cache that rotates keys
    when it reads them cannot reproduce."""


# Dynamic NTK and LongRoPE rescale every position's rotation once the sequence outgrows the
# original length. transformers keeps each cached key rotated as it was when written; Palu's
# latents and KVQuant's pre-RoPE keys are rotated when read, at the scaling of that step, so the
# two disagree (a full-rank Palu model: 21 of 100 generated tokens, |dlogit| 0.85). Static
# scalings (linear, yarn, llama3) rotate a position the same way at every step.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_types(config) -> set[str]:
    """The RoPE types of the model (one per attention type where it has several)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return {"default"}
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return {g.get("rope_type", g.get("type", "default")) for g in groups}


def check_rope(config, who: str) -> None:
    """Refuse a length-dependent RoPE type by name (UnsupportedRopeError)."""
    bad = sorted(rope_types(config) & set(LENGTH_DEPENDENT_ROPE))
    if bad:
        raise UnsupportedRopeError(
            f"{who}: rope_type {bad[0]!r} rescales every position's rotation as the sequence grows; "
            f"transformers keeps each cached key as it was rotated when written, while {who} rotates "
            f"keys when it reads them, so their answers would differ. Not supported: "
            f"{list(LENGTH_DEPENDENT_ROPE)}; static scalings (linear, yarn, llama3) are")


@dataclass(frozen=True)
class Geometry:
    """Attention shapes of one model (the same for every layer in the supported families)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_layers: int
    rope: bool

    @property
    def n_rep(self) -> int:  # query heads per KV head
        return self.num_heads // self.num_kv_heads

    def kv_size(self) -> int:  # numbers per token per layer in an FP16 K+V cache
        return 2 * self.num_kv_heads * self.head_dim

    def group_sizes(self) -> list[int]:
        """Every valid group size: the divisors of the number of KV heads (1 = M-LRD, all = J-LRD)."""
        return [s for s in range(1, self.num_kv_heads + 1) if self.num_kv_heads % s == 0]

    def check_group_size(self, group_size: int) -> int:
        if group_size <= 0 or self.num_kv_heads % group_size:
            raise ValueError(f"group_size={group_size} does not divide the {self.num_kv_heads} KV "
                             f"heads; valid group sizes: {self.group_sizes()}")
        return self.num_kv_heads // group_size


@dataclass(frozen=True)
class FamilyAdapter:
    rope: bool
    layers_attr: str          # dotted path from the CausalLM to the list of decoder layers
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    query_scaled_in_proj: bool = False   # OPT multiplies q by head_dim**-0.5 before attention

    def layers(self, model) -> nn.ModuleList:
        obj = model
        for part in self.layers_attr.split("."):
            obj = getattr(obj, part)
        return obj

    def attention(self, layer) -> nn.Module:
        return layer.self_attn

    def projections(self, attn) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        return getattr(attn, self.q), getattr(attn, self.k), getattr(attn, self.v), getattr(attn, self.o)


_ROPE = FamilyAdapter(rope=True, layers_attr="model.layers")
ADAPTERS: dict[str, FamilyAdapter] = {
    "llama": _ROPE, "mistral": _ROPE, "qwen2": _ROPE,
    "opt": FamilyAdapter(rope=False, layers_attr="model.decoder.layers", o="out_proj",
                         query_scaled_in_proj=True),
}


def config_fingerprint(config) -> str:
    """What an artifact made without the weights (uniform ranks) names its model by: the
    family, vocabulary and attention shapes (sha256, 16 hex digits)."""
    import hashlib
    import json
    g = geometry_of(config)
    key = {"model_type": getattr(config, "model_type", None), "vocab_size": getattr(config, "vocab_size", None),
           **{k: getattr(g, k) for k in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "num_layers")}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def adapter_for(config) -> FamilyAdapter:
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported families: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type]


def sliding_window_of(config) -> int | None:
    """The attention window (tokens) if any layer attends through a sliding window, else None.
    (Mistral sets `sliding_window`; Qwen2 only uses it where `layer_types` says so.)"""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def layer_window(config, layer: int) -> int | None:
    """The sliding window of decoder layer `layer` (None: it attends to every earlier token)."""
    window = sliding_window_of(config)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and types[layer] != "sliding_attention"):
        return None
    return window


def geometry_of(config) -> Geometry:
    adapter = adapter_for(config)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Geometry(num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                    hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                    rope=adapter.rope)
