"""What a composition of Palu's latents with an eviction scorer shares (palu_snapkv.py,
palu_tova.py): the scorer (`cache/eviction.py`, the same SnapKV / TOVA code that serves the plain
subset cache) chooses which tokens' latents a layer holds — after the prefill, or every step for a
scorer that evicts while decoding — and the latent cache keeps one set per layer, voted for by all
its query heads together (a layer's latents share one token axis, and a G-LRD latent serves several
heads at once). Kept keys are rebuilt and rotated at their own positions. Bytes stored = bytes read
per step. A left-padded batch: each row scores and keeps among its own tokens with its own queries,
as its prompt alone would (`PaluAttention._evict`, `LatentLayer.lead`). A subclass sets `name`, its
fields, `method_suffix` and an `eviction` property giving its scorer."""
from __future__ import annotations

from dataclasses import dataclass

from ..cache.protocol import palu_layers
from ..models.adapters import layer_window
from .base import MethodError
from .palu import Palu


@dataclass
class PaluEviction(Palu):
    name = ""                # a base, not a method (subclasses name themselves)
    one_pass = False
    padded_batches = True    # each row of a left-padded batch scores and keeps among its own tokens

    def install(self, model) -> None:
        windows = [i for i in range(model.config.num_hidden_layers) if layer_window(model.config, i) is not None]
        if windows:
            raise MethodError(f"{self.name}: layers {windows} attend through a sliding window; eviction "
                              "on sliding-window layers is not supported")
        policy = self.eviction
        if policy.accumulates:
            raise MethodError(f"{self.name}: {type(policy).__name__} keeps state per KV head's tokens; "
                              "Palu's latent cache holds one set per layer, so it cannot follow it")
        super().install(model)
        for layer in palu_layers(model).values():
            layer.eviction, layer.eviction_owner = policy, self.name
