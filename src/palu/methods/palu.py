"""Palu (Chang et al., ICLR 2025): K/V projections factorised offline; the cache holds the
low-rank latents (optionally quantised per token and group), never the full keys and values.

The factors come from a compressed checkpoint (`palu.compress(...).save(path)` or the pipeline's
decompose step); `latent_bits` 8 / 4 / 3 / 2 stores the latents packed with fp16 scales and zero
points, exactly as `palu.LatentCache(model, bits=...)` does during generation. (`latent_bits`, not
`bits`: a quantiser's `bits` is its code width; Palu's latents may be unquantised (16) or take the
checkpoint's per-layer widths ("alloc"). README, "One word per meaning of bits".)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..cache.latent_cache import LatentCache
from ..decompose.checkpoint import load_compressed, read_manifest
from ..decompose.lineage import lineage_of
from .base import CacheMethod, MethodError

LATENT_BITS = (16, 8, 4, 3, 2)   # 16: latents kept in the model's dtype; 3: torch path (no kernels)
ALLOCATED = "alloc"       # latent_bits: the per-layer widths of the checkpoint's (rank, bits) allocation


def latent_bits_tag(latent_bits: int | str) -> str:
    """The suffix a latent width adds to a checkpoint's tag ('' for unquantised latents)."""
    if latent_bits == ALLOCATED:
        return f"-b{ALLOCATED}"
    return "" if int(latent_bits) == 16 else f"-b{latent_bits}"


@dataclass
class Palu(CacheMethod):
    name = "palu"
    padded_batches = True   # latents coded per token and group: a pad token codes only itself
    renamed = {"bits": "latent_bits"}   # refused by build_method, naming the new key
    checkpoint: Optional[str] = None     # compressed checkpoint folder
    latent_bits: int | str = 16          # latent storage: 16 (model dtype), 8 / 4 / 3 / 2-bit, or
                                         # "alloc": the checkpoint's per-layer widths
    channel_group: Optional[int] = None  # latent channels per scale; None: one scale per group
    _manifest: dict = field(default=None, init=False, repr=False, compare=False)

    def check(self) -> None:
        if self.latent_bits not in LATENT_BITS and self.latent_bits != ALLOCATED:
            raise MethodError(f"method.latent_bits={self.latent_bits!r} is not one of {list(LATENT_BITS)} "
                              f"or {ALLOCATED!r}")
        if self.channel_group is not None and (self.latent_bits in (16, ALLOCATED)
                                               or not isinstance(self.channel_group, int)
                                               or self.channel_group <= 0):
            raise MethodError(f"method.channel_group={self.channel_group!r} needs quantised latents "
                              "(latent_bits < 16) and a positive number of channels")
        if not self.checkpoint:
            raise MethodError("method=palu needs method.checkpoint=<compressed checkpoint folder>")

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            self._manifest = read_manifest(self.checkpoint)
        return self._manifest

    @property
    def tag(self) -> str:
        return (self.manifest["tag"] + latent_bits_tag(self.latent_bits)
                + ("" if self.channel_group is None else f"-cg{self.channel_group}") + self.method_suffix)

    @property
    def method_suffix(self) -> str:
        """What a method built on Palu's latents adds to the tag, from its own fields only (so a
        grid names the run before the checkpoint exists): palu_select, palu_snapkv."""
        return ""

    def lineage(self) -> tuple[str, ...]:
        return lineage_of(self.manifest)

    def inputs(self) -> dict[str, str]:
        return {"checkpoint": str(self.checkpoint)}

    def layer_bits(self) -> list[int]:
        """The latent width of every layer (16: the model's dtype)."""
        allocation = self.manifest["allocation"]
        layers = 1 + max(r["layer"] for r in allocation["ranks"])
        if self.latent_bits != ALLOCATED:
            return [int(self.latent_bits)] * layers
        if "bits" not in allocation:
            raise MethodError(f"method.latent_bits={ALLOCATED!r} needs a checkpoint whose allocation chose "
                              f"widths (rank method error_aware_bytes); {self.checkpoint} has "
                              f"{allocation['method']!r} ranks: pass a number")
        return [int(b) for b in allocation["bits"]]

    def install(self, model) -> None:
        self._manifest = load_compressed(model, self.checkpoint)
        self.layer_bits()    # a bad latent_bits setting fails before any evaluation
        # without its cache the model would run unquantised latents, or no eviction / selection,
        # under this method's name (issue 51, item 3): such a forward is refused by the layers
        if self.latent_bits != 16 or not self.one_pass:
            from ..cache.protocol import palu_layers
            why = (f"{self.tag} stores {self.latent_bits}-bit latents" if self.one_pass else
                   f"{self.tag} evicts or selects tokens through its cache")
            for layer in palu_layers(model).values():
                layer.requires_cache = why

    def make_cache(self, model):
        widths = self.layer_bits()
        return LatentCache(model, bits=widths, channel_group=self.channel_group,
                           evicts=hasattr(self, "eviction"))

    def cache_nbytes(self, cache) -> dict:
        n = cache.nbytes()
        if self.latent_bits != ALLOCATED:
            return {"data": n["latents"], "metadata": n["scales"] + n["positions"], "total": n["total"],
                    "packed": self.latent_bits != 16}
        # mixed widths: layers kept in the model's dtype count as full precision (fp16 in the
        # tables), packed layers as stored
        plain = sum(layer.nbytes()["latents"] for layer in cache.layers if layer.bits == 16)
        return {"data": n["latents"] - plain, "metadata": n["scales"] + n["positions"],
                "full_precision": plain, "total": n["total"], "packed": True}

    def summary(self) -> dict:
        from ..decompose.bit_alloc import byte_ratio
        allocation = self.manifest["allocation"]
        groups = len({r["group"] for r in allocation["ranks"]})
        widths = self.layer_bits()
        kv_bits = self.latent_bits
        if self.latent_bits == ALLOCATED:   # the mean width of the kept latents
            kv_bits = round(sum(r["rank"] * widths[r["layer"]] for r in allocation["ranks"])
                            / allocation["latent_size"], 3)
        budget = allocation.get("byte_budget")
        # installed: group size and kept ratio from the factors in the model (load_compressed)
        return {**self.manifest["summary"], **self.manifest.get("installed", {}), "kv_bits": kv_bits,
                "num_kv_heads": groups * allocation["group_size"],
                # what a byte_budget table pairs rows by: the budget, or these ranks' bytes
                "byte_ratio_target": (budget["ratio_target"] if budget and self.latent_bits == ALLOCATED
                                      else round(byte_ratio(allocation, widths), 5))}

    def record(self) -> dict:
        return {"name": self.name, "checkpoint": self.checkpoint, "latent_bits": self.latent_bits,
                "channel_group": self.channel_group, "manifest": self.manifest}
