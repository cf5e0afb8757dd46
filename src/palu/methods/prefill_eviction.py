"""What a composition with SnapKV adds to a compressed cache (kivi_snapkv.py, palu_snapkv.py):
after the prefill, keep only the prompt tokens SnapKV's observation window votes for (kvpress's
`compression_ratio`: the fraction of the prompt removed), then store those in the compressed form
(KIVI's quantised keys / values, Palu's low-rank latents); decoding appends every new token as the
compressed cache alone would. The prefill itself attends as the compressed method alone does, and
one-pass scores are refused (`one_pass`), as for SnapKV."""
from __future__ import annotations

from dataclasses import dataclass

from .base import MethodError, check_int
from .snapkv import SnapKVPolicy


@dataclass
class PrefillEviction:
    evict_ratio: float = 0.5    # fraction of the prompt's tokens removed (kvpress's compression_ratio)
    evict_window: int = 32      # SnapKV's observation window (the prompt's last queries)
    evict_kernel: int = 5       # SnapKV's pooling over neighbouring tokens (odd)

    def check_eviction(self) -> None:
        r = self.evict_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise MethodError(f"method.evict_ratio={r!r} must be in [0, 1) (the fraction of the prompt removed)")
        check_int(self.evict_window, "evict_window")
        check_int(self.evict_kernel, "evict_kernel")
        if self.evict_kernel % 2 == 0:
            raise MethodError(f"method.evict_kernel={self.evict_kernel!r} must be odd (pooling centred on each token)")

    @property
    def eviction_tag(self) -> str:
        return f"-snapkv-r{self.evict_ratio:g}-w{self.evict_window}-k{self.evict_kernel}"

    @property
    def eviction(self) -> SnapKVPolicy:
        return SnapKVPolicy(float(self.evict_ratio), self.evict_window, self.evict_kernel)
