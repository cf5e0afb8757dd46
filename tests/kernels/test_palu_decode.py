"""Kernel vs torch reference on tiny shapes; runs on CPU through the Triton interpreter."""
import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from palu.quant.packed import QuantLatent, as_groups, dequantize_latent, quantize_latent  # noqa: E402
from palu_kernels.launch_defaults import (one_pass_options, one_pass_tiles, programs_per_sm,  # noqa: E402
                                          qproj_int_default, qproj_options, qproj_pair_default,
                                          values_splits)
from palu_kernels.palu_decode import palu_decode  # noqa: E402
from palu_kernels.reference import latent_decode_reference  # noqa: E402

# the interpreter (TRITON_INTERPRET=1, the tests' default) runs on CPU tensors; TRITON_INTERPRET=0
# on a GPU host runs the compiled kernels on the GPU
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _case(B, G, s, n_rep, T, rk, rv, D=32, rope=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = G * s * n_rep
    q = torch.randn(B, H, D if rope else rk, generator=g).half()
    hk = torch.randn(B, G, T, rk, generator=g).half()
    hv = torch.randn(B, G, T, rv, generator=g).half()
    bk = (torch.randn(G, s * D, rk, generator=g) / math.sqrt(rk)).half() if rope else None
    pos = torch.arange(T).expand(B, T).contiguous() + 3
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    return [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in (q, hk, hv, bk, pos, inv_freq)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("block_r", [16, 32])  # 32 = the whole rank: B_k kept in registers
@pytest.mark.parametrize("B, G, s, n_rep, T", [(1, 2, 1, 1, 37), (2, 1, 2, 2, 70), (1, 2, 2, 1, 129)])
def test_fp16_latents_match_reference(rope, block_r, B, G, s, n_rep, T):
    q, hk, hv, bk, pos, invf = _case(B, G, s, n_rep, T, rk=32, rv=32, rope=rope)
    kw = dict(scale=0.17, n_rep=n_rep, group_size=s, bk=bk, positions=pos, inv_freq=invf)
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, splits=2, block_t=16, block_r=block_r, block_rv=16, **kw)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 5e-3  # fp16 operands, fp32 accumulation


@pytest.mark.parametrize("rope, fused", [(True, None), (False, True), (False, False)])
def test_bf16_latents_and_queries_match_reference(rope, fused):
    # bf16 models: latents and queries arrive in bf16; the kernels take them to fp16 on-chip
    q, hk, hv, bk, pos, invf = _case(2, 2, 2, 1, 45, rk=64, rv=64, rope=rope, seed=3)
    q, hk, hv = q.bfloat16(), hk.bfloat16(), hv.bfloat16()
    bk = bk.bfloat16() if rope else None
    kw = dict(scale=0.2, n_rep=1, group_size=2, bk=bk, inv_freq=invf, lengths=torch.tensor([45, 30], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, splits=2, block_t=16, block_r=16, block_rv=16, fused_block_t=16,
                      fused=fused, **kw)
    assert _rel(out, ref) < 2e-3


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("rope, fused", [(True, None), (True, False), (False, None)])
def test_quantised_latents_match_dequantised_reference(bits, rope, fused):
    # RoPE: values through the one-pass kernel reading the scores (None) or `_values` (False)
    q, hk, hv, bk, pos, invf = _case(1, 2, 1, 2, 45, rk=64, rv=64, rope=rope, seed=bits)
    qk, qv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=0.2, n_rep=2, group_size=1, bk=bk, positions=pos, inv_freq=invf)
    ref = latent_decode_reference(q, dequantize_latent(qk), dequantize_latent(qv), **kw)
    out = palu_decode(q, qk, qv, splits=3, block_t=16, block_r=16, block_rv=16, fused_block_t=16,
                      fused=fused, **kw)
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("bits", [16, 4])
def test_scores_kernel_chunk_loop_matches_unrolled_chunks(rope, bits, monkeypatch):
    # large ranks (J-LRD) loop over rank chunks instead of unrolling them (shared memory); on a
    # GPU `_dynamic_chunks` decides by compiling, here it is forced
    import palu_kernels.palu_decode as pd
    q, hk, hv, bk, pos, invf = _case(2, 1, 2, 1, 50, rk=128, rv=32, rope=rope, seed=bits + 7)
    if bits != 16:
        hk = quantize_latent(hk, bits)
    kw = dict(scale=0.2, n_rep=1, group_size=2, bk=bk, positions=pos, inv_freq=invf,
              lengths=torch.tensor([50, 29], device=DEV))
    run = lambda: palu_decode(q, hk, hv, splits=2, block_t=16, block_r=16, block_rv=16,  # noqa: E731
                              fused=False, qproj=False, **kw)
    unrolled = run()
    monkeypatch.setattr(pd, "_dynamic_chunks", lambda *a: True)
    looped = run()
    ref = latent_decode_reference(q, hk, hv, **kw)
    assert _rel(looped, ref) < 5e-3 and _rel(looped, unrolled) < 1e-5


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("bits, rk", [(4, 96), (2, 192), (16, 80), (8, 48)])
def test_padded_rank_block_matches_the_divisor_blocks(rope, bits, rk, monkeypatch):
    # SmolLM2's J-LRD-50 % keys: rank 96, 48 stored columns at 4 bits, whose largest power-of-two
    # divisor is 16 (three chunks of tiny dots); `pad_r` takes them in one 64-column chunk, the
    # overrun masked. GQA (3 query rows a KV head, as SmolLM2), ragged lengths, chunks unrolled
    # and looped alike (the loop is what large ranks take)
    q, hk, hv, bk, pos, invf = _case(2, 1, 3, 3 if rope else 1, 40, rk=rk, rv=32, rope=rope, seed=rk + bits)
    if bits != 16:
        hk = quantize_latent(hk, bits)
    kw = dict(scale=0.2, n_rep=3 if rope else 1, group_size=3, bk=bk, positions=pos, inv_freq=invf,
              lengths=torch.tensor([40, 23], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    run = lambda pad, block_r=None: palu_decode(q, hk, hv, splits=2, block_t=16, block_rv=16,  # noqa: E731
                                                fused=False, qproj=False, pad_r=pad, block_r=block_r, **kw)
    divisor, padded = run(False), run(True)
    assert _rel(padded, ref) < 5e-3 and _rel(padded, divisor) < 1e-5
    assert _rel(run(True, 32), divisor) < 1e-5   # two chunks, the second one masked
    import palu_kernels.palu_decode as pd
    monkeypatch.setattr(pd, "_dynamic_chunks", lambda *a: True)
    assert _rel(run(True), padded) < 1e-5


def test_padded_rank_block_plan():
    from palu_kernels.decode_policy import scores_plan
    kw = dict(rope=True, rows=3, contig=True, kbits=4, units=3, units_per_group=3, T=4096, B=64,
              dev=torch.device("cpu"), splits=None, block_t=32, qproj=None, qproj_int=None,
              qproj_pair=None, qproj_block_t=None, qproj_stages=None, qproj_warps=None)
    assert scores_plan(rk=96, block_r=None, pad_r=False, **kw).block_r == 16   # the divisor block
    assert scores_plan(rk=96, block_r=None, pad_r=True, **kw).block_r == 64
    assert scores_plan(rk=96, block_r=32, pad_r=True, **kw).block_r == 32   # two chunks, one masked
    assert scores_plan(rk=512, block_r=None, pad_r=True, **kw).block_r == 128
    with pytest.raises(ValueError, match="block_r=24"):
        scores_plan(rk=96, block_r=24, pad_r=True, **kw)
    # not told: the measured defaults (64-token tiles, 3 stages, the padded block for packed
    # keys of rank <= 128; 32-token tiles above), what the caller says wins
    kw.pop("block_t")
    plan = scores_plan(rk=96, block_r=None, block_t=None, **kw)
    assert (plan.block_t, plan.stages, plan.block_r) == (64, 3, 64)
    plan = scores_plan(rk=512, block_r=None, block_t=None, **kw)
    assert (plan.block_t, plan.stages, plan.block_r) == (32, 2, 128)
    plan = scores_plan(rk=96, block_r=None, block_t=32, stages=2, pad_r=False, **kw)
    assert (plan.block_t, plan.stages, plan.block_r) == (32, 2, 16)


def test_rebuild_defaults_follow_the_measurements():
    # benchmarks/NOTES.md session 44 (SmolLM2 J-LRD / M-LRD, batch 64 / 128 x 4K) and session 2
    # (Llama-2 G-LRD-4 rank 256: 64-token tiles slower)
    from palu_kernels.launch_defaults import rebuild_options
    assert rebuild_options(4, 96) == (64, 3, True)
    assert rebuild_options(16, 96) == (64, 2, False)
    assert rebuild_options(16, 256) == (32, 2, False) and rebuild_options(4, 256) == (32, 2, False)
    assert rebuild_options(4, 96, block_t=32, stages=2, pad_r=False) == (32, 2, False)


@pytest.mark.parametrize("shared, looped", [(655872, True), (82432, False)])
def test_scores_chunk_loop_is_chosen_by_the_compiled_shared_memory(shared, looped, monkeypatch):
    # The GPU-only branch of `_dynamic_chunks`, compiler and device faked: the unrolled variant
    # is compiled once per specialisation and replaced by the loop when it would not fit an SM.
    import types
    import palu_kernels.decode_policy as policy
    import palu_kernels.palu_decode as pd
    warmups, launches = [], []

    class FakeScores:
        def warmup(self, *args, grid, **meta):
            warmups.append(meta["DYN_CHUNKS"])
            return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=shared))

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(meta["DYN_CHUNKS"])

    class NoValues:   # the values kernel is not under test
        def __getitem__(self, grid):
            return lambda *args, **meta: None

    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448)
    for module in (pd, policy):      # the launcher and the policy that compiles to decide
        monkeypatch.setattr(module, "_scores", FakeScores())
        monkeypatch.setattr(module, "_use_asm", lambda dev: True)
    monkeypatch.setattr(policy, "_DYNAMIC", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(pd, "_launch_combine", lambda *a: None)
    monkeypatch.setattr(pd, "_values", NoValues())
    q, hk, hv, bk, _, invf = _case(1, 1, 2, 1, 40, rk=64, rv=32)
    for _ in range(2):
        pd.palu_decode(q, hk, hv, scale=0.1, n_rep=1, group_size=2, bk=bk, inv_freq=invf,
                       fused=False, qproj=False)
    assert warmups == [False] and launches == [looped, looped]


@pytest.mark.parametrize("bits, rk", [(8, 64), (4, 64), (4, 256), (2, 128)])
def test_folded_query_int8_dots_match_reference_and_fp16_unpack(bits, rk):
    # qproj_int: stored fields straight into int8 dots, the folded query as two int8 digits per
    # row; positions far from 0 and a ragged batch; 8-bit fields are n - 128
    q, hk, hv, bk, _, invf = _case(2, 1, 2, 1, 53, rk=rk, rv=32, D=64, seed=bits + rk)
    hk = quantize_latent(hk, bits)
    kw = dict(scale=0.15, n_rep=1, group_size=2, bk=bk, inv_freq=invf,
              position_offset=torch.tensor([7, 40000], device=DEV),
              lengths=torch.tensor([53, 20], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    run = lambda **o: palu_decode(q, hk, hv, splits=2, qproj_block_t=16, fused_block_t=16,  # noqa: E731
                                  qproj=True, **o, **kw)
    out, fp16 = run(qproj_int=True), run(qproj_int=False)
    assert _rel(out, ref) < 5e-3 and _rel(out, fp16) < 1e-3
    if bits == 2:
        with pytest.raises(ValueError, match="qproj_int needs the folded-query kernel"):
            palu_decode(q, hk, hv, qproj=False, qproj_int=True, **kw)
        q2, hk2, hv2, bk2, _, _ = _case(1, 1, 1, 1, 20, rk=64, rv=32, D=64)
        with pytest.raises(ValueError, match=r"qproj_int needs packed keys .* \(key rank 64, 2-bit\)"):
            palu_decode(q2, quantize_latent(hk2, 2), hv2, scale=0.1, n_rep=1, group_size=1, bk=bk2,
                        inv_freq=invf, qproj_int=True)


@pytest.mark.parametrize("bits", [16, 4, 2])
def test_rope_g_lrd_rank_256_folded_scores_and_one_pass_values(bits):
    # G-LRD group 4 at 50 %: key rank 256, the largest the folded-query kernel takes by default
    # (its folded query, 64 KB in fp16, stays on-chip); ragged lengths, positions far from 0
    q, hk, hv, bk, _, invf = _case(2, 1, 4, 1, 70, rk=256, rv=128, D=64, seed=bits)
    if bits != 16:
        hk, hv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=0.15, n_rep=1, group_size=4, bk=bk, inv_freq=invf,
              position_offset=torch.tensor([3, 30000], device=DEV),
              lengths=torch.tensor([70, 41], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    new = palu_decode(q, hk, hv, splits=2, qproj_block_t=16, fused_block_t=16, **kw)
    old = palu_decode(q, hk, hv, splits=2, qproj=False, fused=False, block_t=16, block_r=16,
                      block_rv=16, **kw)
    assert _rel(new, ref) < 5e-3 and _rel(old, ref) < 5e-3


@pytest.mark.parametrize("s", [1, 2, 4])
def test_two_heads_per_program_give_the_single_head_scores(s):
    # fp16 folded-query scores, heads u and u + 1 in one program (their own latent tiles at s = 1,
    # one shared tile inside a G-LRD group), ragged lengths, positions from two offsets
    q, hk, hv, bk, _, invf = _case(2, 2, s, 1, 70, rk=64, rv=32, seed=s)
    kw = dict(scale=0.2, n_rep=1, group_size=s, bk=bk, inv_freq=invf,
              lengths=torch.tensor([70, 41], device=DEV), position_offset=torch.tensor([3, 4000], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    run = lambda pair: palu_decode(q, hk, hv, qproj=True, qproj_pair=pair, splits=2,  # noqa: E731
                                   block_t=16, block_rv=16, qproj_block_t=16, **kw)
    pair, single = run(True), run(False)
    assert _rel(pair, ref) < 5e-3
    torch.testing.assert_close(pair, single, rtol=1e-4, atol=1e-5)   # a wrong head or tile: O(1)


def test_two_heads_per_program_are_refused_where_heads_do_not_pair():
    q, hk, hv, bk, _, invf = _case(1, 1, 3, 1, 40, rk=48, rv=32)
    kw = dict(scale=0.2, n_rep=1, bk=bk, inv_freq=invf, position_offset=torch.tensor([0], device=DEV))
    with pytest.raises(ValueError, match=r"qproj_pair needs .* \(got 16-bit keys, 3 per group, 3 heads\)"):
        palu_decode(q, hk, hv, group_size=3, qproj=True, qproj_pair=True, **kw)
    q, hk, hv, bk, _, invf = _case(1, 2, 2, 1, 40, rk=64, rv=32)
    kw["bk"], kw["inv_freq"] = bk, invf
    with pytest.raises(ValueError, match="qproj_pair needs .* 4-bit keys"):
        palu_decode(q, quantize_latent(hk, 4), hv, group_size=2, qproj=True, qproj_pair=True, **kw)


def test_ragged_batch_masks_each_tail_and_strided_cache_layout():
    B, G, T = 2, 2, 50
    q, hk, hv, bk, pos, invf = _case(B, G, 1, 1, T, rk=32, rv=32)
    lengths = torch.tensor([50, 23], device=DEV)
    # The latent cache's [B, 1, T, G*R] layout, seen as groups without a copy.
    cache_k = hk.permute(0, 2, 1, 3).reshape(B, 1, T, -1)
    cache_v = hv.permute(0, 2, 1, 3).reshape(B, 1, T, -1)
    kw = dict(scale=0.2, n_rep=1, group_size=1, bk=bk, positions=pos, inv_freq=invf, lengths=lengths)
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, as_groups(cache_k, G), as_groups(cache_v, G), splits=2, block_t=16,
                      block_r=16, block_rv=16, **kw)
    assert _rel(out, ref) < 5e-3


def test_quantise_round_trip_error_is_bounded():
    h = torch.randn(2, 3, 40, 64)
    for bits in (8, 4, 2):
        err = (dequantize_latent(quantize_latent(h, bits), torch.float32) - h).abs()
        step = (h.amax(-1) - h.amin(-1)) / (2 ** bits - 1)
        assert (err <= step[..., None] * 0.51 + 1e-2).all()


def test_bad_shapes_are_rejected():
    q, hk, hv, bk, pos, invf = _case(1, 2, 1, 1, 20, rk=32, rv=32)
    with pytest.raises(ValueError, match="query heads"):
        palu_decode(q, hk, hv, scale=1.0, n_rep=2, group_size=1, bk=bk, positions=pos, inv_freq=invf)
    with pytest.raises(TypeError, match="fp16/bf16"):
        palu_decode(q, hk.float(), hv, scale=1.0, n_rep=1, group_size=1, bk=bk, positions=pos,
                    inv_freq=invf)
    q2, hk2, hv2, bk2, pos2, invf2 = _case(1, 1, 1, 1, 20, rk=32, rv=32, D=24)
    with pytest.raises(ValueError, match="head_dim/2"):
        palu_decode(q2, hk2, hv2, scale=1.0, n_rep=1, group_size=1, bk=bk2, positions=pos2,
                    inv_freq=invf2)
    kw = dict(scale=1.0, n_rep=1, group_size=1, bk=bk)
    with pytest.raises(ValueError, match=r"positions shape \(1, 19\) != \(batch, tokens\)"):
        palu_decode(q, hk, hv, positions=pos[:, 1:], inv_freq=invf, **kw)
    with pytest.raises(ValueError, match=r"inv_freq shape \(8,\) != \(head_dim / 2,\) = \(16,\)"):
        palu_decode(q, hk, hv, positions=pos, inv_freq=invf[:8], **kw)
    with pytest.raises(ValueError, match="needs inv_freq"):
        palu_decode(q, hk, hv, positions=pos, **kw)
    if DEV == "cpu":
        with pytest.raises(ValueError, match=r"lengths \[21\] must lie in \[1, 20\]"):
            palu_decode(q, hk, hv, positions=pos, inv_freq=invf, lengths=torch.tensor([21]), **kw)
    with pytest.raises(ValueError, match=r"position_offset shape \(2,\) != \(batch,\)"):
        palu_decode(q, hk, hv, position_offset=torch.zeros(2, device=DEV), inv_freq=invf, **kw)


def test_latents_without_unit_rank_stride_are_rejected_not_misread():
    # a transposed view (rank stride = tokens) once gave a silent 100 % error
    q, hk, hv, _, _, _ = _case(1, 2, 1, 1, 40, rk=32, rv=32, rope=False)
    kw = dict(scale=0.2, n_rep=1, group_size=1)
    bad = hk.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match=r"key latents must be \[batch, groups, tokens, rank\] with unit stride"):
        palu_decode(q, bad, hv, **kw)
    with pytest.raises(ValueError, match="differ in batch, groups or tokens"):
        palu_decode(q, hk, hv[:, :, :20], **kw)
    qk = quantize_latent(hk, 4)
    with pytest.raises(ValueError, match="16 packed bytes per token do not hold rank 64 at 4 bits"):
        palu_decode(q, QuantLatent(qk.data, qk.scale, qk.zero, 4, 64), hv, **kw)
    with pytest.raises(ValueError, match=r"scales \(1, 2, 39\) / zero points"):
        palu_decode(q, QuantLatent(qk.data, qk.scale[:, :, 1:], qk.zero, 4, 32), hv, **kw)
    # a strided query is copied (cheap), strided positions too
    qs = torch.stack([q, q], -1)[..., 0]            # stride 2 along the dim
    ref = latent_decode_reference(q, hk, hv, **kw)
    assert _rel(palu_decode(qs, hk, hv, splits=2, fused_block_t=16, **kw), ref) < 5e-3


def test_contiguous_positions_fast_rope_matches_reference():
    q, hk, hv, bk, pos, invf = _case(2, 2, 1, 2, 75, rk=32, rv=48)
    off = torch.tensor([5, 1000], device=DEV)
    kw = dict(scale=0.2, n_rep=2, group_size=1, bk=bk, inv_freq=invf, position_offset=off)
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, splits=2, block_t=16, block_r=16, block_rv=64, **kw)
    assert _rel(out, ref) < 5e-3


def test_rank_that_does_not_tile_is_rejected():
    q, hk, hv, bk, pos, invf = _case(1, 1, 1, 1, 20, rk=32, rv=40)
    with pytest.raises(ValueError, match="value rank 40 must give a multiple of 16 stored columns"):
        palu_decode(q, hk, hv, scale=1.0, n_rep=1, group_size=1, bk=bk, inv_freq=invf)


@pytest.mark.parametrize("bits, int_keys", [(16, False), (8, False), (8, True), (4, False), (4, True),
                                            (2, False), (2, True)])
@pytest.mark.parametrize("B, G, s, n_rep, T", [(1, 2, 1, 2, 45), (2, 1, 2, 1, 130)])
def test_one_pass_norope_kernel_matches_two_pass_and_reference(bits, int_keys, B, G, s, n_rep, T):
    rk = 128 if bits == 2 else 64        # int8 key dots need >= 32 stored columns
    q, hk, hv, _, _, _ = _case(B, G, s, n_rep, T, rk=rk, rv=128, rope=False, seed=bits + T)
    if bits != 16:
        hk, hv = quantize_latent(hk, bits), quantize_latent(hv, 4)   # K and V widths may differ
    kw = dict(scale=0.2, n_rep=n_rep, group_size=s, lengths=torch.tensor([T, T - 17][:B], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    one = palu_decode(q, hk, hv, fused=True, fused_block_t=16, splits=3, fused_int_keys=int_keys, **kw)
    two = palu_decode(q, hk, hv, fused=False, block_t=16, block_r=16, block_rv=16, splits=3, **kw)
    assert _rel(one, ref) < 5e-3 and _rel(two, ref) < 5e-3
    assert _rel(one, two) < 2e-3


def test_one_pass_kernel_refuses_what_it_cannot_serve():
    q, hk, hv, bk, pos, invf = _case(1, 1, 1, 1, 20, rk=32, rv=32)
    with pytest.raises(ValueError, match="RoPE keys are rebuilt"):
        palu_decode(q, hk, hv, scale=1.0, n_rep=1, group_size=1, bk=bk, inv_freq=invf, fused=True)
    q, hk, hv, _, _, _ = _case(1, 1, 1, 1, 20, rk=1024, rv=32, rope=False)
    with pytest.raises(ValueError, match="key rank 1024 too large for registers"):
        palu_decode(q, hk, hv, scale=1.0, n_rep=1, group_size=1, fused=True)
    with pytest.raises(ValueError, match=r"value rank 1024 x 16 rows too large for registers"):
        palu_decode(q[..., :32], hv, hk, scale=1.0, n_rep=1, group_size=1, fused=True)
    out = palu_decode(q, hk, hv, scale=1.0, n_rep=1, group_size=1, block_r=64, block_rv=16)
    ref = latent_decode_reference(q, hk, hv, scale=1.0, n_rep=1, group_size=1)
    assert _rel(out, ref) < 5e-3   # auto: falls back to the two-pass kernels
    q, hk, hv, _, _, _ = _case(1, 1, 1, 1, 20, rk=64, rv=32, rope=False)
    with pytest.raises(ValueError, match="fused_int_keys needs packed keys with >= 32 stored columns"):
        palu_decode(q, quantize_latent(hk, 2), hv, scale=1.0, n_rep=1, group_size=1, fused_int_keys=True)


@pytest.mark.parametrize("bits, int_keys", [(16, False), (4, False), (4, True), (2, True)])
def test_one_pass_kernel_pads_ranks_that_are_not_powers_of_two(bits, int_keys):
    # the K25/V75 split: value ranks 96 s; stored widths 96 / 48 / 48 columns in tiles of 128 / 64 / 64
    q, hk, hv, _, _, _ = _case(2, 2, 1, 2, 50, rk=96 if bits == 16 else 192, rv=192 if bits == 2 else 96,
                               rope=False, seed=11)
    if bits != 16:
        hk, hv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=0.2, n_rep=2, group_size=1, lengths=torch.tensor([50, 33], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, fused=True, fused_block_t=16, splits=2, fused_int_keys=int_keys, **kw)
    assert _rel(out, ref) < 2e-3


@pytest.mark.parametrize("rope", [True, False])
def test_many_splits_are_combined_in_blocks(rope):
    # 35 splits > the combine kernel's block of 32: exercises its loop over split blocks.
    q, hk, hv, bk, pos, invf = _case(1, 1, 1, 2, 1100, rk=32, rv=32, rope=rope, seed=5)
    kw = dict(scale=0.2, n_rep=2, group_size=1, bk=bk, positions=pos if rope else None, inv_freq=invf)
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, splits=60, block_t=16, block_r=16, block_rv=16, fused_block_t=16, **kw)
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantise_store_kernel_is_bit_identical_to_torch(bits):
    from palu.quant.packed import QuantLatent
    from palu_kernels.quantize import quantize_into
    h = (torch.randn(2, 3, 5, 96) * torch.rand(2, 3, 5, 1) * 4).half().to(DEV)
    h[0, 0, 0] = 0.7                           # a constant row: scale clamps, no division by zero
    ref = quantize_latent(h, bits)
    per = 8 // bits
    dst = QuantLatent(torch.zeros(2, 3, 9, 96 // per, dtype=torch.uint8, device=DEV),
                      torch.zeros(2, 3, 9, dtype=torch.float16, device=DEV),
                      torch.zeros(2, 3, 9, dtype=torch.float16, device=DEV), bits, 96)
    quantize_into(h, dst, start=3)
    assert torch.equal(dst.data[:, :, 3:8], ref.data)
    assert torch.equal(dst.scale[:, :, 3:8], ref.scale) and torch.equal(dst.zero[:, :, 3:8], ref.zero)
    assert dst.data[:, :, :3].eq(0).all() and dst.data[:, :, 8:].eq(0).all()   # nothing else written
    assert torch.isfinite(dequantize_latent(ref)).all()


@pytest.mark.parametrize("bits", [4, 2])
def test_quantise_store_reads_its_start_slot_from_a_tensor(bits):
    # A captured CUDA graph replays with the slot held in device memory, not a Python int.
    from palu.quant.packed import QuantLatent
    from palu_kernels.quantize import quantize_into
    h = torch.randn(1, 2, 1, 64).half().to(DEV)
    per = 8 // bits

    def empty():
        return QuantLatent(torch.zeros(1, 2, 6, 64 // per, dtype=torch.uint8, device=DEV),
                           torch.zeros(1, 2, 6, dtype=torch.float16, device=DEV),
                           torch.zeros(1, 2, 6, dtype=torch.float16, device=DEV), bits, 64)
    by_int, by_tensor = empty(), empty()
    quantize_into(h, by_int, start=4)
    quantize_into(h, by_tensor, start=torch.tensor([4], device=DEV))
    for a, b in ((by_int.data, by_tensor.data), (by_int.scale, by_tensor.scale), (by_int.zero, by_tensor.zero)):
        assert torch.equal(a, b)
    assert by_tensor.scale[:, :, 4].ne(0).all() and by_tensor.scale[:, :, :4].eq(0).all()
    with pytest.raises(ValueError, match="do not fit a cache of 6"):
        quantize_into(h, empty(), start=6)
    with pytest.raises(ValueError, match="start tensor must be one integer"):
        quantize_into(h, empty(), start=torch.tensor([1.0, 2.0], device=DEV))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantise_store_writes_each_row_at_its_own_slot(bits):
    # a ragged batch's decode step: row b's token at slot start[b], one launch, the bytes torch's
    # codes give that row; no other slot touched
    from palu.quant.packed import QuantLatent
    from palu_kernels.quantize import quantize_into
    h = (torch.randn(3, 2, 1, 64) * 3).half().to(DEV)
    per = 8 // bits
    dst = QuantLatent(torch.zeros(3, 2, 7, 64 // per, dtype=torch.uint8, device=DEV),
                      torch.zeros(3, 2, 7, dtype=torch.float16, device=DEV),
                      torch.zeros(3, 2, 7, dtype=torch.float16, device=DEV), bits, 64)
    starts = torch.tensor([[5, 1], [0, 1], [3, 1]], device=DEV)[:, 0]   # a strided view, as positions[:, 0]
    quantize_into(h, dst, starts, per_row=True)
    ref = quantize_latent(h, bits)
    for b, t in enumerate(starts.tolist()):
        assert torch.equal(dst.data[b, :, t], ref.data[b, :, 0])
        assert torch.equal(dst.scale[b, :, t], ref.scale[b, :, 0]) and torch.equal(dst.zero[b, :, t], ref.zero[b, :, 0])
        others = [j for j in range(7) if j != t]
        assert dst.scale[b, :, others].eq(0).all() and dst.data[b, :, others].eq(0).all()
    for bad in (torch.tensor([1, 2], device=DEV), torch.tensor([1.0, 2.0, 3.0], device=DEV), 4):
        with pytest.raises(ValueError, match="per_row: start must be 3 integers"):
            quantize_into(h, dst, bad, per_row=True)


def test_quantise_store_puts_tokens_on_the_long_grid_axis():
    # A 64K-token prefill on the grid's second axis (at most 65535 programs) failed on the GPU
    # with "invalid argument"; the first axis takes 2^31 - 1.
    from palu.quant.packed import QuantLatent
    from palu_kernels.quantize import MAX_GRID_Y, quantize_grid, quantize_into
    assert quantize_grid(2, 8, 131072) == (131072, 16)
    h = torch.zeros(MAX_GRID_Y + 1, 1, 1, 32, dtype=torch.float16)
    dst = QuantLatent(torch.zeros(MAX_GRID_Y + 1, 1, 1, 16, dtype=torch.uint8), torch.zeros(MAX_GRID_Y + 1, 1, 1),
                      torch.zeros(MAX_GRID_Y + 1, 1, 1), 4, 32)
    with pytest.raises(ValueError, match="65536 exceeds the 65535"):
        quantize_into(h, dst, start=0)


@pytest.mark.gpu
@pytest.mark.skipif(DEV == "cpu", reason="70K tokens: slow in the interpreter; runs on a GPU")
def test_quantise_store_takes_a_prefill_longer_than_65535_tokens():
    from palu.quant.packed import QuantLatent
    from palu_kernels.quantize import quantize_into
    n = 70_000
    h = torch.randn(1, 2, n, 64, device=DEV).half()
    ref = quantize_latent(h, 4)
    dst = QuantLatent(torch.zeros(1, 2, n, 32, dtype=torch.uint8, device=DEV),
                      torch.zeros(1, 2, n, dtype=torch.float16, device=DEV),
                      torch.zeros(1, 2, n, dtype=torch.float16, device=DEV), 4, 64)
    quantize_into(h, dst, start=0)
    bad = [(dst.data != ref.data).sum().item(), (dst.scale != ref.scale).sum().item(),
           (dst.zero != ref.zero).sum().item()]
    assert bad == [0, 0, 0], f"bytes / scales / zero points that differ from torch: {bad}"


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
@pytest.mark.parametrize("s", [1, 2])
def test_folded_query_rope_scores_match_reference_and_rebuilt_keys(bits, s):
    # MHA (one query per KV head), contiguous positions: the query is folded into B_k.
    q, hk, hv, bk, _, invf = _case(2, 2, s, 1, 70, rk=64, rv=32, seed=bits + s)
    if bits != 16:
        hk = quantize_latent(hk, bits)
    kw = dict(scale=0.2, n_rep=1, group_size=s, bk=bk, inv_freq=invf,
              position_offset=torch.tensor([3, 4000], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    folded = palu_decode(q, hk, hv, qproj=True, splits=2, block_t=16, block_rv=16, **kw)
    rebuilt = palu_decode(q, hk, hv, qproj=False, splits=2, block_t=16, block_r=16, block_rv=16, **kw)
    assert _rel(folded, ref) < 5e-3 and _rel(rebuilt, ref) < 5e-3
    with pytest.raises(ValueError, match="qproj=True needs RoPE"):
        palu_decode(q, hk, hv, qproj=True, positions=torch.arange(70, device=DEV).expand(2, 70),
                    **{k: v for k, v in kw.items() if k != "position_offset"})


@pytest.mark.parametrize("qproj", [True, False])
def test_rope_angle_recurrence_does_not_drift_over_many_tiles(qproj):
    # one split of 40 tiles at positions ~60K: cos/sin are advanced tile to tile by rotation
    q, hk, hv, bk, _, invf = _case(1, 2, 1, 1, 640, rk=32, rv=32, seed=9)
    kw = dict(scale=0.3, n_rep=1, group_size=1, bk=bk, inv_freq=invf,
              position_offset=torch.tensor([60000], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, qproj=qproj, splits=1, block_t=16, block_r=32, block_rv=32,
                      qproj_block_t=16, **kw)
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("int_keys", [False, True])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packed_part_weights_and_zero_points_are_removed_exactly(bits, int_keys):
    # Latents that are zero except one column whose size varies per token (so do the per-token
    # scales): the result then hinges on how the 2^(k bits) part weights and the zero points are
    # removed by the one-pass kernel, and a slip in either is an error of order one scale.
    q, hk, hv, _, _, _ = _case(1, 1, 2, 1, 33, rk=128, rv=64, rope=False, seed=bits)
    size = torch.rand(hk.shape[:-1], generator=torch.Generator().manual_seed(1)).to(DEV) + 0.5
    hk = torch.zeros_like(hk)
    hv = torch.zeros_like(hv)
    hk[..., -1] = size.half()           # last rank: the highest part of the packing
    hv[..., 0] = size.half()
    hv[..., -1] = -(2 - size).half()
    qk, qv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=0.3, n_rep=1, group_size=2)
    ref = latent_decode_reference(q, qk, qv, **kw)
    out = palu_decode(q, qk, qv, fused=True, fused_block_t=16, splits=2, fused_int_keys=int_keys, **kw)
    assert _rel(out, ref) < 1e-3


@pytest.mark.parametrize("rope", [True, False])
def test_an_outlier_latent_does_not_leak_into_the_other_columns(rope):
    # One value latent at -10 and the rest near 0: zero points ~ levels and stored integers
    # ~ levels for every small value. Removing the zero points with weights rounded differently
    # from the dot's (the two-pass values kernel did) left sum_t (rounding_t) n_t s_t in every
    # column: 10-100x the small columns' signal (in a tiny model: 2% logit errors).
    q, hk, hv, bk, pos, invf = _case(1, 2, 1, 2, 45, rk=64, rv=64, rope=rope, seed=5)
    hv = 0.02 * hv
    hv[..., 0] = -10.0
    qk, qv = quantize_latent(hk, 8), quantize_latent(hv, 8)
    kw = dict(scale=0.2, n_rep=2, group_size=1, bk=bk, positions=pos, inv_freq=invf)
    ref = latent_decode_reference(q, qk, qv, **kw)
    for fused in ([False] if rope else [False, True]):
        out = palu_decode(q, qk, qv, splits=3, block_t=16, block_r=16, block_rv=16, fused=fused, **kw)
        assert _rel(out[..., 1:], ref[..., 1:]) < 2e-3


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_tokens_whose_latents_share_a_sign_are_not_saturated(bits):
    # min-max quantisation with the zero point clamped to [0, levels] mapped an all-positive
    # token to levels everywhere; the zero point may now leave that range (|z| <= 1024).
    h = torch.rand(2, 3, 5, 64, generator=torch.Generator().manual_seed(0)) + 28.0
    h[0, 0, 0] = 28.0 + 1e-3 * torch.rand(64)            # a tiny range at a large offset
    h = h.half().float()
    back = dequantize_latent(quantize_latent(h, bits), torch.float32)
    step = torch.maximum((h.amax(-1) - h.amin(-1)) / (2 ** bits - 1), h.amin(-1).abs() / 1024)
    assert ((back - h).abs() <= step[..., None] * 0.5 + 2e-3).all()   # + fp16 scale rounding


def test_programs_per_sm_counts_the_scarcest_resource():
    # the one-pass kernel's measured shapes (palu_bench.sass): 168 registers x 4 warps -> 3 blocks
    # by registers; 143 registers, 74 KB shared memory -> 3 by shared memory; 128 -> 4
    assert programs_per_sm(168, 4, 43264) == 3
    assert programs_per_sm(143, 4, 75776) == 3
    assert programs_per_sm(128, 4, 26880) == 4
    assert programs_per_sm(32, 4, 0) == 16            # threads: 2048 / 128
    assert programs_per_sm(255, 8, 240000) == 1       # never zero: a program always runs


def test_one_pass_kernel_launches_one_wave_of_splits(monkeypatch):
    # The GPU-only branch of the split choice, with the compiler and the device faked: a kernel
    # that needs 168 registers x 4 warps fits 3 programs per SM, 132 SMs hold 396, so 8 groups
    # get 49 splits (one wave), not the ~132 of the device-independent fallback.
    import types
    import palu_kernels.palu_decode as pd
    launches, warmups = [], []

    class FakeKernel:
        def warmup(self, *args, grid, **meta):
            warmups.append(meta)
            return types.SimpleNamespace(n_regs=168, metadata=types.SimpleNamespace(num_warps=4, shared=43264))

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, args[12], args[13]))

    props = types.SimpleNamespace(multi_processor_count=132, regs_per_multiprocessor=65536,
                                  shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(pd, "_fused_norope", FakeKernel())
    monkeypatch.setattr(pd, "_use_asm", lambda dev: True)
    monkeypatch.setattr(pd, "_launch_combine", lambda *a: None)
    monkeypatch.setattr(pd, "_SLOTS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    q, hk, hv, _, _, _ = _case(1, 8, 4, 1, 65536, rk=32, rv=32, D=32, rope=False)
    for _ in range(2):
        pd.palu_decode(q, hk, hv, scale=0.1, n_rep=1, group_size=4, fused=True)
    assert len(warmups) == 1                      # registers looked up once per specialisation
    (grid, per_split, splits), _ = launches
    assert grid == (8, 49) and splits == 49 and per_split * 49 >= 65536 > per_split * 48


def test_folded_query_defaults_follow_the_measurements():
    # benchmarks/NOTES.md session 5: fp16 on two warpgroups, packed latents on one (rank >= 128)
    # or 32-token tiles on two warps (rank 64); explicit values win
    assert qproj_options(16, 256) == (64, 3, 8)
    assert qproj_options(4, 256) == (64, 3, 4) and qproj_options(2, 128) == (64, 3, 4)
    assert qproj_options(4, 64) == (32, 3, 2)
    assert qproj_options(4, 64, block_t=16, warps=4) == (16, 3, 4)
    # session 6: int8 key dots where measured faster (4-bit), with 4 warps at rank 64
    assert qproj_options(4, 64, int_keys=True) == (32, 3, 4)
    assert qproj_options(4, 64, int_keys=True, tokens_per_split=2048) == (64, 3, 4)   # long splits
    assert qproj_options(4, 64, int_keys=True, tokens_per_split=512) == (32, 3, 4)
    assert qproj_options(4, 256, int_keys=True) == (64, 3, 4)
    L = 65536
    assert qproj_int_default(4, 128, L) and qproj_int_default(4, 32, L)
    assert not qproj_int_default(2, 64, L) and not qproj_int_default(8, 128, L)
    assert not qproj_int_default(16, 256, L)
    assert not qproj_int_default(4, 16, L) and not qproj_int_default(4, 48, L)
    # session 7: at key rank 256 (128 stored columns) only over >= 1408 tokens per program
    # (batch 1: 33 splits, so from ~46K tokens); smaller ranks always
    assert not qproj_int_default(4, 128, 32768 // 33) and qproj_int_default(4, 128, 49152 // 33)
    assert qproj_int_default(4, 128, 16384 // 5)                     # batch 8 at 16K: 5 splits
    assert qproj_int_default(4, 64, 4096 // 16) and qproj_int_default(4, 32, 64)
    # session 19: two heads per program for fp16 groups of rank 256 (G-LRD-4, K25/V75 G-LRD-8);
    # slower at group rank 128 / 64 and for M-LRD
    assert qproj_pair_default(16, 256, 4) and qproj_pair_default(16, 256, 8)
    assert not qproj_pair_default(16, 128, 4) and not qproj_pair_default(16, 64, 2)
    assert not qproj_pair_default(16, 64, 1) and not qproj_pair_default(4, 256, 4)


def test_one_pass_defaults_follow_the_measurements():
    # benchmarks/NOTES.md v10: int8 key dots for 2/4-bit keys of rank >= 256, capped at 128
    # registers up to rank 256 (rank 512 spills there); fp16 keys elsewhere; 3 stages if packed
    assert one_pass_options(4, 4, 256, 256) == (3, True, 128)      # llama2 G-LRD-4
    assert one_pass_options(2, 2, 512, 512) == (3, True, None)     # G-LRD-8: no cap
    assert one_pass_options(4, 4, 128, 384) == (3, False, None)    # K25/V75: small key rank
    assert one_pass_options(8, 8, 256, 256) == (3, False, None)    # 8-bit: slower with int8 dots
    assert one_pass_options(16, 16, 256, 256) == (2, False, None)
    assert one_pass_options(4, 4, 256, 256, stages=2, int_keys=False, maxnreg=0) == (2, False, 0)
    with pytest.raises(ValueError, match="fused_int_keys needs packed keys"):
        one_pass_options(16, 16, 256, 256, int_keys=True)
    # session 7: 2/4-bit latents of rank <= 128 on 2 warps, 128-token tiles while that leaves two
    # programs per SM (programs = sequences x groups x cdiv(tokens, 256)); explicit values win
    many, sms = 32 * 256, 132                                         # llama2 g1 at 64K, an H200
    assert one_pass_tiles(2, 2, 64, 64, many, sms) == (128, 2) == one_pass_tiles(4, 4, 128, 128, many, sms)
    assert one_pass_tiles(4, 4, 32, 96, many, sms) == (128, 2)        # K25/V75 g1
    assert one_pass_tiles(16, 2, 0, 64, many, sms) == (128, 2)        # a RoPE layer's values half
    assert one_pass_tiles(4, 4, 64, 64, 32 * 16, sms) == (128, 2)     # llama2 g1 at 4K: 512 programs
    assert one_pass_tiles(4, 4, 128, 128, 16 * 16, sms) == (64, 4)    # llama2 g2 at 4K: 256 programs
    assert one_pass_tiles(4, 4, 64, 192, many, sms) == (64, 4)        # K25/V75 g2: value rank 192
    assert one_pass_tiles(16, 16, 64, 64, many, sms) == (64, 4) == one_pass_tiles(8, 8, 64, 64, many, sms)
    assert one_pass_tiles(16, 16, 0, 64, many, sms) == (64, 4)
    assert one_pass_tiles(2, 2, 64, 64, many, sms, block_t=32, warps=4) == (32, 4)


def test_two_pass_values_splits_keep_partials_small():
    # J-LRD (32 query rows share one latent): 512 splits of fp16 rank 2048 wrote 134 MB of float32
    # partials for 268 MB of latents; the values kernel takes at most 1/8 of the latent bytes...
    assert values_splits(65536, 512, 2048, 16, 32, 32, 132) == 128
    assert values_splits(65536, 512, 2048, 4, 32, 16, 132) == 32
    assert values_splits(65536, 264, 768, 16, 8, 96, 132) == 264      # K25/V75 g8: the scores' splits
    assert values_splits(65536, 100, 256, 4, 16, 8, 132) == 66
    # ...but never fewer than two programs per SM (llama3 J-LRD int2 at 4K: cap 1, 2 blocks)
    assert values_splits(4096, 32, 512, 2, 32, 2, 132) == 32
    assert values_splits(16384, 128, 512, 2, 32, 2, 132) == 128
    assert values_splits(65536, 512, 512, 2, 32, 2, 132) == 132
    assert values_splits(64, 8, 2048, 4, 32, 600, 132) == 1           # never zero


@pytest.mark.parametrize("bits, rope", [(16, False), (4, True), (2, False)])
def test_two_pass_values_with_their_own_splits_match_reference(bits, rope):
    # splits=None: the values kernel picks `values_splits` (here 1-2, the scores kernel 2), unpacks
    # every part of each loaded block, and the combine merges its partials; other split counts
    # differ only by where the fp16-rounded weights p*scale are taken (per-split maxima)
    q, hk, hv, bk, pos, invf = _case(2, 1, 4, 2, 96, rk=64, rv=128, rope=rope, seed=bits + 11)
    if bits != 16:
        hk, hv = quantize_latent(hk, bits), quantize_latent(hv, bits)
    kw = dict(scale=0.2, n_rep=2, group_size=4, bk=bk, positions=pos, inv_freq=invf,
              lengths=torch.tensor([96, 41], device=DEV))
    ref = latent_decode_reference(q, hk, hv, **kw)
    out = palu_decode(q, hk, hv, block_t=16, block_r=16, block_rv=16, fused=False, **kw)
    forced = palu_decode(q, hk, hv, block_t=16, block_r=16, block_rv=16, fused=False, splits=5, **kw)
    assert _rel(out, ref) < 5e-3 and _rel(out, forced) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(DEV == "cpu", reason="128K tokens: minutes in the interpreter; runs on a GPU")
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("fused", [True, False])
def test_quantised_values_stay_accurate_over_long_spread_attention(bits, fused):
    # Llama-2 shapes, one head per group, 128K random tokens: attention is spread, so the output
    # is a small average of values while the zero-point term cancels a sum of ~T 2^(bits-1) s p.
    # With fields unpacked as n in [0, 2^bits) the tensor cores' truncating accumulation lost
    # 0.6-2 % here (measured on the H200: 8-bit 2.2e-2, 4-bit 5.9e-3, 2-bit 6.6e-3 one-pass);
    # centred fields (`_unpack_part`) 2e-4, 2e-4, 1.1e-3 (benchmarks/NOTES.md, v13).
    from palu_bench.cases import palu_case
    shape = {"heads": 32, "kv_heads": 32, "head_dim": 128, "rope_theta": 10000.0}
    q, hk, hv, kw, _ = palu_case(shape, 1, 131072, 1, 0.5, 0.5, bits, rope=False, device=DEV)
    kw["bk"] = None
    ref = latent_decode_reference(q, hk, hv, **kw)
    assert _rel(palu_decode(q, hk, hv, fused=fused, **kw), ref) < (2e-3 if bits == 2 else 1e-3)
