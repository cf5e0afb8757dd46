"""Architecture adapters: a family described by what its attention has, not replaced.

An adapter says where the decoder layers and the q/k/v/o projections are, whether the family uses
RoPE, whether q and k go through a norm before RoPE (per head, or over all heads at once), and
whether q/k/v are one fused projection (split at first use, exactly). Per-layer attention types
(sliding windows, a RoPE per layer type) come from the config (`layer_window`, `LayerRotary`).
Palu attention, the quantised-KV attention and every calibration hook follow the description.

Supported: Llama, Mistral, Qwen2 (RoPE; MHA or GQA; Qwen2 has q/k/v bias), OPT (no RoPE, learned
positions, biases everywhere), Qwen3 (per-head q/k norm), Gemma-3 text (per-head q/k norm with
Gemma's (1 + w) weights, MQA, head_dim 256, sliding-window layers with their own RoPE), OLMo-2
(q/k norm over all heads) and Phi-3 (fused QKV, partial rotary). A family whose attention does
something else (logit soft-capping: Gemma-2) is refused by name.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..registry import Registry


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


QK_NORMS = (None, "head", "all")


@dataclass(frozen=True)
class FamilyAdapter:
    rope: bool
    layers_attr: str          # dotted path from the CausalLM to the list of decoder layers
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None    # one fused [q; k; v] projection (Phi-3): split at first use
    # "head": an RMSNorm over each head's dims (Qwen3, Gemma-3); "all": over all heads' dims at
    # once (OLMo-2); applied to q and k after the projection (and its bias), before RoPE
    qk_norm: str | None = None
    query_scaled_in_proj: bool = False   # OPT multiplies q by head_dim**-0.5 before attention

    def layers(self, model) -> nn.ModuleList:
        obj = model
        for part in self.layers_attr.split("."):
            obj = getattr(obj, part)
        return obj

    def attention(self, layer) -> nn.Module:
        return layer.self_attn

    def projections(self, attn) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        if self.qkv is not None:
            fused = split_qkv(attn, self.qkv)
            return fused.q_proj, fused.k_proj, fused.v_proj, getattr(attn, self.o)
        return getattr(attn, self.q), getattr(attn, self.k), getattr(attn, self.v), getattr(attn, self.o)

    def norms(self, attn) -> tuple[nn.Module | None, nn.Module | None]:
        """The q and k norm modules (None, None for a family without them)."""
        if self.qk_norm is None:
            return None, None
        return attn.q_norm, attn.k_norm


class SplitQKV(nn.Module):
    """A fused [q; k; v] projection as three Linear layers whose outputs are concatenated: the
    model computes what it did (each output is the same dot product of the same weights), while
    calibration hooks, Fisher gradients and factorisation see a k and a v projection of their own."""

    def __init__(self, fused: nn.Linear, sizes: tuple[int, int, int]):
        super().__init__()
        if sum(sizes) != fused.out_features:
            raise ValueError(f"a fused qkv projection of {fused.out_features} outputs cannot be split "
                             f"into q/k/v of {sizes}")
        start = 0
        for name, n in zip(("q_proj", "k_proj", "v_proj"), sizes):
            part = nn.Linear(fused.in_features, n, bias=fused.bias is not None,
                             dtype=fused.weight.dtype, device=fused.weight.device)
            with torch.no_grad():
                part.weight.copy_(fused.weight[start:start + n])
                if fused.bias is not None:
                    part.bias.copy_(fused.bias[start:start + n])
            part.weight.requires_grad_(fused.weight.requires_grad)
            setattr(self, name, part)
            start += n

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


def split_qkv(attn: nn.Module, name: str) -> SplitQKV:
    """Replace `attn.<name>` (a fused [q; k; v] Linear) by its exact split, once."""
    fused = getattr(attn, name)
    if isinstance(fused, SplitQKV):
        return fused
    config = attn.config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    split = SplitQKV(fused, (heads * hd, kv * hd, kv * hd))
    setattr(attn, name, split)
    return split


def apply_qk_norm(t: torch.Tensor, norm: nn.Module | None, kind: str | None) -> torch.Tensor:
    """q or k heads (B, n, T, hd) through the family's norm: per head over hd ("head"), or over
    all n * hd values of a token at once ("all", OLMo-2)."""
    if norm is None:
        return t
    if kind == "head":
        return norm(t)
    B, n, T, hd = t.shape
    return norm(t.transpose(1, 2).reshape(B, T, n * hd)).view(B, T, n, hd).transpose(1, 2)


class LayerRotary:
    """The model's rotary embedding as one layer sees it: Gemma-3 keeps one RoPE per attention
    type (local layers rotate at base 10k, global ones at 1M) and takes the layer type as an
    argument; the others take none. `inv_freq` / `attention_scaling` are this layer's (the decode
    kernels read them)."""

    def __init__(self, rotary: nn.Module, layer_type: str | None):
        self.rotary = rotary
        self.layer_type = layer_type if "layer_type" in inspect.signature(rotary.forward).parameters else None

    def __call__(self, x, positions):
        if self.layer_type is None:
            return self.rotary(x, positions)
        return self.rotary(x, positions, self.layer_type)

    @property
    def inv_freq(self):
        return getattr(self.rotary, "inv_freq" if self.layer_type is None else f"{self.layer_type}_inv_freq")

    @property
    def attention_scaling(self):
        name = "attention_scaling" if self.layer_type is None else f"{self.layer_type}_attention_scaling"
        return getattr(self.rotary, name, 1.0)


def partial_rotary(config) -> float:
    """The fraction of each head's dims that RoPE rotates (1.0 for most families; Phi-3 / Phi-4
    mini may rotate part of it)."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)


def rotary_for(model, layer_idx: int) -> LayerRotary | None:
    """Layer `layer_idx`'s view of the model's rotary embedding (None without RoPE)."""
    if not adapter_for(model.config).rope:
        return None
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no model.rotary_emb: cannot rebuild RoPE keys")
    types = getattr(model.config, "layer_types", None)
    return LayerRotary(rotary, None if types is None else types[layer_idx])


# The supported families, by transformers' `model_type`: a new one is its adapter and this call
# (palu.registry: the same registration as methods, suites and allocators).
ADAPTERS: Registry = Registry("model family", UnsupportedArchitectureError)
register_family = ADAPTERS.register

_ROPE = FamilyAdapter(rope=True, layers_attr="model.layers")
_HEAD_NORM = FamilyAdapter(rope=True, layers_attr="model.layers", qk_norm="head")
for _name in ("llama", "mistral", "qwen2"):
    register_family(_name, _ROPE)
for _name in ("qwen3", "gemma3_text"):
    register_family(_name, _HEAD_NORM)
register_family("olmo2", FamilyAdapter(rope=True, layers_attr="model.layers", qk_norm="all"))
register_family("phi3", FamilyAdapter(rope=True, layers_attr="model.layers", qkv="qkv_proj"))
register_family("opt", FamilyAdapter(rope=False, layers_attr="model.decoder.layers", o="out_proj",
                                     query_scaled_in_proj=True))


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
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap:   # SDPA has no soft-capping: every attention palu installs would silently drop it
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} with attn_logit_softcapping={cap} is not supported (palu's "
            f"attention has no logit soft-capping, Gemma-2's); supported families: {sorted(ADAPTERS)}")
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
