"""A KV cache that stores full keys and values quantised, as the KV-quantisation baselines do
(Atom, KIVI, TurboQuant, KVQuant: `palu/methods/`), through transformers' Cache API.

A method gives one `Codec` for keys and one for values (how a block of tokens is encoded) and a
schedule: the first `sink` tokens are kept in the model's dtype forever (KVQuant's attention
sink), the newest `window` tokens too (KIVI's residual), and a codec with `block` > 1 (KIVI's
per-channel keys) quantises `block` consecutive tokens together once all of them have left the
window. So token j (j >= sink) is held quantised from the step whose query is

    quantised_at(j) = sink + ((j - sink) // block + 1) * block - 1 + window

on, and in the model's dtype before it (for block 1 and window 0: from its own step on — a token
attends to its own quantised key, as in decoding).

Decode-equivalence of a one-pass window: a step of T tokens returns, for every token, each form
the cache held it in during the step (the model's dtype and/or quantised), and a mask that lets
query t see, of token j, exactly the form the cache held when t was decoded (`QuantKVView`).
Keys and values may change form at different steps (KIVI: values per token, keys per block), so
a column of the view is one (key form, value form) pair with its interval of queries. Feeding
the same tokens one at a time through the cache gives the same attention, to rounding.

Pre-RoPE keys (KVQuant): the cache also keeps the token positions, and attention rotates the
keys it reads (`QuantKVView.key_positions`).

Padded batches: a method that codes each token from itself alone (no sink, no window, blocks of
one token) gives every row of a padded batch what that prompt gets alone, in one set of tensors.
One that counts tokens (a sink, a window, blocks of several tokens: KIVI, KVQuant) would count a
row's pad tokens too; for a left-padded batch its layer holds one row layer per row instead, each
storing only that row's real tokens (sink, window and blocks counted from the row's first token,
as alone), and a step's view is the rows' views side by side, filler columns masked (`_step_rows`).
A prefill-eviction composition (KIVI + SnapKV, `evicts`) keeps a padded batch's rows apart too, so
each row layer evicts among its own tokens.

Past the prefill, one-token steps take the batch path (`quant_dense.py`): every row in one buffer,
each token in its current form, the blocks that fall due coded for all rows at once; the same
(key, value) pairs as the steps above, without a Python loop over rows or a dequantisation of the
whole history each step (PALU_QUANT_DENSE=0 keeps this layer's own steps).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import banded_prefill
from . import quant_dense
from .protocol import RowEdits, left_pads, to_device

NEVER = 2 ** 62   # quantised_at of a token that stays in the model's dtype


class Codec:
    """Encodes one layer's keys or values, (B, H, n, d) -> a dict of tensors whose axis 2 runs
    over tokens (or over blocks of `block` tokens), so encodings of later tokens concatenate."""
    block: int = 1

    def encode(self, x: torch.Tensor, layer: int) -> dict:
        raise NotImplementedError

    def decode(self, enc: dict, layer: int, dtype) -> torch.Tensor:
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """decode(encode(x)): x in the form the cache holds it once coded. A codec may skip its
        storage format here (packing), provided the values are bit for bit decode(encode(x))."""
        return self.decode(self.encode(x, layer), layer, x.dtype)

    def layer_metadata_nbytes(self, layer: int) -> int:
        """Bytes stored once per layer whatever the length (codebooks, calibrated scales)."""
        return 0


@dataclass(frozen=True)
class Schedule:
    sink: int = 0
    window: int = 0

    def quantised_at(self, j: torch.Tensor, block: int) -> torch.Tensor:
        at = self.sink + (torch.div(j - self.sink, block, rounding_mode="floor") + 1) * block - 1 + self.window
        return torch.where(j < self.sink, torch.full_like(j, NEVER), at)

    def quantised_end(self, n: int, block: int) -> int:
        """End of the quantised tokens [sink, end) once n tokens are cached (min(n, sink) if none)."""
        blocks = max(0, (n - self.window - self.sink) // block)
        return min(n, self.sink) + blocks * block

    def coded(self, n: int, block: int) -> int:
        """How many of n cached tokens are held quantised (the rest: the sink and the window)."""
        return self.quantised_end(n, block) - min(n, self.sink)


def _cat(parts: list[dict]) -> dict:
    parts = [p for p in parts if p]
    if not parts:
        return {}
    return {k: torch.cat([p[k] for p in parts], 2) for k in parts[0]}


class _Stream:
    """Keys or values of one layer: `head` (the sink, model dtype), `enc` (tokens
    [sink, quantised) encoded), `tail` (the rest, model dtype)."""

    def __init__(self, codec: Codec, schedule: Schedule, layer: int):
        self.codec, self.schedule, self.layer = codec, schedule, layer
        self.head = self.tail = None
        self.enc: dict = {}
        self.n = 0

    def quantised(self, n: int) -> int:
        return self.schedule.quantised_end(n, self.codec.block)

    def step(self, x: torch.Tensor):
        """Append x (B, H, T, d); returns (fp, fp_index, dq, dq_index): every token the step can
        see in the model's dtype and every quantised token dequantised, with their indices."""
        s = self.schedule.sink
        n0, n1 = self.n, self.n + x.shape[2]
        q0, q1 = self.quantised(n0), self.quantised(n1)
        held = [t for t in (self.head, self.tail) if t is not None and t.shape[2]]
        fp_all = torch.cat(held + [x], 2)            # tokens [0, h0) and [q0, n1)
        h1 = min(s, n1)
        start = max(q0, h1)                          # first token of `rest`
        rest = fp_all[:, :, h1:]                     # tokens [start, n1)
        new = self.codec.encode(rest[:, :, :q1 - start], self.layer) if q1 > start else {}
        old_dq = self.codec.decode(self.enc, self.layer, x.dtype) if self.enc else None
        new_dq = self.codec.decode(new, self.layer, x.dtype) if new else None
        self.head, self.tail = fp_all[:, :, :h1], rest[:, :, q1 - start:]
        self.enc = _cat([self.enc, new])
        self.n = n1
        fp = torch.cat([self.head, rest], 2)
        # the indices on the host: the layer's bookkeeping never waits for the device (`QuantKVLayer.step`)
        fp_index = torch.cat([torch.arange(h1), torch.arange(start, n1)])
        dq_parts = [t for t in (old_dq, new_dq) if t is not None]
        dq = torch.cat(dq_parts, 2) if dq_parts else x[:, :, :0]
        dq_index = torch.arange(s, s + dq.shape[2])   # encoded: tokens [sink, q1)
        return fp, fp_index, dq, dq_index

    def in_order(self, fp: torch.Tensor, dq: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
        """After a one-token step (`step`'s fp and dq): every token [0, n1) in token order, each in
        the form a query at n0 sees it — the sink and the tail in the model's dtype, the tokens
        [sink, quantised) dequantised (a token coded this step is seen coded: its quantised_at is
        this step)."""
        h1, q1 = min(self.schedule.sink, n1), self.quantised(n1)
        start = max(self.quantised(n0), h1)
        return torch.cat([fp[:, :, :h1], dq, fp[:, :, h1 + q1 - start:]], 2)

    def current(self, dtype) -> torch.Tensor:
        """Every held token in order, in the form the cache holds it now (B, H, n, d)."""
        parts = [self.head, self.codec.decode(self.enc, self.layer, dtype) if self.enc else None, self.tail]
        return torch.cat([t for t in parts if t is not None and t.shape[2]], 2)

    def map(self, fn) -> None:
        for name in ("head", "tail"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        self.enc = {k: fn(v) for k, v in self.enc.items()}

    def nbytes(self) -> dict:
        size = lambda t: 0 if t is None else t.numel() * t.element_size()
        enc = {k: size(v) for k, v in self.enc.items()}
        codes = enc.pop("codes", 0)
        return {"quantised": codes, "metadata": sum(enc.values()),
                "full_precision": size(self.head) + size(self.tail)}


@dataclass
class QuantKVView:
    """What one step's queries attend to: keys and values (B, H, S', d), the token index of each
    column (S',; None: every token in order, a one-token step) and the boolean mask (B or 1, 1, T,
    S'; None: every column) of which query sees which column."""
    keys: torch.Tensor
    values: torch.Tensor
    index: torch.Tensor | None
    mask: torch.Tensor | None
    key_positions: torch.Tensor | None   # (B, S') positions of the keys (pre-RoPE caches)


def hides_causal_keys(attention_mask, n0: int, T: int, window: int | None) -> bool:
    """Whether `attention_mask` hides, from a query, a key that causal (and, with `window`,
    sliding-window) attention would show it: the mark of padding."""
    if attention_mask is None:
        return False
    n1 = n0 + T
    base = attention_mask[..., -T:, :n1]
    visible = base if base.dtype == torch.bool else base == 0
    q = torch.arange(n0, n1, device=visible.device)[:, None]
    k = torch.arange(n1, device=visible.device)[None]
    causal = k <= q
    if window:
        causal &= (q - k) < window
    return bool((causal & ~visible).any())


def _lookup(index: torch.Tensor, n: int) -> torch.Tensor:
    """Column of each token in a tensor listing `index` tokens (-1: absent), on the host."""
    where = torch.full((n,), -1, dtype=torch.long)
    where[index] = torch.arange(index.numel())
    return where


class QuantKVLayer(RowEdits, CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self, key_codec: Codec, value_codec: Codec, schedule: Schedule, layer: int,
                 keep_positions: bool, evicts: bool = False):
        super().__init__()
        self.k = _Stream(key_codec, schedule, layer)
        self.v = _Stream(value_codec, schedule, layer)
        self.schedule, self.layer_idx, self.keep_positions = schedule, layer, keep_positions
        self.evicts = evicts   # a prefill-eviction composition: each row of a batch chooses its own tokens
        self.positions: torch.Tensor | None = None
        self.evicted = 0   # tokens seen but no longer held (a prefill-eviction composition)
        # a left-padded batch of a method that counts tokens: one layer per row, its real tokens
        # only; `pads` each row's left pad, `width` the batch's tokens seen (pads included)
        self.rows: list[QuantKVLayer] | None = None
        self.pads: list[int] = []
        self.width = 0
        # past the prefill: every row in one buffer, each token in its current form (quant_dense.py)
        self.dense: quant_dense.DenseRows | None = None
        # the exact keys and values of the steps taken while set (a list): what preallocated
        # slots code per row after a right-padded prefill (`quant_slots.QuantSlots`)
        self.stash: list | None = None
        # with the stash, each row's real tokens (a right-padded prefill: row b's first
        # `stash_lengths[b]` columns) and, for a prefill-eviction composition, the tokens each row
        # keeps, chosen by the attention after the prefill: `ScoredEviction.keep_right_padded`'s
        # (index (B, H, n), counts), index None where no row evicts
        self.stash_lengths: list[int] | None = None
        self.kept_rows: tuple | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("a quantised KV cache is read through its method's attention "
                        "(method.install(model)), not by a model's own attention")

    @property
    def counts_tokens(self) -> bool:
        """Whether a token's stored form depends on where it sits in the sequence (a sink, a
        window, blocks of several tokens), not only on itself."""
        return bool(self.schedule.sink or self.schedule.window or self.k.codec.block > 1
                    or self.v.codec.block > 1)

    @property
    def keeps_rows_apart(self) -> bool:
        """Whether a left-padded batch is held one row layer per row: its code counts tokens,
        or each row evicts among its own tokens (a prefill-eviction composition)."""
        return self.counts_tokens or self.evicts

    def step(self, keys, values, positions, attention_mask, window: int | None = None,
             owner: str | None = None, banded: bool = False) -> QuantKVView | banded_prefill.QuantKVBand:
        """Store this step's keys and values (B, H, T, d) at `positions` ((B or 1, T)); return
        what its queries see (see the module docstring). `window`: the layer's sliding window.
        `banded`: the caller takes a prefill as both forms of every token
        (`attention/banded_prefill.py`) where that applies."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        B, _, T, _ = keys.shape
        if self.stash is not None:
            self.stash.append((keys, values))
        if self.dense is None and T == 1 and window is None and self._goes_dense():
            self._to_dense()
        if self.dense is not None:
            k, v, mask = self.dense.step(keys, values, attention_mask)
            return QuantKVView(k, v, None, mask, None)
        n0 = self.k.n
        if self.rows is None and self.keeps_rows_apart and hides_causal_keys(attention_mask, n0, T, window):
            self._split_rows(attention_mask, B, T, n0, window, owner)
        if self.rows is not None:
            if banded and self.width == 0:
                bands = self._band_rows(keys, values, owner)
                if bands is not None:
                    return bands
            return self._step_rows(keys, values, positions, owner)
        n1, dev = n0 + T, keys.device
        band = (banded and n0 == 0 and window is None and not self.keep_positions
                and banded_prefill.applies(T, self.reach) and banded_prefill.enabled()
                and not hides_causal_keys(attention_mask, n0, T, window))
        kf, kfi, kq, kqi = self.k.step(keys)
        vf, vfi, vq, vqi = self.v.step(values)
        if band:
            return self._band(kf, kq, vf, vq, n1)
        if self.keep_positions:
            pos = positions.to(torch.int32).expand(B, -1)
            self.positions = pos if self.positions is None else torch.cat([self.positions, pos], 1)
        if T == 1:   # one query (decoding): every token once, in order, in the form it sees it
            mask = None
            if attention_mask is not None:                            # padding, sliding windows
                base = attention_mask[..., -1:, :n1]
                mask = base if base.dtype == torch.bool else base == 0
            return QuantKVView(self.k.in_order(kf, kq, n0, n1), self.v.in_order(vf, vq, n0, n1),
                               None, mask, self.positions)
        # Which form of each token each query sees is a function of integers the host holds (the
        # schedule, n0, T): computed there, so no `nonzero` waits for the device. A padded batch's
        # per-row path calls this for every row of every layer each step (~500 waits a step at a
        # batch of 4 before: results/checks/decode-syncs.json).
        tokens = torch.arange(n1)
        at_k = self.schedule.quantised_at(tokens, self.k.codec.block)
        at_v = self.schedule.quantised_at(tokens, self.v.codec.block)
        queries = torch.arange(n0, n1, device=dev)
        col_k, col_v, idx, masks = [], [], [], []
        k_where = {False: _lookup(kfi, n1), True: _lookup(kqi, n1)}
        v_where = {False: _lookup(vfi, n1), True: _lookup(vqi, n1)}
        never = torch.full_like(tokens, NEVER)
        for kq_form in (False, True):
            for vq_form in (False, True):
                # the queries that see token j with keys / values in these forms: [lo, hi)
                lo = torch.maximum(at_k if kq_form else tokens, at_v if vq_form else tokens)
                hi = torch.minimum(never if kq_form else at_k, never if vq_form else at_v)
                ok = ((k_where[kq_form] >= 0) & (v_where[vq_form] >= 0)
                      & (lo.clamp_min(n0) < hi.clamp_max(n1)))
                j = ok.nonzero().flatten()
                if not j.numel():
                    continue
                # one copy: the tokens, their columns in the key / value tensors, their query interval
                moved = to_device(torch.stack([j, k_where[kq_form][j], v_where[vq_form][j], lo[j], hi[j]]), dev)
                col_k.append((kq if kq_form else kf).index_select(2, moved[1]))
                col_v.append((vq if vq_form else vf).index_select(2, moved[2]))
                idx.append(moved[0])
                masks.append((moved[3][None, :] <= queries[:, None]) & (queries[:, None] < moved[4][None, :]))
        index = torch.cat(idx)
        mask = torch.cat(masks, 1)[None, None]                        # (1, 1, T, S')
        if attention_mask is not None:                                # padding, sliding windows
            base = attention_mask[..., -T:, :n1]
            base = base if base.dtype == torch.bool else base == 0
            mask = mask & base.index_select(-1, index)
        key_positions = None if self.positions is None else self.positions.index_select(1, index)
        return QuantKVView(torch.cat(col_k, 2), torch.cat(col_v, 2), index, mask, key_positions)

    @property
    def reach(self) -> int:
        """How far behind a query a token may still be exact (quantised_at(j) - j at most; a sink
        is exact at any distance and needs none)."""
        return max(self.k.codec.block, self.v.codec.block) - 1 + self.schedule.window

    def _band(self, kf, kq, vf, vq, n1: int) -> "banded_prefill.QuantKVBand":
        """A first step's tokens in both forms: `_Stream.step` returned every token exact (kf, vf)
        and the coded ones [sink, quantised) dequantised (kq, vq)."""
        h1 = min(self.schedule.sink, n1)
        coded = lambda f, c: torch.cat([f[:, :, :h1], c, f[:, :, h1 + c.shape[2]:]], 2)  # noqa: E731
        tokens = torch.arange(n1)
        at = [to_device(self.schedule.quantised_at(tokens, s.codec.block).clamp_max(n1), kf.device)
              for s in (self.k, self.v)]
        return banded_prefill.QuantKVBand(kf, vf, coded(kf, kq), coded(vf, vq), at[0], at[1], self.reach)

    def _goes_dense(self) -> bool:
        """Whether the next one-token step takes the batch path (`quant_dense`): after a prefill,
        codes of a block that depend on that block alone, keys stored after RoPE."""
        return (quant_dense.enabled() and self.get_seq_length() > 0 and not self.keep_positions
                and getattr(self.k.codec, "dense", False) and getattr(self.v.codec, "dense", False))

    def _to_dense(self) -> None:
        layers = self.rows if self.rows is not None else [self]   # a row layer holds one row
        keys = [row for lay in layers for row in lay.k.current(self.dtype).split(1)]
        values = [row for lay in layers for row in lay.v.current(self.dtype).split(1)]
        self.dense = quant_dense.DenseRows(self.k.codec, self.v.codec, self.schedule, self.layer_idx,
                                           keys, values, self.get_seq_length(), by_rows=self.rows is not None)
        self.rows = None   # the row layers' state now lives in the buffer
        self.k = _Stream(self.k.codec, self.schedule, self.layer_idx)
        self.v = _Stream(self.v.codec, self.schedule, self.layer_idx)

    def evict(self, keys, values, seen: int) -> None:
        """Hold only `keys` / `values` (B, H, n, d), the tokens a prefill-eviction method kept (in
        order, a set per KV head), coded as this cache codes a prompt of those n tokens; every
        later step appends after them. `get_seq_length` still counts all `seen` tokens (the next
        token's position); masks span the tokens held."""
        if self.keep_positions:
            raise TypeError("a pre-RoPE quantised cache cannot evict: its keys are rotated at "
                            "positions kept per token, not per KV head")
        if self.dense is not None:
            raise ValueError("a quantised cache evicts after its prefill, not after decoding steps")
        if self.rows is not None:
            raise ValueError("a padded batch's rows are apart: evict each row layer (`rows`) among "
                             "its own tokens, not the batch, whose columns hold pad tokens")
        self.k = _Stream(self.k.codec, self.schedule, self.layer_idx)
        self.v = _Stream(self.v.codec, self.schedule, self.layer_idx)
        self.k.step(keys)
        self.v.step(values)
        self.evicted = seen - keys.shape[2]

    def held(self) -> list[int]:
        """Tokens each row holds (after an eviction, fewer than it has seen)."""
        if self.dense is not None:
            return list(self.dense.n)
        if self.rows is not None:
            return [r.k.n for r in self.rows]
        return [self.k.n] * (0 if self.k.tail is None else self.k.tail.shape[0])

    def get_seq_length(self) -> int:
        if self.dense is not None:
            return self.dense.seen
        return self.width if self.rows is not None else self.k.n + self.evicted

    def crop(self, max_length: int) -> None:
        # assisted / prompt-lookup decoding removes rejected draft tokens with Cache.crop
        raise TypeError("a quantised KV cache cannot crop tokens it has coded (assisted or "
                        "prompt-lookup decoding rolls back draft tokens): decode without an "
                        "assistant (greedy, sampling or beam search)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _map_rows(self, fn) -> None:
        if self.dense is not None:
            self.dense.map_rows(fn)
            return
        if self.rows is not None:   # beam search, batch edits: the row layers move whole
            order = fn(torch.arange(len(self.rows))).tolist()
            taken: set = set()
            rows = []
            for i in order:       # a row repeated is a copy: each copy then grows on its own
                rows.append(copy.deepcopy(self.rows[i]) if i in taken else self.rows[i])
                taken.add(i)
            self.rows, self.pads = rows, [self.pads[i] for i in order]
            return
        self.k.map(fn)
        self.v.map(fn)
        if self.positions is not None:
            self.positions = fn(self.positions)

    def _split_rows(self, attention_mask, B: int, T: int, n0: int, window, owner) -> None:
        """Enter the per-row mode at a left-padded batch's first step; anything else is refused."""
        what = owner or "this quantised cache"
        counts = (f"sink {self.schedule.sink}, window {self.schedule.window}, key blocks of "
                  f"{self.k.codec.block}")
        if n0 or self.evicted:
            raise ValueError(f"{what}: a padded batch whose padding appears after its first step: "
                             f"this method counts a row's tokens ({counts}). Pad on the left, once")
        if window:
            raise ValueError(f"{what}: a padded batch on a sliding-window layer ({window}): this "
                             f"method counts a row's tokens ({counts}) and its rows are kept apart "
                             f"only under full attention. Run each prompt alone (batch size 1)")
        pads = left_pads(attention_mask, B, T, what)
        self.rows = [QuantKVLayer(self.k.codec, self.v.codec, self.schedule, self.layer_idx,
                                  self.keep_positions, self.evicts) for _ in range(B)]
        self.pads, self.width = [int(p) for p in pads], 0

    def _band_rows(self, keys, values, owner) -> "banded_prefill.RowBands | None":
        """A left-padded batch's first step with every row long enough for a band: each row's
        real tokens through its own row layer as a band (what that prompt alone gets); None
        (nothing stored) where a row is too short, for the masked view."""
        B, _, T, _ = keys.shape
        skips = [min(T, p) for p in self.pads]
        if (not self.keep_positions and banded_prefill.enabled()
                and all(banded_prefill.applies(T - s, self.reach) for s in skips)):
            self.width = T
            return banded_prefill.RowBands(
                skips, [row.step(keys[b:b + 1, :, s:], values[b:b + 1, :, s:], None, None, None, owner,
                                 banded=True) for b, (row, s) in enumerate(zip(self.rows, skips))])
        return None

    def _step_rows(self, keys, values, positions, owner) -> QuantKVView:
        """Each row's real tokens of this step through its own row layer (as that prompt alone);
        the batch view puts the rows' columns side by side, padded with masked zero columns. A
        row's pad queries see one column (outputs never read; an all-masked row would be NaN)."""
        B, H, T, d = keys.shape
        views, real = [], []
        for b, row in enumerate(self.rows):
            skip = min(T, max(0, self.pads[b] - self.width))
            real.append(T - skip)
            if skip == T:
                views.append(None)
                continue
            pos = None if positions is None else positions[b if positions.shape[0] > 1 else 0][None, skip:]
            views.append(row.step(keys[b:b + 1, :, skip:], values[b:b + 1, :, skip:], pos, None,
                                  None, owner))
        self.width += T
        S = max([v.keys.shape[2] for v in views if v is not None] + [1])
        ks = keys.new_zeros(B, H, S, d)
        vs = values.new_zeros(B, H, S, values.shape[-1])
        mask = torch.zeros(B, 1, T, S, dtype=torch.bool, device=keys.device)
        kpos = (torch.zeros(B, S, dtype=torch.int32, device=keys.device) if self.keep_positions else None)
        for b, v in enumerate(views):
            mask[b, 0, :T - real[b], 0] = True
            if v is None:
                continue
            s = v.keys.shape[2]
            ks[b, :, :s], vs[b, :, :s] = v.keys[0], v.values[0]
            mask[b, 0, T - real[b]:, :s] = True if v.mask is None else v.mask[0, 0]
            if kpos is not None:
                kpos[b, :s] = v.key_positions[0]
        return QuantKVView(ks, vs, torch.arange(S, device=keys.device), mask, kpos)

    def nbytes(self) -> dict:
        if self.dense is not None:
            return self.dense.nbytes()
        if self.rows is not None:   # the codecs' per-layer metadata is stored once for all rows
            parts = [r.nbytes() for r in self.rows]
            out = {key: sum(p[key] for p in parts) for key in parts[0]}
            out["metadata"] -= out["fixed"] - parts[0]["fixed"]
            out["fixed"] = parts[0]["fixed"]
            return out
        k, v = self.k.nbytes(), self.v.nbytes()
        out = {key: k[key] + v[key] for key in k}
        fixed = (self.k.codec.layer_metadata_nbytes(self.layer_idx)
                 + self.v.codec.layer_metadata_nbytes(self.layer_idx))
        out["metadata"] += fixed
        out["positions"] = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        out["fixed"] = fixed   # of the metadata: per layer, whatever the rows and tokens (codebooks)
        return out


class QuantKVCache(Cache):
    """One QuantKVLayer per decoder layer; `owner` is the method whose attention reads it (an
    attention module refuses a cache of another method)."""

    def __init__(self, key_codec: Codec, value_codec: Codec, schedule: Schedule, num_layers: int,
                 keep_positions: bool = False, owner=None, evicts: bool = False):
        super().__init__(layers=[QuantKVLayer(key_codec, value_codec, schedule, i, keep_positions, evicts)
                                 for i in range(num_layers)])
        self.owner = owner
        self.slots = None   # decode steps in preallocated slots (cache/quant_slots.py), once set

    def step(self, layer_idx, keys, values, positions, attention_mask,
             window: int | None = None, banded: bool = False):
        return self.layers[layer_idx].step(keys, values, positions, attention_mask, window, self.owner, banded)

    def stash_prompt(self, lengths: list[int]) -> None:
        """Keep the exact keys and values of the next steps in every layer (`QuantKVLayer.stash`),
        for preallocated slots to code per row after a right-padded prefill whose rows hold
        `lengths` real tokens (a prefill-eviction composition then chooses each row's tokens among
        its own, `QuantKVAttention._evict`)."""
        for layer in self.layers:
            layer.stash, layer.stash_lengths, layer.kept_rows = [], lengths, None

    def holds_rows_apart(self) -> bool:
        """Whether a padded batch split its rows (then `row(b)` is a row's bytes as alone)."""
        return any(layer.rows is not None or (layer.dense is not None and layer.dense.by_rows)
                   for layer in self.layers)

    def row_bytes_by_snapshot(self) -> bool:
        """Whether a row's bytes are taken when it ends (`row(b)` once rows are apart, or an even
        share of an unpadded batch): codes that count tokens (KIVI, KVQuant) and rows that evict
        are not a per-token share of the batch's bytes; per-token codes (Atom, TurboQuant) are."""
        return self.layers[0].keeps_rows_apart

    def row(self, b: int) -> "QuantKVCache":
        """Row b of a batch whose rows are apart (`holds_rows_apart`), as a cache of its own."""
        if any(layer.dense is not None for layer in self.layers):
            return _DenseRowBytes([layer.dense for layer in self.layers], b)
        one = copy.copy(self)
        one.layers = [layer.rows[b] for layer in self.layers]
        return one

    def nbytes(self) -> dict:
        """Bytes as stored, summed over layers: `quantised` (packed codes), `metadata` (scales,
        minima, norms, outlier values and indices, per-layer codebooks), `full_precision`
        (sink and window tokens in the model's dtype), `positions` (pre-RoPE caches)."""
        totals: dict = {}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                totals[key] = totals.get(key, 0) + value
        totals["total"] = sum(v for k, v in totals.items() if k != "fixed")
        return totals


class _DenseRowBytes:
    """Row b of a batch on the batch path (`quant_dense`), for its bytes as alone: `nbytes` as
    `QuantKVCache.nbytes` counts them."""

    def __init__(self, layers, b: int):
        self.layers, self.b = layers, b

    def nbytes(self) -> dict:
        totals: dict = {}
        for layer in self.layers:
            for key, value in layer.row_nbytes(self.b).items():
                totals[key] = totals.get(key, 0) + value
        totals["total"] = sum(v for k, v in totals.items() if k != "fixed")
        return totals
