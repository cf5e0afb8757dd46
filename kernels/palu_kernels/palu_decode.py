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
The kernels live one idea a module: unpack (packed fields), two_pass_scores, qproj, qproj_pair,
two_pass_values, one_pass, combine. This module launches them; decode_inputs checks a step's
inputs, decode_policy chooses the scores kernel, splits and tiles, launch_defaults holds what fits
and the measured defaults.
"""
from __future__ import annotations

import torch
import triton

from .combine import launch_combine as _launch_combine
from .decode_inputs import check_inputs, check_positions
from .decode_policy import (_SLOTS, _dynamic_chunks, _even_splits, _pow2_block, _resident_programs,
                            _sm_count, _use_asm, scores_plan)
from .hopper_scores import rope_scores as hopper_rope_scores
from .launch_defaults import (_fused_unfit, _stored_pad, _values_unfit, one_pass_options, one_pass_tiles,
                              values_splits)
from .one_pass import _fused_norope
from .qproj import _scores_qproj
from .qproj_pair import _scores_qproj_pair
from .two_pass_scores import _scores
from .two_pass_values import _values

LOG2E = 1.4426950408889634


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
                block_t: int | None = None, block_r: int | None = None, block_rv: int = 64,
                stages: tuple[int, int] | None = None, warps: tuple[int, int] = (4, 4),
                fused: bool | None = None, fused_block_t: int | None = None, fused_stages: int | None = None,
                fused_warps: int | None = None, fused_maxnreg: int | None = None,
                fused_int_keys: bool | None = None, qproj: bool | None = None,
                qproj_block_t: int | None = None, qproj_stages: int | None = None,
                qproj_warps: int | None = None, qproj_int: bool | None = None,
                qproj_pair: bool | None = None, hopper: bool | None = None,
                pad_r: bool | None = None) -> torch.Tensor:
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
    `warps` are those of `_scores` and `_values`, tuned in benchmarks/NOTES.md, None: the measured
    defaults of `rebuild_options` (`_scores`) and 3 stages (`_values`); `qproj_int`: packed
    keys through int8 tensor-core dots in the folded-query kernel, None: where measured faster,
    `qproj_int_default`; `qproj_pair`: fp16 latents two heads per program, `_scores_qproj_pair`,
    None: where measured faster, `qproj_pair_default`);
    `pad_r=True`: the key-rebuild scores kernel's rank block covers the stored columns with one
    power of two (masked), not the largest power of two dividing them (`scores_plan`);
    `hopper=True`: RoPE scores by the warp-specialised CUDA kernel of `hopper_scores` (M-LRD rank 64,
    fp16 latents, contiguous positions, 1 or 4 query heads per KV head, a Hopper GPU; else an error
    naming why); None / False: the Triton scores kernels;
    `fused_block_t` / `fused_warps=None`: the measured tiles of `one_pass_tiles`;
    `fused_stages=None` picks 2 for fp16 and 3 for packed latents, `fused_maxnreg` caps its
    registers per thread (0: no cap), `fused_int_keys` sends packed keys through int8
    tensor-core dots (None: where measured faster, with a 128-register cap at rank 256).
    With `splits=None` the one-pass kernel runs one wave: as many sequence splits as the GPU
    holds programs at once. `lengths` [B] (default: all T) must lie in [1, T]; only a CPU tensor
    is checked. bf16 latents and queries are taken to fp16 on-chip (exact for
    6e-5 <= |x| < 65504, fp16's normal range; latents of real models lie well inside it).
    """
    if hopper and bk is None:
        raise ValueError("hopper=True: the Hopper kernel computes RoPE scores, and this is not a RoPE layer (bk=None)")
    x = check_inputs(q, hk, hv, bk, n_rep, group_size, lengths)
    q, bk, lengths, dev = x.q, x.bk, x.lengths, x.dev
    kbits, kdata, kscale, kzero, rk = x.kbits, x.kdata, x.kscale, x.kzero, x.rk
    vbits, vdata, vscale, vzero, rv = x.vbits, x.vdata, x.vscale, x.vzero, x.rv
    B, G, T, H, rope = x.B, x.G, x.T, x.H, x.rope
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
    positions, pos0, inv_freq, contig = check_positions(x, positions, position_offset, inv_freq)
    rows, units, units_per_group = x.rows, x.units, x.units_per_group
    plan = scores_plan(rope=rope, rows=rows, contig=contig, kbits=kbits, rk=rk, units=units,
                       units_per_group=units_per_group, T=T, B=B, dev=dev, splits=splits,
                       block_t=block_t, block_r=block_r, qproj=qproj, qproj_int=qproj_int,
                       qproj_pair=qproj_pair, qproj_block_t=qproj_block_t, qproj_stages=qproj_stages,
                       qproj_warps=qproj_warps, pad_r=pad_r, stages=stages[0] if stages else None)
    splits_arg, splits, per_split, block_t = splits, plan.splits, plan.per_split, plan.block_t
    stages = (plan.stages, stages[1] if stages else 3)
    M = max(16, triton.next_power_of_2(rows))
    S = None if hopper else torch.empty(B, H, T, device=dev, dtype=torch.float32)   # Hopper: its own
    ks = kscale if kbits != 16 else kdata
    if hopper:
        S = hopper_rope_scores(q, kdata if kbits == 16 else hk, bk, pos0, inv_freq, lengths, scale * LOG2E,
                               n_rep, group_size=group_size, contiguous_positions=contig)
    elif plan.kernel == "qproj_pair":
        _scores_qproj_pair[(B * units // 2, splits)](
            q, kdata, bk, pos0, inv_freq, S, lengths, per_split, scale * LOG2E,
            q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
            S.stride(0), S.stride(1), UNITS_PER_GROUP=units_per_group, R=rk, HALF=q.shape[-1] // 2,
            BLOCK_T=plan.qproj_block_t, NUM_UNITS=units, num_stages=plan.qproj_stages,
            num_warps=plan.qproj_warps)
    elif plan.kernel == "qproj":
        _scores_qproj[(B * units, splits)](
            q, kdata, kscale, kzero, bk, pos0, inv_freq, S, lengths, per_split, scale * LOG2E,
            q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
            ks.stride(0), ks.stride(1), ks.stride(2), S.stride(0), S.stride(1),
            UNITS_PER_GROUP=units_per_group, R=rk, HALF=q.shape[-1] // 2, BITS=kbits,
            BLOCK_T=plan.qproj_block_t, NUM_UNITS=units, ASM=_use_asm(dev), INT_H=plan.qproj_int,
            num_stages=plan.qproj_stages, num_warps=plan.qproj_warps)
    else:
        grid = (B * units, splits)
        args = (q, kdata, kscale, kzero, bk if rope else q, positions, pos0, inv_freq, S, lengths,
                T, per_split, scale * LOG2E,
                q.stride(0), q.stride(1), kdata.stride(0), kdata.stride(1), kdata.stride(2),
                ks.stride(0), ks.stride(1), ks.stride(2), positions.stride(0), S.stride(0), S.stride(1))
        meta = dict(UNITS_PER_GROUP=units_per_group, ROWS=rows, M=M, R=rk, BLOCK_R=plan.block_r,
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
