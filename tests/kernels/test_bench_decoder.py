"""End-to-end decode model: the Palu path (static latent cache + Triton kernels through the
interpreter) computes the same model as the dense path at full rank; quantised caches stay close."""
import dataclasses
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from palu_bench.bench_decoder import Decoder, DecoderShape, PaluSpec  # noqa: E402
from palu_bench.static_cache import StaticLatentCache  # noqa: E402

SHAPE = DecoderShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, intermediate=96, vocab=50)


def _decode(model, tokens, max_tokens=16):
    cache = model.new_cache(tokens.shape[0], max_tokens)
    return torch.stack([model.step(tokens[:, t], t, cache).float() for t in range(tokens.shape[1])], 1)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("group_size, rope", [(1, True), (2, True), (2, False)])
def test_full_rank_palu_decoder_reproduces_dense(group_size, rope):
    shape = dataclasses.replace(SHAPE, rope=rope)
    dense = Decoder(shape, seed=1, weight_std=0.3, kernel_params=dict(block_t=16, block_r=16, block_rv=16))
    full = group_size * SHAPE.head_dim
    palu = Decoder.palu_from_dense(dense, PaluSpec(group_size, full, full))
    tokens = torch.randint(0, SHAPE.vocab, (2, 13), generator=torch.Generator().manual_seed(0))
    ref, out = _decode(dense, tokens), _decode(palu, tokens)
    assert _rel(out, ref) < 1e-2          # fp16 weights and activations on both paths
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_quantised_latent_caches_degrade_gracefully():
    dense = Decoder(SHAPE, seed=2, weight_std=0.3, kernel_params=dict(block_t=16, block_r=16, block_rv=16))
    tokens = torch.randint(0, SHAPE.vocab, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = _decode(dense, tokens)
    errs = {bits: _rel(_decode(Decoder.palu_from_dense(dense, PaluSpec(2, 64, 64, bits)), tokens), ref)
            for bits in (8, 4, 2)}
    # measured: 8-bit 0.024, 4-bit 0.32, 2-bit 0.92; without any attention output: 1.42
    assert errs[8] < 0.05 and errs[8] < errs[4] < errs[2] < 1.2, errs
    half = _rel(_decode(Decoder.palu_from_dense(dense, PaluSpec(2, 32, 32)), tokens), ref)
    assert 0 < half < 1.2                 # rank 50% of random weights: lossy (no low-rank structure)


def test_static_latent_cache_bytes_and_bad_input():
    c = StaticLatentCache(layers=3, batch=2, groups=4, max_tokens=10, rank_k=64, rank_v=32, bits=4)
    # packed data (rank/2 bytes) + fp16 scale + fp16 zero, per layer, batch, group, token
    assert c.nbytes() == 3 * 2 * 4 * 10 * ((32 + 4) + (16 + 4))
    with pytest.raises(ValueError, match="bits=3"):
        StaticLatentCache(1, 1, 1, 4, 16, 16, bits=3)
    with pytest.raises(ValueError, match="max_tokens=0"):
        StaticLatentCache(1, 1, 1, 0, 16, 16)
    with pytest.raises(ValueError, match="do not fit a cache of 10"):
        c.write(0, torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 32), 10)
    with pytest.raises(ValueError, match="group_size=3 does not divide kv_heads=2"):
        PaluSpec.from_kept(SHAPE, 3, 0.5, 0.5)
    with pytest.raises(ValueError, match="kv_heads=3"):
        DecoderShape(layers=1, hidden=8, heads=4, kv_heads=3, head_dim=8, intermediate=8, vocab=8)


def test_step_flops_counts_the_work_each_path_does():
    from palu_bench.bench_decoder import step_flops
    s = SHAPE
    dense = step_flops(s, None, context=99)
    # dense attention: q.k and p.v over 100 tokens, 4 query heads of 32 dims, per layer
    assert dense - step_flops(s, None, context=49) == s.layers * 4 * s.heads * 50 * s.head_dim
    full = PaluSpec(2, 64, 64)
    rope = step_flops(s, full, context=99)
    norope = step_flops(dataclasses.replace(s, rope=False), full, context=99)
    assert rope > dense and norope < rope    # rebuilding keys costs; the fused query does not


def test_fused_elementwise_ops_compute_the_same_model():
    # palu_kernels/fused_ops.py (here through the interpreter) against the torch expressions.
    tokens = torch.randint(0, SHAPE.vocab, (2, 6), generator=torch.Generator().manual_seed(3))
    outs = []
    for fused in (False, True):
        dense = Decoder(SHAPE, seed=4, weight_std=0.3, fused_ops=fused)
        assert dense.fused_ops is fused
        palu = Decoder.palu_from_dense(dense, PaluSpec(2, 32, 32))
        assert palu.fused_ops is fused
        outs.append(_decode(dense, tokens))
    assert _rel(outs[1], outs[0]) < 5e-3
    assert Decoder(SHAPE, init=False).fused_ops is False          # default: only on a GPU
