"""Packed latent fields unpacked in-kernel: exact small integers (fp16 or int8 operands),
query columns split the same way, and the per-token scale / zero-point loads."""
from __future__ import annotations

import triton
import triton.language as tl


# Packed latents are unpacked to exact small integers; scales and zero points are folded in by
# the callers (per token: k = s (B n) - s z (B 1), q.h = s (q.n) - s z (sum q),
# sum_t p h = sum_t (p s) n - sum_t p s z), so unpacking is the only per-element work.
# Part k of packed bytes as fp16 (n - 2^(bits-1)) * 2^(k bits), four bytes per asm block: two
# PRMTs spread the bytes over the half-words, one LOP3 per pair keeps field k and ORs in the fp16
# exponent of 1024 (the FasterTransformer / Marlin trick without a shift: the field stays where it
# is and its weight 2^(k bits) goes into the query or the output scale), one HSUB2 per pair
# removes 1024 + 2^(bits-1) 2^(k bits). A byte-wise unpack spends ~3 instructions per value;
# this spends 1.25. Why centred: the tensor cores' fp32 accumulation truncates, so its
# error grows with the partial sums' size; with n in [0, 2^bits) every token adds ~2^(bits-1) s p
# to the value accumulators, a sum that the zero-point term then cancels, and at 128K tokens of
# spread attention the remainder lost 0.6-2 % (measured, benchmarks/NOTES.md). Centred fields
# add terms of either sign. (Leaving the 1024 in costs 10-50x more for the same reason.)
# Callers shift the zero point alike: `_unpacked_zero`.
def _unpack_asm(k: int, bits: int) -> str:
    mask = ((1 << bits) - 1) << (k * bits)
    sub = 0x6400 | (1 << (k * bits + bits - 1))   # fp16 1024 + 2^(bits-1) 2^(k bits)
    return ("{ .reg .b32 a<2>, c, d; mov.b32 c, 0x64006400; "
            f"mov.b32 d, {sub << 16 | sub:#010x}; "
            "prmt.b32 a0, $2, 0, 0x4140; prmt.b32 a1, $2, 0, 0x4342; "
            f"lop3.b32 a0, a0, {mask << 16 | mask:#010x}, c, 0xea; "
            f"lop3.b32 a1, a1, {mask << 16 | mask:#010x}, c, 0xea; "
            "sub.f16x2 $0, a0, d; sub.f16x2 $1, a1, d; }")


_ASM_8_0: tl.constexpr = tl.constexpr(_unpack_asm(0, 8))
_ASM_4_0: tl.constexpr = tl.constexpr(_unpack_asm(0, 4))
_ASM_4_1: tl.constexpr = tl.constexpr(_unpack_asm(1, 4))
_ASM_2_0: tl.constexpr = tl.constexpr(_unpack_asm(0, 2))
_ASM_2_1: tl.constexpr = tl.constexpr(_unpack_asm(1, 2))
_ASM_2_2: tl.constexpr = tl.constexpr(_unpack_asm(2, 2))
_ASM_2_3: tl.constexpr = tl.constexpr(_unpack_asm(3, 2))


@triton.jit
def _unpack_part(raw, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Part k of packed latents as fp16 (n - 2^(BITS-1)) * 2^(k BITS), n the stored integer
    (exact); the zero point goes with it (`_unpacked_zero`).

    Callers divide the query part (or the output part) by 2^(k BITS). ASM=False (the Triton
    interpreter, which runs no inline assembly) computes the same numbers with plain integer ops.
    """
    if ASM:
        if BITS == 8:
            code: tl.constexpr = _ASM_8_0
        elif BITS == 4:
            code: tl.constexpr = _ASM_4_0 if k == 0 else _ASM_4_1
        elif k == 0:
            code: tl.constexpr = _ASM_2_0
        elif k == 1:
            code: tl.constexpr = _ASM_2_1
        elif k == 2:
            code: tl.constexpr = _ASM_2_2
        else:
            code: tl.constexpr = _ASM_2_3
        x = tl.inline_asm_elementwise(code, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:
        n = (raw.to(tl.int32) & (((1 << BITS) - 1) << (k * BITS))) | 0x6400
        x = n.to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + (1 << (k * BITS + BITS - 1)))
    return x


@triton.jit
def _unpacked_zero(zp, BITS: tl.constexpr):
    """The zero point of fields unpacked by `_unpack_part` (centred: n - 2^(BITS-1))."""
    return zp - (1 << (BITS - 1))


# Field k of packed bytes as signed 8-bit integers, four bytes per 32-bit word (the operand
# layout of int8 tensor-core dots): a shift and an AND per word. 8-bit latents (0..255) are
# stored shifted by -128 (XOR of the top bit) to fit int8; callers add 128 to the zero point.
_INT8_8_0: tl.constexpr = tl.constexpr("xor.b32 $0, $1, 0x80808080;")
_INT8_4_0: tl.constexpr = tl.constexpr("and.b32 $0, $1, 0x0f0f0f0f;")
_INT8_4_1: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 4; and.b32 $0, a, 0x0f0f0f0f; }")
_INT8_2_0: tl.constexpr = tl.constexpr("and.b32 $0, $1, 0x03030303;")
_INT8_2_1: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 2; and.b32 $0, a, 0x03030303; }")
_INT8_2_2: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 4; and.b32 $0, a, 0x03030303; }")
_INT8_2_3: tl.constexpr = tl.constexpr("{ .reg .b32 a; shr.b32 a, $1, 6; and.b32 $0, a, 0x03030303; }")


@triton.jit
def _field_int8(raw, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Field k of packed latents as int8: n for 2/4-bit, n - 128 for 8-bit latents."""
    if ASM:
        if BITS == 8:
            code: tl.constexpr = _INT8_8_0
        elif BITS == 4:
            code: tl.constexpr = _INT8_4_0 if k == 0 else _INT8_4_1
        elif k == 0:
            code: tl.constexpr = _INT8_2_0
        elif k == 1:
            code: tl.constexpr = _INT8_2_1
        elif k == 2:
            code: tl.constexpr = _INT8_2_2
        else:
            code: tl.constexpr = _INT8_2_3
        x = tl.inline_asm_elementwise(code, "=r,r", [raw], dtype=tl.int8, is_pure=True, pack=4)
    elif BITS == 8:
        x = (raw.to(tl.int32) - 128).to(tl.int8)
    else:
        x = ((raw.to(tl.int32) >> (k * BITS)) & ((1 << BITS) - 1)).to(tl.int8)
    return x


@triton.jit
def _query_cols(q_rows, row_ok, k: tl.constexpr, RKP: tl.constexpr, PAD: tl.constexpr):
    """Query columns of packed part k (RKP of them, zero-padded to the power of two PAD), fp32."""
    c = tl.arange(0, PAD)
    ok = row_ok[:, None] & (c < RKP)[None, :]
    return tl.load(q_rows + k * RKP + c[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _query_int8(q_rows, row_ok, k: tl.constexpr, RKP: tl.constexpr, PAD: tl.constexpr, inv_sq):
    """Query columns of part k as two int8 digits (q ~ sq (hi + lo / 256)): an int8 dot per
    digit gives the query 16 bits of precision relative to its row maximum."""
    return _digits(_query_cols(q_rows, row_ok, k, RKP, PAD) * inv_sq[:, None])


@triton.jit
def _digits(x):
    """x (|x| <= 127, per row) as two int8 digits, x ~ hi + lo / 256, and the rows' sums of
    what the digits represent (zero-point terms that then cancel exactly)."""
    hi = tl.floor(x + 0.5)
    lo = tl.minimum(tl.maximum(tl.floor((x - hi) * 256.0 + 0.5), -127.0), 127.0)
    return hi.to(tl.int8), lo.to(tl.int8), tl.sum(hi, 1) + tl.sum(lo, 1) * (1.0 / 256.0)


@triton.jit
def _int8_scores(qh, ql, raw, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, ih, il):
    n = tl.trans(_field_int8(raw, k, BITS, ASM))
    return ih + tl.dot(qh, n), il + tl.dot(ql, n)


@triton.jit
def _token_scale_zero(SCALE, ZERO, offset, offs_t, stride_t, t_ok):
    """Per-token scale and zero point of a tile of quantised latents, float32."""
    sc = tl.load(SCALE + offset + offs_t * stride_t, mask=t_ok, other=0.0).to(tl.float32)
    zp = tl.load(ZERO + offset + offs_t * stride_t, mask=t_ok, other=0.0).to(tl.float32)
    return sc, zp
