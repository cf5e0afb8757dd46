"""The codecs of the KV-quantisation baselines (`cache.quant_cache.Codec`): how each stores a
block of keys or values, and the bytes that takes (`nbytes_for`, checked against real caches)."""
from __future__ import annotations

import torch

from ..cache.quant_cache import Codec
from ..decompose.rotation import rotation_matrix
from .codebook import nearest, sphere_coordinate_codebook
from .uniform import dequantize, fake_quantize, quantize
from palu.quant.packed import pack_codes, packed_width, unpack_codes


def _work_dtype(x: torch.Tensor):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class UniformCodec(Codec):
    """Min-max integer codes in groups (`quant/uniform.py`): `axis="channel"` groups `group`
    channels of a token (block 1), `axis="token"` groups `group` tokens of a channel (block =
    group). Metadata: an fp16 scale and minimum per group."""
    dense = True   # a block's codes depend on that block alone (cache/quant_dense.py)

    def __init__(self, bits: int, group: int, axis: str = "channel"):
        self.bits, self.group, self.axis = bits, group, axis
        self.block = group if axis == "token" else 1

    def encode(self, x, layer):
        return quantize(x, self.bits, self.group, self.axis)

    def decode(self, enc, layer, dtype):
        return dequantize(enc, self.bits, self.group, self.axis, dtype)

    def roundtrip(self, x, layer):
        return fake_quantize(x, self.bits, self.group, self.axis)

    def nbytes_for(self, tokens: int, B: int, H: int, d: int) -> dict:
        groups = tokens * d // self.group
        return {"quantised": B * H * tokens * packed_width(d, self.bits), "metadata": B * H * groups * 2 * 2}


class TurboCodec(Codec):
    """TurboQuant (MSE variant): each head vector's fp16 norm, then the unit vector rotated by a
    randomised Hadamard transform (random signs, then a normalised Hadamard matrix; seeded per
    layer) and each coordinate coded by a Lloyd-Max codebook for the coordinate distribution of a
    uniformly random unit vector in R^d. No data-dependent calibration."""
    dense = True   # per-token codes

    def __init__(self, bits: int, head_dim: int, num_layers: int, seed: int = 0):
        self.bits, self.d = bits, head_dim
        R, how = rotation_matrix("hadamard", head_dim, seed)   # a random orthogonal if no Hadamard
        self.rotation_kind = how
        self.H = R
        g = torch.Generator().manual_seed(seed)
        self.signs = [torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1
                      for _ in range(num_layers)]
        self.codebook = sphere_coordinate_codebook(head_dim, bits).float()

    def _rotation(self, layer, x):
        # D H: x -> x @ (D H); float64 for float64 models (the equivalence tests), else float32.
        # Kept per device and dtype: a copy from the host each call cannot be captured in a CUDA
        # graph (the quantised caches' replayed decode steps) and waits for the device
        return self._on(("rotation", layer), lambda: self.signs[layer][:, None] * self.H, x.device, x.dtype)

    def _on(self, key, make, device, dtype):
        memo = self.__dict__.setdefault("_device_copies", {})
        if (key, device, dtype) not in memo:
            memo[(key, device, dtype)] = make().to(device, dtype)
        return memo[(key, device, dtype)]

    def _codes(self, x, layer):
        """Each head vector's codebook indices (uint8) and fp16 norm."""
        xf = x.to(_work_dtype(x))
        norm = xf.norm(dim=-1, keepdim=True)
        y = (xf / norm.clamp_min(1e-30)) @ self._rotation(layer, xf)
        codebook = self._on("codebook", lambda: self.codebook, y.device, y.dtype)
        return nearest(y, codebook), norm.half()

    def _vectors(self, codes, norm, layer, dtype):
        """`_codes` undone: the head vectors in `dtype`."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        codebook = self._on("codebook", lambda: self.codebook, codes.device, work)
        y = codebook[codes.long()]
        u = y @ self._rotation(layer, y).T
        return (u * norm.to(work)).to(dtype)

    def encode(self, x, layer):
        codes, norm = self._codes(x, layer)
        return {"codes": pack_codes(codes, self.bits), "norm": norm}

    def decode(self, enc, layer, dtype):
        return self._vectors(unpack_codes(enc["codes"], self.bits, self.d), enc["norm"], layer, dtype)

    def roundtrip(self, x, layer):
        """`decode(encode(x))` without packing the codes and unpacking them (lossless both ways):
        the same values bit for bit in 36 leaf torch ops where there were 175 (3 bits, CPU
        profiler). A replayed decode step codes each due token's keys and values this way, and
        TurboQuant-3's step was 16.8 ms in 6,141 kernels at 64 x 4K on an H100, Atom's 8.3 ms in
        2,901 (session 49, before this; not timed since)."""
        return self._vectors(*self._codes(x, layer), layer, x.dtype)

    def layer_metadata_nbytes(self, layer):
        return self.d + 2 * self.codebook.numel()   # int8 signs and an fp16 codebook per layer

    def nbytes_for(self, tokens, B, H, d):
        return {"quantised": B * H * tokens * packed_width(d, self.bits), "metadata": B * H * tokens * 2}


def top_outliers(z: torch.Tensor, k: int):
    """Indices (uint8) of the k largest |z| per vector (last axis), and z with them zeroed."""
    if k == 0:
        return None, z
    idx = z.abs().topk(k, dim=-1).indices
    return idx, z.scatter(-1, idx, 0.0)


class KVQuantCodec(Codec):
    """KVQuant's dense-and-sparse non-uniform codes. Per vector (one head of one token) the k
    largest-magnitude normalised entries are kept exactly (fp16 value + uint8 index); the others
    are normalised and coded by a per-layer codebook (`codebooks[layer]`, 2^bits levels in
    [-1, 1]-normalised units, fitted on calibration activations: `methods/kvquant.py`).

    keys (`per_channel=True`): normalised per channel by calibrated offsets and scales
    (`channel_offset` / `channel_scale` [layer] (H, d)), before RoPE. values: normalised per token
    by the non-outlier entries' midpoint and half-range (fp16 each, stored per vector)."""

    def __init__(self, bits, codebooks, outliers: int, per_channel: bool, head_dim: int,
                 channel_offset=None, channel_scale=None):
        self.bits, self.codebooks, self.k, self.d = bits, codebooks, outliers, head_dim
        self.per_channel, self.offset, self.scale = per_channel, channel_offset, channel_scale

    def normalise(self, x, layer):
        """x in the codebook's units, and the per-vector metadata that normalisation stored."""
        xf = x.float()
        if self.per_channel:
            off = self.offset[layer].to(x.device)[None, :, None, :]
            sc = self.scale[layer].to(x.device)[None, :, None, :]
            return (xf - off) / sc, {}
        idx, rest = top_outliers(xf, self.k)
        if idx is None:
            lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
        else:
            kept = torch.ones_like(xf, dtype=torch.bool).scatter(-1, idx, False)
            lo = torch.where(kept, xf, torch.full_like(xf, float("inf"))).amin(-1, keepdim=True)
            hi = torch.where(kept, xf, torch.full_like(xf, -float("inf"))).amax(-1, keepdim=True)
        off = ((hi + lo) / 2).half()
        sc = ((hi - lo) / 2).clamp_min(2.0 ** -14).half()
        return (xf - off.float()) / sc.float(), {"offset": off, "scale": sc}

    def encode(self, x, layer):
        z, meta = self.normalise(x, layer)
        idx, dense = top_outliers(z, self.k)
        codes = nearest(dense, self.codebooks[layer])
        out = {"codes": pack_codes(codes, self.bits), **meta}
        if idx is not None:
            out["outlier_value"] = x.gather(-1, idx).half()
            out["outlier_index"] = idx.to(torch.uint8)
        return out

    def decode(self, enc, layer, dtype):
        z = self.codebooks[layer].to(enc["codes"].device).float()[unpack_codes(enc["codes"], self.bits, self.d).long()]
        if self.per_channel:
            x = z * self.scale[layer].to(z.device)[None, :, None, :] + self.offset[layer].to(z.device)[None, :, None, :]
        else:
            x = z * enc["scale"].float() + enc["offset"].float()
        if "outlier_index" in enc:
            x = x.scatter(-1, enc["outlier_index"].long(), enc["outlier_value"].float())
        return x.to(dtype)

    def layer_metadata_nbytes(self, layer):
        per_layer = 2 * self.codebooks[layer].numel()                      # fp16 codebook
        if self.per_channel:
            per_layer += 2 * 2 * self.offset[layer].numel()                # fp16 offset + scale
        return per_layer

    def nbytes_for(self, tokens, B, H, d):
        vectors = B * H * tokens
        meta = vectors * self.k * (2 + 1) + (0 if self.per_channel else vectors * 2 * 2)
        return {"quantised": vectors * packed_width(d, self.bits), "metadata": meta}
