"""The decode kernels' inputs, checked and normalised before any launch: latents (fp16 / bf16 or
packed `QuantLatent`), the query, B_k in RoPE mode, lengths, positions and RoPE frequencies. Every
error names the bad shape or value; what is checked costs no host sync on a GPU."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from palu.quant.packed import QuantLatent


def _bits_and_parts(x, name):
    data = x.data if isinstance(x, QuantLatent) else x
    if not isinstance(x, QuantLatent) and x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{name} latents must be fp16/bf16 or QuantLatent, got {x.dtype}")
    if data.dim() != 4 or (data.stride(-1) != 1 and data.shape[-1] > 1):
        # the kernels address [batch, group, token] by strides and the rank contiguously
        raise ValueError(f"{name} latents must be [batch, groups, tokens, rank] with unit stride "
                         f"along the rank (src/palu/quant/packed.py); got shape {tuple(data.shape)}, "
                         f"strides {data.stride()}")
    if isinstance(x, QuantLatent):
        if x.bits not in (2, 4, 8) or x.rank * x.bits != data.shape[-1] * 8:
            raise ValueError(f"{name} latents: {data.shape[-1]} packed bytes per token do not hold "
                             f"rank {x.rank} at {x.bits} bits")
        if x.scale.shape != data.shape[:3] or x.zero.shape != data.shape[:3]:
            raise ValueError(f"{name} latents: scales {tuple(x.scale.shape)} / zero points "
                             f"{tuple(x.zero.shape)} must be [batch, groups, tokens] = {tuple(data.shape[:3])}")
        return x.bits, x.data, x.scale, x.zero, x.rank
    return 16, x, x, x, x.shape[-1]


def _check_pow2(value, name):
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16 for the kernel "
                         "(use the torch reference path otherwise)")


@dataclass(frozen=True)
class DecodeInputs:
    q: torch.Tensor
    bk: torch.Tensor | None
    lengths: torch.Tensor          # [B] int32 on the latents' device
    dev: torch.device
    kbits: int
    kdata: torch.Tensor
    kscale: torch.Tensor
    kzero: torch.Tensor
    rk: int
    vbits: int
    vdata: torch.Tensor
    vscale: torch.Tensor
    vzero: torch.Tensor
    rv: int
    B: int
    G: int
    T: int
    H: int
    rope: bool
    units_per_group: int           # query units per group a scores program serves
    rows: int                      # query rows per unit

    @property
    def units(self) -> int:
        return self.G * self.units_per_group


def check_inputs(q, hk, hv, bk, n_rep: int, group_size: int, lengths) -> DecodeInputs:
    """Shapes, widths and lengths of one decode step (positions: `check_positions`, only for the
    kernels that read them)."""
    kbits, kdata, kscale, kzero, rk = _bits_and_parts(hk, "key")
    vbits, vdata, vscale, vzero, rv = _bits_and_parts(hv, "value")
    B, G, T, _ = kdata.shape
    if q.dim() != 3 or q.shape[0] != B:
        raise ValueError(f"query must be [batch={B}, heads, dim]; got shape {tuple(q.shape)}")
    if vdata.shape[:3] != kdata.shape[:3]:
        raise ValueError(f"key latents {tuple(kdata.shape)} and value latents {tuple(vdata.shape)} "
                         "differ in batch, groups or tokens")
    q = q if q.stride(-1) == 1 else q.contiguous()   # a few KB: copying beats a strided path
    H = q.shape[1]
    if H != G * group_size * n_rep:
        raise ValueError(f"{H} query heads != {G} groups x {group_size} KV heads x {n_rep}")
    rope = bk is not None
    if rope:
        D = q.shape[-1]
        _check_pow2(D // 2, "head_dim/2")
        if bk.shape != (G, group_size * D, rk):
            raise ValueError(f"bk shape {tuple(bk.shape)} != {(G, group_size * D, rk)}")
        units_per_group, rows = group_size, n_rep
        bk = bk.to(torch.float16).contiguous()
    else:
        if q.shape[-1] != rk:
            raise ValueError(f"fused query dim {q.shape[-1]} != key rank {rk}")
        units_per_group, rows = 1, group_size * n_rep
    for r, bits, name in ((rk, kbits, "key rank"), (rv, vbits, "value rank")):
        per = 1 if bits == 16 else 8 // bits
        if (r // per) % 16:
            raise ValueError(f"{name} {r} must give a multiple of 16 stored columns ({bits}-bit)")
    dev = kdata.device
    if lengths is not None:
        if lengths.shape != (B,):
            raise ValueError(f"lengths shape {tuple(lengths.shape)} != (batch,) = {(B,)}")
        # values are checked only where that is free (a CUDA tensor would need a host sync per
        # step, and no sync can run inside a captured CUDA graph); past T the kernels read garbage
        if lengths.device.type == "cpu" and (lengths.min() < 1 or lengths.max() > T):
            raise ValueError(f"lengths {lengths.tolist()} must lie in [1, {T}] (the cached tokens)")
    lengths = (torch.full((B,), T, dtype=torch.int32, device=dev) if lengths is None
               else lengths.to(device=dev, dtype=torch.int32).contiguous())
    return DecodeInputs(q, bk, lengths, dev, kbits, kdata, kscale, kzero, rk, vbits, vdata, vscale, vzero,
                        rv, B, G, T, H, rope, units_per_group, rows)


def check_positions(x: DecodeInputs, positions, position_offset, inv_freq):
    """(positions [B, T] or [B, 1], pos0 [B], inv_freq, contiguous): arbitrary `positions`, or
    contiguous ones from `position_offset` (default 0)."""
    B, T, dev, rope, lengths, q = x.B, x.T, x.dev, x.rope, x.lengths, x.q
    contig = positions is None
    if contig:
        pos0 = (torch.zeros(B, dtype=torch.int32, device=dev) if position_offset is None
                else position_offset.to(torch.int32).contiguous())
        positions = pos0[:, None]
    else:
        if positions.shape != (B, T):
            raise ValueError(f"positions shape {tuple(positions.shape)} != (batch, tokens) = {(B, T)}")
        positions, pos0 = positions.to(torch.int32).contiguous(), lengths
    if contig and pos0.shape != (B,):
        raise ValueError(f"position_offset shape {tuple(pos0.shape)} != (batch,) = {(B,)}")
    if inv_freq is None:
        if rope:
            raise ValueError("RoPE mode (bk given) needs inv_freq [head_dim / 2]")
        inv_freq = torch.ones(1, device=dev)
    elif rope and inv_freq.shape != (q.shape[-1] // 2,):
        raise ValueError(f"inv_freq shape {tuple(inv_freq.shape)} != (head_dim / 2,) = {(q.shape[-1] // 2,)}")
    inv_freq = inv_freq.float().contiguous()
    return positions, pos0, inv_freq, contig
