"""Palu + SnapKV (a composition, issue 36): a Palu checkpoint's latents of only the prompt tokens
SnapKV's observation window votes for (and of every decoded token), at `bits`. A layer keeps one
set of tokens, voted for by all its query heads together (SnapKV alone keeps a set per KV head):
Palu's latents of a layer share one token axis, and a G-LRD latent serves several heads at once.
Kept keys are rebuilt and rotated at their own positions. Bytes stored = bytes read per step.
A left-padded batch: each row votes over its own tokens with its own queries and keeps what its
prompt alone keeps, led by masked filler slots where it keeps fewer than the longest row
(`PaluAttention._evict_rows`, `LatentLayer.lead`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..cache.protocol import palu_layers
from ..models.adapters import layer_window
from .base import MethodError
from .palu import Palu
from .prefill_eviction import PrefillEviction


@dataclass
class PaluSnapKV(Palu, PrefillEviction):
    name = "palu_snapkv"
    one_pass = False
    padded_batches = True    # each row of a left-padded batch votes and keeps among its own tokens

    def check(self) -> None:
        super().check()
        self.check_eviction()

    @property
    def method_suffix(self) -> str:
        return self.eviction_tag

    def install(self, model) -> None:
        windows = [i for i in range(model.config.num_hidden_layers) if layer_window(model.config, i) is not None]
        if windows:
            raise MethodError(f"palu_snapkv: layers {windows} attend through a sliding window; eviction "
                              "on sliding-window layers is not supported")
        super().install(model)
        policy = self.eviction
        for layer in palu_layers(model).values():
            layer.eviction = policy

    def summary(self) -> dict:
        return {**super().summary(), "family": "composition", "compression_ratio": self.evict_ratio}
