"""The decode launcher's policy: which scores kernel serves a RoPE layer (folded query, paired
heads, int8 dots, or key rebuild), the sequence splits, tiles and blocks, and what the GPU holds
(resident programs, SMs, shared memory). `palu_decode.palu_decode` launches what these choose;
the measured defaults behind them are in launch_defaults.py (benchmarks/NOTES.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from .launch_defaults import (_qproj_int_fits, rebuild_options, programs_per_sm, qproj_int_default, qproj_options,
                              qproj_pair_default)
from .two_pass_scores import _scores


def _use_asm(dev) -> bool:
    """Inline PTX on a CUDA device; the Triton interpreter (CPU tests) runs none."""
    return dev.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _pow2_block(columns: int, cap: int) -> int:
    """Largest power of two <= cap dividing `columns` (tl.arange needs powers of two)."""
    b = 1
    while b * 2 <= cap and columns % (b * 2) == 0:
        b *= 2
    if b < 16:
        raise ValueError(f"{columns} stored columns have no power-of-two block >= 16 "
                         "(tl.dot needs 16); use the torch reference path for this rank")
    return b


_SLOTS: dict = {}   # (device, kernel specialisation) -> resident programs per GPU


def _resident_programs(compiled, dev) -> int:
    """How many programs of a compiled kernel the GPU holds at once."""
    if getattr(compiled, "n_regs", None) is None:
        compiled._init_handles()   # loads the binary; triton sets n_regs then (not at compile)
    p = torch.cuda.get_device_properties(dev)
    return p.multi_processor_count * programs_per_sm(
        compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
        p.regs_per_multiprocessor, p.shared_memory_per_multiprocessor, p.max_threads_per_multi_processor)


_DYNAMIC: dict = {}   # (device, `_scores` specialisation) -> chunk loop not unrolled


def _dynamic_chunks(grid, args, meta, dev) -> bool:
    """Whether `_scores` must loop over its rank chunks instead of unrolling them: unrolled,
    the pipeliner buffers every chunk's loads, which for large ranks (J-LRD: rank 2048 needs
    656 KB with RoPE) exceeds an SM's shared memory. Decided by compiling the unrolled variant
    once per specialisation; the interpreter (no shared memory) unrolls."""
    if not _use_asm(dev):
        return False
    key = (dev, tuple(meta.items()))
    if key not in _DYNAMIC:
        compiled = _scores.warmup(*args, grid=grid, DYN_CHUNKS=False, **meta)
        limit = getattr(torch.cuda.get_device_properties(dev), "shared_memory_per_block_optin", 232448)
        _DYNAMIC[key] = compiled.metadata.shared > limit
    return _DYNAMIC[key]


_SMS: dict = {}   # device -> streaming multiprocessors


def _sm_count(dev) -> int:
    """Streaming multiprocessors of the device (4 stands in for the CPU interpreter). Cached:
    get_device_properties cost ~15 us of host time per call, three calls per decode step."""
    if dev.type != "cuda":
        return 4
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def _two_pass_splits(T: int, block_t: int, programs: int, dev) -> int:
    """Default sequence splits of the two-kernel (scores, values) path: enough programs for ~4
    waves of the SMs (8 per SM over `programs` per split), at least four tiles each."""
    return max(1, min(triton.cdiv(T, 4 * block_t), triton.cdiv(8 * _sm_count(dev), programs)))


def _even_splits(T: int, splits: int, block_t: int) -> tuple[int, int]:
    """(tokens per split, splits): whole tiles per split, no empty split."""
    per_split = triton.cdiv(triton.cdiv(T, splits), block_t) * block_t
    return per_split, triton.cdiv(T, per_split)


def _padded_block(columns: int, cap: int) -> int:
    """A rank block of min(cap, next power of two >= columns) stored columns (>= 16), the last
    chunk masked: rank 96 at 4 bits (48 columns, whose largest power-of-two divisor is 16) in
    one 64-column chunk instead of three 16-column dots."""
    if cap < 16 or cap & (cap - 1):
        raise ValueError(f"block_r={cap} must be a power of two >= 16 (tl.dot's minimum)")
    return max(16, min(cap, triton.next_power_of_2(columns)))


@dataclass(frozen=True)
class ScoresPlan:
    kernel: str                # qproj_pair | qproj | rebuild (the `_scores` key-rebuild kernel)
    qproj_int: bool            # packed keys through int8 dots (the folded-query kernel)
    qproj_block_t: int | None
    qproj_stages: int | None
    qproj_warps: int | None
    block_t: int               # the two-pass tiles (splits hold whole tiles of both kernels)
    stages: int                # the scores kernel's pipeline stages (`_scores`; the qproj kernels: qproj_stages)
    per_split: int
    splits: int
    block_r: int               # `_scores`' rank block (stored columns; masked where it overruns)


def scores_plan(*, rope: bool, rows: int, contig: bool, kbits: int, rk: int, units: int,
                units_per_group: int, T: int, B: int, dev, splits: int | None, block_t: int | None,
                block_r: int | None, qproj: bool | None, qproj_int: bool | None,
                qproj_pair: bool | None, qproj_block_t: int | None, qproj_stages: int | None,
                qproj_warps: int | None, pad_r: bool | None = None,
                stages: int | None = None) -> ScoresPlan:
    """The scores kernel of a two-pass step and its launch shape; the caller's explicit choices
    are checked (an impossible one is an error), None ones take the measured defaults. `pad_r`:
    the rebuild kernel's rank block is the power of two covering the stored columns (up to
    `block_r`), its overrun masked, instead of the largest power of two dividing them (False);
    `block_t`, `stages`, `pad_r` None: the rebuild kernel's measured defaults (`rebuild_options`:
    64-token tiles up to key rank 128) and 32-token tiles beside the folded-query kernels."""
    rkp = rk // (1 if kbits == 16 else 8 // kbits)
    if qproj is None:   # folded-query scores: MHA, contiguous positions, a small rank
        qproj = rope and rows == 1 and contig and rk <= 256 and rkp & (rkp - 1) == 0
    int_told = qproj_int is not None
    if not int_told:   # provisional (the whole sequence as one split); final once splits are known
        qproj_int = bool(qproj) and qproj_int_default(kbits, rkp, T)
    if qproj_int and not _qproj_int_fits(kbits, rkp):
        raise ValueError(f"qproj_int needs packed keys with a power-of-two number >= 32 of stored "
                         f"columns (key rank {rk}, {kbits}-bit)")
    pair_ok = bool(qproj) and kbits == 16 and units % 2 == 0 and units_per_group % 2 in (0, units_per_group)
    if qproj_pair and not pair_ok:
        raise ValueError(f"qproj_pair needs the folded-query kernel with fp16 keys and an even number of "
                         f"heads per group or one (got {kbits}-bit keys, {units_per_group} per group, "
                         f"{units} heads)")
    if qproj_pair is None:
        qproj_pair = pair_ok and qproj_pair_default(kbits, rk, units_per_group)
    if qproj_int and not qproj:
        raise ValueError("qproj_int needs the folded-query kernel (RoPE, one query per KV head, "
                         "contiguous positions, key rank <= 256)")
    if not qproj:
        block_t, stages, pad_r = rebuild_options(kbits, rk, block_t, stages, pad_r)
    else:
        block_t, stages = block_t or 32, stages or 2
    if qproj:
        if not (rope and rows == 1 and contig):
            raise ValueError("qproj=True needs RoPE, one query per KV head and contiguous positions")
        # the split length as 32-token tiles would give it (the default splits below)
        split_tokens = triton.cdiv(T, splits or _two_pass_splits(T, 32, B * units, dev))
        qproj_block_t, qproj_stages, qproj_warps = qproj_options(kbits, rk, qproj_block_t, qproj_stages,
                                                                 qproj_warps, qproj_int, split_tokens)
        block_t = max(block_t, qproj_block_t)   # splits hold whole tiles of both kernels
    if splits is None:
        splits = _two_pass_splits(T, block_t, B * units, dev)
    per_split, splits = _even_splits(T, splits, block_t)
    if qproj and not int_told:
        # only the rank-256 choice depends on the split's length, and its tiles are the same
        # either way (qproj_options), so the splits above stand
        qproj_int = qproj_int_default(kbits, rkp, per_split)
    if block_r is None:   # fp16 RoPE keys: B_k of rank <= 256 stays in registers (measured)
        block_r = 256 if rope and kbits == 16 else 128
    kernel = "qproj_pair" if qproj_pair else "qproj" if qproj else "rebuild"
    return ScoresPlan(kernel, bool(qproj_int), qproj_block_t, qproj_stages, qproj_warps, block_t, stages,
                      per_split, splits, _padded_block(rkp, block_r) if pad_r else _pow2_block(rkp, block_r))
