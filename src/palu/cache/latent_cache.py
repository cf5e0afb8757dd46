"""A KV cache that stores Palu latents (r numbers per token per group), pre-RoPE.

Plugs into transformers' Cache API, so `model.generate(..., past_key_values=LatentCache(model))`
works. Per layer it keeps `keys` (B, 1, T, R_k) and `values` (B, 1, T, R_v) — the latents of all
groups side by side (groups may have different ranks) — plus the token positions (B, T) that
RoPE needs when keys are rebuilt.

`LatentCache(model, bits=4)` (or 2, 3, 8) stores the latents quantised per token and group in the
packed layout of `palu.quant.packed` (`channel_group=32`: one scale per 32 latent channels of a
group instead of per group; the torch path reads those) (`keys` / `values` then hold the packed bytes of all groups
side by side, and `key_sz` / `value_sz` (B, T, G, 2) their fp16 scales and zero points). The
decode kernels read 2 / 4 / 8-bit latents as they are; the torch path (and 3-bit) gets them
dequantised.

Appending a decode step copies only the new token: every per-token tensor is a prefix view of a
buffer with spare room (`LatentLayer._append`), grown by max(256 tokens, 1/8) when full. A
transformers DynamicLayer concatenates instead, copying the whole cache at every step (O(T) per
token, O(T^2) per generation). The prefill is stored exactly, without spare room.
"""
from __future__ import annotations

import copy
import itertools

import torch
from transformers.cache_utils import Cache, DynamicLayer

from palu.quant.packed import (KERNEL_BITS, SUPPORTED_BITS, UNQUANTISED, QuantLatent, as_groups,
                               dequantize_latent, packed_width, quantize_latent)

from .protocol import causal_mask, check_latent_model


def _use_quantize_kernel(h: torch.Tensor) -> bool:
    """The one-launch quantise-and-store kernel on a GPU; the torch ops elsewhere (the Triton
    interpreter would run it on CPU too, but slowly: tests switch it on explicitly)."""
    return h.device.type == "cuda"


def _quantize_groups(h, ranks, bits):
    """(B, T, sum ranks) -> packed (B, 1, T, sum ranks / per_byte) uint8 and (B, T, G, 2) fp16."""
    data, sz, off = [], [], 0
    for r in ranks:
        q = quantize_latent(h[..., off:off + r].unsqueeze(1), bits)      # groups one at a time
        data.append(q.data)
        sz.append(torch.stack([q.scale[:, 0], q.zero[:, 0]], -1))         # (B, T, 2)
        off += r
    return torch.cat(data, -1), torch.stack(sz, 2)


def _dequantize_groups(data, sz, ranks, bits, dtype):
    out, off = [], 0
    for g, r in enumerate(ranks):
        w = packed_width(r, bits)
        q = QuantLatent(data[..., off:off + w], sz[:, None, :, g, 0], sz[:, None, :, g, 1], bits, r)
        out.append(dequantize_latent(q, dtype)[:, 0])
        off += w
    return torch.cat(out, -1)


_FRESH = itertools.count(-1, -1)   # fingerprints no hash of a real history collides with in practice


class LatentLayer(DynamicLayer):
    def __init__(self, bits: int = UNQUANTISED, **kwargs):
        super().__init__(**kwargs)
        self.bits = bits
        self.key_sz: torch.Tensor | None = None       # packed mode: scales and zero points
        self.value_sz: torch.Tensor | None = None
        self.ranks: tuple[list[int], list[int]] | None = None
        self.positions: torch.Tensor | None = None
        # Every row holds positions p0, p0 + 1, ... (the usual cache): the decode kernels then
        # take a per-row offset and their fast RoPE path. Tracked as tokens arrive, so a decode
        # step checks its new tokens only, not the whole cache.
        self.contiguous = True
        # Host-side fingerprint of the position tensors appended so far: layers with the same
        # fingerprint hold the same positions, so one layer's contiguity check (a host sync)
        # serves the others (`update_latent`'s memo). 0: no positions yet.
        self._history = 0
        self._room: dict[str, torch.Tensor] = {}      # the buffers the per-token tensors view
        # A left-padded batch of an evicting method (palu_evict.py): `starts` each row's first
        # slot of its own tokens, on the host (its left pad, then its fillers). After an eviction
        # each row's kept tokens are led by `lead[b]` masked filler slots (rows keep different
        # numbers): (B,) on the device; the model's padding mask no longer lines up with the
        # slots held, so `mask` is built here.
        self.starts: list[int] | None = None
        self.lead: torch.Tensor | None = None

    def _extend(self, name: str, view: torch.Tensor | None, shape, dim: int, dtype, device) -> torch.Tensor:
        """`view` (a prefix of the buffer `name`, or any tensor) lengthened by shape[dim] unwritten
        slots along the token axis `dim`. In place while the buffer has room; otherwise a new
        buffer with max(256, 1/8) tokens to spare. A view that is no longer a prefix of its
        buffer (after batch selection or reordering, which build new tensors) is copied too."""
        n = shape[dim]
        if view is None or view.numel() == 0:   # the prefill: stored exactly, no spare room
            self._room[name] = out = torch.empty(shape, dtype=dtype, device=device)
            return out
        T, buf = view.shape[dim], self._room.get(name)
        fits = (buf is not None and view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride()
                and T + n <= buf.shape[dim]
                and all(view.shape[d] == buf.shape[d] for d in range(view.dim()) if d != dim))
        if not fits:
            grown = list(view.shape)
            grown[dim] = T + n + max(256, (T + n) // 8)
            buf = view.new_empty(grown)
            buf.narrow(dim, 0, T).copy_(view)
            self._room[name] = buf
        return buf.narrow(dim, 0, T + n)

    def _append(self, name: str, view: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
        """`view` with `new` appended along the token axis `dim` (see `_extend`)."""
        out = self._extend(name, view, new.shape, dim, new.dtype, new.device)
        out.narrow(dim, out.shape[dim] - new.shape[dim], new.shape[dim]).copy_(new)
        return out

    def _store_packed(self, h: torch.Tensor, ranks: list[int], data: str, sz: str) -> None:
        """Quantise latents h (B, n, sum ranks) per token and group and append them. On a GPU,
        with equal group ranks, one kernel launch writes straight into the buffers
        (`palu_kernels.quantize`, bit-identical to the torch path's ~20 small kernels per group)."""
        B, n, _ = h.shape
        G, per = len(ranks), 8 // self.bits
        if (_use_quantize_kernel(h) and len(set(ranks)) == 1 and self.bits in KERNEL_BITS
                and ranks[0] % per == 0):
            from palu_kernels.quantize import quantize_into   # imports triton: only where it runs
            packed = self._extend(data, getattr(self, data), (B, 1, n, sum(ranks) // per), 2,
                                  torch.uint8, h.device)
            pairs = self._extend(sz, getattr(self, sz), (B, n, G, 2), 1, torch.float16, h.device)
            dst = QuantLatent(as_groups(packed, G), pairs[..., 0].transpose(1, 2),
                              pairs[..., 1].transpose(1, 2), self.bits, ranks[0])
            quantize_into(h.contiguous().view(B, n, G, ranks[0]).transpose(1, 2), dst, packed.shape[2] - n)
        else:
            d, s = _quantize_groups(h, ranks, self.bits)
            packed, pairs = self._append(data, getattr(self, data), d, 2), self._append(sz, getattr(self, sz), s, 1)
        setattr(self, data, packed)
        setattr(self, sz, pairs)

    def update(self, key_states, value_states, *args, **kwargs):
        """DynamicLayer.update without the whole-cache copy: (B, 1, T, R) appended in place."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append("keys", self.keys, key_states, key_states.dim() - 2)
        self.values = self._append("values", self.values, value_states, value_states.dim() - 2)
        return self.keys, self.values

    def update_latent(self, hk, hv, positions, ranks=None, dequantize: bool = True,
                      memo: dict | None = None):
        """Append latents (B, T, R) and positions (B, T); return everything stored so far.

        Packed mode: `ranks` = (per-group key ranks, value ranks), default one group each; the
        latents come back dequantised, or as (None, None) with `dequantize=False` (a caller
        whose kernels read them packed, `packed_groups`, fetches `latents()` only if needed).
        `memo`: shared by the layers of one cache (`LatentCache`); a layer whose positions so far
        and new positions tensor match the last check's takes its answer instead of checking.
        """
        if self.bits == UNQUANTISED:
            keys, values = self.update(hk.unsqueeze(1), hv.unsqueeze(1))
            keys, values = keys.squeeze(1), values.squeeze(1)
        else:
            self.ranks = ranks or ([hk.shape[-1]], [hv.shape[-1]])
            if not self.is_initialized:   # DynamicLayer bookkeeping (dtype, device, empty tensors)
                self.lazy_initialization(hk.new_empty(0, dtype=torch.uint8), hv.new_empty(0, dtype=torch.uint8))
            self._store_packed(hk, self.ranks[0], "keys", "key_sz")
            self._store_packed(hv, self.ranks[1], "values", "value_sz")
            keys, values = self.latents(hk.dtype) if dequantize else (None, None)
        # transformers hands every layer the same position_ids tensor in a forward pass: its
        # identity, storage and version name its contents without reading them
        state = (self._history, id(positions), positions.data_ptr(), positions._version,
                 tuple(positions.shape), hk.shape[0])
        positions_in = positions
        positions = positions.to(torch.int32).expand(hk.shape[0], -1)
        if self.contiguous:
            if memo is not None and memo.get("state") == state:
                self.contiguous = memo["contiguous"]
            else:   # one host sync (per decode step when a memo is shared)
                start = positions[:, :1] if self.positions is None else self.positions[:, -1:] + 1
                steps = torch.arange(positions.shape[1], device=positions.device, dtype=positions.dtype)
                self.contiguous = bool((positions == start + steps).all())
                if memo is not None:   # the tensor is held, so its id is not reused meanwhile
                    memo.update(state=state, contiguous=self.contiguous, tensor=positions_in,
                                checks=memo.get("checks", 0) + 1)
        self._history = hash(state)
        self.positions = self._append("positions", self.positions, positions, 1)
        return keys, values, self.positions

    evicted = 0   # tokens seen but no longer held (a prefill-eviction composition, palu_snapkv)

    def get_seq_length(self) -> int:
        """Tokens seen (the next token's position), held or evicted."""
        return super().get_seq_length() + self.evicted

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # masks span the tokens held (an evicted token has no column)
        return super().get_seq_length() + query_length, 0

    def held_tokens(self) -> int:
        """Token slots held (fillers included), not tokens seen."""
        return super().get_seq_length()

    def evict(self, keep: torch.Tensor, seen: int, lead: list[int] | None = None) -> None:
        """Hold only the tokens at indices `keep` (B, n) of those stored (one set per sequence,
        for every group: the groups' latents share one token axis), with their positions, so
        later keys are still rebuilt and rotated where their tokens were. `lead`: a left-padded
        batch's rows, each its first `lead[b]` slots masked fillers (its own tokens after them)."""
        held = super().get_seq_length()

        def take(t, dim):
            t = t.expand(keep.shape[0], *t.shape[1:])
            idx = keep.view(keep.shape[0], *([1] * (dim - 1)), keep.shape[1], *([1] * (t.dim() - dim - 1)))
            return t.gather(dim, idx.expand(*t.shape[:dim], keep.shape[1], *t.shape[dim + 1:]))
        self.keys, self.values = take(self.keys, self.keys.dim() - 2), take(self.values, self.values.dim() - 2)
        for name in ("key_sz", "value_sz"):
            if getattr(self, name) is not None:
                setattr(self, name, take(getattr(self, name), 1))
        self.positions = take(self.positions, 1)
        self._room = {}                  # gathered tensors: the next append grows new buffers
        self.contiguous = lead is None and bool((self.positions == self.positions[:, :1]
                                                 + torch.arange(keep.shape[1], device=keep.device)).all())
        self.lead = None if lead is None else torch.tensor(lead, device=keep.device)
        self.starts = lead
        self._history = next(_FRESH)
        self.evicted += held - keep.shape[1]

    def row(self, b: int) -> "LatentLayer":
        """Row `b` alone: its slots after any filler, as a one-row layer (bytes as that prompt
        alone holds them)."""
        out = LatentLayer(self.bits)
        out.ranks, out.evicted, out.contiguous = self.ranks, self.evicted, self.contiguous
        if self.keys is None:
            return out
        out.is_initialized, out.dtype, out.device = True, self.dtype, self.device
        lead = 0 if self.lead is None else int(self.lead[b])

        def mine(t, dim):
            return None if t is None else t[b:b + 1].narrow(dim, lead, t.shape[dim] - lead)
        out.keys, out.values = mine(self.keys, self.keys.dim() - 2), mine(self.values, self.values.dim() - 2)
        out.key_sz, out.value_sz = mine(self.key_sz, 1), mine(self.value_sz, 1)
        out.positions = mine(self.positions.expand(self.keys.shape[0], -1), 1)
        return out

    def latents(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed mode: all stored key and value latents dequantised, (B, T, R) each."""
        return (_dequantize_groups(self.keys, self.key_sz, self.ranks[0], self.bits, dtype),
                _dequantize_groups(self.values, self.value_sz, self.ranks[1], self.bits, dtype))

    def packed_groups(self, groups: int) -> tuple[QuantLatent, QuantLatent]:
        """Packed mode, equal ranks: the stored latents as kernel-layout views [B, G, T, C]."""
        out = []
        for data, sz, ranks in ((self.keys, self.key_sz, self.ranks[0]),
                                (self.values, self.value_sz, self.ranks[1])):
            scale, zero = sz[..., 0].transpose(1, 2), sz[..., 1].transpose(1, 2)   # (B, G, T)
            out.append(QuantLatent(as_groups(data, groups), scale, zero, self.bits, ranks[0]))
        return out[0], out[1]

    def _map_extras(self, fn, rows: bool = True) -> None:
        """Apply `fn` to the per-token tensors kept beside keys/values (batch first, then T);
        `rows`: `fn` edits the batch axis (beam search, batch edits), not only the tokens."""
        self._history = next(_FRESH)   # positions changed outside update_latent
        for name in ("positions", "key_sz", "value_sz", "lead"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if rows and self.starts is not None:   # beam search and batch edits move a row's start with it
            self.starts = [self.starts[i] for i in fn(torch.arange(len(self.starts))).tolist()]

    def crop(self, tokens_to_remove: int) -> None:
        if self.evicted:
            raise TypeError("a latent cache that evicted tokens cannot crop (assisted or "
                            "prompt-lookup decoding): decode without an assistant")
        super().crop(tokens_to_remove)
        if self.keys is not None:
            self._map_extras(lambda t: t[:, : self.keys.shape[-2]], rows=False)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_extras(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_extras(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_extras(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def nbytes(self) -> dict:
        """Bytes of the stored tokens, and `reserved`: of the buffers behind them (spare room
        included; equal after a prefill, up to max(256 tokens, 1/8) more while generating)."""
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        def held(name):
            t, buf = getattr(self, name), self._room.get(name)
            return size(buf) if t is not None and buf is not None and t.data_ptr() == buf.data_ptr() else size(t)
        return {"latents": size(self.keys) + size(self.values),
                "scales": size(self.key_sz) + size(self.value_sz), "positions": size(self.positions),
                "reserved": sum(held(n) for n in ("keys", "values", "key_sz", "value_sz", "positions"))}


class _StoredLatentLayer:
    """A LatentLayer after a step stored its latents (the `StoredLatents` protocol)."""

    cached = True

    def __init__(self, layer: LatentLayer, hk, hv, positions, kernel_layout: bool = True):
        self.layer, self.hk, self.hv, self._positions = layer, hk, hv, positions
        self.bits, self.kernel_layout = layer.bits, kernel_layout

    @property
    def positions(self):
        return self._positions

    def mask(self, attention_mask, T: int):
        lead, S = self.layer.lead, self._positions.shape[-1]
        if lead is None:
            return causal_mask(attention_mask, T, S, self._positions.device)
        # a padded batch after its prefill eviction: a row's fillers hidden, its own tokens causal
        j = torch.arange(S, device=lead.device)
        t = torch.arange(S - T, S, device=lead.device)[:, None]
        return (j[None] >= lead[:, None])[:, None, None, :] & (j[None] <= t)[None, None]

    kernel_mask = mask

    def latents(self, dtype):
        # packed latents are dequantised only when the torch path runs
        return (self.hk, self.hv) if self.hk is not None else self.layer.latents(dtype)

    def kernel_latents(self, groups: int):
        if self.bits != UNQUANTISED:
            return self.layer.packed_groups(groups)
        return tuple(as_groups(h.unsqueeze(1), groups) for h in (self.hk, self.hv))

    def kernel_positions(self) -> dict:
        return {"kpos": self._positions, "contiguous": self.layer.contiguous}


class LatentCache(Cache):
    """One LatentLayer per decoder layer of `model` (or `num_layers`); `bits` in (2, 3, 4, 8)
    stores the latents quantised (per token and group, packed), None keeps them as computed.

    Sliding-window models: every token's latents are kept and the model's window mask (which
    Palu attention applies on the torch path; a mask sends a decode step there) decides what each
    query sees, so the window is honoured exactly; the bytes count every kept token."""

    def __init__(self, model=None, num_layers: int | None = None, bits=UNQUANTISED,
                 channel_group: int | None = None, evicts: bool = False):
        n = num_layers if num_layers is not None else (model.config.num_hidden_layers if model is not None else None)
        if n is None:
            raise ValueError("LatentCache needs the model or num_layers")
        # `bits` one width for every layer, or one per layer (a (rank, bits) byte allocation,
        # decompose/bit_alloc.py; 16 in the list: that layer's latents unquantised)
        per_layer = list(bits) if isinstance(bits, (list, tuple)) else [bits] * n
        if len(per_layer) != n:
            raise ValueError(f"bits lists {len(per_layer)} widths for a model of {n} layers")
        for b in per_layer:
            if b != UNQUANTISED and b not in SUPPORTED_BITS:
                raise ValueError(f"bits={b!r} is not one of {SUPPORTED_BITS} (or {UNQUANTISED}: unquantised)")
        quantised = [b for b in per_layer if b != UNQUANTISED]
        if channel_group is not None and (not quantised or not isinstance(channel_group, int)
                                          or channel_group <= 0):
            raise ValueError(f"channel_group={channel_group!r}: a positive number of latent channels "
                             "per scale, for quantised latents (bits set)")
        if model is not None:
            check_latent_model(model, "LatentCache")
        super().__init__(layers=[LatentLayer(b) for b in per_layer])
        self.layer_bits = per_layer
        # one width for the whole cache, else None: widths differ by layer (see layer_bits)
        self.bits = per_layer[0] if len(set(per_layer)) == 1 else None
        self.channel_group = channel_group
        self._contiguity_memo: dict = {}   # one contiguity check per step, not per layer
        self.evicts = evicts   # a prefill-eviction composition (palu_snapkv): rows keep their own tokens

    def row_bytes_by_snapshot(self) -> bool:
        """Whether a row's bytes are taken when it ends (`row(b)`): after a prefill eviction a
        batch's rows hold different numbers of tokens, not a per-token share of the batch."""
        return self.evicts

    holds_rows_apart = row_bytes_by_snapshot

    def row(self, b: int) -> "LatentCache":
        """Row `b` of a batch as a cache of its own: the slots it holds after any filler."""
        one = copy.copy(self)
        one.layers = [layer.row(b) for layer in self.layers]
        return one

    def update_latent(self, hk, hv, positions, layer_idx: int, ranks=None, dequantize: bool = True):
        return self.layers[layer_idx].update_latent(hk, hv, positions, ranks, dequantize,
                                                    memo=self._contiguity_memo)

    def store_latents(self, layer_idx: int, hk, hv, positions, ranks) -> _StoredLatentLayer:
        """The `LatentStore` protocol: append (B, T, R) latents; positions None continue the
        layer's sequence. A packed cache returns no dequantised latents until asked for."""
        if positions is None:
            past = self.get_seq_length(layer_idx)
            positions = torch.arange(past, past + hk.shape[1], device=hk.device)[None]
        if self.channel_group is not None:   # each group's rank split into scale groups
            ranks = tuple(_split(r, self.channel_group) for r in ranks)
        hk_all, hv_all, kpos = self.update_latent(hk, hv, positions, layer_idx, ranks=ranks,
                                                  dequantize=False)
        return _StoredLatentLayer(self.layers[layer_idx], hk_all, hv_all, kpos,
                                  kernel_layout=self.channel_group is None)

    def nbytes(self) -> dict:
        """Bytes of the stored tokens: latents (packed in quantised mode), their scales and zero
        points, and the int32 positions, summed over layers; `reserved`: the buffers' bytes."""
        totals = {"latents": 0, "scales": 0, "positions": 0, "reserved": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                totals[key] += value
        totals["total"] = totals["latents"] + totals["scales"] + totals["positions"]
        return totals


def _split(ranks: list[int], size: int) -> list[int]:
    """Each rank cut into quantisation groups of `size` channels (the last one shorter)."""
    return [min(size, r - start) for r in ranks for start in range(0, r, size)]


def dense_cache_nbytes(cache) -> int:
    """Bytes held by an ordinary transformers cache (keys + values of every layer)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
