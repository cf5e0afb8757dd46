"""What the full-K/V quantisation baselines share (Atom, KIVI, TurboQuant, KVQuant): their
attention (`attention/kv_attention.py`) is installed in every layer and reads a `QuantKVCache`
built from the method's key and value codecs and schedule. A subclass names its codecs.

Bytes: `cache_nbytes` counts a real cache's tensors; `expected_nbytes` is the same count from
the formula (tests check one against the other)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..cache.quant_cache import QuantKVCache, Schedule
from ..models.adapters import adapter_for, check_rope, geometry_of, rotary_for
from .base import CacheMethod, MethodError


@dataclass
class QuantizedKV(CacheMethod):
    pre_rope: ClassVar[bool] = False   # keys stored before RoPE (and rotated when read)
    BITS: ClassVar[tuple[int, ...]] = (2, 3, 4, 8)
    bits: int = 4
    _built: tuple = field(default=None, init=False, repr=False, compare=False)

    @property
    def kv_bits(self) -> int:
        """The bit width the codes are stored at (KVQuant: its fitted state's)."""
        return self.bits

    def check(self) -> None:
        if self.kv_bits not in self.BITS:
            raise MethodError(f"method.bits={self.kv_bits!r} is not one of {list(self.BITS)} for "
                              f"{self.name}")

    # ---- what a subclass defines ---------------------------------------------------------------
    def codecs(self, geom, model) -> tuple:
        """(key codec, value codec) for a model of geometry `geom`."""
        raise NotImplementedError

    def schedule(self) -> Schedule:
        return Schedule()

    # ---- the contract ----------------------------------------------------------------------------
    def install(self, model) -> None:
        from ..attention.kv_attention import QuantKVAttention
        adapter, geom = adapter_for(model.config), geometry_of(model.config)
        if self.pre_rope:          # keys rotated when read (KVQuant): models/adapters.py
            check_rope(model.config, f"{self.name} (pre-RoPE keys)")
        try:
            key_codec, value_codec = self.codecs(geom, model)
        except ValueError as e:
            raise MethodError(f"{self.name}: {e}") from None
        for i, layer in enumerate(adapter.layers(model)):
            attn = adapter.attention(layer)
            if getattr(attn, "quantises_kv", False) or getattr(attn, "stores_latents", False):
                raise ValueError(f"the model's attention is already replaced "
                                 f"({type(attn).__name__}); install {self.name} on a fresh model")
            layer.self_attn = QuantKVAttention(attn, adapter, geom, self, rotary=rotary_for(model, i))
        self._built = (geom, key_codec, value_codec)

    def _parts(self):
        if self._built is None:
            raise RuntimeError(f"method {self.name}: install(model) before making caches")
        return self._built

    def make_cache_for(self, num_layers: int) -> QuantKVCache:
        _, key_codec, value_codec = self._parts()
        return QuantKVCache(key_codec, value_codec, self.schedule(), num_layers,
                            keep_positions=self.pre_rope, owner=self.tag,
                            evicts=getattr(self, "eviction", None) is not None)

    def make_cache(self, model):
        return self.make_cache_for(model.config.num_hidden_layers)

    def cache_nbytes(self, cache) -> dict:
        n = cache.nbytes()
        return {"data": n["quantised"], "metadata": n["metadata"] + n["positions"],
                "full_precision": n["full_precision"], "total": n["total"], "packed": True,
                "fixed": n["fixed"]}

    def expected_nbytes(self, tokens: int, batch: int = 1, element_size: int = 2) -> dict:
        """`cache_nbytes` of a cache holding `tokens` tokens, from the formula."""
        geom, key_codec, value_codec = self._parts()
        sched, H, d = self.schedule(), geom.num_kv_heads, geom.head_dim
        out = {"data": 0, "metadata": 0, "full_precision": 0, "fixed": 0}
        for codec in (key_codec, value_codec):
            quantised = sched.coded(tokens, codec.block)
            part = codec.nbytes_for(quantised, batch, H, d)
            fixed = sum(codec.layer_metadata_nbytes(i) for i in range(geom.num_layers))
            out["data"] += part["quantised"] * geom.num_layers
            out["metadata"] += part["metadata"] * geom.num_layers + fixed
            out["fixed"] += fixed
            out["full_precision"] += (tokens - quantised) * batch * H * d * element_size * geom.num_layers
        if self.pre_rope:
            out["metadata"] += batch * tokens * 4 * geom.num_layers   # int32 positions
        out["total"] = out["data"] + out["metadata"] + out["full_precision"]
        out["packed"] = True
        return out

    def summary(self) -> dict:
        return {"kv_bits": self.kv_bits, "family": self.name}
