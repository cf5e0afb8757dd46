"""Palu (Chang et al., ICLR 2025): K/V projections factorised offline; the cache holds the
low-rank latents (optionally quantised per token and group), never the full keys and values.

The factors come from a compressed checkpoint (`palu.compress(...).save(path)` or the pipeline's
decompose step); `bits` 8 / 4 / 3 / 2 stores the latents packed with fp16 scales and zero points,
exactly as `palu.LatentCache(model, bits=...)` does during generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..cache.latent_cache import LatentCache
from ..decompose.checkpoint import load_compressed, read_manifest
from .base import CacheMethod, MethodError

BITS = (16, 8, 4, 3, 2)   # 16: latents kept in the model's dtype; 3: torch path (no kernels)


def bits_tag(bits: int) -> str:
    """The suffix a latent bit width adds to a checkpoint's tag ('' for unquantised latents)."""
    return "" if int(bits) == 16 else f"-b{bits}"


@dataclass
class Palu(CacheMethod):
    name = "palu"
    checkpoint: Optional[str] = None     # compressed checkpoint folder
    bits: int = 16                       # latent storage: 16 (model dtype) or 8 / 4 / 3 / 2-bit
    channel_group: Optional[int] = None  # latent channels per scale; None: one scale per group
    _manifest: dict = field(default=None, init=False, repr=False, compare=False)

    def check(self) -> None:
        if self.bits not in BITS:
            raise MethodError(f"method.bits={self.bits!r} is not one of {list(BITS)}")
        if self.channel_group is not None and (self.bits == 16 or not isinstance(self.channel_group, int)
                                               or self.channel_group <= 0):
            raise MethodError(f"method.channel_group={self.channel_group!r} needs quantised latents "
                              "(bits < 16) and a positive number of channels")
        if not self.checkpoint:
            raise MethodError("method=palu needs method.checkpoint=<compressed checkpoint folder>")

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            self._manifest = read_manifest(self.checkpoint)
        return self._manifest

    @property
    def tag(self) -> str:
        return (self.manifest["tag"] + bits_tag(self.bits)
                + ("" if self.channel_group is None else f"-cg{self.channel_group}"))

    def lineage(self) -> tuple[str, ...]:
        from ..pipeline.naming import lineage_of   # naming imports this module
        return lineage_of(self.manifest)

    def inputs(self) -> dict[str, str]:
        return {"checkpoint": str(self.checkpoint)}

    def install(self, model) -> None:
        self._manifest = load_compressed(model, self.checkpoint)

    def make_cache(self, model):
        return LatentCache(model, bits=None if self.bits == 16 else self.bits,
                           channel_group=self.channel_group)

    def cache_nbytes(self, cache) -> dict:
        n = cache.nbytes()
        return {"data": n["latents"], "metadata": n["scales"] + n["positions"], "total": n["total"],
                "packed": self.bits != 16}

    def summary(self) -> dict:
        allocation = self.manifest["allocation"]
        groups = len({r["group"] for r in allocation["ranks"]})
        return {**self.manifest["summary"], "kv_bits": self.bits,
                "num_kv_heads": groups * allocation["group_size"]}

    def record(self) -> dict:
        return {"name": self.name, "checkpoint": self.checkpoint, "bits": self.bits,
                "channel_group": self.channel_group, "manifest": self.manifest}
