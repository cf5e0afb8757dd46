"""A preallocated latent cache for transformers that a CUDA graph can capture.

`LatentCache` grows its buffers and decides things on the host as tokens arrive (buffer room,
position contiguity), so every decode step runs eagerly: at 7B shapes a Palu layer costs ~1.5 ms
of Python per token (measured; benchmarks/NOTES.md). `GraphLatentCache` allocates `max_tokens`
slots per layer once, in the kernels' layout (`src/palu/quant/packed.py`: [batch, groups, tokens, rank],
packed along the rank when quantised), and writes token i at slot i with device-side indices
(`position_ids`). Nothing it does in a one-token step reads a device value on the host, so
`palu.graph_decoding.GraphDecoder` captures the whole model step as one CUDA graph and replays it.

The kernels read the first `view_tokens` slots (a host number fixed per captured graph, rounded
up from the real length by the decoder) and mask by `lengths` (device, = last position + 1).
Rows of a batch are aligned: every row holds positions 0 .. n-1 (no left padding). Eager use
(prefill, CPU, the torch path) works like any cache; the positions are then checked.
"""
from __future__ import annotations

import os

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from palu.quant.packed import (KERNEL_BITS, UNQUANTISED, QuantLatent, dequantize_latent, pack_unit,
                               quantize_latent)
from ..models.adapters import sliding_window_of
from .protocol import causal_mask, check_latent_model
from .slots import slot_buffer, slot_nbytes, slot_range, slot_rows


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class GraphLatentLayer(CacheLayerMixin):
    """One layer's latents: keys [B, G, max_tokens, rank_k], values (rank_v), fp16 or packed."""

    is_compileable = True

    def __init__(self, cache: "GraphLatentCache", groups: int, rank_k: int, rank_v: int, dtype, device):
        super().__init__()
        self.cache, self.groups = cache, groups
        B, n, bits = cache.batch, cache.max_tokens, cache.bits
        self.keys = slot_buffer(B, groups, n, rank_k, bits, device, dtype)
        self.values = slot_buffer(B, groups, n, rank_v, bits, device, dtype)
        self.dtype, self.device, self.is_initialized = dtype, torch.device(device), True

    def lazy_initialization(self, key_states, value_states) -> None:   # allocated up front
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("GraphLatentCache stores Palu latents (PaluAttention calls update_latent); "
                        "a model without Palu attention needs a dense cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_max_length(self) -> int:
        return self.cache.max_tokens

    def reset(self) -> None:
        for buf in (self.keys, self.values):
            for t in ((buf.data, buf.scale, buf.zero) if isinstance(buf, QuantLatent) else (buf,)):
                t.zero_()

    def write(self, hk: torch.Tensor, hv: torch.Tensor, slots: torch.Tensor, per_row: bool = False) -> None:
        """Latents hk (B, T, G*rank_k), hv (B, T, G*rank_v) to the contiguous slots
        slots[0] .. slots[0]+T-1 (`slots`: a device tensor of T positions); `per_row`: one token
        a row, row b's at slot slots[b] (a ragged batch, `GraphLatentCache.set_row_lengths`)."""
        B, T, _ = hk.shape
        for buf, h in ((self.keys, hk), (self.values, hv)):
            h = h.view(B, T, self.groups, -1).transpose(1, 2)              # (B, G, T, r)
            if per_row and isinstance(buf, QuantLatent) and (h.device.type == "cuda" or _interpreting()):
                from palu_kernels.quantize import quantize_into   # one launch, each row at its slot
                quantize_into(h, buf, slots, per_row=True)
            elif per_row:   # torch quantisation (bit for bit the kernel's), scattered row by row
                rows = torch.arange(B, device=h.device)
                pairs = ((buf, h.to(buf.dtype)),) if not isinstance(buf, QuantLatent) else \
                    ((dst, src) for dst, src in zip((buf.data, buf.scale, buf.zero),
                                                    _parts(quantize_latent(h, buf.bits))))
                for dst, src in pairs:
                    dst[rows, :, slots] = src[:, :, 0]
            elif not isinstance(buf, QuantLatent):
                buf.index_copy_(2, slots, h.to(buf.dtype))
            elif h.device.type == "cuda" or _interpreting():
                from palu_kernels.quantize import quantize_into   # imports triton: only where it runs
                quantize_into(h, buf, slots[:1])
            else:   # CPU without the interpreter: torch quantisation, same bytes
                q = quantize_latent(h, buf.bits)
                for dst, src in ((buf.data, q.data), (buf.scale, q.scale), (buf.zero, q.zero)):
                    dst.index_copy_(2, slots, src)

    def view(self, tokens: int):
        """The first `tokens` slots of keys and values (views, no copy)."""
        return slot_range(self.keys, 0, tokens), slot_range(self.values, 0, tokens)


def _parts(q: QuantLatent):
    return q.data, q.scale, q.zero


class _StoredSlots:
    """A GraphLatentCache layer after a step stored its latents (`StoredLatents`): `S` slots,
    masked by the cache's device-side lengths, so nothing reads a device value on the host."""

    cached = True
    kernel_layout = True

    def __init__(self, cache: "GraphLatentCache", layer_idx: int, S: int, device):
        self.cache, self.layer_idx, self.S = cache, layer_idx, S
        self.bits = cache.bits
        self._positions = torch.arange(S, device=device)[None]

    @property
    def positions(self):
        return self._positions

    def mask(self, attention_mask, T: int):
        if T == 1:   # slots past the row's length hold stale or no tokens
            return (self._positions < self.cache.lengths[:, None].to(self._positions.dtype))[:, None, None, :]
        return causal_mask(attention_mask, T, self.S, self._positions.device)

    def kernel_mask(self, attention_mask, T: int):
        return None   # the kernels mask by `lengths` themselves

    def latents(self, dtype):
        return self.cache.latents(self.layer_idx, self.S, dtype)

    def kernel_latents(self, groups: int):
        return self.cache.kernel_latents(self.layer_idx, self.S)

    def kernel_positions(self) -> dict:
        return {"lengths": self.cache.lengths, "position_offset": self.cache.offsets}


class GraphLatentCache(Cache):
    """Latents of every Palu layer of `model` in preallocated slots (`max_tokens` per row).

    `bits` 16 keeps the latents in the model's dtype; 2, 4 or 8 stores them packed with fp16
    scales and zero points per token and group. Every layer's groups need one key rank and one
    value rank (the kernels' layout; uniform allocations have them).
    """

    @staticmethod
    def unsupported(model, bits: int = UNQUANTISED) -> str | None:
        """Why a GraphLatentCache cannot hold `model`'s latents at `bits`, or None."""
        if bits != UNQUANTISED and bits not in KERNEL_BITS:
            return (f"bits={bits!r} is not one of {KERNEL_BITS} (or {UNQUANTISED}: unquantised); "
                    "3-bit latents: use palu.LatentCache (torch path)")
        modules = check_latent_model(model, "GraphLatentCache")
        window = sliding_window_of(model.config)
        if window is not None:
            # its decode mask is the row's length alone: a window would be silently ignored
            return (f"GraphLatentCache has no sliding-window attention (the model's window is {window} "
                    "tokens); use palu.LatentCache")
        for i in sorted(modules):
            for name, ranks in (("key", modules[i].ranks_k), ("value", modules[i].ranks_v)):
                if len(set(ranks)) != 1:
                    return (f"layer {i}: {name} ranks differ between groups ({list(ranks)}); "
                            "GraphLatentCache needs one rank per layer (use LatentCache)")
                if bits != UNQUANTISED and ranks[0] % pack_unit(bits):
                    return (f"layer {i}: {name} rank {ranks[0]} is not a multiple of {pack_unit(bits)}, "
                            f"so its {bits}-bit latents are padded; the kernels read unpadded ones "
                            "(use LatentCache)")
        return None

    def __init__(self, model, max_tokens: int, batch: int = 1, bits: int = UNQUANTISED):
        for name, value in (("max_tokens", max_tokens), ("batch", batch)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        why = self.unsupported(model, bits)
        if why is not None:
            raise ValueError(why)
        modules = check_latent_model(model, "GraphLatentCache")
        n_layers = model.config.num_hidden_layers
        self.max_tokens, self.batch, self.bits = max_tokens, batch, bits
        self.seen = 0              # tokens stored (host): advanced by eager steps, set by GraphDecoder
        self.view_tokens: int | None = None   # slots the kernels read while a graph is captured
        layers = []
        for i in range(n_layers):
            attn = modules[i]
            layers.append(GraphLatentLayer(self, attn.n_groups, attn.ranks_k[0], attn.ranks_v[0],
                                           attn.A_k.dtype, attn.A_k.device))
        super().__init__(layers=layers)
        device = attn.A_k.device
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)    # last position + 1
        self.offsets = torch.zeros(batch, dtype=torch.int32, device=device)    # slot i = position i
        # after a right-padded prefill (`set_row_lengths`) each row holds its own number of tokens
        # and a one-token step writes each row's token at that row's next slot
        self.ragged = False

    def set_row_lengths(self, lengths: torch.Tensor) -> None:
        """After a right-padded prefill: row b holds its `lengths[b]` tokens at slots 0, 1, ... (its
        pads after them, never read: every row is masked by its length). Each later step then
        takes one token a row, at that row's position = its length (`positions` (B, 1))."""
        lengths = torch.as_tensor(lengths, device=self.lengths.device).to(self.lengths.dtype)
        if tuple(lengths.shape) != (self.batch,):
            raise ValueError(f"lengths of shape {tuple(lengths.shape)}, expected ({self.batch},)")
        if not self.seen or bool((lengths < 1).any()) or bool((lengths > self.seen).any()):
            raise ValueError(f"row lengths {lengths.tolist()} must lie in 1..{self.seen} (the tokens "
                             "prefilled); prefill the right-padded batch first")
        self.lengths.copy_(lengths)
        self.ragged = True

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (a device index, in order): the rows that ended leave.
        Graphs captured before read the old buffers: capture again."""
        for layer in self.layers:
            layer.keys, layer.values = slot_rows(layer.keys, rows), slot_rows(layer.values, rows)
        self.lengths, self.offsets = self.lengths[rows], self.offsets[rows]
        self.batch = len(rows)

    def update_latent(self, hk: torch.Tensor, hv: torch.Tensor, positions: torch.Tensor,
                      layer_idx: int) -> int:
        """Store latents (B, T, R) at slots positions[0] .. (`positions`: (B or 1, T), the same
        in every row); return the number of slots the attention reads this step."""
        B, T, _ = hk.shape
        if B != self.batch:
            raise ValueError(f"batch {B} != the cache's batch {self.batch}")
        capturing = _capturing()
        if layer_idx == 0:
            if not capturing and self.view_tokens is None:
                self._check_positions(positions, T)
            self.lengths.copy_((positions[:, -1] + 1).expand(B).to(self.lengths.dtype))
        self.layers[layer_idx].write(hk, hv, positions[:, 0] if self.ragged else positions[0],
                                     per_row=self.ragged)
        if self.view_tokens is not None:
            return self.view_tokens
        if capturing:
            raise RuntimeError("GraphLatentCache: set view_tokens before capturing a CUDA graph "
                               "(GraphDecoder does)")
        tokens = self.seen + T
        if layer_idx == len(self.layers) - 1:
            self.seen = tokens
        return tokens

    def store_latents(self, layer_idx: int, hk, hv, positions, ranks=None) -> _StoredSlots:
        """The `LatentStore` protocol (token i at slot i; positions None continue after `seen`)."""
        if positions is None:
            positions = torch.arange(self.seen, self.seen + hk.shape[1], device=hk.device)[None]
        S = self.update_latent(hk, hv, positions, layer_idx)
        return _StoredSlots(self, layer_idx, S, hk.device)

    def _check_positions(self, positions: torch.Tensor, T: int) -> None:
        """Eager steps only (a host sync): slots seen .. seen+T-1 in every row (ragged: one token
        a row, at the row's length)."""
        if self.seen + T > self.max_tokens:
            raise ValueError(f"{self.seen} cached + {T} new tokens exceed max_tokens={self.max_tokens}")
        if self.ragged:
            if T != 1 or positions.shape[0] != self.batch or \
                    not bool((positions[:, 0] == self.lengths.to(positions.dtype)).all()):
                raise ValueError("a ragged GraphLatentCache takes one token a row at the row's "
                                 f"length ({self.lengths.tolist()}); got positions {positions.tolist()}")
            return
        want = torch.arange(self.seen, self.seen + T, device=positions.device)
        if positions.shape[-1] != T or not bool((positions == want).all()):
            raise ValueError(f"GraphLatentCache stores token i at slot i: positions must be "
                             f"{self.seen}..{self.seen + T - 1} in every row (no left padding); got "
                             f"{positions[:, :4].tolist()}...")

    def kernel_latents(self, layer_idx: int, tokens: int):
        """Keys and values of `tokens` slots in the kernels' layout ([B, G, tokens, r] or packed)."""
        return self.layers[layer_idx].view(tokens)

    def latents(self, layer_idx: int, tokens: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path's (B, tokens, G*r) keys and values, dequantised when packed."""
        out = []
        for buf in self.kernel_latents(layer_idx, tokens):
            h = dequantize_latent(buf, dtype) if isinstance(buf, QuantLatent) else buf.to(dtype)
            B, G, S, r = h.shape
            out.append(h.transpose(1, 2).reshape(B, S, G * r))
        return out[0], out[1]

    def reset(self) -> None:
        """Empty the cache (slots zeroed), keeping its buffers: captured graphs stay valid."""
        super().reset()
        self.seen = 0
        self.lengths.zero_()
        self.ragged = False

    def nbytes(self) -> int:
        """Bytes of every layer's slots (packed data, scales and zero points included)."""
        return sum(slot_nbytes(layer.keys) + slot_nbytes(layer.values) for layer in self.layers)
