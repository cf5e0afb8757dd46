"""KVQuant (Hooper et al., NeurIPS 2024): keys quantised per channel *before* RoPE, values per
token; non-uniform per-layer codebooks fitted on calibration activations (k-means weighted by
the Fisher information of each activation — KVQuant's sensitivity weighting — or plain k-means
as the ablation); dense-and-sparse: the largest-magnitude ~`outlier_fraction` of each vector's
entries kept in fp16 with their indices; the first token (attention sink) kept exact.

    state = fit_kvquant(model, calibration_windows, bits=3)      # palu.calib.kvquant; or a saved folder
    method = KVQuant(state=state); method.install(model)

Per-channel keys use offsets and scales calibrated offline per layer and channel (the central
range between the outlier_fraction / 2 quantiles), so a key is coded without its neighbours
(block 1); values are normalised per token by their non-outlier midpoint and half-range.
Outliers per vector: k = max(1, round(outlier_fraction * head_dim)) when the fraction is > 0
(so ~1% is one entry in 64, 1.6%).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..cache.quant_cache import Schedule
from ..calib.state_folder import load_state, save_state
from ..quant.codecs import KVQuantCodec
from .base import MethodError
from .fitted_state import FittedState
from .quantized_kv import QuantizedKV

WEIGHTINGS = ("fisher", "uniform")
FORMAT = 1


def check_settings(bits, weighting, outlier_fraction) -> None:
    if bits not in (2, 3, 4, 8):
        raise MethodError(f"kvquant bits={bits!r} is not one of [2, 3, 4, 8]")
    if weighting not in WEIGHTINGS:
        raise MethodError(f"kvquant weighting={weighting!r} is not one of {list(WEIGHTINGS)}")
    if not isinstance(outlier_fraction, (int, float)) or not 0 <= outlier_fraction < 0.5:
        raise MethodError(f"kvquant outlier_fraction={outlier_fraction!r} is not in [0, 0.5)")


def outliers_per_vector(fraction: float, head_dim: int) -> int:
    return 0 if fraction == 0 else max(1, round(fraction * head_dim))


def state_tag(bits: int, weighting: str, outlier_fraction: float) -> str:
    return f"kvquant-b{bits}-{weighting}-o{outlier_fraction:g}"


@dataclass
class KVQuantState:
    """What fitting produced: per layer the key / value codebooks (2^bits ascending, in
    normalised units) and the keys' per-channel offsets and scales (H, d)."""
    bits: int
    weighting: str
    outlier_fraction: float
    key_codebooks: torch.Tensor      # (layers, 2^bits)
    value_codebooks: torch.Tensor    # (layers, 2^bits)
    channel_offset: torch.Tensor     # (layers, H, d)
    channel_scale: torch.Tensor      # (layers, H, d)
    info: dict = field(default_factory=dict)   # calibration settings, tokens

    @property
    def tag(self) -> str:
        return state_tag(self.bits, self.weighting, self.outlier_fraction)

    def save(self, path: str | Path) -> None:
        save_state(path, {"key_codebooks": self.key_codebooks, "value_codebooks": self.value_codebooks,
                          "channel_offset": self.channel_offset, "channel_scale": self.channel_scale},
                   {"format": FORMAT, "method": "kvquant", "tag": self.tag, "bits": self.bits,
                    "weighting": self.weighting, "outlier_fraction": self.outlier_fraction, "info": self.info})

    @classmethod
    def load(cls, path: str | Path) -> "KVQuantState":
        manifest, t = load_state(path, "kvquant", FORMAT, "KVQuant state",
                                 "python -m palu.pipeline.cli.fit fitted=kvquant")
        state = cls(manifest["bits"], manifest["weighting"], manifest["outlier_fraction"],
                    t["key_codebooks"], t["value_codebooks"], t["channel_offset"], t["channel_scale"],
                    manifest.get("info", {}))
        state.check(path)
        return state

    def check(self, where) -> None:
        """What the tensors say against what the manifest says: 2^bits entries per codebook, the
        outliers per vector its outlier fraction gives (a 3-bit codebook labelled 2 bits packed 8
        entries into 2 bits and still gave a perplexity)."""
        for name in ("key_codebooks", "value_codebooks"):
            levels = getattr(self, name).shape[-1]
            if levels != 2 ** self.bits:
                raise ValueError(f"KVQuant state {where}: {name} have {levels} entries, a {self.bits}-bit "
                                 f"state has {2 ** self.bits}")
        head_dim = self.channel_offset.shape[-1]
        stored = self.info.get("outliers_per_vector")
        if stored is not None and stored != outliers_per_vector(self.outlier_fraction, head_dim):
            raise ValueError(f"KVQuant state {where}: outlier fraction {self.outlier_fraction} gives "
                             f"{outliers_per_vector(self.outlier_fraction, head_dim)} outliers per vector "
                             f"of {head_dim}, its codebooks were fitted with {stored}")


def _codecs(state: KVQuantState, head_dim: int):
    k = outliers_per_vector(state.outlier_fraction, head_dim)
    keys = KVQuantCodec(state.bits, list(state.key_codebooks), k, per_channel=True, head_dim=head_dim,
                        channel_offset=list(state.channel_offset), channel_scale=list(state.channel_scale))
    values = KVQuantCodec(state.bits, list(state.value_codebooks), k, per_channel=False,
                          head_dim=head_dim)
    return keys, values


@dataclass
class KVQuant(FittedState, QuantizedKV):
    name = "kvquant"
    state_class, state_what = KVQuantState, "KVQuant state"
    padded_batches = True   # a left-padded batch keeps its rows apart (quant_cache: per-row mode)
    pre_rope = True
    state: Any = None          # a fitted KVQuantState, or the folder one was saved to
    sink: int = 1              # first tokens kept exact (the attention sink)
    bits: Optional[int] = None   # from the state; set it to check the state has these bits

    def check(self) -> None:
        if self.state is None:
            raise MethodError("method=kvquant needs method.state=<a fitted KVQuant state folder> "
                              "(python -m palu.pipeline.cli.fit fitted=kvquant) or a KVQuantState")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise MethodError(f"method.sink={self.sink!r} must be a non-negative integer")
        if self.bits is not None:
            check_settings(self.bits, "fisher", 0.0)
            if self.bits != self.loaded.bits:
                raise MethodError(f"method.bits={self.bits} but the KVQuant state {self.state} was "
                                  f"fitted for {self.loaded.bits} bits")
        super().check()

    @property
    def kv_bits(self) -> int:
        return self.loaded.bits

    @property
    def tag(self) -> str:
        return self.loaded.tag + ("" if self.sink == 1 else f"-sink{self.sink}")

    def install(self, model) -> None:
        self.check_state_model(model)
        super().install(model)

    def codecs(self, geom, model):
        s = self.loaded
        if s.channel_offset.shape[:2] != (geom.num_layers, geom.num_kv_heads) or s.channel_offset.shape[2] != geom.head_dim:
            raise ValueError(f"the state was fitted for (layers, kv heads, head_dim) "
                             f"{tuple(s.channel_offset.shape)}, the model has "
                             f"{(geom.num_layers, geom.num_kv_heads, geom.head_dim)}")
        return _codecs(s, geom.head_dim)

    def schedule(self) -> Schedule:
        return Schedule(sink=self.sink)

    def summary(self) -> dict:
        return {**super().summary(), "weighting": self.loaded.weighting,
                "outlier_fraction": self.loaded.outlier_fraction}

    def record(self) -> dict:
        s = self.loaded
        return {"name": self.name, "state": str(self.state) if not isinstance(self.state, KVQuantState) else None,
                "sink": self.sink, "bits": s.bits, "weighting": s.weighting,
                "outlier_fraction": s.outlier_fraction, "info": s.info}
