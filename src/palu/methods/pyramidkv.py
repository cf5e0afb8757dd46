"""PyramidKV (Cai et al., 2024): SnapKV's choice of tokens with a budget per layer that shrinks
with depth — lower layers attend broadly, upper ones to few tokens. Layer l keeps
avg x (1 + spread x (1 - 2 l / (L - 1))) prompt tokens, an arithmetic sequence whose mean is
SnapKV's budget at the same `compression_ratio` (so the two compare at equal bytes, up to
rounding); `spread` 0 is SnapKV."""
from __future__ import annotations

from dataclasses import dataclass

from .base import MethodError
from .snapkv import SnapKV, SnapKVPolicy


class PyramidPolicy(SnapKVPolicy):
    def __init__(self, ratio: float, window: int, kernel: int, spread: float, layers: int):
        super().__init__(ratio, window, kernel)
        self.spread, self.layers = spread, layers

    def budget(self, layer: int, prompt: int) -> int:
        avg = prompt - prompt * self.ratio
        tilt = 1 - 2 * layer / (self.layers - 1) if self.layers > 1 else 0.0
        return int(round(avg * (1 + self.spread * tilt)))


@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    spread: float = 0.5      # the first layer keeps (1 + spread) x the mean budget, the last (1 - spread) x

    def check(self) -> None:
        super().check()
        s = self.spread
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1:
            raise MethodError(f"method.spread={s!r} must be in [0, 1)")

    @property
    def tag(self) -> str:
        return f"pyramidkv-r{self.compression_ratio:g}-s{self.spread:g}-w{self.window}-k{self.kernel}"

    @property
    def policy(self) -> PyramidPolicy:
        layers = getattr(self, "_layers", None)
        if layers is None:
            raise RuntimeError("pyramidkv: install(model) before making caches (its budgets are per layer)")
        return PyramidPolicy(float(self.compression_ratio), self.window, self.kernel, float(self.spread), layers)
