"""Atom (Zhao et al., MLSys 2024) for the KV cache: full keys (after RoPE) and values quantised
per token in groups of `group` channels (default one head: Atom's 128 = Llama's head_dim),
asymmetric min-max, fp16 scale and minimum per group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..quant.codecs import UniformCodec
from ..quant.uniform import check_group
from .base import MethodError
from .quantized_kv import QuantizedKV


@dataclass
class Atom(QuantizedKV):
    name = "atom"
    padded_batches = True   # per-token groups
    BITS = (2, 3, 4, 8)
    group: Optional[int] = None        # channels per group; None: one head (head_dim)

    def check(self) -> None:
        super().check()
        if self.group is not None and (not isinstance(self.group, int) or self.group <= 0):
            raise MethodError(f"method.group={self.group!r} must be a positive integer or null")

    @property
    def tag(self) -> str:
        return f"atom-b{self.bits}" + ("" if self.group is None else f"-g{self.group}")

    def codecs(self, geom, model):
        group = check_group(self.group or geom.head_dim, geom.head_dim, "head_dim")
        codec = UniformCodec(self.bits, group, "channel")
        return codec, codec
