"""Architecture adapters: where a family keeps its attention projections, and whether it uses RoPE.

Supported: Llama, Mistral, Qwen2 (RoPE; MHA or GQA; Qwen2 has k/v bias) and OPT (no RoPE,
learned positions, biases everywhere) as the non-RoPE family.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no adapter."""


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


def geometry_of(config) -> Geometry:
    adapter = adapter_for(config)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Geometry(num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                    hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                    rope=adapter.rope)
