"""GraphLatentCache (preallocated, graph-capturable) and GraphDecoder: the same model as LatentCache."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import palu
from palu.quant.packed import QuantLatent
from palu.attention.install import set_backend
from palu.graph_decoding import GraphDecoder, bucket_tokens
from tiny import tiny_llama, tiny_opt, tiny_qwen2


def _compressed(model, group_size=2, multiple=8):
    palu.compress(model, torch.randint(0, 97, (2, 32)), kept_ratio=0.5, group_size=group_size,
                  multiple=multiple, progress=False)
    return model


def _kernel_llama():   # head_dim 32: the RoPE kernels need head_dim/2 >= 16
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32)).eval()
    return _compressed(model, multiple=16)


def _steps(model, cache, ids, tokens):
    """Prefill `ids`, then one-token steps fed `tokens` (fixed, not argmax: two paths whose
    logits differ by rounding must not diverge on a near-tie); logits (B, 1 + steps, vocab)."""
    with torch.no_grad():
        out = [model(ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        for i in range(tokens.shape[1]):
            out.append(model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bits", [16, 4, 2])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_graph_cache_computes_what_the_latent_cache_does(family, bits):
    model = _compressed(tiny_llama() if family == "llama" else tiny_opt())
    set_backend(model, "torch")
    ids, tokens = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 4))
    ref = _steps(model, palu.LatentCache(model, bits=bits), ids, tokens)
    cache = palu.GraphLatentCache(model, max_tokens=20, batch=2, bits=bits)
    out = _steps(model, cache, ids, tokens)
    assert _rel(out, ref) < 1e-5          # same latents (same quantised bytes), same attention
    assert cache.seen == 13 and cache.lengths.tolist() == [13, 13]
    per = 1 if bits == 16 else 8 // bits
    assert isinstance(cache.layers[0].keys, QuantLatent) == (bits != 16)
    rk = sum(model.model.layers[0].self_attn.ranks_k) // per if family == "llama" else None
    if rk:   # the slots: every layer's keys and values for max_tokens tokens, preallocated
        stored = cache.layers[0].keys.data if bits else cache.layers[0].keys
        assert stored.shape[0] == 2 and stored.shape[2] == 20 and stored.shape[1] * stored.shape[3] == rk


def test_transformers_generate_runs_on_the_graph_cache():
    model = _compressed(tiny_llama())
    set_backend(model, "torch")
    ids = torch.randint(0, 97, (1, 7))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=palu.LatentCache(model))
    out = model.generate(ids, max_new_tokens=6, do_sample=False,
                         past_key_values=palu.GraphLatentCache(model, max_tokens=16))
    assert torch.equal(out, ref)


def _poison_unused_slots(cache, start):
    """Large values in the slots past `start`: a step that reads them unmasked goes wrong."""
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):
            if isinstance(buf, QuantLatent):
                buf.data[:, :, start:].fill_(0xFF)
                buf.scale[:, :, start:].fill_(50.0)
            else:
                buf[:, :, start:].fill_(50.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bits", [16, 4])
def test_a_step_over_more_slots_than_tokens_masks_by_the_cache_lengths(backend, bits, monkeypatch):
    # What a captured graph runs: the kernels (or the torch path) read a whole bucket of slots,
    # most of them past the tokens, and must mask by the device-side lengths.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _kernel_llama()
    set_backend(model, backend)
    ids, tokens = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 1))
    ref = _steps(model, palu.LatentCache(model, bits=bits), ids, tokens)[:, -1]
    cache = palu.GraphLatentCache(model, max_tokens=48, batch=2, bits=bits)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    _poison_unused_slots(cache, 9)
    from palu.attention import kernel_backend
    calls, real = [], kernel_backend.kernel_decode
    monkeypatch.setattr(kernel_backend, "kernel_decode",
                        lambda *a, **k: calls.append(k["lengths"] is cache.lengths) or real(*a, **k))
    cache.view_tokens = 32
    with torch.no_grad():
        out = model(tokens, position_ids=torch.full((2, 1), 9), attention_mask=torch.ones(2, 1, 1, 1).bool(),
                    past_key_values=cache, use_cache=True).logits[:, -1]
    assert calls == ([True] * 2 if backend == "triton" else [])
    assert cache.lengths.tolist() == [10, 10] and cache.seen == 9   # a graph step leaves seen to its driver
    assert _rel(out, ref) < (5e-3 if backend == "triton" else 1e-5)


class EagerDecoder(GraphDecoder):
    """GraphDecoder whose "graphs" are the captured function called eagerly: everything but the
    capture itself (which needs a GPU; tests/test_graph_cache.py's GPU test captures)."""

    @staticmethod
    def _check_device(device):
        pass

    def _capture(self, fn):
        self.captured = getattr(self, "captured", 0) + 1
        bucket = self.cache.view_tokens

        def replay():   # as the graph would: the bucket's slots, no host-side bookkeeping
            self.cache.view_tokens = bucket
            try:
                return fn()
            finally:
                self.cache.view_tokens = None
        return replay


@pytest.mark.parametrize("family, bits", [("llama", 16), ("llama", 4), ("qwen2", 4), ("opt", 16)])
def test_graph_decoder_generates_what_transformers_generates(family, bits):
    model = _compressed({"llama": tiny_llama, "qwen2": tiny_qwen2, "opt": tiny_opt}[family]())
    set_backend(model, "torch")
    ids = torch.randint(0, 97, (2, 5))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False,
                         past_key_values=palu.LatentCache(model, bits=bits))
    cache = palu.GraphLatentCache(model, max_tokens=16, batch=2, bits=bits)
    decoder = EagerDecoder(model, cache, min_bucket=4)
    out = decoder.generate(ids, max_new_tokens=12)
    assert torch.equal(out, ref)
    # one "graph" per bucket of context lengths: 6..16 tokens, below 16 every length its own
    assert sorted(decoder.graphs) == list(range(6, 17)) and decoder.captured == 11
    with pytest.raises(ValueError, match="already holds 16 tokens"):
        decoder.generate(ids, max_new_tokens=2)
    cache.reset()
    assert torch.equal(decoder.generate(ids, max_new_tokens=12), ref)   # same graphs, reused
    assert decoder.captured == 11


def test_graph_decoder_stops_at_eos():
    model = _compressed(tiny_llama())
    set_backend(model, "torch")
    ids = torch.randint(0, 97, (1, 5))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                         past_key_values=palu.LatentCache(model))
    eos = int(ref[0, 8])
    first = next(k for k in range(5, 17) if int(ref[0, k]) == eos)
    out = EagerDecoder(model, palu.GraphLatentCache(model, max_tokens=16)).generate(ids, 12, eos_token_id=eos)
    assert torch.equal(out, ref[:, :first + 1])


def test_bucket_tokens_rounds_up_by_at_most_an_eighth():
    assert [bucket_tokens(n, 1 << 20) for n in (1, 256, 257, 4096, 4097, 4609, 65537)] == \
        [256, 256, 288, 4096, 4608, 5120, 73728]
    assert bucket_tokens(4097, 4500) == 4500
    assert bucket_tokens(4097, 1 << 20, per_doubling=4) == 5120
    for n in range(300, 20000, 997):
        assert n <= bucket_tokens(n, 1 << 20) <= n * 1.125
    with pytest.raises(ValueError, match="4501 tokens do not fit a cache of max_tokens=4500"):
        bucket_tokens(4501, 4500)


def test_graph_cache_errors_name_the_problem():
    dense = tiny_llama()
    with pytest.raises(ValueError, match="no Palu attention"):
        palu.GraphLatentCache(dense, max_tokens=8)
    model = _compressed(tiny_llama())
    with pytest.raises(ValueError, match="bits=3 is not one of"):
        palu.GraphLatentCache(model, max_tokens=8, bits=3)
    with pytest.raises(ValueError, match="max_tokens=0 must be a positive integer"):
        palu.GraphLatentCache(model, max_tokens=0)
    cache = palu.GraphLatentCache(model, max_tokens=8)
    with pytest.raises(ValueError, match=r"4 cached \+ 5 new tokens exceed max_tokens=8"), torch.no_grad():
        model(torch.randint(0, 97, (1, 4)), past_key_values=cache, use_cache=True)
        model(torch.randint(0, 97, (1, 5)), past_key_values=cache, use_cache=True)
    cache = palu.GraphLatentCache(model, max_tokens=8)
    with pytest.raises(ValueError, match="positions must be 0..2 in every row"), torch.no_grad():
        model(torch.randint(0, 97, (1, 3)), position_ids=torch.tensor([[2, 3, 4]]), past_key_values=cache)
    with pytest.raises(ValueError, match="batch 2 != the cache's batch 1"), torch.no_grad():
        model(torch.randint(0, 97, (2, 3)), past_key_values=cache)
    with pytest.raises(TypeError, match="needs a GraphLatentCache, not LatentCache"):
        GraphDecoder(model, palu.LatentCache(model))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the cache is on cpu"):
        GraphDecoder(model, cache)
    decoder = EagerDecoder(model, palu.GraphLatentCache(model, max_tokens=8))
    with pytest.raises(ValueError, match="need a cache of at least 9"):
        decoder.generate(torch.randint(0, 97, (1, 4)), max_new_tokens=6)


def test_graph_cache_refuses_groups_of_different_ranks():
    from palu.decompose.factors import LayerFactors
    model = tiny_llama()          # 2 KV heads of 16, hidden 64; one group per head
    factors = []
    for _ in range(2):
        lf = LayerFactors()
        for rk in (3, 5):
            lf.A_k.append(torch.randn(rk, 64))
            lf.B_k.append(torch.randn(16, rk))
            lf.A_v.append(torch.randn(4, 64))
            lf.B_v.append(torch.randn(16, 4))
        factors.append(lf)
    palu.install_palu(model, factors, group_size=1)
    with pytest.raises(ValueError, match=r"layer 0: key ranks differ between groups \(\[3, 5\]\)"):
        palu.GraphLatentCache(model, max_tokens=8)


def _gpu_model(family, dtype):
    """Small models of each path the captured step can take: Llama MHA (RoPE kernels), Qwen2
    (GQA; its key bias keeps RoPE layers on the torch path, captured too), OPT (no RoPE)."""
    from transformers import OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=384,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=4, head_dim=64))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=256, intermediate_size=384,
                                             num_hidden_layers=2, num_attention_heads=8,
                                             num_key_value_heads=2))
    else:
        model = OPTForCausalLM(OPTConfig(vocab_size=97, hidden_size=256, ffn_dim=384, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=1024,
                                         word_embed_proj_dim=256))
    _compressed(model.eval(), group_size=2 if family != "qwen2" else 1, multiple=16)
    return model.to(dtype).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: runs on a GPU")
@pytest.mark.parametrize("family, dtype, bits", [("llama", torch.float16, 16), ("llama", torch.float16, 4),
                                                 ("llama", torch.bfloat16, 2), ("qwen2", torch.float16, 4),
                                                 ("opt", torch.float16, 16), ("opt", torch.float16, 4)])
def test_captured_steps_replay_what_eager_steps_compute(family, dtype, bits):
    model = _gpu_model(family, dtype)
    ids = torch.randint(0, 97, (2, 300), device="cuda")
    tokens = torch.randint(0, 97, (2, 40), device="cuda")
    eager = palu.GraphLatentCache(model, max_tokens=400, batch=2, bits=bits)
    ref = _steps(model, eager, ids, tokens)              # eager steps (exact lengths)
    cache = palu.GraphLatentCache(model, max_tokens=400, batch=2, bits=bits)
    decoder = GraphDecoder(model, cache, min_bucket=256)
    with torch.no_grad():
        out = [model(ids, past_key_values=cache, use_cache=True).logits[:, -1]]
    for i in range(tokens.shape[1]):
        out.append(decoder.step(tokens[:, i], 300 + i).clone())
    assert sorted(decoder.graphs) == [320, 352]          # 301..340 tokens
    assert cache.seen == eager.seen == 340
    assert _rel(torch.stack(out, 1).float(), ref.float()) < (2e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.parametrize("bits", [4, 2])
def test_a_ragged_step_stores_each_row_as_torch_does(bits, monkeypatch):
    # the ragged (per-row slot) write: one quantise-store launch on a GPU / in the interpreter,
    # torch's codes scattered row by row on a plain CPU; the same bytes either way
    model = _compressed(tiny_llama())
    torch.manual_seed(1)
    buffers = []
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        cache = palu.GraphLatentCache(model, max_tokens=12, batch=3, bits=bits)
        layer = cache.layers[0]
        rk, rv = layer.keys.rank * layer.groups, layer.values.rank * layer.groups
        g = torch.Generator().manual_seed(7)
        hk, hv = torch.randn(3, 1, rk, generator=g), torch.randn(3, 1, rv, generator=g)
        layer.write(hk, hv, torch.tensor([4, 9, 0]), per_row=True)
        buffers.append([t.clone() for buf in (layer.keys, layer.values) for t in (buf.data, buf.scale, buf.zero)])
    for torch_made, kernel_made in zip(*buffers):
        assert torch.equal(torch_made, kernel_made)
    assert buffers[0][1][1, :, 9].ne(0).all() and buffers[0][1][1, :, :9].eq(0).all()
