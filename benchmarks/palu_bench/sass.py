"""Compile the one-pass decode kernel for a Hopper GPU on a machine without one, and count the
machine instructions of its main loop (triton ships `ptxas` and `cuobjdump`).

Why: a kernel version's prediction ("fewer instructions per token", "fewer registers, one more
block per SM") can be checked in seconds on a laptop before spending GPU time, and a CPU test
can check that the inline PTX in `palu_decode` assembles. The counts depend on the triton version
(the H200 runs in benchmarks/NOTES.md used triton 3.6).

    python -m palu_bench.sass            # table for fp16 / 8 / 4 / 2-bit latents, Llama-2 g4 shapes
    python -m palu_bench.sass --scores   # shared memory of the two-pass scores kernel at large ranks
    python -m palu_bench.sass --qproj    # the folded-query RoPE scores kernel, fp16 vs int8 dots
    python -m palu_bench.sass --two-pass # the rebuild-scores and values kernels (J-LRD, GQA, rank 512)
    python -m palu_bench.sass --smollm2  # rebuild scores at SmolLM2's J-LRD keys: divisor vs padded rank block
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from palu_kernels.palu_decode import _fused_norope, _scores, _scores_qproj, _values

_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*?);")


def _compile(fn, consts: dict, pointer: dict, divisible: dict, warps: int, stages: int, arch: int):
    if not hasattr(fn, "cache_key"):
        raise RuntimeError("kernels were imported under TRITON_INTERPRET=1; compiling needs "
                           "TRITON_INTERPRET=0 (e.g. a fresh `python -m palu_bench.sass`)")
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else pointer.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in pointer or (n in divisible and divisible[n] % 16 == 0)}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_fused(bits: int = 4, rows: int = 4, rank: int = 256, block_t: int = 64,
                  warps: int = 4, stages: int = 3, tokens: int = 65536, arch: int = 90,
                  int_keys: bool = False):
    """`_fused_norope` for one group size / width, specialised as a contiguous cache would be."""
    per = 1 if bits == 16 else 8 // bits
    cols = rank // per
    consts = dict(ROWS=rows, M=max(16, triton.next_power_of_2(rows)), RK=rank, RV=rank,
                  RKPAD=cols, RVPAD=cols,
                  BITS_K=bits, BITS_V=bits, BLOCK_T=block_t, G=8, ASM=True, INT_KEYS=int_keys and bits != 16,
                  SCORES_IN=False, s_kst=1, s_vst=1)
    divisible = dict(s_qb=32 * rank, s_qh=rank, s_kt=cols, s_kg=tokens * cols, s_kb=8 * tokens * cols,
                     s_vt=cols, s_vg=tokens * cols, s_vb=8 * tokens * cols,
                     s_ksb=8 * tokens, s_ksg=tokens, s_vsb=8 * tokens, s_vsg=tokens)
    packed = "*u8" if bits != 16 else "*fp16"
    pointer = {"Q": "*fp16", "HK": packed, "HV": packed, "HKS": "*fp16", "HKZ": "*fp16", "HVS": "*fp16",
               "HVZ": "*fp16", "S": "*fp32", "ACC": "*fp32", "MS": "*fp32", "LS": "*fp32", "LENS": "*i32"}
    return _compile(_fused_norope, consts, pointer, divisible, warps, stages, arch)


def compile_scores(bits: int = 16, rank: int = 2048, rope: bool = True, dynamic: bool = False,
                   block_r: int | None = None, arch: int = 90, rows: int | None = None,
                   units: int | None = None, half: int = 64, block_t: int = 32, warps: int = 4):
    """The two-pass `_scores` kernel (default: llama2 shapes, MHA, palu_decode's default tiles),
    its rank chunks unrolled or (dynamic) looped; `rows` query heads a KV head, `units` KV heads
    a group, `half` = head_dim / 2 for other models' shapes."""
    rows = rows or (1 if rope else 32)
    units = units or (32 if rope else 1)
    block_r = block_r or (256 if rope and bits == 16 else 128)
    consts = dict(UNITS_PER_GROUP=units, ROWS=rows, M=max(16, triton.next_power_of_2(rows)), R=rank,
                  BLOCK_R=block_r, HALF=half if rope else 16, ROPE=rope, BITS=bits, BLOCK_T=block_t,
                  NUM_UNITS=units, CONTIG=True, DYN_CHUNKS=dynamic, ASM=True, s_st=1)
    pointer = {"Q": "*fp16", "HK": "*u8" if bits != 16 else "*fp16", "HKS": "*fp16", "HKZ": "*fp16",
               "BK": "*fp16", "POS": "*i32", "POS0": "*i32", "INVF": "*fp32", "S": "*fp32", "LENS": "*i32"}
    cols = rank // (1 if bits == 16 else 8 // bits)
    divisible = dict(s_qb=32 * 128, s_qh=128, s_kt=cols, s_kg=65536 * cols, s_kb=65536 * cols,
                     s_sb=65536, s_sg=65536, s_ob=32 * 65536, s_oh=65536)
    return _compile(_scores, consts, pointer, divisible, warps, 2, arch)


def compile_qproj(bits: int = 4, rank: int = 256, int_h: bool = False, block_t: int = 64,
                  warps: int = 4, stages: int = 3, arch: int = 90):
    """The folded-query RoPE scores kernel `_scores_qproj` (llama2 shapes, MHA, group of 4)."""
    cols = rank // (1 if bits == 16 else 8 // bits)
    consts = dict(UNITS_PER_GROUP=4, R=rank, HALF=64, BITS=bits, BLOCK_T=block_t, NUM_UNITS=32,
                  ASM=True, INT_H=int_h, s_st=1)
    pointer = {"Q": "*fp16", "HK": "*u8" if bits != 16 else "*fp16", "HKS": "*fp16", "HKZ": "*fp16",
               "BK": "*fp16", "POS0": "*i32", "INVF": "*fp32", "S": "*fp32", "LENS": "*i32"}
    divisible = dict(s_qb=32 * 128, s_qh=128, s_kt=cols, s_kg=65536 * cols, s_kb=8 * 65536 * cols,
                     s_sb=8 * 65536, s_sg=65536, s_ob=32 * 65536, s_oh=65536, tokens_per_split=64)
    return _compile(_scores_qproj, consts, pointer, divisible, warps, stages, arch)


def compile_values(bits: int = 4, rank: int = 2048, rows: int = 32, block_rv: int = 64,
                   block_t: int = 32, warps: int = 4, stages: int = 3, arch: int = 90):
    """The two-pass `_values` kernel for one block of stored value columns (all packed parts)."""
    cols = rank // (1 if bits == 16 else 8 // bits)
    consts = dict(ROWS=rows, M=max(16, triton.next_power_of_2(rows)), RV=rank, BLOCK_RV=block_rv,
                  BITS=bits, BLOCK_T=block_t, G=1, ASM=True, s_qt=1)
    pointer = {"S": "*fp32", "HV": "*u8" if bits != 16 else "*fp16", "HVS": "*fp16", "HVZ": "*fp16",
               "ACC": "*fp32", "MS": "*fp32", "LS": "*fp32", "LENS": "*i32"}
    divisible = dict(s_sb=32 * 65536, s_sh=65536, s_vt=cols, s_vg=65536 * cols, s_vb=65536 * cols,
                     s_qb=65536, s_qg=65536)
    return _compile(_values, consts, pointer, divisible, warps, stages, arch)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_profile(kernel) -> dict:
    """Registers, shared memory and the opcode counts of the largest loop (the token loop)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    ins = [(int(a, 16), op, rest) for a, op, rest in _INS.findall(sass)]
    loop = None
    for addr, op, rest in ins:      # the widest backward branch closes the token loop
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            span = (int(target.group(1), 16), addr)
            if loop is None or span[1] - span[0] > loop[1] - loop[0]:
                loop = span
    ops = collections.Counter(op.split(".")[0] for a, op, _ in ins if loop and loop[0] <= a <= loop[1])
    regs = re.search(r"REG:(\d+)", res)
    return {"registers": int(regs.group(1)) if regs else None, "shared": kernel.metadata.shared,
            "loop_instructions": sum(ops.values()), "ops": ops}


def _two_pass_table():
    print("two-pass kernels, sm_90: rebuild scores `_scores` (32-token tiles, palu_decode's block_r) and")
    print("values `_values` (64 stored columns, every packed part); loop = instructions per token tile")
    print(f"{'kernel':>7} {'rope':>5} {'bits':>4} {'rank':>5} {'rows':>4} {'regs':>5} {'loop':>5}  top opcodes")
    for bits, rank, rope in ((16, 256, True), (4, 256, True), (2, 256, True), (4, 512, True),
                             (4, 2048, False)):
        p = loop_profile(compile_scores(bits, rank, rope, rank >= 1024))
        top = ", ".join(f"{k} {v}" for k, v in p["ops"].most_common(6))
        print(f"{'scores':>7} {str(rope):>5} {bits:4d} {rank:5d} {1 if rope else 32:4d} {p['registers']:5d} "
              f"{p['loop_instructions']:5d}  {top}")
    for bits, rank, rows in ((16, 2048, 32), (4, 2048, 32), (2, 2048, 32), (4, 256, 4)):
        p = loop_profile(compile_values(bits, rank, rows))
        top = ", ".join(f"{k} {v}" for k, v in p["ops"].most_common(6))
        print(f"{'values':>7} {'-':>5} {bits:4d} {rank:5d} {rows:4d} {p['registers']:5d} "
              f"{p['loop_instructions']:5d}  {top}")


def _shared_table():
    print("two-pass `_scores`, shared memory in bytes (an H100/H200 SM: 232448 per block)")
    print(f"{'rope':>5} {'bits':>4} {'rank':>5} {'unrolled':>9} {'loop':>7}")
    for rope, bits, rank in ((True, 16, 2048), (True, 4, 2048), (True, 16, 1024), (False, 16, 2048),
                             (True, 16, 512)):
        unrolled, loop = (compile_scores(bits, rank, rope, dyn).metadata.shared for dyn in (False, True))
        print(f"{str(rope):>5} {bits:4d} {rank:5d} {unrolled:9d} {loop:7d}")


def _qproj_table():
    print("folded-query RoPE scores `_scores_qproj`, rank 256 (G-LRD-4) and 64 (M-LRD), 64/32-token tiles")
    print(f"{'bits':>4} {'rank':>4} {'dots':>5} {'tile':>7} {'regs':>5} {'loop':>5}  top opcodes")
    for bits, rank, int_h, bt, warps in ((16, 256, False, 64, 8), (4, 256, False, 64, 4), (4, 256, True, 64, 4),
                                         (2, 256, False, 64, 4), (2, 256, True, 64, 4),
                                         (4, 64, False, 32, 2), (4, 64, True, 32, 2)):
        p = loop_profile(compile_qproj(bits, rank, int_h, bt, warps))
        top = ", ".join(f"{k} {v}" for k, v in p["ops"].most_common(8))
        print(f"{bits:4d} {rank:4d} {'int8' if int_h else 'fp16':>5} {f'{bt}/{warps}w':>7} "
              f"{p['registers']:5d} {p['loop_instructions']:5d}  {top}")


def _smollm2_table():
    """SmolLM2-135M's J-LRD-50 % keys (rank 96 over 3 KV heads of 64 dimensions, 3 query heads
    each): the rank block that divides the stored columns against one padded block (`pad_r`)."""
    print("`_scores` at SmolLM2's J-LRD-50 % keys (rank 96, 3 KV heads x 3 query rows, head_dim 64), sm_90;")
    print("loop = instructions per token tile (the widest backward branch), per token = loop / tile")
    print(f"{'bits':>4} {'block_r':>8} {'tile':>7} {'regs':>5} {'smem':>7} {'loop':>5} {'per token':>9}  top opcodes")
    for bits in (4, 16):
        cols = 96 // (1 if bits == 16 else 8 // bits)
        divisor = 16 if bits == 4 else 32
        for block_r, block_t, warps in ((divisor, 32, 4), (triton.next_power_of_2(cols), 32, 4),
                                        (divisor, 64, 4), (triton.next_power_of_2(cols), 64, 4)):
            p = loop_profile(compile_scores(bits, 96, True, block_r=block_r, rows=3, units=3, half=32,
                                            block_t=block_t, warps=warps))
            top = ", ".join(f"{k} {v}" for k, v in p["ops"].most_common(8))
            pad = "" if cols % block_r == 0 else " pad"
            print(f"{bits:4d} {str(block_r) + pad:>8} {f'{block_t}/{warps}w':>7} {p['registers']:5d} "
                  f"{p['shared']:7d} {p['loop_instructions']:5d} {p['loop_instructions'] / block_t:9.1f}  {top}")


if __name__ == "__main__":
    if "--smollm2" in sys.argv:
        _smollm2_table()
        sys.exit()
    if "--scores" in sys.argv:
        _shared_table()
        sys.exit()
    if "--qproj" in sys.argv:
        _qproj_table()
        sys.exit()
    if "--two-pass" in sys.argv:
        _two_pass_table()
        sys.exit()
    print(f"triton {triton.__version__}, sm_90, one-pass kernel, rank 256, 4 query rows, "
          "64-token tiles, 4 warps")
    print(f"{'bits':>4} {'keys':>5} {'regs':>5} {'smem':>7} {'loop':>6} {'per token':>10} "
          f"{'tensor-core ops':>18}  top opcodes")
    for bits, int_keys in ((16, False), (8, False), (8, True), (4, False), (4, True), (2, False), (2, True)):
        p = loop_profile(compile_fused(bits=bits, stages=2 if bits == 16 else 3, int_keys=int_keys))
        mma = f"HMMA {p['ops']['HMMA']:3d} IMMA {p['ops']['IMMA']:3d}"
        top = ", ".join(f"{k} {v}" for k, v in p["ops"].most_common(10))
        print(f"{bits:4d} {'int8' if int_keys else 'fp16':>5} {p['registers']:5d} {p['shared']:7d} "
              f"{p['loop_instructions']:6d} {p['loop_instructions'] * 4 / 64:10.1f} {mma:>18}  {top}")
