"""Triton decode attention over Palu latents (one query token per sequence): the launcher.

Flash-decoding style: the sequence is split across programs, then the splits are merged.
  - Non-RoPE layers (small ranks): `_fused_norope`, one pass per tile (scores q~.h, online
    softmax, accumulation of the attention-weighted *latent* values), then `_combine`.
  - RoPE layers: a scores kernel writes base-2 scores (4 bytes per head per token), keys never
    touch memory: `_scores_qproj` for MHA with contiguous positions (the query folded into B_k,
    q . RoPE_t(B h) as cos/sin-weighted dots with h) or `_scores` (rebuild the head's key tile
    with B_k and rotate it). Then `_fused_norope` with SCORES_IN accumulates the values, then
    `_combine`.
  - Layers too large for registers: `_scores`, `_values` (online softmax and value accumulation
    per group, split and rank chunk), `_combine`.
The caller maps z [B, H, Rv] to the hidden size (fused o_proj, or B_v then o_proj).
The kernels live one idea a module: unpack (packed fields), scores, qproj, values, one_pass,
combine; options holds what fits and the measured launch defaults.
"""
from __future__ import annotations

import os

import torch
import triton

from palu.quant.packed import QuantLatent
from .combine import _combine
from .one_pass import _fused_norope
from .launch_defaults import (_fused_unfit, _qproj_int_fits, _stored_pad, _values_unfit, one_pass_options,  # noqa: F401
                      one_pass_tiles, programs_per_sm, qproj_int_default, qproj_options, qproj_pair_default,
                      values_splits)
from .qproj import _scores_qproj
from .qproj_pair import _scores_qproj_pair
from .two_pass_scores import _scores
from .two_pass_values import _values

LOG2E = 1.4426950408889634


def _launch_combine(acc, ms, ls, z, splits, rows, M, rv, G):
    B, H = z.shape[0], z.shape[1]
    block_c = min(64, triton.next_power_of_2(rv))
    block_s = min(32, triton.next_power_of_2(splits))
    _combine[(B * H, triton.cdiv(rv, block_c))](acc, ms, ls, z, splits, z.stride(0), z.stride(1),
                                                ROWS=rows, M=M, RV=rv, BLOCK_C=block_c, G=G,
                                                BLOCK_S=block_s)


def _use_asm(dev) -> bool:
    """Inline PTX on a CUDA device; the Triton interpreter (CPU tests) runs none."""
    return dev.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


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


def _run_fused(q, kdata, kscale, kzero, kbits, vdata, vscale, vzero, vbits, lengths, scale,
               B, G, T, H, rk, rv, rows, M, block_t, stages, warps, splits, maxnreg=None,
               int_keys=False, scores=None):
    """One-pass kernel, one wave, then the combine. With `scores` [B, H, T] (a RoPE layer's, from
    a scores kernel) only the value side runs: q and the key arguments are not read."""
    dev = vdata.device
    ks = kscale if kbits != 16 else kdata
    vs = vscale if vbits != 16 else vdata
    sc = q if scores is None else scores

    def launch_args(acc, ms, ls, per_split, splits):
        return (q, kdata, kscale, kzero, vdata, vscale, vzero, sc, acc, ms, ls, lengths, per_split, splits,
                scale * LOG2E, q.stride(0), q.stride(1),
                kdata.stride(0), kdata.stride(1), kdata.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
                vdata.stride(0), vdata.stride(1), vdata.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
                sc.stride(0), sc.stride(1))

    meta = dict(ROWS=rows, M=M, RK=rk, RV=rv, RKPAD=_stored_pad(rk, kbits), RVPAD=_stored_pad(rv, vbits),
                BITS_K=kbits, BITS_V=vbits, BLOCK_T=block_t, G=G,
                ASM=_use_asm(dev), INT_KEYS=int_keys, SCORES_IN=scores is not None,
                num_stages=stages, num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    if splits is None:
        sms = _sm_count(dev)
        splits = max(1, min(triton.cdiv(T, 2 * block_t), triton.cdiv(8 * sms, B * G)))
        if _use_asm(dev):
            # One wave: as many splits as the GPU holds programs at once, so all start together
            # and stream equal shares; more leave a partial last wave (measured, benchmarks/NOTES.md:
            # group 8 int4 at 64K, 264 splits in 2 waves 96 us, 64 splits in one 75 us).
            key = (dev, tuple(meta.items()))   # constexprs and launch options: hashable
            if key not in _SLOTS:   # compile (no launch) to read registers and shared memory
                dummy = torch.empty(1, device=dev, dtype=torch.float32)
                compiled = _fused_norope.warmup(*launch_args(dummy, dummy, dummy, *_even_splits(T, splits, block_t)),
                                                grid=(1,), **meta)
                _SLOTS[key] = _resident_programs(compiled, dev)
            splits = max(1, min(triton.cdiv(T, 2 * block_t), _SLOTS[key] // (B * G)))
    per_split, splits = _even_splits(T, splits, block_t)
    acc = torch.empty(B, G, splits, M, rv, device=dev, dtype=torch.float32)
    ms = torch.empty(B, G, splits, M, device=dev, dtype=torch.float32)
    ls = torch.empty_like(ms)
    _fused_norope[(B * G, splits)](*launch_args(acc, ms, ls, per_split, splits), **meta)
    z = torch.empty(B, H, rv, device=dev, dtype=torch.float32)
    _launch_combine(acc, ms, ls, z, splits, rows, M, rv, G)
    return z


def palu_decode(q, hk, hv, *, scale: float, n_rep: int, group_size: int, bk=None,
                positions=None, position_offset=None, inv_freq=None, lengths=None,
                splits: int | None = None,
                block_t: int = 32, block_r: int | None = None, block_rv: int = 64,
                stages: tuple[int, int] = (2, 3), warps: tuple[int, int] = (4, 4),
                fused: bool | None = None, fused_block_t: int | None = None, fused_stages: int | None = None,
                fused_warps: int | None = None, fused_maxnreg: int | None = None,
                fused_int_keys: bool | None = None, qproj: bool | None = None,
                qproj_block_t: int | None = None, qproj_stages: int | None = None,
                qproj_warps: int | None = None, qproj_int: bool | None = None,
                qproj_pair: bool | None = None) -> torch.Tensor:
    """One decode step of attention over latents; returns z [B, H, Rv] (float32).

    Same contract as `palu_kernels.reference.latent_decode_reference`. RoPE mode when `bk`
    [G, group_size*D, Rk] is given (q [B, H, D] already rotated, positions [B, T],
    inv_freq [D/2]); otherwise q is the fused query [B, H, Rk]. Positions are either arbitrary
    (`positions` [B, T]) or contiguous from `position_offset` [B] (the usual cache; faster RoPE).
    Non-RoPE layers with small ranks take the one-pass `_fused_norope` kernel (`fused=None`:
    whenever it can; False: always the three-launch path; True: required, else an error).
    RoPE layers write scores with `_scores` or `_scores_qproj` (`qproj=None`: folded query for
    MHA with contiguous positions and key rank <= 256) and, unless `fused=False` or the value
    rank is too large, accumulate values with the one-pass kernel reading those scores
    (`qproj_*=None`: the measured tiles of `qproj_options`; `block_t`, `block_r`, `stages` and
    `warps` are those of `_scores` and `_values`, tuned in benchmarks/NOTES.md; `qproj_int`: packed
    keys through int8 tensor-core dots in the folded-query kernel, None: where measured faster,
    `qproj_int_default`; `qproj_pair`: fp16 latents two heads per program, `_scores_qproj_pair`,
    None: where measured faster, `qproj_pair_default`);
    `fused_block_t` / `fused_warps=None`: the measured tiles of `one_pass_tiles`;
    `fused_stages=None` picks 2 for fp16 and 3 for packed latents, `fused_maxnreg` caps its
    registers per thread (0: no cap), `fused_int_keys` sends packed keys through int8
    tensor-core dots (None: where measured faster, with a 128-register cap at rank 256).
    With `splits=None` the one-pass kernel runs one wave: as many sequence splits as the GPU
    holds programs at once. `lengths` [B] (default: all T) must lie in [1, T]; only a CPU tensor
    is checked. bf16 latents and queries are taken to fp16 on-chip (exact for
    6e-5 <= |x| < 65504, fp16's normal range; latents of real models lie well inside it).
    """
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
    mv = max(16, triton.next_power_of_2(group_size * n_rep))
    why_not = _fused_unfit(rope, rk, rv, kbits, vbits, mv)
    if fused and why_not:
        raise ValueError(f"the one-pass kernel cannot serve this layer: {why_not}")
    if fused is not False and not why_not:
        fused_stages, int_keys, fused_maxnreg = one_pass_options(
            kbits, vbits, rk, rv, fused_stages, fused_int_keys, fused_maxnreg)
        fused_block_t, fused_warps = one_pass_tiles(kbits, vbits, rk, rv, B * G * triton.cdiv(T, 256),
                                                    _sm_count(dev), fused_block_t, fused_warps)
        return _run_fused(q, kdata, kscale, kzero, kbits, vdata, vscale, vzero, vbits, lengths,
                          scale, B, G, T, H, rk, rv, group_size * n_rep, mv,
                          fused_block_t, fused_stages, fused_warps, splits, fused_maxnreg, int_keys)
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
    units = G * units_per_group
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
    if qproj:
        if not (rope and rows == 1 and contig):
            raise ValueError("qproj=True needs RoPE, one query per KV head and contiguous positions")
        # the split length as 32-token tiles would give it (the default splits below)
        split_tokens = triton.cdiv(T, splits or _two_pass_splits(T, 32, B * units, dev))
        qproj_block_t, qproj_stages, qproj_warps = qproj_options(kbits, rk, qproj_block_t, qproj_stages,
                                                                 qproj_warps, qproj_int, split_tokens)
        block_t = max(block_t, qproj_block_t)   # splits hold whole tiles of both kernels
    splits_arg = splits
    if splits is None:
        splits = _two_pass_splits(T, block_t, B * units, dev)
    per_split, splits = _even_splits(T, splits, block_t)
    if qproj and not int_told:
        # only the rank-256 choice depends on the split's length, and its tiles are the same
        # either way (qproj_options), so the splits above stand
        qproj_int = qproj_int_default(kbits, rkp, per_split)
    M = max(16, triton.next_power_of_2(rows))
    S = torch.empty(B, H, T, device=dev, dtype=torch.float32)
    ks = kscale if kbits != 16 else kdata
    if block_r is None:   # fp16 RoPE keys: B_k of rank <= 256 stays in registers (measured)
        block_r = 256 if rope and kbits == 16 else 128
    br = _pow2_block(rk // (1 if kbits == 16 else 8 // kbits), block_r)
    if qproj_pair:
        _scores_qproj_pair[(B * units // 2, splits)](
            q, kdata, bk, pos0, inv_freq, S, lengths, per_split, scale * LOG2E,
            q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
            S.stride(0), S.stride(1), UNITS_PER_GROUP=units_per_group, R=rk, HALF=q.shape[-1] // 2,
            BLOCK_T=qproj_block_t, NUM_UNITS=units, num_stages=qproj_stages, num_warps=qproj_warps)
    elif qproj:
        _scores_qproj[(B * units, splits)](
            q, kdata, kscale, kzero, bk, pos0, inv_freq, S, lengths, per_split, scale * LOG2E,
            q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
            ks.stride(0), ks.stride(1), ks.stride(2), S.stride(0), S.stride(1),
            UNITS_PER_GROUP=units_per_group, R=rk, HALF=q.shape[-1] // 2, BITS=kbits,
            BLOCK_T=qproj_block_t, NUM_UNITS=units, ASM=_use_asm(dev), INT_H=bool(qproj_int),
            num_stages=qproj_stages, num_warps=qproj_warps)
    else:
        grid = (B * units, splits)
        args = (q, kdata, kscale, kzero, bk if rope else q, positions, pos0, inv_freq, S, lengths,
                T, per_split, scale * LOG2E,
                q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
                ks.stride(0), ks.stride(1), ks.stride(2), positions.stride(0), S.stride(0), S.stride(1))
        meta = dict(UNITS_PER_GROUP=units_per_group, ROWS=rows, M=M, R=rk, BLOCK_R=br,
                    HALF=(q.shape[-1] // 2 if rope else 16), ROPE=rope, BITS=kbits,
                    BLOCK_T=block_t, NUM_UNITS=units, CONTIG=contig, ASM=_use_asm(dev),
                    num_stages=stages[0], num_warps=warps[0])
        _scores[grid](*args, DYN_CHUNKS=_dynamic_chunks(grid, args, meta, dev), **meta)
    if fused is not False and not _values_unfit(rv, vbits, mv):
        # the values half through the one-pass kernel (one wave, whole ranks)
        fused_block_t, fused_warps = one_pass_tiles(16, vbits, 0, rv, B * G * triton.cdiv(T, 256),
                                                    _sm_count(dev), fused_block_t, fused_warps)
        return _run_fused(q, q, q, q, 16, vdata, vscale, vzero, vbits, lengths, scale, B, G, T, H,
                          16, rv, group_size * n_rep, mv, fused_block_t,
                          fused_stages or (2 if vbits == 16 else 3), fused_warps, splits_arg,
                          fused_maxnreg, scores=S)
    rvp = rv // (1 if vbits == 16 else 8 // vbits)
    brv = _pow2_block(rvp, block_rv)
    chunks = rvp // brv   # blocks of stored columns; each program unpacks all their parts
    if splits_arg is None:   # the values kernel's own splits: its partials stay small
        sms = _sm_count(dev)
        per_split, splits = _even_splits(
            T, values_splits(T, splits, rv, vbits, group_size * n_rep, B * G * chunks, sms), block_t)
    acc = torch.empty(B, G, splits, mv, rv, device=dev, dtype=torch.float32)
    ms = torch.empty(B, G, splits, mv, device=dev, dtype=torch.float32)
    ls = torch.empty_like(ms)
    vs = vscale if vbits != 16 else vdata
    _values[(B * G, splits, chunks)](
        S, vdata, vscale, vzero, acc, ms, ls, lengths, per_split, splits,
        S.stride(0), S.stride(1), vdata.stride(0), vdata.stride(1), vdata.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        ROWS=group_size * n_rep, M=mv, RV=rv, BLOCK_RV=brv, BITS=vbits, BLOCK_T=block_t, G=G,
        ASM=_use_asm(dev), num_stages=stages[1], num_warps=warps[1])
    z = torch.empty(B, H, rv, device=dev, dtype=torch.float32)
    _launch_combine(acc, ms, ls, z, splits, group_size * n_rep, mv, rv, G)
    return z
