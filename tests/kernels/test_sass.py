"""The inline PTX of the one-pass kernel assembles for Hopper, checked on a machine without a GPU."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_one_pass_kernel_with_inline_ptx_compiles_for_sm90():
    # A fresh process: this test session imports the kernels under the Triton interpreter.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-m", "palu_bench.sass"], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(int(line.split()[0]), line.split()[1]): line for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {(16, "fp16"), (8, "fp16"), (8, "int8"), (4, "fp16"), (4, "int8"),
                         (2, "fp16"), (2, "int8")}
    mma = {key: tuple(int(n) for n in re.search(r"HMMA +(\d+) IMMA +(\d+)", line).groups())
           for key, line in rows.items()}
    for bits in (8, 4, 2):   # the asm's byte permutes and the tensor-core dots are in the loop
        assert "PRMT" in rows[bits, "fp16"] and mma[bits, "fp16"][0] > 0
        assert mma[bits, "int8"][1] > 0      # int8 key dots (fused_int_keys)


def test_large_rank_scores_loop_over_chunks_to_fit_shared_memory():
    # J-LRD (all heads one group, rank 2048): unrolled, the two-pass scores kernel asks for more
    # shared memory than an SM has (the H200 grid recorded "out of resource: shared memory");
    # `palu_decode` then compiles the chunk loop instead (`_dynamic_chunks`), which fits.
    code = ("from palu_bench.sass import compile_scores as c; "
            "print(c(16, 2048, False, False).metadata.shared, c(16, 2048, True, True).metadata.shared, "
            "c(4, 2048, True, True).metadata.shared)")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    unrolled, rope_loop, rope_int4_loop = map(int, out.stdout.split())
    limit = 232448   # bytes per block on an H100/H200 SM
    assert unrolled > limit and rope_loop <= limit and rope_int4_loop <= limit


def test_folded_query_int8_dots_compile_to_int8_tensor_core_instructions():
    # qproj_int: the packed fields' inline PTX assembles and the dots run as int8 mma (IGMMA /
    # IMMA) in the token loop, not as fp16 ones
    code = ("from palu_bench.sass import compile_qproj, loop_profile; "
            "print(' '.join(loop_profile(compile_qproj(4, 256, True))['ops']))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    ops = set(out.stdout.split())
    assert ops & {"IGMMA", "IMMA"} and not ops & {"HGMMA", "HMMA"}
