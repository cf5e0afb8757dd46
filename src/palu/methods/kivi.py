"""KIVI (Liu et al., ICML 2024): keys quantised per channel in groups of `group` consecutive
tokens, values per token in groups of `group` channels, asymmetric min-max, and the newest
`residual` tokens kept in the model's dtype.

Schedule here (`cache/quant_cache.py`): at every step the newest `residual` tokens are exact;
older values are quantised token by token; older keys once their whole `group`-token block has
left the window (so up to residual + group - 1 keys are exact). KIVI's code quantises keys a
whole residual block at a time, holding 1..residual exact keys; both keep the newest keys exact
and quantise keys per channel within token groups."""
from __future__ import annotations

from dataclasses import dataclass

from ..cache.quant_cache import Schedule
from ..quant.codecs import UniformCodec
from ..quant.uniform import check_group
from .base import MethodError
from .quantized_kv import QuantizedKV


@dataclass
class KIVI(QuantizedKV):
    name = "kivi"
    padded_batches = True   # a left-padded batch keeps its rows apart (quant_cache: per-row mode)
    BITS = (2, 3, 4, 8)
    bits: int = 2
    group: int = 32        # tokens per key group, channels per value group
    residual: int = 128    # newest tokens kept exact

    def check(self) -> None:
        super().check()
        if not isinstance(self.group, int) or self.group <= 0:
            raise MethodError(f"method.group={self.group!r} must be a positive integer")
        if not isinstance(self.residual, int) or self.residual < 0 or self.residual % self.group:
            raise MethodError(f"method.residual={self.residual!r} must be a non-negative multiple "
                              f"of method.group={self.group} (KIVI's residual holds whole groups)")

    @property
    def tag(self) -> str:
        return f"kivi-b{self.bits}-g{self.group}-r{self.residual}"

    def codecs(self, geom, model):
        check_group(self.group, geom.head_dim, "head_dim (values are grouped by channel)")
        return UniformCodec(self.bits, self.group, "token"), UniformCodec(self.bits, self.group, "channel")

    def schedule(self) -> Schedule:
        return Schedule(window=self.residual)
