"""Decode steps of a quantised KV cache at batch speed (`quant_cache.QuantKVLayer`, after its prefill).

The reference layer dequantises every coded token at every step, and a left-padded batch of a
method that counts tokens (KIVI's window and key blocks) is held one row layer per row, stepped in
a Python loop: at a batch of 64 on the H200 KIVI-2 answered 0.30 prompts/s (session 35,
`results/throughput/h200-smollm2-4k-baselines.json`). Here every row of the batch sits in one
buffer (B, H, capacity, d) in the model's dtype, holding each token in the form the cache holds it
now: the sink and the newest tokens exact, the coded ones dequantised. A row's tokens end at the
batch's last slot (the rows are right-aligned, as a left-padded batch is), so a row is its first
slot `start[b]` and its token count `n[b]`, both on the host. A one-token step writes the new
token, codes what the schedule says falls due this step (at most one block per row and stream:
`block` tokens leave the window, for the rows whose count reaches a block boundary, all such rows
coded at once) and returns the buffer with a mask of each row's slots.

The same tokens in the same forms as the reference layer: a token is coded once, from its exact
value, by the same codec call on the same block (codes of a block depend on that block alone), and
a coded token never changes again; attention then sees the same (key, value) pairs, in other
columns (tests/unit/test_quant_dense.py: every row within 1e-9 of the reference in float64, the
same tokens, the same bytes). Bytes are the codes' as the reference stores them, from the codecs'
`nbytes_for` (checked against the reference layer's real tensors); the buffer itself is the
harness's working copy, as a dequantising kernel's registers would be. Codecs declare `dense`
(their codes of a block depend on that block alone); pre-RoPE caches (KVQuant) and sliding-window
layers keep the reference path, and so does everything with PALU_QUANT_DENSE=0.
"""
from __future__ import annotations

import os

import torch

from .protocol import to_device


def enabled() -> bool:
    return os.environ.get("PALU_QUANT_DENSE", "1") != "0"


def _pinned(values, device) -> torch.Tensor:
    """Host integers on `device` without a wait for its queue."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


class DenseRows:
    """One layer's keys and values for a batch, each token in its current form (module docstring)."""

    def __init__(self, k_codec, v_codec, schedule, layer: int, rows: list[torch.Tensor],
                 values: list[torch.Tensor], seen: int, by_rows: bool):
        """`rows` / `values`: each row's held tokens in order, (1, H, n_b, d), in current form;
        `seen`: the tokens the batch has seen (its next position, pads and evicted ones counted);
        `by_rows`: rows of different counts (a padded batch kept apart): the mask comes from the
        rows' slots; otherwise every row holds the same tokens and the model's mask applies."""
        self.codecs, self.schedule, self.layer = (k_codec, v_codec), schedule, layer
        self.n = [r.shape[2] for r in rows]
        self.width = max(self.n)
        self.by_rows, self.seen = by_rows, seen
        first = rows[0]
        B, H = len(rows), first.shape[1]
        cap = self.width + 64
        self.bufs = [first.new_zeros(B, H, cap, first.shape[-1]),
                     values[0].new_zeros(B, H, cap, values[0].shape[-1])]
        for b, (k, v) in enumerate(zip(rows, values)):
            lo = self.width - k.shape[2]
            self.bufs[0][b, :, lo:self.width] = k[0]
            self.bufs[1][b, :, lo:self.width] = v[0]
        self.start = [self.width - n for n in self.n]    # constant: a step adds one slot and one token
        self._start_dev = _pinned(self.start, first.device)
        self._heads = torch.arange(H, device=first.device)

    # ---- a decode step --------------------------------------------------------------------------
    def step(self, keys, values, attention_mask):
        """Append one token to every row (keys / values (B, H, 1, d)), code what falls due, and
        return (keys, values, mask) for the step's attention over slots [0, width)."""
        if keys.shape[2] != 1:
            raise ValueError("a quantised cache past its prefill takes one token a step on its batch "
                             "path; set PALU_QUANT_DENSE=0 to feed several tokens after decoding")
        self._grow()
        w = self.width
        self.bufs[0][:, :, w] = keys[:, :, 0]
        self.bufs[1][:, :, w] = values[:, :, 0]
        self.width, self.seen = w + 1, self.seen + 1
        old = self.n
        self.n = [n + 1 for n in old]
        for buf, codec in zip(self.bufs, self.codecs):
            self._code_due(buf, codec, old)
        keys, values = self.bufs[0][:, :, :self.width], self.bufs[1][:, :, :self.width]
        if self.by_rows:
            slots = torch.arange(self.width, device=keys.device)
            mask = (slots[None, :] >= self._start_dev[:, None])[:, None, None, :]
        elif attention_mask is not None:
            base = attention_mask[..., -1:, :self.width]
            mask = base if base.dtype == torch.bool else base == 0
        else:
            mask = None
        return keys, values, mask

    def _code_due(self, buf, codec, old: list[int]) -> None:
        """Code, in every row whose count just reached it, the block that left the window."""
        block, sched = codec.block, self.schedule
        # coded tokens are [sink, quantised_end(n)): a block falls due when their count grows;
        # it starts at quantised_end(n), the first token not yet coded
        due = [(b, self.start[b] + sched.quantised_end(n, block)) for b, n in enumerate(old)
               if sched.coded(n + 1, block) != sched.coded(n, block)]
        if not due:
            return
        rows = _pinned([b for b, _ in due], buf.device)
        slots = _pinned([[s + i for i in range(block)] for _, s in due], buf.device)
        where = (rows[:, None, None], self._heads[None, :, None], slots[:, None, :])
        exact = buf[where]                                              # (rows, H, block, d)
        buf[where] = codec.roundtrip(exact, self.layer)

    def _grow(self) -> None:
        if self.width < self.bufs[0].shape[2]:
            return
        extra = max(64, self.width // 2)
        self.bufs = [torch.cat([b, b.new_zeros(*b.shape[:2], extra, b.shape[-1])], 2) for b in self.bufs]

    # ---- rows and bytes -------------------------------------------------------------------------
    def map_rows(self, fn) -> None:
        """Beam search and batch edits: `fn` indexes the batch axis (rows move whole)."""
        order = fn(torch.arange(len(self.n))).tolist()
        self.bufs = [fn(b) for b in self.bufs]
        self.n, self.start = [self.n[i] for i in order], [self.start[i] for i in order]
        self._start_dev = fn(self._start_dev)

    def row_nbytes(self, b: int) -> dict:
        """Row b's bytes as the reference layer stores them (`held_nbytes`)."""
        return held_nbytes(self.codecs, self.schedule, self.layer, self.n[b], self.bufs)

    def nbytes(self) -> dict:
        parts = [self.row_nbytes(b) for b in range(len(self.n))]
        out = {key: sum(p[key] for p in parts) for key in parts[0]}
        out["metadata"] -= out["fixed"] - parts[0]["fixed"]   # per-layer metadata once for the batch
        out["fixed"] = parts[0]["fixed"]
        return out


def held_nbytes(codecs, schedule, layer: int, n: int, bufs) -> dict:
    """The bytes of one row holding `n` tokens as the reference layer stores them (codes, their
    metadata, the exact tokens), from the codecs' counts; `bufs`: the keys' and values' buffers
    (B, H, slots, d), for their heads, widths and element size."""
    out = {"quantised": 0, "metadata": 0, "full_precision": 0, "positions": 0}
    for buf, codec in zip(bufs, codecs):
        H, d = buf.shape[1], buf.shape[-1]
        coded = schedule.coded(n, codec.block)
        part = codec.nbytes_for(coded, 1, H, d)
        out["quantised"] += part["quantised"]
        out["metadata"] += part["metadata"]
        out["full_precision"] += (n - coded) * H * d * buf.element_size()
    fixed = sum(c.layer_metadata_nbytes(layer) for c in codecs)
    out["metadata"] += fixed
    out["fixed"] = fixed
    return out
