"""Palu with latent-space token selection (ours; `palu/attention/latent_selection.py`): a Palu
checkpoint whose decode steps score every cached token from its latent with the query folded in,
and read only the best `tokens` per group plus the newest `window` (keys rebuilt with RoPE at
their positions). Everything is stored (the latents, at `latent_bits`); a step reads the `sketch`
leading channels of every key latent plus the whole latents of the chosen tokens. The prefill
attends fully, so one-pass scores are refused (`one_pass`); decode-time suites evaluate it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..attention.latent_selection import LatentSelection
from ..cache.protocol import palu_layers
from .base import MethodError, check_int
from .palu import Palu


@dataclass
class PaluSelect(Palu):
    name = "palu_select"
    one_pass = False
    padded_batches = True    # a row chooses among its own tokens (pads hidden from the choice)
    tokens: int = 256             # tokens read per group beyond the window
    window: int = 32              # newest tokens always read
    sketch: Optional[int] = None  # leading key-latent channels scored (None: all)

    def check(self) -> None:
        super().check()
        check_int(self.tokens, "tokens")
        check_int(self.window, "window", 0)
        if self.sketch is not None:
            check_int(self.sketch, "sketch")

    @property
    def method_suffix(self) -> str:
        sketch = "" if self.sketch is None else f"-sk{self.sketch}"
        return f"-sel{self.tokens}-w{self.window}{sketch}"

    def install(self, model) -> None:
        from ..models.adapters import adapter_for
        if adapter_for(model.config).qk_norm is not None:
            raise MethodError(f"palu_select: {model.config.model_type!r} normalises keys after they are "
                              "rebuilt, so a latent dot product does not rank tokens by their logit")
        super().install(model)
        self.selection = LatentSelection(self.tokens, self.window, self.sketch)
        for layer in palu_layers(model).values():
            layer.selection = self.selection
        self._ranks = [(layer.ranks_k, layer.ranks_v) for _, layer in sorted(palu_layers(model).items())]

    def cache_nbytes(self, cache) -> dict:
        n = super().cache_nbytes(cache)
        tokens = cache.get_seq_length()
        per_channel = n["data"] / max(1, tokens * self._channels())
        return {**n, "read_per_step": self._read(tokens, per_channel) + n["metadata"]}

    def row_read_per_step(self, n: dict, tokens: int, batch: int, slots: int) -> int:
        """Bytes one row of `tokens` tokens reads per step, in a batch cache of `batch` rows x
        `slots` tokens whose bytes are `n` (the row chooses among its own tokens only)."""
        share = tokens / (batch * slots)
        return self._read(tokens, n["data"] / max(1, batch * slots * self._channels())) + n["metadata"] * share

    def _channels(self) -> int:
        return sum(sum(k) + sum(v) for k, v in self._ranks)

    def _read(self, tokens: int, per_channel: float) -> int:
        """The latents a step reads: the sketch of every key, whole latents of the chosen."""
        read_tokens = min(tokens, self.tokens + self.window)
        sketch = sum(sum(min(r, self.sketch or r) for r in k) for k, _ in self._ranks) * tokens
        return int(round((sketch + self._channels() * read_tokens) * per_channel))

    def summary(self) -> dict:
        return {**super().summary(), "family": "selection", "tokens": self.tokens, "window": self.window}
