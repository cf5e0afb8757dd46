"""The real embedded SmolLM2-135M: exactness at full rank, compression that generates, bytes."""
import copy

import pytest
import torch

import palu
from palu.cache.memory import prefill_nbytes
from palu.methods import build_method
from palu.models.loading import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm(prepared_model):
    model, tok = load_model(str(prepared_model))
    calib = palu.calibration_data(tok, "wiki_standin", samples=2, seqlen=256, seed=0)
    return model, tok, calib


class _InMemoryPalu:
    """The Palu method's cache over a model compressed in memory (no checkpoint on disk)."""
    def make_cache(self, model):
        return palu.LatentCache(model)

    def cache_nbytes(self, cache):
        from palu.methods.palu import Palu
        return Palu.cache_nbytes(self, cache)

    latent_bits = 16


def test_full_rank_j_lrd_reproduces_smollm2(smollm):
    base, _, calib = smollm
    model = copy.deepcopy(base)
    palu.compress(model, calib, kept_ratio=1.0, group_size=3, progress=False)
    x = calib[:1, :128]
    ref, out = base(x).logits, model(x).logits
    # float32 on CPU through a float64 factorisation: |Δlogit| < 1e-3 on logits of size ~40.
    assert (out - ref).abs().max().item() < 1e-3
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_compressed_smollm2_generates_and_stores_half_the_cache(smollm):
    base, tok, calib = smollm
    model = copy.deepcopy(base)
    palu.compress(model, calib, kept_ratio=0.5, group_size=3, progress=False)
    prompt = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         past_key_values=palu.LatentCache(model))
    # the latent cache decodes what recomputing the whole prefix at every step decodes, and not
    # one token over and over (what a cache read wrongly tends to give)
    recomputed = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                use_cache=False)
    assert torch.equal(out, recomputed) and len(set(out[0, prompt.shape[1]:].tolist())) > 3
    # the preallocated, graph-capturable cache holds the same latents: the same greedy text
    graph_cache = palu.GraphLatentCache(model, max_tokens=prompt.shape[1] + 12)
    same = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          past_key_values=graph_cache)
    assert torch.equal(same, out) and graph_cache.seen == out.shape[1] - 1   # the last token is not cached
    ids = calib[:1, :200]
    dense = prefill_nbytes(base, build_method({"name": "fp16"}), ids)
    latent = prefill_nbytes(model, _InMemoryPalu(), ids)
    assert latent["metadata"] == 200 * 4 * base.config.num_hidden_layers   # int32 positions
    assert latent["data"] == dense["data"] // 2


def test_smollm2_takes_no_bos_and_stops_at_im_end(smollm):
    """Issue 20: `data.bos: auto` leaves SmolLM2's windows as they were (its tokenizer adds no
    BOS, so the committed numbers hold), and the prepared tokenizer's EOS is the model's
    (<|im_end|>, 2), not the GGUF conversion's <|im_start|>."""
    from palu.data.windows import bos_token_for
    model, tok, _ = smollm
    assert bos_token_for(tok, "auto") is None
    assert tok.eos_token_id == model.config.eos_token_id == 2
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
