"""KIVI + SnapKV (a composition, issue 36): SnapKV's choice of prompt tokens per KV head after the
prefill, those tokens (and every decoded one) stored as KIVI stores a cache — keys per channel in
`group`-token blocks, values per token, the newest `residual` exact. Bytes stored = bytes read per
step: KIVI's packed codes, scales and exact window for the kept tokens only. A left-padded batch's
rows are apart in the quantised cache (one row layer each): each row evicts among its own tokens
(`QuantKVAttention._evict`)."""
from __future__ import annotations

from dataclasses import dataclass

from .kivi import KIVI
from .prefill_eviction import PrefillEviction


@dataclass
class KIVISnapKV(KIVI, PrefillEviction):
    name = "kivi_snapkv"
    one_pass = False
    padded_batches = True    # a left-padded batch's rows are apart: each evicts among its own tokens

    def check(self) -> None:
        super().check()
        self.check_eviction()

    @property
    def tag(self) -> str:
        return super().tag + self.eviction_tag

    def summary(self) -> dict:
        return {**super().summary(), "family": "composition", "compression_ratio": self.evict_ratio}
