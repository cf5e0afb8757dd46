"""Every RoPE type transformers offers for Llama, through a full-rank Palu model and KVQuant's
pre-RoPE cache: either `generate` equals the base model's token for token, or the type is refused
by name at compression, at install and at cache creation (issue 34, item 2).

Dynamic NTK and LongRoPE change the rotation of every position once the sequence grows past the
original length; transformers keeps each cached key as it was rotated when written, while a
latent (or pre-RoPE) cache rotates keys when they are read, at the current scaling."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import palu
from palu.models.adapters import UnsupportedRopeError

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 16},
}
REFUSED = {"dynamic", "longrope"}


def _model(kind: str):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=16, rope_scaling=ROPE[kind])
    return LlamaForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_full_rank_palu_generates_as_the_model_or_refuses_the_rope_type(kind):
    base = _model(kind)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    calib = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    model = copy.deepcopy(base)
    if kind in REFUSED:
        with pytest.raises(UnsupportedRopeError, match=kind):
            palu.compress(model, calib, kept_ratio=1.0, group_size=2, progress=False)
        with pytest.raises(UnsupportedRopeError, match=kind):
            palu.LatentCache(base)
        return
    palu.compress(model, calib, kept_ratio=1.0, group_size=2, progress=False)
    # past the original 16 positions: where the scaled types change what they compute
    want = base.generate(ids, max_new_tokens=20, do_sample=False)
    got = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=palu.LatentCache(model))
    assert torch.equal(want, got)


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_kvquant_refuses_a_dynamic_rope_at_install(kind, tmp_path):
    from palu.methods import build_method
    from palu.calib.kvquant import fit_kvquant
    model = _model(kind).float()
    with pytest.raises(UnsupportedRopeError, match=kind):
        fit_kvquant(model, torch.randint(0, 97, (2, 12)), bits=3, weighting="uniform", progress=False)
    state = fit_kvquant(_model("default").float(), torch.randint(0, 97, (2, 12)), bits=3,
                        weighting="uniform", progress=False)
    state.save(tmp_path / "s")
    with pytest.raises(UnsupportedRopeError, match=kind):
        build_method({"name": "kvquant", "state": str(tmp_path / "s")}).install(model)
