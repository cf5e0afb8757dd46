"""Preallocated latent slots in the kernels' layout ([batch, groups, tokens, rank], fp16/bf16 or
packed 2/4/8-bit with fp16 scales and zero points): the storage of `GraphLatentCache`."""
from __future__ import annotations

import torch

from palu.quant.packed import QuantLatent


def slot_buffer(batch, groups, tokens, rank, bits, device, dtype):
    """Zeroed slots for `tokens` tokens; `bits` 16 keeps `dtype`, 2/4/8 packs along the rank."""
    if bits == 16:
        return torch.zeros(batch, groups, tokens, rank, device=device, dtype=dtype)
    if rank % (8 // bits):
        raise ValueError(f"rank {rank} is not a multiple of {8 // bits} ({bits}-bit packing)")
    shape = (batch, groups, tokens)
    return QuantLatent(torch.zeros(*shape, rank // (8 // bits), device=device, dtype=torch.uint8),
                       torch.zeros(*shape, device=device, dtype=torch.float16),
                       torch.zeros(*shape, device=device, dtype=torch.float16), bits, rank)


def slot_range(buf, start: int, stop: int):
    """Tokens start .. stop-1 of a slot buffer (views, no copy)."""
    if isinstance(buf, QuantLatent):
        return QuantLatent(buf.data[:, :, start:stop], buf.scale[:, :, start:stop],
                           buf.zero[:, :, start:stop], buf.bits, buf.rank)
    return buf[:, :, start:stop]


def slot_rows(buf, rows: torch.Tensor):
    """The batch rows `rows` of a slot buffer (a copy: the rows that leave are freed)."""
    if isinstance(buf, QuantLatent):
        return QuantLatent(buf.data[rows], buf.scale[rows], buf.zero[rows], buf.bits, buf.rank)
    return buf[rows]


def slot_nbytes(buf) -> int:
    """Bytes held, packed data, scales and zero points included."""
    return buf.nbytes() if isinstance(buf, QuantLatent) else buf.numel() * buf.element_size()
