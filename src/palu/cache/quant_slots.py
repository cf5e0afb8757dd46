"""A quantised KV cache's decode steps in preallocated slots, replayed as CUDA graphs
(`eval/static_quant.greedy_static_quant`): KIVI, KIVI + SnapKV, Atom, TurboQuant, KIVI's value scales.

The batch path (`quant_dense.DenseRows`) already holds every row in one buffer, each token in the
form the cache holds it now, and codes the blocks that fall due; but it decides on the host which
rows are due and grows its buffer, so each step launches ~2.5x the plain model's kernels one by one
(KIVI-2 answered 3.06 prompts/s at 64 x 4K + 64 on the H200, session 36). Here the same state lives
in tensors of one shape with every count on the device, so a step can be captured once and replayed:

  - each layer's buffer has room for every new token: the prefill's tokens right-aligned at its
    width (row b's first slot `start[b]`, as `DenseRows` places them), step k's token at slot
    width + k in every row, its mask column opened in place;
  - each step codes, in every row, the block that would fall due at the row's count (`due`: the
    count of coded tokens grows), and writes back the coded block where due and the exact one
    elsewhere: the same codec call on the same exact block as `DenseRows`, so the same forms;
  - attention groups the query heads by KV head over the buffer (`grouped_decode`).

A padded batch prefilled right-padded (`QuantSlots(..., lengths=)`) is coded into its rows' forms
here, from the exact keys and values its layers kept (`_row_forms`). So a row sees, at every step,
the (key, value) pairs `DenseRows` gives it, which the reference layer gives it (tests/unit/test_static_quant_decode.py: every row of a left-padded batch within
1e-9 of its prompt alone in float64, answers and bytes equal to the eager loop's).
"""
from __future__ import annotations

import torch

from ..attention.grouped_decode import grouped_decode
from .quant_dense import held_nbytes


class QuantSlots:
    def __init__(self, cache, new_tokens: int, mask: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None):
        """`cache`: prefilled; `mask`: the prefill's (B, width) left-padding mask (None: none). A layer
        whose codes count no tokens holds a padded batch in one tensor, pads included: its rows'
        pads are dropped here, so every layer's rows hold only their real tokens. `lengths`: the
        prefill was right-padded (each row's tokens first, as alone) with every layer's exact
        keys and values stashed (`QuantKVLayer.stash`): each row's tokens are coded here, as the
        row alone holds them (`_row_forms`)."""
        pads = None if mask is None else (mask.shape[1] - mask.long().sum(-1)).tolist()
        self.keys, self.values, self.masks, self.widths, self.starts, self.counts = [], [], [], [], [], []
        self.held = []   # per layer, each row's tokens after the prefill, on the host (for bytes)
        self.codecs, self.schedule = None, None
        for i, lay in enumerate(cache.layers):
            if not lay.is_initialized or lay.get_seq_length() == 0:
                raise ValueError(f"layer {i} holds no tokens: prefill the batch through the cache first")
            if lay.dense is not None:
                raise ValueError(f"layer {i} has decoded on its batch path already: slots start after the prefill")
            self.codecs, self.schedule = (lay.k.codec, lay.v.codec), lay.schedule
            if lengths is not None:   # every row's tokens first: right-aligned by one gather a tensor
                keys, values, held = self._row_forms(lay, lengths)
                width = max(held)
                count = torch.tensor(held, dtype=torch.long, device=keys.device)
                bufs = [_right_aligned(x, count, width, new_tokens) for x in (keys, values)]
            else:
                parts = lay.rows if lay.rows is not None else [lay]   # a row layer holds one row
                keys = [row for p in parts for row in p.k.current(lay.dtype).split(1)]
                values = [row for p in parts for row in p.v.current(lay.dtype).split(1)]
                if lay.rows is None and pads is not None:   # one tensor, pads on the left of each row
                    keys = [k[:, :, p:] for k, p in zip(keys, pads)]
                    values = [v[:, :, p:] for v, p in zip(values, pads)]
                held = [k.shape[2] for k in keys]
                width, B, H = max(held), len(keys), keys[0].shape[1]
                bufs = [keys[0].new_zeros(B, H, width + new_tokens, keys[0].shape[-1]),
                        values[0].new_zeros(B, H, width + new_tokens, values[0].shape[-1])]
                for b, (k, v) in enumerate(zip(keys, values)):
                    bufs[0][b, :, width - held[b]:width] = k[0]
                    bufs[1][b, :, width - held[b]:width] = v[0]
                count = torch.tensor(held, dtype=torch.long, device=bufs[0].device)
            device = bufs[0].device
            start = width - count
            slots = torch.arange(width + new_tokens, device=device)
            mask = ((slots >= start[:, None]) & (slots < width))[:, None, None, :]
            self.keys.append(bufs[0])
            self.values.append(bufs[1])
            self.masks.append(mask)
            self.widths.append(width)
            self.starts.append(start)
            self.counts.append(count)
            self.held.append(held)
        self.step = torch.zeros(1, dtype=torch.long, device=self.keys[0].device)   # advanced on the device
        self.new_tokens = new_tokens
        # Layers whose rows hold the same counts (every layer but an evicting composition's) share
        # one step's due blocks: computed at the first such layer, reused by the rest (a captured
        # step replays the first layer's index kernels and every layer reads their outputs).
        self._shares_due = all(h == self.held[0] for h in self.held)
        self._due: dict = {}

    def _row_forms(self, lay, lengths: torch.Tensor):
        """(keys, values, held): every row's tokens (B, H, width, d), row b's first held[b] in the
        forms that row alone holds them after its prompt, from a right-padded prefill's exact keys
        and values: every whole block of the batch's width coded at once (a block's codes depend on
        that block alone, and every row's blocks start at its first token), kept for row b's tokens
        [sink, quantised_end(n_b)), exact elsewhere."""
        if not lay.stash:
            raise ValueError(f"layer {lay.layer_idx}: a right-padded prefill keeps its exact keys and "
                             "values (cache.stash_prompt(lengths) before it)")
        exact = [torch.cat([step[k] for step in lay.stash], 2) for k in (0, 1)]
        lay.stash = None
        if lay.kept_rows is not None:   # a prefill-eviction composition: each row's kept tokens first
            exact, lengths = _kept_first(exact, lay.kept_rows, lengths)
            lay.kept_rows = None
        sink = self.schedule.sink
        rows = lengths.tolist()
        forms = []
        for x, codec in zip(exact, self.codecs):
            n = x.shape[2]
            end = sink + max(0, n - sink) // codec.block * codec.block
            if end > sink:
                coded = codec.roundtrip(x[:, :, sink:end], lay.layer_idx)
                j = torch.arange(n, device=x.device)
                held = (j >= sink) & (j < self._quantised_end(lengths.to(x.device), codec.block)[:, None])
                x = torch.where(held[:, None, :, None], torch.cat([x[:, :, :sink], coded, x[:, :, end:]], 2), x)
            forms.append(x)
        return forms[0], forms[1], rows

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Every row's new token (B, H, 1, d) at the layer's next slot, its column opened and the
        blocks that fall due coded: the layer's keys, values and mask to attend with."""
        slot = self.step + self.widths[layer]
        self.keys[layer].index_copy_(2, slot, keys)
        self.values[layer].index_copy_(2, slot, values)
        self.masks[layer].index_fill_(3, slot, True)
        if layer == 0 or not self._shares_due:
            self._due.clear()
        for buf, codec in zip((self.keys[layer], self.values[layer]), self.codecs):
            self._code_due(buf, codec, layer)
        return self.keys[layer], self.values[layer], self.masks[layer]

    def attend(self, layer: int, queries, keys, values, scale: float) -> torch.Tensor:
        """One decode step of the layer: (B, nh, 1, d) queries over every slot the row holds."""
        keys, values, mask = self.write(layer, keys, values)
        return grouped_decode(queries, keys, values, mask, scale)

    def advance(self) -> None:
        self.step.add_(1)

    def _quantised_end(self, n: torch.Tensor, block: int) -> torch.Tensor:
        """`Schedule.quantised_end` for every row's count at once, on the device."""
        sink, window = self.schedule.sink, self.schedule.window
        return n.clamp(max=sink) + torch.div((n - window - sink).clamp(min=0), block, rounding_mode="floor") * block

    def _due_blocks(self, layer: int, block: int, cap: int):
        """(grows (B,), slots (B, 1, block, 1)): whether each row's count of coded tokens grows with
        this step's token, and the slots of the block starting at its first uncoded token."""
        if block not in self._due:
            old = self.counts[layer] + self.step          # (B,) tokens each row held before this one
            sink = self.schedule.sink
            end = self._quantised_end(old, block)
            grows = self._quantised_end(old + 1, block) - (old + 1).clamp(max=sink) != end - old.clamp(max=sink)
            slots = (self.starts[layer] + end)[:, None] + torch.arange(block, device=old.device)   # (B, block)
            self._due[block] = grows, slots.clamp(max=cap - 1)[:, None, :, None]
        return self._due[block]

    def _code_due(self, buf, codec, layer: int) -> None:
        """In every row, the block starting at its first uncoded token coded; kept where its count of
        coded tokens grows with this token (`DenseRows._code_due`), left exact elsewhere."""
        block = codec.block
        B, H, cap, d = buf.shape
        grows, slots = self._due_blocks(layer, block, cap)
        where = slots.expand(B, H, block, d)
        exact = buf.gather(2, where)
        coded = codec.roundtrip(exact, layer)
        buf.scatter_(2, where, torch.where(grows[:, None, None, None], coded, exact))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (a device index, in order): the rows that ended leave."""
        places = rows.tolist()
        for name in ("keys", "values", "masks", "starts", "counts"):
            setattr(self, name, [t[rows] for t in getattr(self, name)])
        self.held = [[held[i] for i in places] for held in self.held]
        self._due.clear()

    def row(self, b: int, new: int) -> "_SlotRowBytes":
        """Row b once `new` decoded tokens are in the cache, for its bytes as alone."""
        return _SlotRowBytes(self, b, new)


def _kept_first(exact, kept_rows, lengths):
    """The exact keys and values (B, H, width, d) with each row's kept tokens first, right-padded
    with zeros, by one gather a tensor: the prompt of n_b tokens the row holds after its eviction,
    and those n_b. `kept_rows`: `ScoredEviction.keep_right_padded`'s (index (B, H or 1, width),
    counts) in order per KV head; (None, _): every row keeps all its tokens."""
    index, counts = kept_rows
    if index is None:
        return exact, lengths
    B, H, width = exact[0].shape[0], exact[0].shape[1], index.shape[-1]
    index = index.expand(B, H, width)
    real = torch.arange(width, device=index.device) < torch.tensor(counts, device=index.device)[:, None, None]
    out = [x.gather(2, index[..., None].expand(B, H, width, x.shape[-1])).masked_fill_(~real[..., None], 0)
           for x in exact]
    return out, torch.tensor(counts, device=lengths.device)


def _right_aligned(x: torch.Tensor, held: torch.Tensor, width: int, extra: int) -> torch.Tensor:
    """A slot buffer (B, H, width + extra, d) with row b's first held[b] tokens of `x` (B, H, S, d)
    at slots [width - held[b], width), zeros elsewhere: one gather where a copy a row was
    (2 x 64 rows x 30 layers of small copies at a batch of 64)."""
    B, H, S, d = x.shape
    slots = torch.arange(width + extra, device=x.device)
    src = slots - (width - held)[:, None]                                     # (B, slots)
    real = (src >= 0) & (src < held[:, None])
    got = x.gather(2, src.clamp(0, S - 1)[:, None, :, None].expand(B, H, width + extra, d))
    return got.masked_fill_(~real[:, None, :, None], 0)   # the gather's own tensor: no second buffer


class _SlotRowBytes:
    """`QuantKVCache.nbytes` of one row of the slots: the codes, their metadata and the exact
    tokens as the reference layer stores them (`quant_dense.held_nbytes`)."""

    def __init__(self, slots: QuantSlots, b: int, new: int):
        self.slots, self.b, self.new = slots, b, new

    def nbytes(self) -> dict:
        s = self.slots
        totals: dict = {}
        for layer, (keys, held) in enumerate(zip(s.keys, s.held)):
            n = held[self.b] + self.new
            part = held_nbytes(s.codecs, s.schedule, layer, n, (keys, s.values[layer]))
            for key, value in part.items():
                totals[key] = totals.get(key, 0) + value
        totals["total"] = sum(v for k, v in totals.items() if k != "fixed")
        return totals
