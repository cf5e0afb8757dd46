"""Launch options of the kernels: what fits in registers and tiles, and the measured defaults
(tiles, stages, warps, int8 dots, sequence splits). The measurements behind each default are in
benchmarks/NOTES.md."""
from __future__ import annotations

import triton

# Measured defaults (H200, Llama-2 / Llama-3 shapes; each number's measurement and the variants
# it beat are in benchmarks/NOTES.md, "Tile defaults"). Change them there first, with a timing.
ONE_PASS = {
    "stages_fp16": 2, "stages_packed": 3,        # pipeline stages
    "int_keys_min_rank": 256,                    # int8 key dots for 2/4-bit keys from this rank
    "int_keys_capped_up_to_rank": 256,           # ... with a register cap up to this rank
    "int_keys_maxnreg": 128,
    "small_rank": 128,                           # 2/4-bit ranks up to this take the long tiles
    "tiles_small_packed": (128, 2),              # (token tile, warps)
    "tiles": (64, 4),
}
QPROJ_TILES = {                                  # (token tile, pipeline stages, warps)
    "fp16": (64, 3, 8),
    "packed": (64, 3, 4),                        # key rank >= 128
    "packed_small": (32, 3, 2),                  # key rank < 128, fp16 unpack
    "packed_small_int8": (32, 3, 4),             # key rank < 128, int8 dots
    "packed_small_int8_long": (64, 3, 4),        # ... over splits of >= QPROJ_LONG_TILE_MIN_TOKENS
}
# The key-rebuild scores kernel `_scores` (GQA / J-LRD RoPE layers): (token tile, pipeline stages,
# padded rank block) for key ranks up to REBUILD_LONG_TILE_MAX_RANK, else the short tile. Measured
# on the H100 (session 44, `python -m palu_bench.batch_scores`, SmolLM2 J-LRD-50 % rank 96 and M-LRD,
# batch 64 / 128 x 4K): 64-token tiles 0.71-0.83x the time of 32 (fp16 0.64-0.67x), the padded block 0-4 % at
# 4 bits, 3 stages -8 % for packed keys (+8 % for fp16). Llama-2 G-LRD-4 (rank 256, fp16) ran
# 1.4x slower on 64-token tiles (session 2 tune), hence the rank bound.
REBUILD_TILES = {"short": (32, 2, False), "long_fp16": (64, 2, False), "long_packed": (64, 3, True)}
REBUILD_LONG_TILE_MAX_RANK = 128
QPROJ_PAIR_MIN_RANK = 256                        # fp16 G-LRD keys of this rank: two heads per program
QPROJ_LONG_TILE_MIN_TOKENS = 1024                # tokens per split (32-token tiles' splits)
QPROJ_INT_MIN_TOKENS_AT_128_COLUMNS = 1408       # tokens per split for int8 dots at rank 256


def _stored_pad(r: int, bits: int) -> int:
    """Stored columns of rank r, rounded up to a power of two (the one-pass kernel's tiles)."""
    return triton.next_power_of_2(r // (1 if bits == 16 else 8 // bits))


def _values_unfit(rv, vbits, M) -> str | None:
    """Why the one-pass kernel cannot accumulate a layer's values (None if it can)."""
    rv_pad = _stored_pad(rv, vbits) * (1 if vbits == 16 else 8 // vbits)
    if M * rv_pad > 16 * 512:   # the whole value rank lives in registers
        return f"value rank {rv} x {M} rows too large for registers"
    return None


def _fused_unfit(rope, rk, rv, kbits, vbits, M) -> str | None:
    """Why the one-pass kernel cannot serve a layer (None if it can)."""
    if rope:
        return "RoPE keys are rebuilt by the two-pass kernels"
    rk_pad = _stored_pad(rk, kbits) * (1 if kbits == 16 else 8 // kbits)
    if rk_pad > 512:   # whole ranks live in registers
        return f"key rank {rk} too large for registers"
    return _values_unfit(rv, vbits, M)


def programs_per_sm(regs: int, warps: int, shared: int, sm_regs: int = 65536,
                    sm_shared: int = 233472, sm_threads: int = 2048) -> int:
    """Blocks of a kernel one SM holds at once, as the occupancy calculator counts them:
    registers are allocated per warp in units of 256, each block reserves 1 KB of shared memory
    besides its own, at most 32 blocks (defaults: an H100/H200 SM)."""
    regs_per_warp = triton.cdiv(max(regs, 1) * 32, 256) * 256
    by_regs = sm_regs // (regs_per_warp * warps)
    by_smem = sm_shared // (shared + 1024) if shared else 32
    return max(1, min(by_regs, by_smem, sm_threads // (32 * warps), 32))


def values_splits(T: int, splits: int, rv: int, vbits: int, rows: int, blocks: int, sms: int) -> int:
    """Sequence splits of the two-pass values kernel: at most `splits`, and few enough that the
    float32 partial outputs (query rows x rv per split, written, then read by the combine) stay
    within 1/8 of the value latents' bytes -- unless that would leave the GPU with fewer than two
    programs per SM (`blocks` programs per split). Every query row of a group has its own
    partials, so with all heads in one group (J-LRD: 32 rows at rank 2048) 512 splits wrote
    134 MB of partials for 268 MB of fp16 latents; capping alone starved short contexts
    (a J-LRD layer at 4K tokens got one split and two programs)."""
    per_token = rv * 2 if vbits == 16 else rv * vbits // 8 + 4
    cap = T * per_token // (8 * 4 * rows * rv)
    fill = -(-2 * sms // blocks)
    return max(1, min(splits, max(cap, fill)))


def one_pass_options(kbits: int, vbits: int, rk: int, rv: int, stages: int | None = None,
                     int_keys: bool | None = None, maxnreg: int | None = None) -> tuple[int, bool, int | None]:
    """(pipeline stages, int8 key dots, register cap) of the one-pass kernel; None = the measured
    default (`ONE_PASS`). Int8 key dots pay for 2/4-bit keys of large rank and cost for small
    ones; they need more registers, so up to rank 256 a register cap keeps 4 programs per SM
    (at rank 512 the cap spills, so none there)."""
    if stages is None:
        stages = ONE_PASS["stages_fp16"] if kbits == vbits == 16 else ONE_PASS["stages_packed"]
    int_ok = kbits != 16 and _stored_pad(rk, kbits) >= 32   # int8 dots: k in steps of 32
    if int_keys and not int_ok:
        raise ValueError(f"fused_int_keys needs packed keys with >= 32 stored columns "
                         f"(key rank {rk}, {kbits}-bit)")
    if int_keys is None:
        int_keys = kbits in (2, 4) and rk >= ONE_PASS["int_keys_min_rank"]
    int_keys = bool(int_keys)
    if maxnreg is None and int_keys and max(rk, rv) <= ONE_PASS["int_keys_capped_up_to_rank"]:
        maxnreg = ONE_PASS["int_keys_maxnreg"]
    return stages, int_keys, maxnreg


def one_pass_tiles(kbits: int, vbits: int, rk: int, rv: int, programs: int, sms: int,
                   block_t: int | None = None, warps: int | None = None) -> tuple[int, int]:
    """(token tile, warps) of the one-pass kernel; None = the measured default (rk = 0: keys not
    read, the values half of a RoPE layer). `programs`: sequences x groups x cdiv(tokens, 256),
    the programs that 128-token tiles (two per split at least) can give the GPU's `sms` SMs.
    Small packed ranks run best on 2 warps with long tiles, as long as that leaves two programs
    per SM; larger ranks and fp16 latents need the registers of 4 warps."""
    packed = {kbits, vbits} - {16}
    small = (packed and packed <= {2, 4} and max(rk, rv) <= ONE_PASS["small_rank"]
             and programs >= 2 * sms)
    d = ONE_PASS["tiles_small_packed"] if small else ONE_PASS["tiles"]
    return (block_t or d[0], warps or d[1])


def rebuild_options(kbits: int, rk: int, block_t: int | None = None, stages: int | None = None,
                    pad_r: bool | None = None) -> tuple[int, int, bool]:
    """(token tile, pipeline stages, padded rank block) of the key-rebuild scores kernel; None =
    the measured default (`REBUILD_TILES`)."""
    if rk > REBUILD_LONG_TILE_MAX_RANK:
        d = REBUILD_TILES["short"]
    else:
        d = REBUILD_TILES["long_fp16" if kbits == 16 else "long_packed"]
    return (block_t or d[0], stages or d[1], d[2] if pad_r is None else pad_r)


def qproj_options(kbits: int, rk: int, block_t: int | None = None, stages: int | None = None,
                  warps: int | None = None, int_keys: bool = False,
                  tokens_per_split: int = 0) -> tuple[int, int, int]:
    """(token tile, pipeline stages, warps) of the folded-query RoPE scores kernel; None = the
    measured default (`QPROJ_TILES`). fp16 latents feed wgmma from shared memory on two
    warpgroups; packed latents are unpacked in registers and run best on one warpgroup, with
    short tiles at small key ranks -- except int8 dots over long splits (`tokens_per_split`, as
    32-token tiles would split the sequence), where 64-token tiles win."""
    if kbits == 16:
        d = QPROJ_TILES["fp16"]
    elif rk >= 128:
        d = QPROJ_TILES["packed"]
    elif int_keys:
        long = tokens_per_split >= QPROJ_LONG_TILE_MIN_TOKENS
        d = QPROJ_TILES["packed_small_int8_long" if long else "packed_small_int8"]
    else:
        d = QPROJ_TILES["packed_small"]
    return (block_t or d[0], stages or d[1], warps or d[2])


def qproj_pair_default(kbits: int, rk: int, units_per_group: int) -> bool:
    """Whether fp16 folded-query scores run two heads of a group per program when not told: where
    the heads share a latent tile of rank >= QPROJ_PAIR_MIN_RANK (measured faster: G-LRD-4 and
    the K25/V75 split's G-LRD-8; slower at group rank 128 and 64 and for M-LRD, whose two heads
    read two tiles and need more registers than two programs per SM allow)."""
    return kbits == 16 and rk >= QPROJ_PAIR_MIN_RANK and units_per_group % 2 == 0


def _qproj_int_fits(kbits: int, rkp: int) -> bool:
    """Packed keys whose stored columns (rkp) the int8-dot folded-query kernel can take."""
    return kbits != 16 and rkp >= 32 and rkp & (rkp - 1) == 0


def qproj_int_default(kbits: int, rkp: int, tokens_per_split: int) -> bool:
    """Whether the folded-query kernel takes packed keys through int8 dots when not told: for
    4-bit keys (measured faster; 2-bit measured slower, 8-bit not measured, so both keep the fp16
    unpack). At key rank 256 (128 stored columns) only over long splits: the int8 path folds the
    query twice per program, which over few tokens costs more than its dots save."""
    return (kbits == 4 and _qproj_int_fits(kbits, rkp)
            and (rkp < 128 or tokens_per_split >= QPROJ_INT_MIN_TOKENS_AT_128_COLUMNS))
