"""TurboQuant-style KV cache (Zandieh et al. 2025; what vLLM ships as a KV-cache dtype): each
full key (after RoPE) and value head vector is stored as its fp16 norm and, for the unit vector
after a randomised Hadamard rotation, one Lloyd-Max code per coordinate for the distribution a
coordinate of a random unit vector has. Data-oblivious: nothing is calibrated. (The MSE variant;
the inner-product variant's 1-bit QJL residual is not included.)"""
from __future__ import annotations

from dataclasses import dataclass

from ..quant.codecs import TurboCodec
from .quantized_kv import QuantizedKV


@dataclass
class TurboQuant(QuantizedKV):
    name = "turboquant"
    padded_batches = True   # per-token codes
    BITS = (2, 3, 4)
    bits: int = 3
    seed: int = 0          # the random signs of the rotation (per layer)

    @property
    def tag(self) -> str:
        return f"turboquant-b{self.bits}" + ("" if self.seed == 0 else f"-s{self.seed}")

    def codecs(self, geom, model):
        keys = TurboCodec(self.bits, geom.head_dim, geom.num_layers, seed=2 * self.seed)
        values = TurboCodec(self.bits, geom.head_dim, geom.num_layers, seed=2 * self.seed + 1)
        return keys, values
