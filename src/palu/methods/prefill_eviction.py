"""What a composition with SnapKV adds to a compressed cache (kivi_snapkv.py, palu_snapkv.py):
after the prefill, keep only the prompt tokens SnapKV's observation window votes for (kvpress's
`compression_ratio`: the fraction of the prompt removed), then store those in the compressed form
(KIVI's quantised keys / values, Palu's low-rank latents); decoding appends every new token as the
compressed cache alone would. The prefill itself attends as the compressed method alone does, and
one-pass scores are refused (`one_pass`), as for SnapKV."""
from __future__ import annotations

from dataclasses import dataclass

from .snapkv import SnapKVPolicy, check_snapkv


@dataclass
class PrefillEviction:
    evict_ratio: float = 0.5    # fraction of the prompt's tokens removed (kvpress's compression_ratio)
    evict_window: int = 32      # SnapKV's observation window (the prompt's last queries)
    evict_kernel: int = 5       # SnapKV's pooling over neighbouring tokens (odd)

    def check_eviction(self) -> None:
        check_snapkv(self.evict_ratio, self.evict_window, self.evict_kernel,
                     ("evict_ratio", "evict_window", "evict_kernel"))

    @property
    def eviction_tag(self) -> str:
        return f"-snapkv-r{self.evict_ratio:g}-w{self.evict_window}-k{self.evict_kernel}"

    @property
    def eviction(self) -> SnapKVPolicy:
        return SnapKVPolicy(float(self.evict_ratio), self.evict_window, self.evict_kernel)
