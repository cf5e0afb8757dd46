"""Palu + SnapKV (a composition, issue 36): a Palu checkpoint's latents of only the prompt tokens
SnapKV's observation window votes for (and of every decoded token), at `latent_bits`; one set per layer
(`palu_evict.py`: SnapKV alone keeps a set per KV head)."""
from __future__ import annotations

from dataclasses import dataclass

from .palu_evict import PaluEviction
from .prefill_eviction import PrefillEviction


@dataclass
class PaluSnapKV(PaluEviction, PrefillEviction):
    name = "palu_snapkv"

    def check(self) -> None:
        super().check()
        self.check_eviction()

    @property
    def method_suffix(self) -> str:
        return self.eviction_tag

    def summary(self) -> dict:
        return {**super().summary(), "family": "composition", "compression_ratio": self.evict_ratio}
