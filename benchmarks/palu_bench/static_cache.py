"""The benchmark decoder's preallocated latent cache for CUDA-graph decoding (fp16 or packed 2/4/8-bit latents).

`LatentCache` (the transformers-facing cache) appends into buffers that grow as tokens arrive and
quantises each new token with torch ops, so its tensors change between steps and a decode step
cannot be captured in a CUDA graph. This cache allocates `max_tokens` once, in the layout the kernels read
(`src/palu/quant/packed.py`: [batch, groups, tokens, rank], packed along the rank when quantised), and
each step writes the new token's latents in place (quantised on the fly) at a fixed slot, so a
decode step is a static graph. Positions are contiguous (token i is at position i).
"""
from __future__ import annotations

import os

import torch

from palu.cache.slots import slot_buffer, slot_nbytes, slot_range
from palu.quant.packed import KERNEL_BITS, QuantLatent, quantize_latent
from palu_kernels.quantize import quantize_into


class StaticLatentCache:
    """Per layer: key latents [B, G, max_tokens, rank_k] and value latents (rank_v), fp16 or packed."""

    def __init__(self, layers: int, batch: int, groups: int, max_tokens: int, rank_k: int,
                 rank_v: int, bits: int = 16, device="cpu", dtype=torch.float16):
        if bits != 16 and bits not in KERNEL_BITS:   # the kernels read it in place
            raise ValueError(f"bits={bits} must be 16 (no quantisation) or one of {KERNEL_BITS}")
        for name, value in (("layers", layers), ("batch", batch), ("groups", groups),
                            ("max_tokens", max_tokens), ("rank_k", rank_k), ("rank_v", rank_v)):
            if value < 1:
                raise ValueError(f"{name}={value} must be positive")
        self.bits, self.max_tokens, self.groups = bits, max_tokens, groups
        self.keys = [slot_buffer(batch, groups, max_tokens, rank_k, bits, device, dtype) for _ in range(layers)]
        self.values = [slot_buffer(batch, groups, max_tokens, rank_v, bits, device, dtype) for _ in range(layers)]

    def write(self, layer: int, hk: torch.Tensor, hv: torch.Tensor, start: int) -> None:
        """Store latents hk [B, G, n, rank_k], hv [B, G, n, rank_v] at tokens start .. start+n-1."""
        n = hk.shape[2]
        if start < 0 or start + n > self.max_tokens:
            raise ValueError(f"tokens {start}..{start + n - 1} do not fit a cache of {self.max_tokens}")
        for buf, h in ((self.keys[layer], hk), (self.values[layer], hv)):
            dst = slot_range(buf, start, start + n)
            if self.bits == 16:
                dst.copy_(h)
            elif h.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
                quantize_into(h, buf, start)      # one launch (torch: ~20 small kernels)
            else:
                q = quantize_latent(h, self.bits)
                dst.data.copy_(q.data)
                dst.scale.copy_(q.scale)
                dst.zero.copy_(q.zero)

    def read(self, layer: int, length: int):
        """The first `length` tokens of a layer as kernel inputs (views, no copy)."""
        if not 0 < length <= self.max_tokens:
            raise ValueError(f"length={length} outside 1..{self.max_tokens}")
        return slot_range(self.keys[layer], 0, length), slot_range(self.values[layer], 0, length)

    def fill_random(self, seed: int = 0) -> None:
        """Random contents (latency benchmarks: decode time does not depend on the values)."""
        gen = torch.Generator(device=self._device()).manual_seed(seed)
        for buf in self.keys + self.values:
            if isinstance(buf, QuantLatent):
                buf.data.random_(0, 256, generator=gen)
                buf.scale.uniform_(0.01, 0.1, generator=gen)
                buf.zero.random_(0, 2 ** buf.bits, generator=gen)
            else:
                buf.normal_(generator=gen)

    def _device(self):
        buf = self.keys[0]
        return (buf.data if isinstance(buf, QuantLatent) else buf).device

    def nbytes(self) -> int:
        """Bytes held (packed data, scales and zero points included)."""
        return sum(slot_nbytes(b) for b in self.keys + self.values)
